"""The static schedule of the kernels, per grid step, from libtpu's compiler: no TPU needed.

``measure(generation, jobs)`` compiles each kernel at a few small grids with the full-size tiles
in a child process started with libtpu's static-profile flags (libtpu reads them once per
process), reads the estimated cycles, executed bundles and DMA bytes back, and fits them to the
full grid (:mod:`.grid_fit`). Each :class:`KernelSchedule` puts the cycles of a step beside the
fewest its matmuls need on that generation's MXUs (:mod:`.chips`), and the step's HBM time beside
its MXU time. The method: ``shared/notes/tpu-static-schedule.md``; the figures: docs/benchmarks.md ("TPU:
libtpu's static schedule") and the notes it links (docs/notes/).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

from ce_pallas_tpu.tooling.schedule.chips import PROFILED_GENERATIONS, SCHEDULE_CHIPS, mxu_cycles
from ce_pallas_tpu.tooling.schedule.dumps import libtpu_flags
from ce_pallas_tpu.tooling.schedule.kept_calls import kept_jobs
from ce_pallas_tpu.tooling.schedule.records import CHUNK_ROLES, KERNELS, Job, KernelSchedule, chunk_roles

__all__ = ["CHUNK_ROLES", "KERNELS", "PROFILED_GENERATIONS", "SCHEDULE_CHIPS", "Job", "KernelSchedule", "chunk_roles",
           "kept_jobs", "measure", "mxu_cycles"]


#: The prefix of an absl FATAL log line (``F1122 05:48:18.599031   21555 llo_dumper.cc:1778] ``).
_FATAL = re.compile(r"^F\d{4} [\d:.]+\s+\d+ \S+\] ")


class ScheduleError(RuntimeError):
    """The compile process failed as a whole (one job's failure is recorded in its row instead)."""


def measure(generation: str, jobs: Sequence[Job], *, quiet: bool = False) -> list[KernelSchedule]:
    """The static schedule of each job's kernel on ``generation``, compiled in a child process.

    Needs libtpu. One compile at a time, a few seconds each (4 small grids per job). libtpu's
    profiler aborts the process on some kernels that compile fine without it; such a job gets a
    row with the check that failed, and the remaining jobs go on in a fresh process.
    """
    if generation not in SCHEDULE_CHIPS:
        raise ValueError(f"libtpu profiles {sorted(SCHEDULE_CHIPS)}, not {generation!r}")
    results: list[KernelSchedule] = []
    while len(results) < len(jobs):
        done, failure = _run_worker(generation, jobs[len(results):], quiet)
        results += done
        if failure is not None:
            job = jobs[len(results)]
            results.append(KernelSchedule(generation, job.kernel, job.n, job.h, job.v, job.x_dtype, job.w_dtype,
                                          variant=job.variant, error=failure))
    return results


def _run_worker(generation: str, jobs: Sequence[Job], quiet: bool) -> tuple[list[KernelSchedule], str | None]:
    """The records of the jobs done, and why the process died before the next one (None: it did not)."""
    with tempfile.TemporaryDirectory(prefix="ce-schedule-") as tmp:
        root = Path(tmp)
        jobs_path, out_path = root / "jobs.json", root / "out.json"
        jobs_path.write_text(json.dumps([job.__dict__ for job in jobs]))
        env = dict(os.environ)
        env["LIBTPU_INIT_ARGS"] = f"{env.get('LIBTPU_INIT_ARGS', '')} {libtpu_flags(root / 'profile')}".strip()
        env["JAX_PLATFORMS"] = "cpu"
        env["ALLOW_MULTIPLE_LIBTPU_LOAD"] = "1"  # no TPU is driven; other JAX processes may hold the lock
        env.pop("CE_PALLAS_TPU_INTERPRET", None)
        command = [sys.executable, "-m", "ce_pallas_tpu.tooling.schedule.worker", generation, str(root / "profile"),
                   str(jobs_path), str(out_path)]
        tail: list[str] = []
        reason = None
        with subprocess.Popen(command, env=env, stderr=subprocess.PIPE, text=True) as child:
            assert child.stderr is not None
            for line in child.stderr:  # progress lines start with "[i/n]"; keep the rest for errors
                if line.startswith("[") and not quiet:
                    print(line, end="", file=sys.stderr, flush=True)
                if reason is None and ("Check failed" in line or _FATAL.match(line)):
                    reason = _FATAL.sub("", line.strip())
                tail = [*tail, line.rstrip()][-8:]
        written = json.loads(out_path.read_text()) if out_path.exists() else []
        done = [KernelSchedule.from_json(item) for item in written]
        if child.returncode == 0 and len(done) == len(jobs):
            return done, None
        if reason is None and not done and child.returncode > 0:  # not an abort: the worker itself is broken
            lines = "\n".join(tail)
            raise ScheduleError(f"schedule worker for {generation} exited with {child.returncode}:\n{lines}")
        return done, f"libtpu aborted (signal {-child.returncode}): {(reason or tail[-1] if tail else '')[:300]}"
