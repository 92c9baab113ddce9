"""libtpu's static schedule of the pallas_tpu kernels walking the live token blocks, beside the kernels
that take every block (issue 43): what a live grid step costs with the walk.

    ALLOW_MULTIPLE_LIBTPU_LOAD=1 uv run python tools/schedule_live_blocks.py --generations v5e,v5p,v6e

Each kernel is compiled at a small grid (3 token blocks x 3 vocab blocks per core) with the default
tiles of the full problem, twice: without the walk (what ``return_lse`` calls run) and walking every
block as live (what a call with ignored tokens runs where no block is dead). Printed per step: the
estimated cycles over the step's MXU minimum, the executed bundles, and the HBM bytes of the DMAs the
profiler walked.

The profiler does not read the scalar-prefetched block ids: a program walking 0, 1 or every live block
gets the same estimate, and the DMAs of the blocks those ids select drop out of its count (the bytes
column shows it), so its cycles under-count the walk's live steps. The bundles are the static work a
step issues; their ratio is the walk's overhead on a live step.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
from pathlib import Path

HEADS = {"llama3-8b": (8192, 4096, 128256, "hv"), "qwen2.5-0.5b": (8192, 896, 151936, "vh")}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--generations", default="v5e,v5p,v6e")
    parser.add_argument("--heads", default=",".join(HEADS))
    args = parser.parse_args(argv)
    profile = Path(tempfile.mkdtemp(prefix="live_blocks_"))
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    os.environ["JAX_PLATFORMS"] = "cpu"
    from ce_pallas_tpu.tooling.schedule.dumps import libtpu_flags, read_kernel_trace

    os.environ["LIBTPU_INIT_ARGS"] = f"{os.environ.get('LIBTPU_INIT_ARGS', '')} {libtpu_flags(profile)}".strip()
    import jax

    from ce_core import StatsSpec
    from ce_pallas_tpu.tooling.aot import compiling_for
    from ce_pallas_tpu.tooling.schedule.chips import mxu_cycles
    from ce_pallas_tpu.tooling.schedule.grid_fit import small_grid
    from ce_pallas_tpu.tooling.schedule.programs import kernel_config, kernel_program

    print("| gen | head | kernel | cycles / MXU min, every block | walking, all live | bundles, walking / every "
          "| HBM MB walked, every / walking |")
    print("|---|---|---|---|---|---|---|")
    for generation in args.generations.split(","):
        with compiling_for(generation) as device:
            for head in args.heads.split(","):
                n, h, v, layout = HEADS[head]
                for kernel in ("forward", "backward"):
                    cfg = small_grid(kernel_config(kernel, n, h, v, "bfloat16", "bfloat16", StatsSpec(w_layout=layout)),
                                     3, 3)
                    steps = cfg.nb * cfg.nv_per_core * (cfg.nh if kernel == "forward" else 1)
                    step_h = cfg.block_h if kernel == "forward" else cfg.hp
                    floor = steps * mxu_cycles(generation, kernel, cfg.block_b, step_h, cfg.block_v)
                    traces = []
                    for live in (None, cfg.nb):
                        shutil.rmtree(profile, ignore_errors=True)
                        profile.mkdir(parents=True)
                        fn, operands = kernel_program(kernel, cfg, "bfloat16", "bfloat16",
                                                      jax.sharding.SingleDeviceSharding(device), live_blocks=live)
                        try:
                            jax.jit(fn).lower(*operands).compile()
                        except Exception:  # v5e/v6e may fail a VMEM check after the dumps are written
                            pass
                        traces.append(read_kernel_trace(profile, f"ce_pallas_tpu_{kernel}"))
                    every, walking = traces
                    print(f"| {generation} | {head} | {kernel} | {every.cycles / floor:.3f} | "
                          f"{walking.cycles / floor:.3f} | {walking.bundles / every.bundles:.4f} | "
                          f"{every.hbm_bytes / 1e6:.1f} / {walking.hbm_bytes / 1e6:.1f} |", flush=True)
    shutil.rmtree(profile, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
