"""Where a Pallas TPU kernel's grid step spends its bundles, from libtpu's static schedule (no TPU needed).

    ALLOW_MULTIPLE_LIBTPU_LOAD=1 uv run python tools/bundle_census.py kept --generation v6e --head qwen3-0.6b \
        [--objective rl] [--kernel forward|backward] [--tokens 4096]
    ALLOW_MULTIPLE_LIBTPU_LOAD=1 uv run python tools/bundle_census.py pair --generation v6e --pair qwen3 \
        [--divergence jsd] [--mode given|lses|online]
    ALLOW_MULTIPLE_LIBTPU_LOAD=1 uv run python tools/bundle_census.py matmul --generation v6e --shape 512,1024,512

Compiles the kernel at a small grid with its full-size tiles (``kept``: the kept-logits plan's forward or
backward kernel, each head in its model's layout; ``pair``: the dense distillation teacher's statistics
kernel at ``tools/schedule_pair.py``'s tiles; ``matmul``: a plain one-block Pallas ``x @ w``, the
calibration), with libtpu's executed-bundle trace and critical path dumped, and prints the census of one
step (``ce_pallas_tpu.tooling.schedule.census``): its bundles against the step's MXU minimum, and per
float32 output register (a ``[8, 128]`` tile of the step's products; both heads' for a pair) the MXU
results popped, the vector ops, the stores and loads and how many of them go to Mosaic's spill slots, and
the share of the critical path that is stores. ``--json`` prints the numbers as one JSON object instead.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import importlib.util
import json
import os
import shutil
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

#: ``(fn, operands, op name, rows, columns, MXU cycles)`` of one small grid of a kernel: what is compiled, the
#: name its dumps carry, its step's output tile and the step's MXU minimum.
Program = tuple[Any, Sequence[Any], str, int, int, int]

TOOLS = Path(__file__).resolve().parent

#: Opcode prefixes of the vector ALU's work (the four VALU slots of a bundle).
VALU_PREFIXES = ("vadd", "vsub", "vmul", "vmax", "vmin", "vsel", "vcmp", "vpack", "vcombine", "vand", "vor",
                 "vxor", "vcvt", "vexp2", "vlog2", "vrcp", "vclamp")


def _tool(name: str):
    spec = importlib.util.spec_from_file_location(name, TOOLS / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _kept_program(args: argparse.Namespace, device: Any) -> Program:
    """The :data:`Program` of a kept-logits kernel of a model head's plan."""
    import jax

    from ce_bench.presets import MODEL_HEADS
    from ce_pallas_tpu.tooling.schedule import worker
    from ce_pallas_tpu.tooling.schedule.grid_fit import small_grid
    from ce_pallas_tpu.tooling.schedule.kept_calls import kept_jobs
    from ce_pallas_tpu.tooling.schedule.programs import kernel_program

    kept_matrix = _tool("kept_matrix")
    (h, v), = [(h, v) for name, h, v in MODEL_HEADS if name == args.head]
    layout = kept_matrix.layout(args.head)
    plan = kept_matrix.kept_plan(args.generation, args.tokens, h, v, layout, args.objective)
    job = [job for job, _ in kept_jobs(plan, w_layout=layout) if job.kernel == args.kernel][-1]
    cfg = worker._config(job)
    small = small_grid(cfg, 3, 3)
    fn, operands = kernel_program(job.kernel, small, job.x_dtype, job.w_dtype,
                                  jax.sharding.SingleDeviceSharding(device))
    mxu = worker.step_mxu_cycles(job, cfg, args.generation)
    return fn, operands, worker.OP_NAMES[job.kernel], cfg.block_b, cfg.block_v, int(mxu)


def _pair_program(args: argparse.Namespace, device: Any) -> Program:
    import jax
    import jax.numpy as jnp

    from ce_core.extend import PairSpec
    from ce_pallas_tpu import pair
    from ce_pallas_tpu.target import current_target
    from ce_pallas_tpu.tooling.schedule.chips import SCHEDULE_CHIPS

    schedule_pair = _tool("schedule_pair")
    hs, s_layout, ht, t_layout, vocab = schedule_pair.PAIRS[args.pair]
    bf16 = jnp.dtype(jnp.bfloat16)
    spec = PairSpec(args.divergence, w_layout=s_layout, teacher_w_layout=t_layout)
    cfg, _ = pair.make_configs(args.tokens, hs, ht, vocab, (bf16, bf16, bf16, bf16), spec, current_target())
    sn, sv = schedule_pair._small(args.tokens, vocab, cfg.block_b, cfg.block_v, 1, 3, 3)
    small = dataclasses.replace(cfg, n=sn, v=sv)
    operands = schedule_pair.stats_operands(args.pair, sn, sv, args.mode, jax.sharding.SingleDeviceSharding(device))
    fn = functools.partial(schedule_pair._stats_program, cfg=small, mode=args.mode, walk_shares=None)
    chip = SCHEDULE_CHIPS[args.generation]
    mxu = cfg.block_b * cfg.block_v * (hs + ht) * 2 / (chip.bf16_flops / chip.clock_hz)
    return fn, operands, f"ce_pallas_tpu_pair_stats_{args.mode}", cfg.block_b, cfg.block_v, int(mxu)


def _matmul_program(args: argparse.Namespace, device: Any) -> Program:
    import jax
    import jax.numpy as jnp
    from jax.experimental import pallas as pl

    from ce_pallas_tpu.tooling.schedule.chips import SCHEDULE_CHIPS

    m, k, n = (int(part) for part in args.shape.split(","))

    def kernel(x_ref, w_ref, o_ref):
        o_ref[...] = jnp.dot(x_ref[...], w_ref[...], preferred_element_type=jnp.float32)

    fn = pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct((m, n), jnp.float32), grid=(2,),
                        in_specs=[pl.BlockSpec((m, k), lambda i: (0, 0)), pl.BlockSpec((k, n), lambda i: (0, 0))],
                        out_specs=pl.BlockSpec((m, n), lambda i: (0, 0)), name="census_matmul")
    sharding = jax.sharding.SingleDeviceSharding(device)
    operands = [jax.ShapeDtypeStruct(shape, jnp.bfloat16, sharding=sharding) for shape in ((m, k), (k, n))]
    chip = SCHEDULE_CHIPS[args.generation]
    return fn, operands, "census_matmul", m, n, int(2 * m * k * n / (chip.bf16_flops / chip.clock_hz))


PROGRAMS = {"kept": _kept_program, "pair": _pair_program, "matmul": _matmul_program}


def measure(args: argparse.Namespace) -> dict:
    """The census of one step of the kernel ``args`` names, as plain numbers."""
    profile = Path(tempfile.mkdtemp(prefix="bundle_census_"))
    os.environ["JAX_PLATFORMS"] = "cpu"
    from ce_pallas_tpu.tooling.schedule.census import CRITICAL_PATH_FLAG
    from ce_pallas_tpu.tooling.schedule.dumps import libtpu_flags

    os.environ["LIBTPU_INIT_ARGS"] = f"{libtpu_flags(profile)} {CRITICAL_PATH_FLAG}"
    import jax

    from ce_pallas_tpu.tooling.aot import compiling_for
    from ce_pallas_tpu.tooling.schedule.census import step_census

    try:
        with compiling_for(args.generation) as device:
            fn, operands, op_name, rows, columns, mxu = PROGRAMS[args.command](args, device)
            try:
                jax.jit(fn).lower(*operands).compile()
            except Exception:  # v5e/v6e may fail a VMEM check after the dumps are written
                pass
        step = step_census(profile, op_name)
    finally:
        shutil.rmtree(profile, ignore_errors=True)
    registers = rows * columns / 1024  # float32 [8, 128] output tiles of the step
    critical = sum(step.critical.values())
    return {
        "kernel": op_name, "tile": [rows, columns], "bundles": step.bundles, "mxu_cycles": mxu,
        "bundles_over_mxu": step.bundles / mxu,
        "per_output_register": {
            "mxu_pops": step.family("vpop.f32.mrf") / registers,
            "valu_ops": sum(step.family(prefix) for prefix in VALU_PREFIXES) / registers,
            "stores": step.stores / registers, "spill_stores": step.spill_stores / registers,
            "loads": step.loads / registers, "spill_loads": step.spill_loads / registers,
        },
        "spilled_from": dict(step.spilled_from.most_common(6)),
        "critical_path": {"instructions": critical,
                          "store_share": step.critical["vst"] / critical if critical else None,
                          "top": dict(step.critical.most_common(6))},
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--json", action="store_true")
    commands = parser.add_subparsers(dest="command", required=True)
    kept = commands.add_parser("kept", help="a kept-logits kernel of a model head's plan")
    kept.add_argument("--head", default="qwen3-0.6b")
    kept.add_argument("--objective", choices=("loss", "rl"), default="rl")
    kept.add_argument("--kernel", choices=("forward", "backward"), default="forward")
    pair_cmd = commands.add_parser("pair", help="the dense teacher's statistics kernel")
    pair_cmd.add_argument("--pair", default="qwen3")
    pair_cmd.add_argument("--divergence", default="jsd")
    pair_cmd.add_argument("--mode", choices=("given", "lses", "online"), default="given")
    matmul = commands.add_parser("matmul", help="a plain Pallas x @ w (the calibration)")
    matmul.add_argument("--shape", default="512,1024,512", help="M,K,N")
    for command in (kept, pair_cmd, matmul):
        command.add_argument("--generation", default="v6e")
        command.add_argument("--tokens", type=int, default=4096)
    args = parser.parse_args(argv)
    result = measure(args)
    if args.json:
        print(json.dumps(result))
        return 0
    print(f"{args.generation} {result['kernel']} tile {result['tile'][0]}x{result['tile'][1]}: "
          f"{result['bundles']} bundles a step, {result['bundles_over_mxu']:.3f} of its MXU minimum")
    print("per float32 output register: " + ", ".join(f"{key} {value:.2f}"
                                                       for key, value in result["per_output_register"].items()))
    print(f"spilled values made by: {result['spilled_from']}")
    path = result["critical_path"]
    print(f"critical path: {path['instructions']} instructions of the step, stores {path['store_share']:.0%}; "
          f"{path['top']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
