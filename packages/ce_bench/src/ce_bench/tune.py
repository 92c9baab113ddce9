"""``ce-bench tune``: choose pallas_tpu's tiles from libtpu's static schedules (no TPU needed).

The search lives in :mod:`ce_pallas_tpu.tooling.tune`; this module runs it for the buckets asked for,
prints every measured candidate and the winners, and with ``write`` re-renders the generated table
:mod:`ce_pallas_tpu.tuned` bucket by bucket (an interrupted run keeps what it finished). For a user's
own problems (:func:`run_tune_problems`) it writes the winners to the user's tile cache
(:mod:`ce_pallas_tpu.tile_cache`) instead, problem by problem.
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from ce_bench.report import _Notes, _render

KERNELS = ("forward", "backward")


class TuneUnavailableError(RuntimeError):
    """ce_pallas_tpu or libtpu is missing."""


@dataclasses.dataclass
class TuneReport:
    """Every measured candidate (one JSON object each), the buckets (or problems) left as they were, and
    the path written (the table, or the tile cache)."""

    rows: list[dict[str, Any]]
    failed: list[str]
    path: Path | None


def bucket_names() -> list[str]:
    from ce_pallas_tpu.tiling import BUCKET_EXAMPLES

    return list(BUCKET_EXAMPLES)


def parse_buckets(spec: str | None) -> list[str]:
    """``--buckets``: comma-separated bucket names (default: all of them)."""
    known = bucket_names()
    buckets = [item.strip() for item in (spec or "").split(",") if item.strip()] or known
    unknown = [bucket for bucket in buckets if bucket not in known]
    if unknown:
        raise ValueError(f"unknown bucket(s) {', '.join(unknown)}; use {', '.join(known)}")
    return list(dict.fromkeys(buckets))


def _log(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def libtpu_version() -> str:
    import importlib.metadata

    try:
        return importlib.metadata.version("libtpu")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def _require_libtpu() -> None:
    import importlib.util

    if importlib.util.find_spec("libtpu") is None:
        raise TuneUnavailableError("tuning needs libtpu: pip install 'ce-pallas-tpu[tpu]' (Linux x86-64)")


def _rows_of(choices: dict[str, Any], label: str) -> list[dict[str, Any]]:
    """One JSON object per measured candidate of each kernel's choice."""
    from ce_pallas_tpu.tooling import tune

    rows = []
    for choice in choices.values():
        for tiles, record in choice.measured:
            row = record.to_json()
            row.update(bucket=label, w_buffers=tiles.w_buffers, chosen=tiles == choice.tiles,
                       incumbent=choice.incumbent is not None and tune.same_tiles(tiles, choice.incumbent),
                       estimated_us=tune.estimated_us(record) if record.error is None else None)
            rows.append(row)
    return rows


def _tune_kernels(where: str, kernels: Sequence[str], tune_one: Callable[[str], Any],
                  kept: str) -> tuple[dict[str, Any], dict[str, str]]:
    """``(choices, failures)``: ``tune_one(kernel)`` for each kernel; one that nothing could be measured for
    (``TuneError``) is logged, saying that its tiles ``kept`` (as they are), and recorded in ``failures``."""
    from ce_pallas_tpu.tooling import tune

    choices: dict[str, Any] = {}
    failures: dict[str, str] = {}
    for kernel in kernels:
        try:
            choices[kernel] = tune_one(kernel)
        except tune.TuneError as error:
            _log(f"  {where}: {error}; its {kernel} tiles {kept}")
            failures[kernel] = str(error)
    return choices, failures


def run_tune_problems(target: str, problems: Sequence[Any], kernels: Sequence[str] = KERNELS,
                      candidates: int = 3, *, cache: Path | None, quiet: bool = False) -> TuneReport:
    """Tune each user problem (a :class:`ce_pallas_tpu.tooling.tune.Problem`) on ``target`` and, with a
    ``cache`` path, write the winners there (the user's tile cache), one entry per problem.

    A kernel not in ``kernels``, or one that could not be measured, keeps the tiles the backend runs
    for the problem today (cached, table or inferred), without figures.
    """
    _require_libtpu()
    try:
        from ce_pallas_tpu import tile_cache
        from ce_pallas_tpu.tooling import tune
    except ImportError as error:
        raise TuneUnavailableError(f"tuning needs ce-pallas-tpu[tpu] ({error})") from error
    rows: list[dict[str, Any]] = []
    failed: list[str] = []
    path = None
    for problem in problems:
        label = f"{problem.n}x{problem.h}x{problem.v}"
        _log(f"{target} {label} ({problem.x_dtype}/{problem.w_dtype}, {problem.objective}):")
        choices, failures = _tune_kernels(
            label, kernels, lambda kernel, problem=problem: tune.tune_kernel(
                target, None, kernel, problem=problem, max_candidates=candidates, quiet=quiet, log=_log),
            "stay as the backend chooses them")
        rows += _rows_of(choices, label)
        if not choices:
            failed.append(label)
            continue
        if cache is not None:
            today = tune.planned_entry(target, problem)
            entry = tune.entry_from(choices, today, {kernel: _reason(text) for kernel, text in failures.items()})
            path = tile_cache.write_entries([tile_cache.make_entry(problem.cache_key(target), entry)], cache)
            _log(f"  {label}: written to {path}")
    return TuneReport(rows, failed, path)


def run_tune(target: str, buckets: Sequence[str], kernels: Sequence[str] = KERNELS, candidates: int = 3, *,
             write: bool = False, shape: tuple[int, int, int] | None = None, quiet: bool = False) -> TuneReport:
    """Tune each bucket's kernels on ``target``; ``write``: re-render the table after each bucket (a
    kernel not in ``kernels`` keeps its entry and figures).

    ``shape`` replaces every bucket's example shape (tests); it cannot be written.
    """
    _require_libtpu()
    try:
        from ce_pallas_tpu.tiling import BUCKET_EXAMPLES, tuned_table
        from ce_pallas_tpu.tooling import tune
    except ImportError as error:
        raise TuneUnavailableError(f"tuning needs ce-pallas-tpu[tpu] ({error})") from error
    if write and shape is not None:
        raise ValueError("writing the table needs the buckets' own example shapes")
    rows: list[dict[str, Any]] = []
    failed: list[str] = []
    path = None
    for bucket in buckets:
        n, h, v = shape or BUCKET_EXAMPLES[bucket]
        _log(f"{target} {bucket} ({n}x{h}x{v}):")
        choices, failures = _tune_kernels(
            bucket, kernels, lambda kernel, bucket=bucket: tune.tune_kernel(
                target, bucket, kernel, max_candidates=candidates, shape=shape, quiet=quiet, log=_log),
            "are left as they were")
        if not choices:
            failed.append(bucket)
            continue
        rows += _rows_of(choices, bucket)
        if write:
            previous = tuned_table().get((target, bucket))
            kept = [kernel for kernel in KERNELS if kernel not in kernels]  # not asked for: as they were
            entry = tune.entry_from(choices, previous, {kernel: _reason(text) for kernel, text in failures.items()},
                                    kept)
            path = tune.write_table(target, {bucket: entry}, libtpu_version=libtpu_version())
            _log(f"  {bucket}: written to {path}")
    return TuneReport(rows, failed, path)


def _reason(error: str) -> str:
    """Why a kernel could not be tuned, for the table's note: the candidates' first error, else the whole text."""
    start, end = error.find(" ("), error.rfind(")")
    return error[start + 2:end] if 0 < start < end else error


def _tiles(row: dict[str, Any]) -> str:
    return "-" if row["tiles"] is None else "/".join(str(t) for t in row["tiles"])


def tune_table(rows: Sequence[dict[str, Any]], fmt: str = "text") -> str:
    """Each measured candidate: tiles, ratio, HBM vs MXU time per step, estimated kernel time, kept."""
    notes = _Notes()
    headers = ["target", "bucket", "kernel", "tiles b/h/v", "w bufs", "ratio", "HBM us/step", "MXU us/step",
               "est. kernel ms", "today", "kept"]
    lines = []
    for row in rows:
        mark = ("yes" if row["incumbent"] else ""), ("yes" if row["chosen"] else "")
        if row.get("error"):
            lines.append([row["generation"], row["bucket"], row["kernel"], _tiles(row), "-",
                          "failed" + notes.ref(row["error"]), "-", "-", "-", *mark])
            continue
        lines.append([row["generation"], row["bucket"], row["kernel"], _tiles(row), str(row["w_buffers"] or "-"),
                      f"{row['ratio']:.3f}", f"{row['hbm_us_per_step']:.2f}", f"{row['mxu_us_per_step']:.2f}",
                      f"{row['estimated_us'] / 1e3:.2f}", *mark])
    return _render(headers, lines, notes, fmt, right={5, 6, 7, 8})
