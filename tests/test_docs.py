"""The documentation: every public name in the API reference, every example runs, strict build."""

import ast
import importlib
import importlib.util
import inspect
import os
import pathlib
import pkgutil
import re
import subprocess
import sys

import pytest

import energyattn as ea

ROOT = pathlib.Path(__file__).parents[1]
DOCS = ROOT / "docs"
PAGES = sorted(DOCS.rglob("*.md"))
FENCE = re.compile(r"^```python\n(.*?)^```", re.DOTALL | re.MULTILINE)


def public_names():
    """`energyattn.X` for every public name users can reach (as `tests/test_package.py`)."""
    namespaces = (ea, ea.nn, ea.ham, ea.models, ea.data, ea.spin, ea.viz)
    for module in namespaces:
        for name in dir(module):
            if not name.startswith("_") and not inspect.ismodule(getattr(module, name)):
                yield f"{module.__name__}.{name}"
    # Public modules: the names in their `__all__`, else their own functions (defined there
    # or in its private modules).
    for module in (
        ea.aot,
        ea.parallel,
        ea.lagrangians,
        ea.spin.afem,
        ea.spin.smt,
        ea.spin.mean_field,
    ):
        listed = getattr(module, "__all__", None)
        for name, obj in vars(module).items():
            home = getattr(obj, "__module__", None) or ""
            own = home.split("._")[0] == module.__name__
            if not name.startswith("_") and (name in listed if listed is not None else own):
                yield f"{module.__name__}.{name}"


def resolve(name):
    module, _, attribute = name.rpartition(".")
    return getattr(sys.modules[module], attribute)


def documented_names():
    text = "\n".join(page.read_text() for page in (DOCS / "api").glob("*.md"))
    return re.findall(r"^::: (energyattn[\w.]*)\s*$", text, re.MULTILINE)


def test_every_public_name_is_in_the_api_reference():
    """Every public object is documented, under one of its public names: the AFEM
    functions are both `ea.spin.X` and `ea.spin.afem.X`, and documented once."""
    public = set(public_names())
    documented = {id(resolve(name)) for name in documented_names() if name in public}
    missing = sorted(name for name in public if id(resolve(name)) not in documented)
    assert not missing, f"public names missing from docs/api/*.md: {missing}"


def test_the_api_reference_names_only_real_objects_once():
    names = documented_names()
    assert len(names) == len(set(names)), "a name is documented twice"
    stale = sorted(set(names) - set(public_names()))
    assert not stale, f"docs/api/*.md documents names that are not public: {stale}"


def test_every_page_is_in_the_navigation():
    nav = (ROOT / "mkdocs.yml").read_text()
    for page in PAGES:
        assert str(page.relative_to(DOCS)) in nav, f"{page} is not in mkdocs.yml's nav"


def test_examples_are_not_hidden_from_the_tests():
    """Only top-level ```python fences run below; an indented one would escape the tests."""
    for page in PAGES:
        assert not re.search(r"^[ \t]+```python", page.read_text(), re.MULTILINE), page


PAGES_WITH_CODE = [page for page in PAGES if FENCE.search(page.read_text())]


@pytest.mark.parametrize("page", PAGES_WITH_CODE, ids=lambda p: str(p.relative_to(DOCS)))
def test_docs_examples_run(page, tmp_path, monkeypatch, capsys, jax_defaults):
    """Every Python example of a page runs, in order, in one namespace (files go to tmp), as
    a reader runs it: in JAX's default 32-bit mode unless the page itself turns on x64."""
    monkeypatch.chdir(tmp_path)
    namespace = {"__name__": "__docs__"}
    for i, block in enumerate(FENCE.findall(page.read_text())):
        exec(compile(block, f"{page.relative_to(ROOT)} (example {i + 1})", "exec"), namespace)


def test_readme_links_resolve():
    readme = (ROOT / "README.md").read_text()
    targets = re.findall(r"\]\((?!https?://|#)([^)#\s]+)", readme)
    assert any(t.startswith("docs/") for t in targets), "README does not link to the docs"
    for target in targets:
        assert (ROOT / target).exists(), f"README links to missing {target}"


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    """The site, built once by `mkdocs build --strict` (a warning fails it); its folder."""
    pytest.importorskip("mkdocs", reason="the docs extra: pip install 'energyattn[docs]'")
    site = tmp_path_factory.mktemp("site")
    done = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env=dict(os.environ, NO_MKDOCS_2_WARNING="1"),
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    return site


def test_mkdocs_build_is_strict_clean(site):
    api = (site / "api" / "energies" / "index.html").read_text()
    assert 'id="energyattn.hopfield_energy"' in api  # mkdocstrings rendered the reference


def test_equations_render_offline(site):
    """Issue 33: every equation of the site is MathML when built (docs/hooks/mathml.py), so
    it shows with no network and no JavaScript; no page loads a script from elsewhere (the
    MathJax CDN was one) or a stylesheet other than the theme's text font."""
    equations = 0
    for page in site.rglob("*.html"):
        text = page.read_text()
        scripts = re.findall(r"<script\b[^>]*\bsrc=\"([^\"]*)\"", text)
        assert not [s for s in scripts if re.match(r"(https?:)?//", s)], (page, scripts)
        sheets = re.findall(r"<link\b[^>]*\bhref=\"((?:https?:)?//[^\"]*)\"", text)
        assert all(s.startswith("https://fonts.g") for s in sheets), (page, sheets)
        math = re.findall(r'class="arithmatex">(.{0,6})', text)
        assert all(m.startswith("<math") for m in math), (page, math)  # no TeX left
        equations += len(math)
    assert equations > 1000  # pages and docstrings
    hopfield = (site / "theory" / "hopfield" / "index.html").read_text()
    assert '<math display="block">' in hopfield and "<mfrac>" in hopfield
    assert "\U0001d53c" in (site / "api" / "models" / "index.html").read_text()  # \mathbb E


def docstring_examples():
    """(name, code) of every ```python block in the docstrings the API reference renders."""
    objects = {name: None for name in public_names()}
    for module in (
        ea,
        ea.nn,
        ea.ham,
        ea.models,
        ea.data,
        ea.spin,
        ea.parallel,
        ea.lagrangians,
        ea.viz,
    ):
        objects[module.__name__] = module
    for name in list(objects):
        if objects[name] is None:
            objects[name] = resolve(name)
    found = []
    for name, obj in objects.items():
        docs = [inspect.getdoc(obj) or ""]
        if inspect.isclass(obj):  # methods are rendered on the class's page
            docs += [inspect.getdoc(m) or "" for _, m in inspect.getmembers(obj, callable)]
        for doc in docs:
            for i, code in enumerate(FENCE.findall(doc)):
                found.append((f"{name} ({i + 1})", code))
    return sorted(set(found))


#: Docstring examples that cannot run in one process, and the test that covers them instead.
NOT_RUN = {"energyattn.parallel.initialize (1)": "test_parallel.py, two processes on loopback"}
#: Names every docstring example may use without importing them.
PRELUDE = (
    "import equinox as eqx\nimport jax\nimport jax.numpy as jnp\nimport jax.random as jr\n"
    "import numpy as np\nimport energyattn as ea\n"
)


@pytest.mark.parametrize("name, code", docstring_examples(), ids=lambda v: v.split(" (")[0])
def test_docstring_examples_run(name, code, tmp_path, monkeypatch):
    if name in NOT_RUN:
        pytest.skip(f"multi-process example; covered by {NOT_RUN[name]}")
    monkeypatch.chdir(tmp_path)
    exec(compile(PRELUDE + code, name, "exec"), {"__name__": "__docs__"})


def test_docstring_examples_are_found():
    names = [name for name, _ in docstring_examples()]
    assert "energyattn.SumEnergy (1)" in names and "energyattn.parallel (1)" in names
    assert set(NOT_RUN) <= set(names)


#: The control character a docstring may hold: newline. Any other comes from an escape in a
#: non-raw string: `"""$\beta$"""` is a backspace and "eta", rendered as "⍰eta".
CONTROL = re.compile(r"[\x00-\x09\x0b-\x1f\x7f]")
#: An escape in a non-raw docstring's source that eats a LaTeX command: `\nabla` is a newline
#: and "abla", `\text` a tab and "ext" (the newline passes `CONTROL`); `\\nabla` is right.
EATEN = re.compile(r"(?<!\\)(?:\\\\)*\\[abfnrtv][A-Za-z]")  # an odd run of backslashes


def package_modules():
    """The name of every module of the package, private ones included."""
    found = pkgutil.walk_packages(ea.__path__, "energyattn.", onerror=lambda name: None)
    return ["energyattn", *sorted(module.name for module in found)]


def test_docstrings_hold_no_control_characters():
    """Every docstring the package holds (modules, classes, functions, properties, and the
    attribute docstrings below fields, which mkdocstrings reads from the source), public or
    private, holds no control character but newline, and no non-raw escape that ate a LaTeX
    command. The source's bare strings are read with `ast` (attribute docstrings exist only
    there), then every object's `__doc__` (docstrings made at run time)."""
    found = []
    for name in package_modules():
        path = importlib.util.find_spec(name).origin
        source = pathlib.Path(path).read_text()
        for node in ast.walk(ast.parse(source, path)):
            if not (
                isinstance(node, ast.Expr)
                and isinstance(node.value, ast.Constant)
                and isinstance(node.value.value, str)
            ):
                continue
            where = name  # the module: the package may be installed, not the source tree
            literal = ast.get_source_segment(source, node.value) or ""
            raw = literal[:2].lower().lstrip("bfu").startswith("r")
            if bad := CONTROL.search(node.value.value):
                found.append(f"{where}:{node.lineno}: {bad.group()!r} in {node.value.value!r:.60}")
            elif not raw and (bad := EATEN.search(literal)):
                found.append(f"{where}:{node.lineno}: {bad.group()!r} in a non-raw string")
        module = importlib.import_module(name)
        objects = [(name, module)]
        for key, obj in vars(module).items():
            if getattr(obj, "__module__", None) == name and (
                inspect.isclass(obj) or inspect.isfunction(obj)
            ):
                objects.append((f"{name}.{key}", obj))
                members = vars(obj).items() if inspect.isclass(obj) else ()
                for member, value in members:
                    value = getattr(value, "fget", value)  # a property's getter
                    value = getattr(value, "__func__", value)  # a static or class method
                    if inspect.isclass(value) or callable(value):
                        objects.append((f"{name}.{key}.{member}", value))
        for where, obj in objects:
            doc = getattr(obj, "__doc__", None)
            if isinstance(doc, str) and (bad := CONTROL.search(doc)):
                found.append(f"{where}: {bad.group()!r} in {doc!r:.60}")
    assert not found, "control characters in docstrings (use r-strings):\n" + "\n".join(
        sorted(set(found))
    )
