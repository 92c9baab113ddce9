"""The compile side of the schedule measurement; runs in a process started with libtpu's dump flags.

    python -m ce_pallas_tpu.tooling.schedule.worker GENERATION PROFILE_DIR JOBS.json OUT.json

For each job: the kernel's plan at full size on the generation (default tiles, or the job's), then
the kernel alone compiled at a few small grids with those tiles (:mod:`.grid_fit`), each compile's
static profile read back (:mod:`.dumps`) and fitted, and the result scaled to the full grid.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import shutil
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from ce_pallas_tpu.tooling.schedule.chips import SCHEDULE_CHIPS, kernel_matmuls, mxu_cycles
from ce_pallas_tpu.tooling.schedule.dumps import read_kernel_trace
from ce_pallas_tpu.tooling.schedule.grid_fit import BilinearFit, grid_points, small_grid
from ce_pallas_tpu.tooling.schedule.records import Job, KernelSchedule, running_dw

OP_NAMES = {"forward": "ce_pallas_tpu_forward", "backward": "ce_pallas_tpu_backward"}


def _config(job: Job) -> Any:
    """The full-size kernel config of ``job`` on the current (AOT) target."""
    from ce_core import StatsSpec
    from ce_pallas_tpu.tooling.schedule.programs import kernel_config

    spec = StatsSpec(logit_soft_cap=job.logit_soft_cap, with_sum=job.with_sum, with_expected=job.with_expected,
                     w_layout=job.w_layout, with_argmax=job.with_argmax, keep_logits=job.keep_logits or None)
    if job.precision is not None:
        spec = dataclasses.replace(spec, precision=job.precision)
    return kernel_config(job.kernel, job.n, job.h, job.v, job.x_dtype, job.w_dtype, spec, job.tiles, job.w_buffers,
                         job.hidden_split, job.delta_over_logits, job.chunk_role, job.x_transposed)


def _compile(job: Job, cfg: Any, device: Any) -> None:
    import jax

    from ce_pallas_tpu.tooling.schedule.programs import kernel_program

    fn, args = kernel_program(job.kernel, cfg, job.x_dtype, job.w_dtype, jax.sharding.SingleDeviceSharding(device))
    jax.jit(fn).lower(*args).compile()


#: Traces of small grids already compiled in this process, by kernel, dtypes and small-grid config: jobs
#: that differ only in how many blocks they have (N = 4096 and 16384 with the same tiles and the
#: same ragged last block) compile the very same small grids, so the second one is free.
_TRACES: dict[tuple[str, str, str, Any, int], Any] = {}


def _measure_grid(job: Job, cfg: Any, device: Any, profile_dir: Path, label_rows_per_block: int = 0):
    key = (job.kernel, job.x_dtype, job.w_dtype, cfg, label_rows_per_block)  # the config holds no dtypes
    if key not in _TRACES:
        with _static_label_rows(label_rows_per_block):
            _TRACES[key] = _trace_grid(job, cfg, device, profile_dir)
    return _TRACES[key]


@contextlib.contextmanager
def _static_label_rows(per_block: int) -> Iterator[None]:
    """A kept backward with ``label_rows`` adds each vocab block's labelled rows in a loop whose bounds it reads
    from SMEM, which libtpu's static profiler does not read (it walks no iteration). For the schedule each block
    walks ``per_block`` rows instead: the full-size call's labels spread evenly over its vocab blocks."""
    from ce_pallas_tpu import backward

    original = backward._label_row_range
    backward._label_row_range = lambda refs, block: (0, per_block)
    try:
        yield
    finally:
        backward._label_row_range = original


def _trace_grid(job: Job, cfg: Any, device: Any, profile_dir: Path):
    shutil.rmtree(profile_dir, ignore_errors=True)
    profile_dir.mkdir(parents=True)
    try:
        _compile(job, cfg, device)
    except Exception as error:  # one job's failure is its row
        # v5e/v6e compiles with the profile flags may fail a VMEM check after the dumps are written;
        # the bundles are those of a normal compile. Without dumps the error is the answer.
        try:
            return read_kernel_trace(profile_dir, OP_NAMES[job.kernel])
        except RuntimeError:
            raise error from None
    return read_kernel_trace(profile_dir, OP_NAMES[job.kernel])


def block_bytes_per_step(job: Job, cfg: Any) -> float:
    """The HBM bytes a grid step moves at least, on average: the operand blocks that change.

    A floor under the bytes counted from the dumps' DMA waits, which miss some large transfers (a
    16 MiB ``w`` block of the forward has read as 0.1 us of traffic).
    """
    import jax.numpy as jnp

    x_bytes, w_bytes = jnp.dtype(job.x_dtype).itemsize, jnp.dtype(job.w_dtype).itemsize
    logits = 4 * cfg.block_b * cfg.block_v if job.keep_logits else 0  # the kept logits' block, out or in
    if getattr(cfg, "kept_bf16", False):  # bf16, and a step's lane maxima (128 a lane-maxima group, float32)
        group = cfg.maxima_columns if job.kernel == "forward" else cfg.kept_block_v
        logits = 2 * cfg.block_b * cfg.block_v + 4 * cfg.block_b * 128 * max(1, cfg.block_v // group)
    if job.kernel == "backward" and job.keep_logits:  # x and dx stay in VMEM for the chunk (per hidden tile)
        # dw per vocab block: the float32 running sum read and written, or the finished block in w's dtype.
        reads, writes = running_dw(job.chunk_role)
        dw_bytes = 4 * reads + (4 if writes else w_bytes)
        return (cfg.block_b * cfg.hidden_tile * (x_bytes + 4) / cfg.nv_per_core
                + cfg.hidden_tile * cfg.block_v * (w_bytes + dw_bytes) / cfg.nb + logits)
    if job.kernel == "forward":  # a w block every step; x once per token block unless hidden is blocked
        x_block = cfg.block_b * cfg.block_h * x_bytes
        return cfg.block_h * cfg.block_v * w_bytes + (x_block if cfg.nh > 1 else x_block / cfg.nv_per_core) + logits
    # The backward: x and the float32 dx partial (in and out) every step, w and dw once per vocab block
    # (kept: the float32 running dw read and written).
    dw_bytes = 8 if job.keep_logits else w_bytes
    return cfg.block_b * cfg.hp * (x_bytes + 8) + cfg.hp * cfg.block_v * (w_bytes + dw_bytes) / cfg.nb + logits


def step_mxu_cycles(job: Job, cfg: Any, generation: str) -> float:
    """The MXU minimum of one grid step of ``job``'s kernel at its full-size config ``cfg``."""
    step_h = cfg.block_h if job.kernel == "forward" else cfg.hidden_tile
    return mxu_cycles(generation, job.kernel, cfg.block_b, step_h, cfg.block_v, job.keep_logits)


def measure_job(job: Job, generation: str, device: Any, profile_dir: Path) -> KernelSchedule:
    """The schedule of one job (errors are recorded, not raised)."""
    record = KernelSchedule(generation, job.kernel, job.n, job.h, job.v, job.x_dtype, job.w_dtype,
                            variant=job.variant)
    start = time.perf_counter()
    try:
        cfg = _config(job)
        points = grid_points(cfg)
        per_block = -(-cfg.n // cfg.nv) if getattr(cfg, "label_rows", False) else 0
        traces = {point: _measure_grid(job, small_grid(cfg, *point), device, profile_dir, per_block)
                  for point in points}
    except Exception as error:
        message = str(error).strip()
        record.error = f"{type(error).__name__}: {message.splitlines()[0][:300] if message else ''}"
        record.compile_s = time.perf_counter() - start
        return record
    finally:
        shutil.rmtree(profile_dir, ignore_errors=True)

    chip = SCHEDULE_CHIPS[generation]
    # hidden blocks per (token, vocab) pair: the forward's, or the kept backward's hidden tiles
    inner = cfg.nh if job.kernel == "forward" else getattr(cfg, "hidden_split", 1)
    steps = cfg.nb * cfg.nv_per_core * inner

    def per_step(field: str) -> float:
        fit = BilinearFit.of({p: getattr(t, field) for p, t in traces.items()})
        return fit.total(cfg.nb, cfg.nv_per_core) / steps

    cycles_fit = BilinearFit.of({p: t.cycles for p, t in traces.items()})
    mxu = step_mxu_cycles(job, cfg, generation)
    record.tiles = (cfg.block_b, cfg.block_h, cfg.block_v)
    record.w_buffers = getattr(cfg, "w_buffers", None)
    record.grid = ((cfg.num_cores, cfg.nb, cfg.nv_per_core, cfg.nh) if job.kernel == "forward"
                   else (cfg.num_cores, inner * cfg.nv_per_core, cfg.nb))
    record.cores = cfg.num_cores
    record.steps_per_core = steps
    cycles_per_step = cycles_fit.total(cfg.nb, cfg.nv_per_core) / steps
    record.cycles_per_step = cycles_per_step
    interior = cycles_fit.interior()
    record.interior_cycles_per_step = None if interior is None else interior / inner
    record.bundles_per_step = per_step("bundles")
    record.vmatmuls_per_step = per_step("vmatmuls")
    record.dma_bytes_per_step = per_step("hbm_bytes")
    record.hbm_bytes_per_step = max(record.dma_bytes_per_step, block_bytes_per_step(job, cfg))
    record.mxu_cycles_per_step = mxu
    record.ratio = cycles_per_step / mxu
    record.hbm_us_per_step = record.hbm_bytes_per_step / chip.hbm_bytes_per_s * 1e6
    record.mxu_us_per_step = mxu / chip.clock_hz * 1e6
    record.step_us = cycles_per_step / chip.clock_hz * 1e6
    record.kernel_us = record.step_us * steps
    record.hbm_floor_us = record.hbm_us_per_step * steps
    matmuls = kernel_matmuls(job.kernel, cfg.block_b, cfg.hp, cfg.block_v, job.keep_logits)
    flops = 2 * len(matmuls) * cfg.n * cfg.hp * cfg.v
    record.roofline_us = flops / (chip.bf16_flops * cfg.num_cores) * 1e6
    record.grids_compiled = list(points)
    record.compile_s = time.perf_counter() - start
    return record


def main(argv: list[str]) -> int:
    generation, profile_dir, jobs_path, out_path = argv
    from ce_pallas_tpu.tooling import aot

    jobs = [Job.from_json(item) for item in json.loads(Path(jobs_path).read_text())]
    results = []
    with aot.compiling_for(generation) as device:
        for index, job in enumerate(jobs):
            record = measure_job(job, generation, device, Path(profile_dir))
            results.append(record.to_json())
            status = record.error or f"ratio {record.ratio:.3f}"
            print(f"[{index + 1}/{len(jobs)}] {generation} {job.kernel} {job.n}x{job.h}x{job.v} "
                  f"tiles {record.tiles}: {status} ({record.compile_s:.0f} s)", file=sys.stderr, flush=True)
            Path(out_path).write_text(json.dumps(results))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
