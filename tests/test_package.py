"""The package itself: metadata, layout, public names."""

import ast
import functools
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


@functools.cache  # parsed once for the tests that read them
def _imports(path: pathlib.Path):
    """The `energyattn` modules that `path` imports, as dotted names (relative imports
    resolved), with the names imported from each."""
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    package = parts if path.name == "__init__.py" else parts[:-1]
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - node.level + 1]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            found.append((module, [alias.name for alias in node.names]))
        elif isinstance(node, ast.Import):
            for alias in node.names:
                found.append((alias.name, []))
    return tuple(found)


def _home(module: str) -> str:
    """The package of the library a module belongs to: `energyattn.nn._hopfield` ->
    `energyattn.nn`; the top-level shared modules (`energyattn._checks`, ...) are their own."""
    parts = module.split(".")
    return ".".join(parts[:2])


def test_the_library_never_imports_the_command_line_or_plots():
    """The command line and its demos sit on top of the library, and `viz` only draws: no
    module of the library imports them. The one exception: the package's `__init__` imports
    `energyattn._cli.startup` first (standard library only), so that the command handles
    Ctrl-C before JAX is imported; it does nothing in any other process."""
    for path in PACKAGE.rglob("*.py"):
        home = _home(".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts))
        if home in ("energyattn._cli", "energyattn.viz", "energyattn.__main__"):
            continue
        for module, names in _imports(path):
            if path == PACKAGE / "__init__.py" and (module, names) == (
                "energyattn._cli",
                ["startup"],
            ):
                continue
            assert not module.startswith(("energyattn._cli", "energyattn.viz")), (path, module)
            assert "demo" not in module, (path, module)


def test_no_private_imports_across_packages():
    """A package uses another one through that package's `__init__` (never its private
    modules) and never imports another package's underscore names; helpers shared between
    packages live in the top-level shared modules (`_checks`, `_custom_types`, `_io`,
    `_linalg`, `_train`)."""
    problems = []
    for path in PACKAGE.rglob("*.py"):
        own = _home(".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts))
        for module, names in _imports(path):
            if not module.startswith("energyattn.") or _home(module) == own:
                continue
            if own == "energyattn.__init__" or path.parent == PACKAGE:
                # the package's own __init__ re-exports; top-level modules are shared homes
                if path.name == "__init__.py":
                    continue
            deeper = module.split(".")[2:]
            if any(part.startswith("_") for part in deeper):
                problems.append(f"{path.relative_to(PACKAGE)}: from {module} import {names}")
            elif any(name.startswith("_") for name in names):
                problems.append(f"{path.relative_to(PACKAGE)}: {module}.{names}")
    assert not problems, "private imports across packages:\n" + "\n".join(problems)


def test_namespace_shows_only_the_subpackages():
    """`dir(energyattn)` lists the library's own modules, not the ones it happens to import."""
    modules = {n for n in dir(ea) if not n.startswith("_") and inspect.ismodule(getattr(ea, n))}
    modules.discard("jaxtyping")  # injected by the suite's runtime type-checking import hook
    assert modules == {
        "aot", "data", "ham", "lagrangians", "models", "nn", "parallel", "spin", "viz"
    }  # fmt: skip
