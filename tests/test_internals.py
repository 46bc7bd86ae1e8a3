"""Importing energyattn changes no other library's rules (DESIGN.md: never register a rule on
another library's primitive), and its private-API uses live in one module."""

import pathlib
import re
import subprocess
import sys
import textwrap

import energyattn as ea

PACKAGE = pathlib.Path(ea.__file__).parent

# Run in a fresh interpreter, so that energyattn is imported after the snapshot (the test
# session has imported it long before). The tables are JAX's rule tables, public where JAX
# exposes them and private (`jax._src`) where it does not; a table a JAX version lacks is
# skipped. (`jax.interpreters.batching.primitive_batchers` and `axis_primitive_batchers` only
# write through to the private tables read here.)
_SCRIPT = textwrap.dedent(
    """
    import importlib, importlib.util, sys

    import jax
    import jax.extend.core
    from jax.interpreters import ad, partial_eval as pe

    import equinox
    import equinox.internal
    if importlib.util.find_spec("lineax") is not None:
        import lineax  # noqa: F401

    tables = {
        "primitive_jvps": ad.primitive_jvps,
        "primitive_transposes": ad.primitive_transposes,
        "custom_partial_eval_rules": pe.custom_partial_eval_rules,
        "partial_eval_jaxpr_custom_rules": pe.partial_eval_jaxpr_custom_rules,
        "dce_rules": pe.dce_rules,
    }
    for module, names in (
        ("jax._src.interpreters.batching", ("fancy_primitive_batchers",)),
        ("jax._src.interpreters.ad", ("primitive_linearizations",)),
        ("jax._src.interpreters.mlir", ("_lowerings", "_platform_specific_lowerings")),
    ):
        try:
            module = importlib.import_module(module)
        except ImportError:
            continue
        for name in names:
            if hasattr(module, name):
                tables[name] = getattr(module, name)

    def primitives():
        # Every primitive Equinox and lineax define (module globals), and those made by
        # `create_vprim` (Equinox's own `_vprim_p` among them).
        found = {}
        for name, module in list(sys.modules.items()):
            if module is None or not name.startswith(("equinox", "lineax")):
                continue
            for value in list(vars(module).values()):
                if isinstance(value, jax.extend.core.Primitive):
                    found[id(value)] = value
        from equinox.internal import _primitive
        for value in getattr(_primitive, "_vprim_impl_registry", {}):
            found[id(value)] = value
        return list(found.values())

    def snapshot(prims):
        rules = {}
        for table_name, table in tables.items():
            for prim in prims:
                if prim in table:
                    rule = table[prim]
                    if isinstance(rule, dict):  # per-platform lowerings
                        rule = tuple(sorted((k, id(v)) for k, v in rule.items()))
                        rules[table_name, prim.name, id(prim)] = rule
                    else:
                        rules[table_name, prim.name, id(prim)] = (id(rule), rule)
        return rules

    prims = primitives()
    assert any(p.name == "vprim" for p in prims), [p.name for p in prims]
    before = snapshot(prims)
    import energyattn  # noqa: F401
    import energyattn.nn  # noqa: F401
    after = snapshot(prims)
    changed = sorted(
        f"{key[0]}[{key[1]}]" for key in before.keys() | after.keys()
        if before.get(key, (None,))[0] != after.get(key, (None,))[0]
    )
    print("checked", len(prims), "primitives,", len(before), "rules")
    if changed:
        print("CHANGED:", ", ".join(changed))
        sys.exit(1)
    """
)


def test_import_changes_no_other_librarys_rules():
    """Every rule JAX holds for Equinox's and lineax's primitives (JVP, transpose, batching,
    partial evaluation, DCE, linearization, lowering) is the same object after energyattn is
    imported, and none is added."""
    result = subprocess.run(
        [sys.executable, "-c", _SCRIPT], capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "checked" in result.stdout


def test_private_apis_live_in_one_module():
    """`jax._src` and `equinox.internal` are used in `_internals.py` alone (DESIGN.md)."""
    private = re.compile(r"jax\._src|equinox\.internal|\beqxi\b")
    users = sorted(
        str(path.relative_to(PACKAGE))
        for path in PACKAGE.rglob("*.py")
        if private.search(path.read_text())
    )
    assert users in ([], ["_internals.py"]), users
