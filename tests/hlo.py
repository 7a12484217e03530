"""Reading compiled HLO: the collectives a program runs and the buffers it updates in place.
For the multi-device checks (`test_sharding.py`, `multi_process.py`)."""

import re
from typing import NamedTuple

import numpy as np


class Collective(NamedTuple):
    op: str  # "all-reduce", "all-gather", ... (an async "-start" form counts as its op)
    shapes: tuple[str, ...]  # result shapes without layouts, e.g. ("f32[5,3]",), ("pred[]",)
    computation: str
    every_step: bool  # False when it sits only in a branch of a `conditional`


_COLLECTIVE_OPS = {
    "all-gather",
    "all-to-all",
    "ragged-all-to-all",
    "collective-permute",
    "collective-broadcast",
    "all-reduce",
    "reduce-scatter",
    "send",
    "recv",
}
_COMPUTATION = re.compile(r"^(?:ENTRY\s+)?%?(?P<name>[A-Za-z_][\w.\-]*)\s.*\{\s*$")
_INSTRUCTION = re.compile(
    r"^\s+(?:ROOT\s+)?%?[\w.\-]+\s*=\s*(?P<type>.+?)\s+(?P<op>[a-z][a-z0-9\-]*)\((?P<rest>.*)$"
)
_CALLEES = re.compile(r"\b(?:calls|to_apply|body|condition)=%?([\w.\-]+)")


def collectives(hlo: str) -> list[Collective]:
    """Every cross-device collective of a compiled (SPMD-partitioned) HLO module.

    An instruction is a collective when its opcode (the word right before its operand list,
    after the result type) is one of `_COLLECTIVE_OPS`, possibly as an async `-start`. Names,
    metadata and `-done` halves are not matched. A collective runs `every_step` when its
    computation is reachable from the entry computation through calls, fusions, reductions and
    loops, without entering a branch of a `conditional`.
    """
    computations: dict[str, list[tuple[str, str, str]]] = {}
    entry = current = None
    for line in hlo.splitlines():
        if m := _COMPUTATION.match(line):
            current = m["name"]
            computations[current] = []
            if line.startswith("ENTRY"):
                entry = current
        elif current is not None and (m := _INSTRUCTION.match(line)):
            computations[current].append((m["op"], m["type"], m["rest"]))
    assert entry is not None, "no ENTRY computation found: not an HLO module?"
    every_step, todo = set(), [entry]
    while todo:
        name = todo.pop()
        if name in every_step:
            continue
        every_step.add(name)
        for op, _, rest in computations[name]:
            if op != "conditional":
                todo.extend(_CALLEES.findall(rest))
    found = []
    for name, instructions in computations.items():
        for op, type_, _ in instructions:
            base = op.removesuffix("-start")
            if base in _COLLECTIVE_OPS:
                # XLA combines small collectives: the result may be a tuple of arrays.
                shapes = tuple(re.findall(r"[a-z]+[0-9]*\[[0-9,]*\]", type_))
                found.append(Collective(base, shapes, name, name in every_step))
    return found


def aliased_parameters(hlo: str) -> set[int]:
    """The parameters whose buffers the outputs reuse (`input_output_alias` of the module)."""
    header = hlo.splitlines()[0]
    match = re.search(r"input_output_alias=\{(.*?)\s\}", header)
    assert match is not None, header
    return {int(p) for p in re.findall(r"\((\d+), \{\}, (?:may|must)-alias\)", match[1])}


class Loop(NamedTuple):
    op_name: str  # the JAX operation it came from, e.g. ".../jit(add)/scatter"
    source: str  # "file.py:line" of the Python line that made it ("" when not recorded)
    trips: int | None  # XLA's known trip count, when it knows one


_LOOP = re.compile(
    r"\swhile\((?:.*?op_name=\"(?P<op>[^\"]*)\")?"
    r"(?:.*?source_file=\"(?P<file>[^\"]*)\" source_line=(?P<line>\d+))?"
    r"(?:.*?known_trip_count\":\{\"n\":\"(?P<n>\d+)\")?"
)


def loops(hlo: str) -> list[Loop]:
    """Every `while` of a compiled HLO module, with the operation and the line it came from.
    On jax 0.5.3 XLA:CPU rewrites every scatter into one (`op_name` ends in `scatter`)."""
    found = []
    for line in hlo.splitlines():
        if (m := _LOOP.search(line)) and m["op"] is not None:
            source = f"{m['file'].rsplit('/', 1)[-1]}:{m['line']}" if m["file"] else ""
            found.append(Loop(m["op"], source, int(m["n"]) if m["n"] else None))
    return found


_SHAPE = re.compile(r"\b[a-z]+[0-9]*\[([0-9,]*)\]")


def copies(hlo: str, min_elements: int) -> list[str]:
    """The `copy` and `transpose` instructions whose result has at least `min_elements`
    elements: with a threshold above every item and sample, the copies of whole storage."""
    found = []
    for line in hlo.splitlines():
        m = _INSTRUCTION.match(line)
        if m is None or m["op"] not in ("copy", "transpose"):
            continue
        for dims in _SHAPE.findall(m["type"]):
            if dims and int(np.prod([int(d) for d in dims.split(",")])) >= min_elements:
                found.append(line.strip())
    return found
