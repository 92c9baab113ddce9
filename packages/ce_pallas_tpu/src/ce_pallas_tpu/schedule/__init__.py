"""The static schedule of the kernels, per grid step, from libtpu's compiler: no TPU needed.

``measure(generation, jobs)`` compiles each kernel at a few small grids with the full-size tiles
in a child process started with libtpu's static-profile flags (libtpu reads them once per
process), reads the estimated cycles, executed bundles and DMA bytes back, and fits them to the
full grid (:mod:`.grid_fit`). Each :class:`KernelSchedule` puts the cycles of a step beside the
fewest its matmuls need on that generation's MXUs (:mod:`.chips`), and the step's HBM time beside
its MXU time. The method: ``shared/notes/tpu-static-schedule.md``; the figures: docs/benchmarks.md.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

from ce_pallas_tpu.schedule.chips import PROFILED_GENERATIONS, SCHEDULE_CHIPS, mxu_cycles
from ce_pallas_tpu.schedule.dumps import libtpu_flags
from ce_pallas_tpu.schedule.records import KERNELS, Job, KernelSchedule

__all__ = ["KERNELS", "PROFILED_GENERATIONS", "SCHEDULE_CHIPS", "Job", "KernelSchedule", "measure", "mxu_cycles"]


class ScheduleError(RuntimeError):
    """The compile process failed as a whole (one job's failure is recorded in its row instead)."""


def measure(generation: str, jobs: Sequence[Job], *, quiet: bool = False) -> list[KernelSchedule]:
    """The static schedule of each job's kernel on ``generation``, compiled in a child process.

    Needs libtpu. One compile at a time, a few seconds each (4 small grids per job).
    """
    if generation not in SCHEDULE_CHIPS:
        raise ValueError(f"libtpu profiles {sorted(SCHEDULE_CHIPS)}, not {generation!r}")
    with tempfile.TemporaryDirectory(prefix="ce-schedule-") as tmp:
        root = Path(tmp)
        jobs_path, out_path = root / "jobs.json", root / "out.json"
        jobs_path.write_text(json.dumps([job.__dict__ for job in jobs]))
        env = dict(os.environ)
        env["LIBTPU_INIT_ARGS"] = f"{env.get('LIBTPU_INIT_ARGS', '')} {libtpu_flags(root / 'profile')}".strip()
        env["JAX_PLATFORMS"] = "cpu"
        env["ALLOW_MULTIPLE_LIBTPU_LOAD"] = "1"  # no TPU is driven; other JAX processes may hold the lock
        env.pop("CE_PALLAS_TPU_INTERPRET", None)
        command = [sys.executable, "-m", "ce_pallas_tpu.schedule.worker", generation, str(root / "profile"),
                   str(jobs_path), str(out_path)]
        tail: list[str] = []
        with subprocess.Popen(command, env=env, stderr=subprocess.PIPE, text=True) as child:
            assert child.stderr is not None
            for line in child.stderr:  # progress lines start with "[i/n]"; keep the rest for errors
                if line.startswith("[") and not quiet:
                    print(line, end="", file=sys.stderr, flush=True)
                tail = (tail + [line.rstrip()])[-8:]
        if child.returncode != 0 or not out_path.exists():
            lines = "\n".join(tail)
            raise ScheduleError(f"schedule worker for {generation} exited with {child.returncode}:\n{lines}")
        return [KernelSchedule.from_json(item) for item in json.loads(out_path.read_text())]
