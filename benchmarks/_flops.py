"""Count the large linear-algebra operations of a compiled program, from its optimised HLO.

What XLA will run, after its dead-code elimination and fusion: every matrix product (`dot`,
also inside fusions), Cholesky factorisation (a LAPACK `potrf` custom call), LU, eigen- and
triangular solve, with its flop count, split into the operations outside any loop and those
in each `while` loop's body (run once per pass). The unit is one Cholesky factorisation of an
N x N matrix, N^3 / 3 flops, so "costs 14 Cholesky" reads directly.
"""

import re
from collections import defaultdict
from dataclasses import dataclass, field

_COMPUTATION = re.compile(r"^(?:ENTRY )?%?([\w.\-]+) .*\{\s*$")
_INSTRUCTION = re.compile(r"^\s*(?:ROOT )?%?([\w.\-]+) = (.*)$")
_SHAPE = re.compile(r"([a-z]\w*)\[([\d,]*)\]")


def _dims(text: str) -> list[int]:
    return [int(d) for d in text.split(",") if d]


def _first_shape(text: str) -> list[int]:
    match = _SHAPE.search(text)
    return _dims(match.group(2)) if match else []


def _prod(values: list[int]) -> int:
    out = 1
    for v in values:
        out *= v
    return out


def _operands(rhs: str, op: str) -> list[str]:
    inside = rhs[rhs.index(op + "(") + len(op) + 1 :]
    return re.findall(r"%([\w.\-]+)", inside.split(")")[0])


def _flops(rhs: str, shapes: dict[str, list[int]]) -> tuple[str, float] | None:
    """The operation's kind and flop count, for the large linear algebra only."""
    if " dot(" in rhs:
        out = _first_shape(rhs)
        a, b = (shapes.get(name, []) for name in _operands(rhs, " dot")[:2])
        contracting = re.search(r"lhs_contracting_dims=\{([\d,]*)\}", rhs)
        k = _prod([a[i] for i in _dims(contracting.group(1))]) if contracting and a else 1
        return f"dot {a} x {b}", 2.0 * _prod(out) * k
    target = re.search(r'custom_call_target="([^"]+)"', rhs)
    if target:
        constraints = re.search(r"operand_layout_constraints=\{((?:[^{}]|\{[^{}]*\})*)\}", rhs)
        operands = (
            [_dims(m.group(2)) for m in _SHAPE.finditer(constraints.group(1))]
            if constraints
            else []
        )
        if not operands or len(operands[0]) < 2:
            return None
        name, shape = target.group(1), operands[0]
        n, batch = shape[-1], _prod(shape[:-2])
        if "potrf" in name:
            return f"cholesky {shape}", batch * n**3 / 3
        if "getrf" in name:
            return f"lu {shape}", batch * 2 * n**3 / 3
        if "syevd" in name or "heevd" in name:
            return f"eigh {shape}", batch * 9.0 * n**3
        if "trsm" in name and len(operands) > 1:
            return f"triangular solve {shape} \\ {operands[1]}", batch * n * _prod(operands[1])
    return None


@dataclass
class Count:
    """Operations (kind -> (number, flops)) outside loops, and per pass of each loop."""

    outside: dict[str, list[float]] = field(default_factory=lambda: defaultdict(lambda: [0, 0.0]))
    loops: list[dict[str, list[float]]] = field(default_factory=list)


def count(hlo_text: str, *, min_flops: float) -> Count:
    """Count the operations of at least `min_flops` in optimised HLO text (e.g.
    `jax.jit(f).lower(*args).compile().as_text()`)."""
    computations: dict[str, list[str]] = {}
    shapes: dict[str, dict[str, list[int]]] = {}
    entry, current = None, None
    for line in hlo_text.splitlines():
        head = _COMPUTATION.match(line)
        if head and not line[:1].isspace():
            current = head.group(1)
            computations[current] = []
            shapes[current] = {}
            if line.startswith("ENTRY"):
                entry = current
            continue
        instruction = _INSTRUCTION.match(line)
        if instruction and current is not None:
            computations[current].append(instruction.group(2))
            shapes[current][instruction.group(1)] = _first_shape(instruction.group(2))

    result = Count()

    def visit(name: str, into: dict[str, list[float]]) -> None:
        for rhs in computations.get(name, []):
            op = _flops(rhs, shapes[name])
            if op is not None and op[1] >= min_flops:
                into[op[0]][0] += 1
                into[op[0]][1] += op[1]
            if " while(" in rhs:
                body = re.search(r"body=%?([\w.\-]+)", rhs).group(1)
                loop: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
                visit(body, loop)
                if loop:
                    result.loops.append(loop)
                continue
            for called in re.findall(r"(?:calls|to_apply)=%?([\w.\-]+)", rhs):
                visit(called, into)
            branches = re.search(r"branch_computations=\{([^}]*)\}", rhs)
            if branches:
                for called in re.findall(r"%?([\w.\-]+)", branches.group(1)):
                    visit(called, into)

    visit(entry, result.outside)
    return result


def in_units(ops: dict[str, list[float]], unit: float) -> float:
    return sum(flops for _, flops in ops.values()) / unit


def describe(ops: dict[str, list[float]], unit: float) -> str:
    parts = [
        f"{int(number)}x {kind} ({flops / unit:.2f})"
        for kind, (number, flops) in sorted(ops.items(), key=lambda kv: -kv[1][1])
    ]
    return "; ".join(parts) if parts else "none"
