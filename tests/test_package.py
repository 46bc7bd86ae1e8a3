"""The package itself: metadata, layout, public names."""

import ast
import importlib.metadata
import inspect
import pathlib

import energyattn as ea

PACKAGE = pathlib.Path(ea.__file__).parent


def test_version_comes_from_metadata():
    assert ea.__version__ == importlib.metadata.version("energyattn") == "0.1.0"


def test_typed_marker_is_shipped():
    assert (PACKAGE / "py.typed").exists()


def test_init_files_only_reexport():
    """`__init__.py` files hold imports (and the version lookup), never definitions."""
    for init in PACKAGE.rglob("__init__.py"):
        tree = ast.parse(init.read_text())
        for node in tree.body:
            assert not isinstance(node, (ast.FunctionDef, ast.ClassDef, ast.AsyncFunctionDef)), (
                f"{init} defines {node.name}"
            )


def public_names():
    for module in (ea, ea.nn, ea.data):
        for name in dir(module):
            obj = getattr(module, name)
            if name.startswith("_") or inspect.ismodule(obj):
                continue
            yield f"{module.__name__}.{name}", obj


def test_every_public_name_is_documented():
    missing = [name for name, obj in public_names() if not (inspect.getdoc(obj) or "").strip()]
    assert not missing, f"public names without a docstring: {missing}"


def test_public_objects_live_in_private_modules():
    """Users import `energyattn as ea`; implementations live in private `_x.py` modules."""
    for name, obj in public_names():
        module = getattr(obj, "__module__", "") or ""
        if module.startswith("energyattn"):
            assert any(part.startswith("_") for part in module.split(".")[1:]), (name, module)


def test_readme_example_runs(capsys):
    """The README's Python example runs as written and shows the identity it claims."""
    readme = (pathlib.Path(__file__).parents[1] / "README.md").read_text()
    blocks = [b.split("```", 1)[0] for b in readme.split("```python\n")[1:]]
    assert blocks, "README has no Python example"
    namespace: dict = {}
    exec(compile(blocks[0], "README.md", "exec"), namespace)
    printed = float(capsys.readouterr().out.strip())
    assert printed < 1e-6  # one descent step equals softmax attention
    assert namespace["descent"].energies.shape == (8, 4)
