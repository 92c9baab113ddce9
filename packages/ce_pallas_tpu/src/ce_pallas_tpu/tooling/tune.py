"""Tile tuning without a TPU: compile candidate tiles, read their static schedules, keep the fastest.

For one generation, one shape bucket (at the bucket's example shape, bfloat16) or one user problem
(``N x H x V``, its dtypes and objective: the user's tile cache, :mod:`ce_pallas_tpu.tile_cache`),
and one kernel:

1. candidates: today's tiles first (the table entry; for a user problem, what the backend would run;
   so a retune never makes things worse), then token x vocab blocks (the forward keeps ``x``
   resident, the backward forms its ``dx``/``dw`` products in 512-row hidden chunks) whose analytic
   HBM time per step stays below their MXU time and whose footprint by the VMEM model
   (:mod:`ce_pallas_tpu.cost_model`) is within reach. The model over-estimates, so it only
   prefilters (:data:`VMEM_PREFILTER_SLACK`); libtpu's compile decides. Ranked: comfortably
   compute-bound (HBM under :data:`HBM_COMFORT` of MXU time) with a step long enough to hide the
   per-step cost (:data:`MIN_STEP_CYCLES`) first, then (forward) the longest step up to
   :data:`FORWARD_LONG_STEP`, then the smallest footprint;
2. each candidate is compiled alone at full size for the generation; a backward one with two
   ``w`` buffers first, then with one. What libtpu refuses (VMEM) is dropped;
3. the first ``max_candidates`` that compile are measured by :func:`ce_pallas_tpu.tooling.schedule.measure`;
4. the winner has the least estimated kernel time (:func:`estimated_us`).

``ce-bench tune --target <generation> [--write]`` runs this per bucket and, with ``--write``,
re-renders :mod:`ce_pallas_tpu.tuned` (:func:`write_table`): the generation's entries replaced, the
others kept. ``ce-bench tune --target <generation> --shapes NxHxV`` runs it per problem and writes the
winners to the user's tile cache.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Callable, Collection, Mapping
from pathlib import Path
from typing import NamedTuple

from ce_pallas_tpu.cost_model import Shape, backward_bytes, forward_bytes
from ce_pallas_tpu.layout import LANES, round_up
from ce_pallas_tpu.target import CHIP_FACTS, Target
from ce_pallas_tpu.tile_cache import CacheKey, lookup
from ce_pallas_tpu.tile_types import KernelTiles, TunedEntry
from ce_pallas_tpu.tiling import BUCKET_EXAMPLES, fit_tiles, resolve_tiles, tuned_table, vmem_limit
from ce_pallas_tpu.tooling import schedule
from ce_pallas_tpu.tooling.schedule.chips import SCHEDULE_CHIPS, mxu_cycles

#: Candidates may exceed the usable VMEM by this factor in the model: the compile decides.
VMEM_PREFILTER_SLACK = 1.35
#: A forward candidate's analytic HBM time per step must stay below this share of its MXU time (a
#: backward one's below its MXU time, ranked first under this share)...
HBM_SHARE = 0.8
#: ...and candidates under this share, with at least this many MXU cycles per step, come first.
HBM_COMFORT = 0.6
MIN_STEP_CYCLES = 16384
#: The streamed forward's per-step cost (the step's DMA and pipeline bookkeeping, its per-lane state,
#: the overflow check) is paid per step and per token row, so longer steps hide it better: up to this
#: many MXU cycles per step, longer ranks first. (v6e, 4096x896x151936: 1024/all/2048 1.191 of the MXU
#: minimum, 2048/all/4096 1.089, 4096/all/4096 1.071.)
FORWARD_LONG_STEP = 131072
FORWARD_TOKENS = (256, 512, 1024, 2048, 4096)
FORWARD_COLUMNS = (256, 512, 1024, 2048, 4096, 8192)
BACKWARD_TOKENS = (128, 256, 512, 1024)
BACKWARD_COLUMNS = (512, 1024, 1536, 2048)
BACKWARD_CHUNK = 512

#: Generation order of the rendered table; v4 cannot be measured (libtpu has no DMA model for it).
GENERATIONS = ("v4", "v5e", "v5p", "v6e", "tpu7x")
V4_NOTE = "not measurable: libtpu has no DMA model for v4; roofline seed, compiled by the tests"

V4_COMMENT = (
    "v4: libtpu has no DMA model for v4, so its static schedule cannot be walked: these stay the",
    "roofline seeds (the inference rule at each bucket's example shape), ratio None, compiled for",
    "v4 by the test suite.",
)

#: Longest line of the rendered module (the workspace's lint limit), and longest note kept.
LINE_LIMIT = 120
NOTE_LIMIT = 200

#: The generated module :func:`write_table` renders.
TUNED_MODULE = Path(__file__).parent.parent / "tuned.py"


@dataclasses.dataclass(frozen=True)
class Problem:
    """What is tuned: ``N x H x V`` with the dtypes of ``x`` and ``w`` and the objective (``loss``, or
    ``rl``: the log-probs with the entropy's expected logit)."""

    n: int
    h: int
    v: int
    x_dtype: str = "bfloat16"
    w_dtype: str = "bfloat16"
    objective: str = "loss"

    @property
    def shape(self) -> Shape:
        """The problem as the tile rules see it (no cap, no sum, no argmax: the tuned case)."""
        import numpy as np

        return Shape(self.n, round_up(self.h, LANES), self.v, np.dtype(self.x_dtype).itemsize,
                     np.dtype(self.w_dtype).itemsize, with_sum=False, capped=False,
                     with_expected=self.objective == "rl")

    def cache_key(self, generation: str) -> CacheKey:
        return CacheKey(generation, self.n, self.h, self.v, self.x_dtype, self.w_dtype, self.objective)


def example_problem(n: int, h: int, v: int) -> Shape:
    """A plain bfloat16 problem as the tile rules see it."""
    return Problem(n, h, v).shape


def _target(generation: str) -> Target:
    return Target(generation, CHIP_FACTS[generation].num_cores, None)


def _prefilter_bytes(generation: str) -> float:
    return vmem_limit(_target(generation)) * VMEM_PREFILTER_SLACK


def _rank(hbm_share: float, cycles: float, need: int, *, few_rows: bool = False,
          long_step: float = 0) -> tuple[bool, bool, float, int]:
    return (few_rows, hbm_share > HBM_COMFORT or cycles < MIN_STEP_CYCLES, -min(cycles, long_step), need)


def _ranked(options: list[tuple[tuple, KernelTiles[int | None]]],
            ) -> list[KernelTiles[int | None]]:
    return list(dict.fromkeys(tiles for _, tiles in sorted(options, key=lambda item: item[0])))


def forward_candidates(shape: Shape, generation: str) -> list[KernelTiles[int | None]]:
    """Forward tiles worth compiling, best guess first (``x`` resident: ``block_h=None``)."""
    chip = SCHEDULE_CHIPS[generation]
    limit = _prefilter_bytes(generation)
    options = []
    for block_b, block_v in itertools.product(FORWARD_TOKENS, FORWARD_COLUMNS):
        block_b, block_v = min(block_b, shape.n), min(block_v, shape.v)
        cycles = mxu_cycles(generation, "forward", block_b, shape.hp, block_v)
        mxu_s = cycles / chip.clock_hz
        hbm_s = shape.hp * block_v * shape.w_bytes / chip.hbm_bytes_per_s  # the w block; x stays resident
        need = forward_bytes(shape, block_b, shape.hp, block_v, chip=CHIP_FACTS[generation])
        if hbm_s <= HBM_SHARE * mxu_s and need <= limit:
            rank = _rank(hbm_s / mxu_s, cycles, need, long_step=FORWARD_LONG_STEP)
            options.append((rank, KernelTiles(block_b, None, block_v)))
    return _ranked(options)


def backward_candidates(shape: Shape, generation: str) -> list[KernelTiles[int | None]]:
    """Backward tiles worth compiling, best guess first.

    A candidate's MXU time is its step's work at the MXUs' peak, not the tiles' pass count: on a
    256-wide MXU a 128-row step's ``dw`` product fills half of each pass, and counting those passes
    made 128-row steps look compute-bound where 256-row ones (the same HBM share) did not (v6e,
    Llama-3 70B's head: 128/512/1024 kept at 47.1 ms, 256/512/1024 measures 31.3). Its HBM time must
    stay below that MXU time (issue 25's goal); among steps of 256 rows or more, under
    :data:`HBM_SHARE` of it ranks first.
    """
    chip = SCHEDULE_CHIPS[generation]
    limit = _prefilter_bytes(generation)
    options = []
    for block_b, block_v in itertools.product(BACKWARD_TOKENS, BACKWARD_COLUMNS):
        block_b, block_v = min(block_b, shape.n), min(block_v, shape.v)
        cycles = mxu_cycles(generation, "backward", block_b, shape.hp, block_v)
        mxu_s = backward_step_flops(block_b, shape.hp, block_v) / chip.bf16_flops
        hbm_s = block_b * shape.hp * (shape.x_bytes + 8) / chip.hbm_bytes_per_s  # x, and the dx partial in and out
        need = backward_bytes(shape, block_b, BACKWARD_CHUNK, block_v)
        if hbm_s <= mxu_s and need <= limit:
            # Fewer than 256 token rows per step underfeed the logits and dx products (the MXU
            # reloads its weights every block_b rows): last resort, for hidden sizes where nothing else fits.
            rank = _rank(hbm_s / mxu_s, cycles, need, few_rows=block_b < 256)
            rank = (rank[0], hbm_s > HBM_SHARE * mxu_s, *rank[1:])
            options.append((rank, KernelTiles(block_b, BACKWARD_CHUNK, block_v)))
    return _ranked(options)


def backward_step_flops(block_b: int, hp: int, block_v: int) -> int:
    """The three products of one backward step (logits, ``dw``, ``dx``), ``2 * b * Hp * v`` flops each."""
    return 6 * block_b * hp * block_v


def compile_error(generation: str, kernel: str, problem: Problem, tiles: KernelTiles[int | None]) -> str | None:
    """Why libtpu does not compile the kernel alone at full size with these tiles (None: it does)."""
    import jax

    from ce_core import StatsSpec
    from ce_pallas_tpu.tooling import aot
    from ce_pallas_tpu.tooling.schedule.programs import kernel_config, kernel_program

    try:
        with aot.compiling_for(generation) as device:
            spec = StatsSpec(with_expected=problem.objective == "rl")
            cfg = kernel_config(kernel, problem.n, problem.shape.hp, problem.v, problem.x_dtype, problem.w_dtype,
                                spec, (tiles.block_b, tiles.block_h, tiles.block_v), tiles.w_buffers)
            fn, args = kernel_program(kernel, cfg, problem.x_dtype, problem.w_dtype,
                                      jax.sharding.SingleDeviceSharding(device))
            jax.jit(fn).lower(*args).compile()
    except Exception as error:  # VMEM refusals, and tiles the kernels reject
        text = f"{type(error).__name__}: {error}".strip()
        return next((line.strip() for line in text.splitlines() if line.strip()), text)[:200]
    return None


def _compiling(generation: str, kernel: str, problem: Problem,
               tiles: KernelTiles[int | None]) -> tuple[KernelTiles[int | None] | None, str]:
    """The candidate as it compiles (a backward one with two buffers if possible), or None and why not."""
    if kernel == "forward":
        error = compile_error(generation, kernel, problem, tiles)
        return (tiles, "") if error is None else (None, error)
    error = ""
    for w_buffers in (2, 1):
        candidate = dataclasses.replace(tiles, w_buffers=w_buffers)
        error = compile_error(generation, kernel, problem, candidate)
        if error is None:
            return candidate, ""
    return None, error


def estimated_us(record: schedule.KernelSchedule) -> float:
    """The kernel's time on the walked core: its static cycles at the clock, or its HBM bytes at the
    core's bandwidth when those take longer (the static cycles do not see HBM)."""
    return max(record.kernel_us or math.inf, record.hbm_floor_us or 0.0)


@dataclasses.dataclass
class KernelChoice:
    """The tiles kept for one kernel, and every candidate's schedule."""

    kernel: str
    tiles: KernelTiles[int | None]
    schedule: schedule.KernelSchedule
    measured: list[tuple[KernelTiles[int | None], schedule.KernelSchedule]]
    refused: list[tuple[KernelTiles[int | None], str]]
    incumbent: KernelTiles[int | None] | None


class TuneError(RuntimeError):
    """No candidate of a kernel compiled, or none could be measured."""


def same_tiles(a: KernelTiles[int | None], b: KernelTiles[int | None]) -> bool:
    return (a.block_b, a.block_h, a.block_v) == (b.block_b, b.block_h, b.block_v)


def fitted(shape: Shape, tiles: KernelTiles[int | None], kernel: str, generation: str) -> KernelTiles[int | None]:
    """``tiles`` clamped to the problem as the kernels will use them on ``generation`` (the forward's
    whole-hidden ``block_h`` stays ``None``; the backward's chunk divides the padded hidden size)."""
    fit = fit_tiles(shape, tiles, backward=kernel == "backward", mxu_side=CHIP_FACTS[generation].mxu_side)
    block_h = None if kernel == "forward" and fit.block_h == shape.hp else fit.block_h
    return KernelTiles(fit.block_b, block_h, fit.block_v, tiles.w_buffers)


def planned_entry(generation: str, problem: Problem) -> TunedEntry:
    """Both kernels' tiles the backend would run for ``problem`` on ``generation`` today (its cached
    entry, else the table's, else the inferred tiles), without figures."""
    shape = problem.shape
    tiles = resolve_tiles(shape, _target(generation), None, lookup(problem.cache_key(generation)))
    return TunedEntry(forward=fitted(shape, tiles.forward, "forward", generation), backward=tiles.backward)


def incumbent_tiles(generation: str, bucket: str | None, kernel: str, problem: Problem,
                    ) -> KernelTiles[int | None] | None:
    """Today's tiles of this kernel, fitted to the problem: the bucket's table entry (None: the table
    has none), or for a user problem (``bucket`` None) what the backend would run for it now (its
    cached entry, else the table's, else the inferred tiles)."""
    shape = problem.shape
    entry = planned_entry(generation, problem) if bucket is None else tuned_table().get((generation, bucket))
    if entry is None:
        return None
    return fitted(shape, entry.forward if kernel == "forward" else entry.backward, kernel, generation)


def tune_kernel(generation: str, bucket: str | None, kernel: str, *, max_candidates: int = 3,
                shape: tuple[int, int, int] | None = None, problem: Problem | None = None, quiet: bool = False,
                log: Callable[[str], None] = print) -> KernelChoice:
    """Compile and measure up to ``max_candidates`` tiles for one kernel of one bucket; keep the fastest.

    ``shape`` ``(N, H, V)`` replaces the bucket's example shape (for tests: a small shape compiles
    and profiles in seconds). ``problem`` with ``bucket`` None tunes one user problem (its dtypes and
    objective) for the tile cache. Today's tiles are always the first candidate.

    Raises:
      TuneError: no candidate compiled, or none could be measured.
    """
    if problem is None:
        if bucket is None:
            raise ValueError("tune_kernel needs a bucket or a problem")
        problem = Problem(*(shape or BUCKET_EXAMPLES[bucket]))
    where = bucket or f"{problem.n}x{problem.h}x{problem.v}"
    problem_shape = problem.shape
    ranked = (forward_candidates if kernel == "forward" else backward_candidates)(problem_shape, generation)
    ranked = list(dict.fromkeys(fitted(problem_shape, tiles, kernel, generation) for tiles in ranked))
    incumbent = incumbent_tiles(generation, bucket, kernel, problem)
    if incumbent is not None:
        ranked = [incumbent, *(t for t in ranked if not same_tiles(t, incumbent))]
    chosen: list[KernelTiles[int | None]] = []
    refused: list[tuple[KernelTiles[int | None], str]] = []
    for tiles in ranked:
        if len(chosen) == max_candidates:
            break
        compiled, why = _compiling(generation, kernel, problem, tiles)
        if compiled is None:
            refused.append((tiles, why))
            log(f"  {kernel} {_label(tiles)}: does not compile, skipped ({why})")
        else:
            chosen.append(compiled)
    if not chosen:
        raise TuneError(f"no {kernel} candidate compiles for {generation}/{where}")
    jobs = [schedule.Job(kernel, problem.n, problem_shape.hp, problem.v, x_dtype=problem.x_dtype,
                         w_dtype=problem.w_dtype, with_expected=problem.objective == "rl", tiles=t.sizes,
                         w_buffers=t.w_buffers)
            for t in chosen]
    records = schedule.measure(generation, jobs, quiet=quiet)
    measured = list(zip(chosen, records, strict=True))
    for tiles, record in measured:
        status = record.error or (f"ratio {record.ratio:.3f}, HBM {record.hbm_us_per_step:.2f} vs MXU "
                                  f"{record.mxu_us_per_step:.2f} us/step, {estimated_us(record) / 1e3:.2f} ms")
        log(f"  {kernel} {_label(tiles)}: {status}")
    usable = [(tiles, record) for tiles, record in measured if record.error is None and record.ratio is not None]
    if not usable:
        first = next((record.error for _, record in measured if record.error), "no ratio")
        raise TuneError(f"no {kernel} candidate could be measured for {generation}/{where} ({first})")
    tiles, record = min(usable, key=lambda item: estimated_us(item[1]))
    return KernelChoice(kernel, tiles, record, measured, refused, incumbent)


def _label(tiles: KernelTiles[int | None]) -> str:
    text = f"{tiles.block_b}/{tiles.block_h}/{tiles.block_v}"
    return text if tiles.w_buffers is None else f"{text} x{tiles.w_buffers}"


def _figure(value: float | None, digits: int) -> float | None:
    return None if value is None else round(value, digits)


def shorten(text: str, limit: int = NOTE_LIMIT) -> str:
    """``text`` cut to ``limit`` characters (ending in ``...`` when cut), for a note in the table."""
    return text if len(text) <= limit else text[: limit - 3].rstrip() + "..."


class _KernelFields(NamedTuple):
    """One kernel's part of a :class:`TunedEntry`: its tiles and their figures (``None``: not measured)."""

    tiles: KernelTiles[int | None]
    ratio: float | None = None
    hbm_us: float | None = None
    mxu_us: float | None = None


def entry_from(choices: Mapping[str, KernelChoice], previous: TunedEntry | None = None,
               failures: Mapping[str, str] | None = None, kept: Collection[str] = ()) -> TunedEntry:
    """The table entry of a bucket's kernel choices, with their measured figures (rounded).

    A kernel in ``kept`` (not tuned in this run) keeps its tiles, figures and notes from
    ``previous``. Any other kernel missing from ``choices`` (it could not be measured) keeps its
    tiles from ``previous`` without figures, and the entry's note says why (``failures[kernel]``).

    Raises:
      ValueError: a kernel is missing and there is no previous entry to keep its tiles from.
    """
    notes: list[str] = []

    def fields_of(kernel: str) -> _KernelFields:
        choice = choices.get(kernel)
        if choice is None:
            if previous is None:
                raise ValueError(f"no {kernel} choice and no previous entry to keep its tiles from")
            tiles = previous.forward if kernel == "forward" else previous.backward
            if kernel in kept:
                notes.extend(note for note in (previous.note or "").split("; ") if note.startswith(f"{kernel} "))
                return _KernelFields(tiles, *(getattr(previous, f"{kernel}_{figure}")
                                              for figure in ("ratio", "hbm_us", "mxu_us")))
            notes.append(shorten(f"{kernel} not measured: {(failures or {}).get(kernel, 'not tuned')}"))
            return _KernelFields(tiles)
        record = choice.schedule
        return _KernelFields(choice.tiles, _figure(record.ratio, 3), _figure(record.hbm_us_per_step, 2),
                             _figure(record.mxu_us_per_step, 2))

    forward, backward = fields_of("forward"), fields_of("backward")
    return TunedEntry(forward=forward.tiles, backward=backward.tiles,
                      forward_ratio=forward.ratio, backward_ratio=backward.ratio,
                      forward_hbm_us=forward.hbm_us, forward_mxu_us=forward.mxu_us,
                      backward_hbm_us=backward.hbm_us, backward_mxu_us=backward.mxu_us,
                      note="; ".join(notes) or None)


# ---------------------------------------------------------------------------------------------
# The generated module.


def _order(key: tuple[str, str]) -> tuple[int, int, str, str]:
    generation, bucket = key
    buckets = list(BUCKET_EXAMPLES)
    return (GENERATIONS.index(generation) if generation in GENERATIONS else len(GENERATIONS),
            buckets.index(bucket) if bucket in buckets else len(buckets), generation, bucket)


def _render_tiles(tiles: KernelTiles[int | None]) -> str:
    text = f"KernelTiles({tiles.block_b}, {tiles.block_h}, {tiles.block_v}"
    return text + (")" if tiles.w_buffers is None else f", w_buffers={tiles.w_buffers})")


def _render_entry(key: tuple[str, str], entry: TunedEntry) -> list[str]:
    lines = [f"    {key!r}: TunedEntry("]
    for field in dataclasses.fields(entry):
        value = getattr(entry, field.name)
        if value is None and field.default is None:
            continue
        if isinstance(value, str) and len(f"        {field.name}={value!r},") > LINE_LIMIT:
            # A long note: implicit concatenation of pieces that fit the line limit.
            width = LINE_LIMIT - 24  # room for the indent, the quotes and a few escapes
            pieces = [value[i:i + width] for i in range(0, len(value), width)]
            lines += [f"        {field.name}=(", *(f"            {piece!r}" for piece in pieces), "        ),"]
            continue
        text = _render_tiles(value) if isinstance(value, KernelTiles) else repr(value)
        lines.append(f"        {field.name}={text},")
    return [*lines, "    ),"]


def render_module(table: Mapping[tuple[str, str], TunedEntry], libtpu: Mapping[str, str]) -> str:
    """The text of :mod:`ce_pallas_tpu.tuned` for ``table``, deterministically ordered.

    ``libtpu``: the libtpu version each measured generation was last tuned with.
    """
    versions = ", ".join(f"{gen} {libtpu[gen]}" for gen in sorted(libtpu, key=lambda g: _order((g, ""))))
    lines = [
        "# Generated by `ce-bench tune --target <generation> --write` (ce_pallas_tpu.tooling.tune); "
        "do not edit by hand.",
        f"# libtpu: {versions or 'none'}.",
        '"""The tuned tile table: (generation, shape bucket) -> tiles of both kernels and their static schedule.',
        "",
        "Each entry was kept by ``ce-bench tune`` at its bucket's example shape (``tiling.BUCKET_EXAMPLES``)",
        "in bfloat16: ``*_ratio`` is libtpu's estimated cycles per grid step over the MXU minimum,",
        "``*_hbm_us``/``*_mxu_us`` the step's HBM and MXU time in microseconds (``tiling.TunedEntry``).",
        '"""',
        "",
        "from ce_pallas_tpu.tile_types import KernelTiles, TunedEntry",
        "",
        "#: The libtpu version each generation's entries were measured with.",
        f"LIBTPU: dict[str, str] = {dict(sorted(libtpu.items(), key=lambda item: _order((item[0], ''))))!r}",
        "",
        "TUNED: dict[tuple[str, str], TunedEntry] = {",
    ]
    previous = None
    for key in sorted(table, key=_order):
        if key[0] != previous:
            if key[0] == "v4":
                lines += [f"    # {line}" for line in V4_COMMENT]
            else:
                lines.append(f"    # {key[0]}")
            previous = key[0]
        lines += _render_entry(key, table[key])
    lines.append("}")
    return "\n".join(lines) + "\n"


def read_module(text: str) -> tuple[dict[tuple[str, str], TunedEntry], dict[str, str]]:
    """``(TUNED, LIBTPU)`` of a rendered module's text (what importing it gives)."""
    namespace: dict[str, object] = {}
    exec(compile(text, str(TUNED_MODULE), "exec"), namespace)
    table = namespace["TUNED"]
    libtpu = namespace["LIBTPU"]
    assert isinstance(table, dict) and isinstance(libtpu, dict)
    return table, libtpu


def write_table(generation: str, entries: Mapping[str, TunedEntry], *, libtpu_version: str,
                path: Path = TUNED_MODULE) -> Path:
    """Re-render the module at ``path`` with ``generation``'s entries for these buckets replaced.

    The module is read back from disk first, under an exclusive lock (two generations may be tuned
    side by side), so the other generations' and buckets' entries (and those written earlier in the
    same run) are kept as they are.
    """
    import fcntl

    with path.open("r+", encoding="utf-8") as file:
        fcntl.flock(file, fcntl.LOCK_EX)
        table, libtpu = read_module(file.read())
        table.update({(generation, bucket): entry for bucket, entry in entries.items()})
        libtpu[generation] = libtpu_version
        file.seek(0)
        file.write(render_module(table, libtpu))
        file.truncate()
    return path


def readme_table(table: Mapping[tuple[str, str], TunedEntry] | None = None) -> str:
    """The tuned table as the package README shows it (Markdown; a test keeps the README equal to it)."""
    table = tuned_table() if table is None else table

    def ratio(value: float | None) -> str:
        return "-" if value is None else f"{value:.3f}"

    lines = ["| generation (VMEM/core, cores) | bucket | forward b / h / v | backward b / h / v (w bufs) "
             "| ratio fwd / bwd |", "|---|---|---|---|---|"]
    previous = None
    for key in sorted(table, key=_order):
        generation, bucket = key
        entry, facts = table[key], CHIP_FACTS[generation]
        label = f"{generation} ({facts.vmem_bytes // 2**20} MiB, {facts.num_cores})" if generation != previous else ""
        previous = generation
        f, b = entry.forward, entry.backward
        buffers = "" if b.w_buffers is None else f" (x{b.w_buffers})"
        lines.append(f"| {label} | {bucket} | {f.block_b} / {'all' if f.block_h is None else f.block_h} / "
                     f"{f.block_v} | {b.block_b} / {b.block_h} / {b.block_v}{buffers} | "
                     f"{ratio(entry.forward_ratio)} / {ratio(entry.backward_ratio)} |")
    return "\n".join(lines)
