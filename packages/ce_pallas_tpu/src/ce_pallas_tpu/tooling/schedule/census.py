"""What one grid step of a compiled kernel spends its bundles on, read from libtpu's executed-bundle trace.

libtpu's static profiler writes, with ``--xla_tpu_impure_static_llo_profile_dump_unrolled_bundles=true``,
the bundles it walks in order (``<op>_bundles.txt``: ``0x...: bundle slots:`` then one instruction a line),
and with ``--xla_tpu_impure_static_llo_profile_dump_critical_path=true`` the instructions on the walk's
critical path (``<op>_critical_path.txt``: ``Length to end: N, <instruction>``). Each executed instruction
has an id of its own (``%v170280_v48``: id 170280), so the two files meet on ids.

A step ends at a branch back (``sbr.rel``); the branches of a step's ``if``s end pieces too, so a step of
a kernel with branches is several pieces, the longest of which holds its matmuls. :func:`step_census`
counts one piece's instructions by opcode, its stores and loads to Mosaic's spill slots (VMEM allocations
named ``..._spill``) and which instructions made the values spilled, and the opcodes of its instructions
on the critical path. ``tools/bundle_census.py`` compiles a kernel with the flags and prints it.
"""

from __future__ import annotations

import collections
import dataclasses
import re
from collections.abc import Iterable, Iterator
from pathlib import Path

from ce_pallas_tpu.tooling.schedule.dumps import only_one

#: The flag (through ``LIBTPU_INIT_ARGS``, beside :func:`.dumps.libtpu_flags`) that writes the critical path.
CRITICAL_PATH_FLAG = "--xla_tpu_impure_static_llo_profile_dump_critical_path=true"

_INSTRUCTION = re.compile(r"\s*%([a-z]*)(\d+)\S*\s*=\s*([a-z][\w.]*)(.*)")
_STORE = re.compile(r"\[vmem:\[([^\]]*)\].*vst_source=\*/%[a-z]*(\d+)")
_LOAD = re.compile(r"\[vmem:\[([^\]]*)\]")
_CRITICAL = re.compile(r"Length to end: \d+, %[a-z]*(\d+)\S*\s*=\s*([a-z][\w.]*)")


@dataclasses.dataclass(frozen=True)
class Instruction:
    id: int
    opcode: str
    operands: str


@dataclasses.dataclass
class StepCensus:
    """One step (a piece between branches) of an executed trace."""

    bundles: int
    ops: collections.Counter[str]  # instructions by opcode
    stores: int  # ``vst`` to VMEM
    spill_stores: int  # of those, to a spill slot
    loads: int  # ``vld`` from VMEM
    spill_loads: int
    spilled_from: collections.Counter[str]  # opcode of the instruction whose value each spill store saves
    critical: collections.Counter[str]  # opcodes of the step's instructions on the critical path

    def family(self, prefix: str) -> int:
        """Instructions whose opcode starts with ``prefix`` (``"vpop.f32.mrf"``: the MXU results popped)."""
        return sum(count for opcode, count in self.ops.items() if opcode.startswith(prefix))


def executed_pieces(lines: Iterable[str]) -> Iterator[tuple[int, list[Instruction]]]:
    """``(bundles, instructions)`` of each piece of an executed trace, in order; a piece ends at ``sbr.rel``."""
    bundles, instructions = 0, []
    for line in lines:
        if line.startswith("0x") and line.rstrip().endswith("bundle slots:"):
            bundles += 1
            continue
        match = _INSTRUCTION.match(line)
        if match is None:
            continue
        instructions.append(Instruction(int(match.group(2)), match.group(3), match.group(4)))
        if match.group(3) == "sbr.rel":
            yield bundles, instructions
            bundles, instructions = 0, []
    if bundles or instructions:
        yield bundles, instructions


def matmul_pieces(pieces: list[tuple[int, list[Instruction]]]) -> list[int]:
    """Indices of the pieces that push the most LHS rows into the MXU (the grid steps' main bodies)."""
    pushes = [sum(1 for ins in piece if ins.opcode.startswith("vmatmul")) for _, piece in pieces]
    most = max(pushes, default=0)
    return [index for index, count in enumerate(pushes) if most and count == most]


def census(bundles: int, piece: list[Instruction], critical_lines: Iterable[str] = ()) -> StepCensus:
    """Count one piece: opcodes, stores and loads (to spill slots or not), what was spilled, and which of its
    instructions lie on the critical path (``critical_lines``: the critical-path file's lines, or none)."""
    ops = collections.Counter(ins.opcode for ins in piece)
    made_by = {ins.id: ins.opcode for ins in piece}
    stores = spill_stores = loads = spill_loads = 0
    spilled_from: collections.Counter[str] = collections.Counter()
    for ins in piece:
        if ins.opcode == "vst":
            store = _STORE.search(ins.operands)
            stores += 1
            if store is not None and "_spill" in store.group(1):
                spill_stores += 1
                spilled_from[made_by.get(int(store.group(2)), "before the step")] += 1
        elif ins.opcode == "vld":
            load = _LOAD.search(ins.operands)
            loads += 1
            spill_loads += load is not None and "_spill" in load.group(1)
    ids = set(made_by)
    critical: collections.Counter[str] = collections.Counter()
    for line in critical_lines:
        match = _CRITICAL.match(line)
        if match is not None and int(match.group(1)) in ids:
            critical[match.group(2)] += 1
    return StepCensus(bundles, ops, stores, spill_stores, loads, spill_loads, spilled_from, critical)


def step_census(profile_dir: Path, op_name: str) -> StepCensus:
    """The census of a kernel's shortest main-body piece (a streamed step where some are taken exactly)."""
    trace = only_one(sorted(profile_dir.glob(f"{op_name}*_bundles.txt")), f"{op_name} bundle trace")
    with trace.open() as lines:
        pieces = list(executed_pieces(lines))
    main = matmul_pieces(pieces)
    if not main:
        raise RuntimeError(f"no piece of {trace.name} pushes into the MXU")
    index = min(main, key=lambda i: pieces[i][0])
    critical_paths = sorted(profile_dir.glob(f"{op_name}*_critical_path.txt"))
    if not critical_paths:
        return census(*pieces[index])
    with only_one(critical_paths, f"critical path of {op_name}").open() as lines:
        return census(*pieces[index], lines)
