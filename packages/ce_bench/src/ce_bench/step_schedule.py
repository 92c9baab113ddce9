"""``ce-bench schedule --step value_and_grad``: libtpu's static schedule of a whole training step.

Per shape, TPU generation and path (:data:`ce_pallas_tpu.tooling.schedule.step.STEP_PATHS`), the
estimated milliseconds of ``value_and_grad`` of the mean loss over ``x`` and ``w`` (bf16), against the
8NHV MXU minimum (``8 * N * H * V`` flops at the chip's bf16 peak: the forward's logits and the
backward's three matmuls of a design that recomputes the logits) and against the materialised
baseline at the same shape (``baseline_ms``).

``recompute`` takes its two kernels from the grid fit of ``ce-bench schedule`` at full size and the XLA
ops around them from the step compiled at a few small token counts, fitted linearly in ``N`` and
extrapolated; ``materialised`` and ``keep_logits`` take every op from those small compiles. The
method and its limits: :mod:`ce_pallas_tpu.tooling.schedule.step`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from ce_bench.presets import Shape
from ce_bench.report import _Notes, _render

#: ``--step`` choices.
STEPS = ("value_and_grad",)
#: ``--paths`` default and choices.
DEFAULT_STEP_PATHS = ("recompute", "materialised")
STEP_PATHS = ("recompute", "materialised", "keep_logits")
#: The default shape of ``--step``.
DEFAULT_STEP_SHAPES = ("llama3-8b",)
#: The MXU minimum the estimate is quoted against, in flops per ``N * H * V``.
MINIMUM_FLOPS_PER_NHV = 8


def chip_cores(generation: str) -> int:
    """TensorCores one device of ``generation`` runs a program on (v5p: 2, megacore)."""
    from ce_pallas_tpu.target import CHIP_FACTS

    return CHIP_FACTS[generation].num_cores if generation in CHIP_FACTS else 1


def minimum_ms(generation: str, n: int, h: int, v: int) -> float:
    """``8 * N * H * V`` flops at the device's bf16 peak, in milliseconds."""
    from ce_pallas_tpu.tooling.schedule.chips import SCHEDULE_CHIPS

    peak = SCHEDULE_CHIPS[generation].bf16_flops * chip_cores(generation)
    return MINIMUM_FLOPS_PER_NHV * n * h * v / peak * 1e3


def small_token_counts(path: str, n: int, tokens: Sequence[int] | None = None, chunk: int | None = None) -> list[int]:
    """The token counts the step of ``path`` is compiled at for a shape of ``n`` tokens: ``tokens``, else one
    and two loop ``chunk``s where the path loops over token chunks, else the path's defaults; those below
    ``n``, and just ``n`` where fewer than two are (nothing to extrapolate)."""
    from ce_pallas_tpu.tooling.schedule.step import DEFAULT_STEP_TOKENS

    default = (chunk, 2 * chunk) if chunk else DEFAULT_STEP_TOKENS[path]
    chosen = sorted({t for t in (tokens or default) if t < n})
    return chosen if len(chosen) >= 2 else [n]


#: bf16 ``w``: the tokens below which a matmul's time is reading ``w`` (peak flops over HBM bytes per second).
def ridge_tokens(generation: str) -> float:
    """The token count where ``[N, H] @ [H, V]`` with bf16 ``w`` turns from reading ``w`` to the MXU."""
    from ce_pallas_tpu.tooling.schedule.chips import SCHEDULE_CHIPS

    chip = SCHEDULE_CHIPS[generation]
    return chip.bf16_flops / chip.hbm_bytes_per_s


def extrapolate(points: dict[int, float], n: int) -> tuple[float, float]:
    """``(value at n, worst relative residual of the smaller points)``: the line in ``N`` through the two
    largest points (a point at ``n`` itself is taken as is)."""
    from ce_pallas_tpu.tooling.schedule.step import linear_fit

    if n in points:
        return points[n], 0.0
    fit = linear_fit(points)
    return fit.at(n), fit.max_residual


class _OpsCache:
    """The small compiles of a run, by generation, path, token count, H and V (shapes that share a head
    share them)."""

    def __init__(self, measure: Callable[..., Any], quiet: bool) -> None:
        self.measure, self.quiet, self.cache = measure, quiet, {}

    def get(self, generation: str, path: str, n: int, h: int, v: int, loop: tuple[int, int, int] | None = None) -> Any:
        import sys
        import time

        key = (generation, path, n, h, v, loop)
        if key not in self.cache:
            start = time.perf_counter()
            self.cache[key] = self.measure(generation, path, n, h, v, loop)
            if not self.quiet:
                ops = self.cache[key]
                aborted = " (profiler aborted; see the record)" if ops.abort else ""
                print(f"[step] {generation} {path} {n}x{h}x{v}: {ops.xla_cycles + ops.kernel_cycles:,.0f} cycles "
                      f"in {ops.ops} ops{aborted} ({time.perf_counter() - start:.0f} s)", file=sys.stderr, flush=True)
        return self.cache[key]


def step_record(generation: str, shape: Shape, path: str, points: dict[int, Any], kernel_records: Sequence[dict],
                clock_hz: float) -> dict[str, Any]:
    """One path's record from its small compiles (``points``: token count -> ``StepOps``) and, for a path
    whose kernels come from the grid fit, those kernels' ``ce-bench schedule`` records."""
    from ce_bench.schedule import estimated_ms

    n = shape.n
    with_kernels = not kernel_records  # the small compiles' kernels count (no fit for them)
    lost = sorted({name for ops in points.values() for name in ops.unprofiled_kernels})
    if with_kernels and lost:  # a kernel's cost cannot be guessed from its bytes
        aborts = "; ".join(sorted({ops.abort or "" for ops in points.values()}))[:200]
        raise RuntimeError(f"the profiler aborted before the kernels {', '.join(lost)} were walked ({aborts})")
    totals = {t: (ops.xla_cycles + (ops.kernel_cycles if with_kernels else 0.0)) / clock_hz * 1e3
              for t, ops in points.items()}
    ops_ms, residual = extrapolate(totals, n)
    kernels_ms = (sum(estimated_ms(record) * record.get("repeats", 1) for record in kernel_records)
                  if kernel_records else None)
    est_ms = ops_ms + (kernels_ms or 0.0)
    minimum = minimum_ms(generation, n, shape.h, shape.v)
    estimated_ops = sorted({name for ops in points.values() for name in ops.estimated_ops})
    aborts = sorted({ops.abort for ops in points.values() if ops.abort})
    return {
        "generation": generation, "shape": shape.label, "n": n, "h": shape.h, "v": shape.v, "objective": "loss",
        "path": path, "est_ms": est_ms, "minimum_8nhv_ms": minimum, "ratio_8nhv": est_ms / minimum,
        "baseline_ms": None,
        "kernels_ms": kernels_ms,  # from the grid fit at full size (None: counted in ops_ms)
        "ops_ms": ops_ms,  # the small compiles' ops (kernels included where kernels_ms is None), at n
        "ops_tokens": sorted(points), "ops_points_ms": {str(t): totals[t] for t in sorted(points)},
        "extrapolated": n not in points, "fit_residual": residual,
        # Compiled below twice the ridge, the small steps' matmuls read w more than they multiply: the
        # slope in N (and the extrapolation) comes out too low.
        "below_ridge": with_kernels and n not in points and sorted(points)[-2:][0] < 2 * ridge_tokens(generation),
        "ops_estimated_from_hbm_bytes": estimated_ops,
        "estimated_from_hbm_ms": max((ops.estimated_cycles for ops in points.values()), default=0.0) / clock_hz * 1e3,
        "profiler_aborts": aborts, "error": None,
    }


def run_step_schedule(target: str, shapes: Sequence[Shape], paths: Sequence[str] = DEFAULT_STEP_PATHS,
                      tokens: Sequence[int] | None = None, *, dtype: str = "bfloat16", w_layout: str = "hv",
                      quiet: bool = False,
                      measure_ops: Callable[..., Any] | None = None,
                      kernel_schedule: Callable[..., list[list[dict[str, Any]]]] | None = None) -> list[dict[str, Any]]:
    """One record per shape and path (in that order); ``baseline_ms`` is the materialised path's
    ``est_ms`` at the same shape where that path is measured; ``w_layout="vh"`` takes every path's head as a tied
    ``[V, H]`` embedding. ``measure_ops`` and ``kernel_schedule`` (its kernel records per shape) replace the
    compiles (tests)."""
    from ce_pallas_tpu.tooling.schedule import step
    from ce_pallas_tpu.tooling.schedule.chips import SCHEDULE_CHIPS

    clock_hz = SCHEDULE_CHIPS[target].clock_hz
    ops_cache = _OpsCache(measure_ops or (lambda g, p, n, h, v, loop: step.measure_step_ops(
        g, p, n, h, v, dtype, loop=loop, w_layout=w_layout)), quiet)
    loops = {(path, shape): step.loop_plan(path, target, shape.n, shape.h, shape.v, dtype, w_layout)
             for path in paths for shape in shapes}
    kernel_records: dict[tuple[str, Shape], list[dict[str, Any]]] = {}
    for path in paths:
        kernels = step.KERNELS_FROM_FIT.get(path)
        if kernels and step.path_unavailable(path) is None:
            found = (kernel_schedule or _kernel_schedule(target, dtype, quiet, w_layout))(
                list(shapes), kernels, [loops[(path, shape)] for shape in shapes])
            for shape, shape_records in zip(shapes, found, strict=True):
                kernel_records[(path, shape)] = shape_records
    records = []
    for shape in shapes:
        for path in paths:
            base = {"generation": target, "shape": shape.label, "n": shape.n, "h": shape.h, "v": shape.v,
                    "w_layout": w_layout, "objective": "loss", "path": path, "est_ms": None, "ratio_8nhv": None,
                    "baseline_ms": None}
            reason = step.path_unavailable(path)
            if reason is not None:
                records.append({**base, "skipped": reason, "error": None})
                continue
            try:
                kernels_found = kernel_records.get((path, shape), [])
                failed = [r["error"] for r in kernels_found if r.get("error")]
                if failed:
                    raise RuntimeError(f"kernel schedule failed: {failed[0]}")
                loop = loops[(path, shape)]
                chunk = loop[0] if loop else None
                points = {t: ops_cache.get(target, path, t, shape.h, shape.v, loop)
                          for t in small_token_counts(path, shape.n, tokens, chunk)}
                record = {**step_record(target, shape, path, points, kernels_found, clock_hz), "w_layout": w_layout}
                record["loop_chunk"] = chunk
                if loop:
                    record["loop_hidden_tiles"], record["loop_longest_piece"] = loop[1], loop[2] or None
                if path == "materialised":
                    record["loss_library"] = step.materialised_library()
                records.append(record)
            except Exception as error:  # one path's failure is its row
                message = str(error).strip().splitlines()
                records.append({**base, "error": f"{type(error).__name__}: {message[0][:300] if message else ''}"})
    fill_baselines(records)
    return records


def _kernel_schedule(target: str, dtype: str, quiet: bool,
                     w_layout: str = "hv") -> Callable[..., list[list[dict[str, Any]]]]:
    """The grid fit of a path's kernels, their records per shape: over the whole N, or per chunk where the path
    loops (``loops``)."""
    from ce_bench.schedule import run_kept_schedule, run_schedule

    def schedule(shapes: list[Shape], kernels: tuple[str, ...],
                 loops: list[tuple[int, int, int] | None]) -> list[list[dict[str, Any]]]:
        if all(loop is None for loop in loops):
            found = run_schedule(target, shapes, dtype, kernels, w_layout=w_layout, quiet=quiet)
            return [found[index * len(kernels):(index + 1) * len(kernels)] for index in range(len(shapes))]
        looped = [shape for shape, loop in zip(shapes, loops, strict=True) if loop is not None]
        found = run_kept_schedule(target, looped, dtype, kernels, w_layout=w_layout, quiet=quiet)
        return [[record for record in found if record["shape"] == shape.label] for shape in shapes]

    return schedule


def fill_baselines(records: Sequence[dict[str, Any]]) -> None:
    """Set each record's ``baseline_ms`` to the materialised path's ``est_ms`` at its shape, head layout and
    generation."""

    def key(r: dict[str, Any]) -> tuple[str, str, str]:
        return r["generation"], r["shape"], r.get("w_layout", "hv")

    baselines = {key(r): r["est_ms"] for r in records if r["path"] == "materialised" and r.get("est_ms") is not None}
    for record in records:
        record["baseline_ms"] = baselines.get(key(record))


def _number(value: float | None, digits: int = 2) -> str:
    return "-" if value is None else f"{value:,.{digits}f}"


def step_table(records: Sequence[dict[str, Any]], fmt: str = "text") -> str:
    """Per shape and path: the estimated step, its ratio to the 8NHV minimum and to the baseline, and
    where the figures come from."""
    notes = _Notes()
    headers = ["target", "shape (N x H x V)", "objective", "path", "est. ms", "8NHV ms", "est. / 8NHV",
               "baseline ms", "est. / baseline", "kernels ms (fit)", "ops ms", "ops from N"]
    rows = []
    for r in records:
        shape = r["shape"] + (" [V, H]" if r.get("w_layout") == "vh" else "")  # a tied head's
        if r.get("skipped") or r.get("error"):
            status = ("skipped" + notes.ref(r["skipped"])) if r.get("skipped") else ("failed" + notes.ref(r["error"]))
            rows.append([r["generation"], shape, r["objective"], r["path"], status, *["-"] * 7])
            continue
        source = ",".join(str(t) for t in r["ops_tokens"])
        if r["extrapolated"]:
            source += f" (linear to {r['n']})"
        if r.get("below_ridge"):
            ridge = 2 * ridge_tokens(r["generation"])
            source += notes.ref(f"{r['generation']}: fitted at N below twice the ridge ({ridge:.0f} tokens), where "
                                "the matmuls are bound by reading w: the extrapolation is too low; use --step-tokens "
                                "above it")
        if r.get("ops_estimated_from_hbm_bytes"):
            aborts = "; ".join(r["profiler_aborts"])[:200]
            why = f"the profiler aborted ({aborts})" if aborts else "libtpu wrote no profile for some ops"
            source += notes.ref(f"{r['generation']} {r['path']}: {why}; "
                                f"{len(r['ops_estimated_from_hbm_bytes'])} ops without a profile estimated from "
                                f"their HBM bytes ({_number(r['estimated_from_hbm_ms'], 3)} ms at the largest N)")
        ratio_baseline = r["est_ms"] / r["baseline_ms"] if r.get("baseline_ms") else None
        rows.append([r["generation"], shape, r["objective"], r["path"], _number(r["est_ms"]),
                     _number(r["minimum_8nhv_ms"]), _number(r["ratio_8nhv"], 3), _number(r["baseline_ms"]),
                     _number(ratio_baseline, 3), _number(r["kernels_ms"]), _number(r["ops_ms"]), source])
    return _render(headers, rows, notes, fmt, right={4, 5, 6, 7, 8, 9, 10})
