"""``ce-bench schedule``: the static schedule of the pallas_tpu kernels per grid step (no TPU needed).

The measurement itself lives in :mod:`ce_pallas_tpu.tooling.schedule` (libtpu's estimated cycles at small
grids, fitted to the full grid); this module runs it for a list of shapes and prints the table.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ce_bench.presets import Shape
from ce_bench.report import _Notes, _render

#: ``--target`` choices: the generations libtpu can walk a static profile for.
SCHEDULE_TARGETS = ("v5e", "v5p", "v6e", "tpu7x")
#: The shapes of issue 11: Llama-3 8B's head at 8k tokens, and a Qwen vocabulary at 32k tokens.
DEFAULT_SCHEDULE_SHAPES = ("llama3-8b", "32768x2048x151936")
KERNELS = ("forward", "backward")
#: ``--objective``: the plain loss, or the RL statistics (log-probs and entropy).
OBJECTIVES = ("loss", "rl")


class ScheduleUnavailableError(RuntimeError):
    """ce_pallas_tpu or libtpu is missing."""


def run_schedule(target: str, shapes: Sequence[Shape], dtype: str, kernels: Sequence[str] = KERNELS,
                 *, w_dtype: str | None = None, precision: str | None = None, w_layout: str = "hv",
                 argmax: bool = False, objective: str = "loss", quiet: bool = False) -> list[dict[str, Any]]:
    """One record (a JSON object) per shape and kernel, in that order.

    ``w_layout="vh"`` schedules a ``[V, H]`` head, ``argmax`` the forward with ``return_argmax``,
    ``objective="rl"`` the kernels of ``linear_log_probs(return_entropy=True)`` (the expected logit).
    """
    if objective not in OBJECTIVES:
        raise ValueError(f"objective must be one of {OBJECTIVES}, got {objective!r}")
    try:
        from ce_pallas_tpu.tooling import schedule
    except ImportError as error:
        raise ScheduleUnavailableError(f"the schedule needs ce-pallas-tpu[tpu] ({error})") from error
    import importlib.util

    if importlib.util.find_spec("libtpu") is None:
        raise ScheduleUnavailableError("the schedule needs libtpu: pip install 'ce-pallas-tpu[tpu]' (Linux x86-64)")
    jobs = [schedule.Job(kernel, shape.n, shape.h, shape.v, x_dtype=dtype, w_dtype=w_dtype or dtype,
                          precision=precision, w_layout=w_layout, with_argmax=argmax and kernel == "forward",
                          with_expected=objective == "rl")
            for shape in shapes for kernel in kernels]
    records = [record.to_json() for record in schedule.measure(target, jobs, quiet=quiet)]
    for record, shape in zip(records, [shape for shape in shapes for _ in kernels], strict=True):
        record["shape"] = shape.label
    return records


def run_kept_schedule(target: str, shapes: Sequence[Shape], dtype: str, kernels: Sequence[str] = KERNELS, *,
                      w_layout: str = "hv", quiet: bool = False) -> list[dict[str, Any]]:
    """The records of the kept-logits path's kernels (``keep_logits=True``), shape by shape: each kernel call of
    the plan the step takes at the shape's N (``step.kept_plan``; ``schedule.kept_jobs``: the forward once a
    chunk, the backward once a piece of each chunk, in the role of its call: its float32 ``dw`` started, added
    onto or ended), each record's ``repeats`` the calls that run it and ``shape`` its shape's label."""
    from ce_pallas_tpu.tooling import schedule
    from ce_pallas_tpu.tooling.schedule import step

    jobs, labels, repeats = [], [], []
    for shape in shapes:
        plan = step.kept_plan(target, shape.n, shape.h, shape.v, dtype, w_layout)
        for job, count in schedule.kept_jobs(plan, x_dtype=dtype, w_dtype=dtype, w_layout=w_layout):
            if job.kernel in kernels:
                jobs.append(job)
                labels.append(shape.label)
                repeats.append(count)
    records = [record.to_json() for record in schedule.measure(target, jobs, quiet=quiet)]
    for record, job, label, count in zip(records, jobs, labels, repeats, strict=True):
        record["shape"], record["repeats"], record["chunk_role"] = label, count, job.chunk_role
    return records


def _tiles(record: dict[str, Any]) -> str:
    return "-" if record["tiles"] is None else "/".join(str(t) for t in record["tiles"])


def _dtypes(record: dict[str, Any]) -> str:
    short = {"bfloat16": "bf16", "float32": "f32"}
    names: list[str] = [record["x_dtype"], record["w_dtype"]]
    x, w = (short.get(name, name) for name in names)
    return x if x == w else f"{x}/{w}"


def _number(value: float | None, digits: int = 0) -> str:
    return "-" if value is None else f"{value:,.{digits}f}"


def estimated_ms(record: dict[str, Any]) -> float:
    """The kernel's estimated time: its static cycles at the clock, or its HBM bytes at the core's
    bandwidth where those take longer (the static cycles do not see HBM)."""
    return max(record["kernel_us"], record["hbm_floor_us"]) / 1e3


def over_roofline(record: dict[str, Any]) -> float | None:
    """The estimated time over the kernel's flops at the chip's peak: unlike the ratio (cycles over the
    tiles' MXU passes), it also counts passes the tiles leave half-filled (a 128-row backward step on a
    256-wide MXU) and padding of ``H`` to 128."""
    roofline = record.get("roofline_us")
    return None if not roofline else estimated_ms(record) * 1e3 / roofline


def schedule_table(records: Sequence[dict[str, Any]], fmt: str = "text") -> str:
    """Per kernel: tiles, grid, cycles and bundles per step, the MXU minimum, their ratio, HBM vs MXU time,
    the estimated kernel time and that over the roofline."""
    notes = _Notes()
    headers = ["target", "shape (N x H x V)", "x/w dtype", "kernel", "variant", "tiles b/h/v", "grid", "cycles/step",
               "bundles/step", "MXU min", "ratio", "HBM us/step", "MXU us/step", "est. kernel ms", "est. / roofline"]
    rows = []
    for record in records:
        if record.get("error"):
            rows.append([record["generation"], record["shape"], _dtypes(record), record["kernel"],
                         record.get("variant") or "plain", "-", "-",
                         "failed" + notes.ref(record["error"]), *["-"] * 7])
            continue
        grid = "x".join(str(d) for d in record["grid"])
        rows.append([record["generation"], record["shape"], _dtypes(record), record["kernel"],
                     record.get("variant") or "plain", _tiles(record), grid,
                     _number(record["cycles_per_step"]), _number(record["bundles_per_step"]),
                     _number(record["mxu_cycles_per_step"]), f"{record['ratio']:.3f}",
                     _number(record["hbm_us_per_step"], 2), _number(record["mxu_us_per_step"], 2),
                     _number(estimated_ms(record), 2), _number(over_roofline(record), 3)])
    return _render(headers, rows, notes, fmt, right={7, 8, 9, 10, 11, 12, 13, 14})
