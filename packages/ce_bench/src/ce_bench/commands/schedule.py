"""``ce-bench schedule --target ...``: libtpu's static schedule of the pallas_tpu kernels per grid step
(:mod:`ce_bench.schedule`; no TPU needed)."""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence

from ce_bench import presets
from ce_bench.commands import common


def schedule_parser() -> argparse.ArgumentParser:
    """The parser of ``ce-bench schedule``."""
    from ce_bench.schedule import DEFAULT_SCHEDULE_SHAPES, KERNELS, OBJECTIVES, SCHEDULE_TARGETS

    parser = argparse.ArgumentParser(
        prog="ce-bench schedule",
        description="Static schedule of the pallas_tpu kernels from libtpu's compiler (no TPU needed): per grid "
                    "step, the estimated cycles and bundles against the fewest cycles the step's matmuls need on "
                    "the generation's MXUs, and the step's HBM time against its MXU time.")
    parser.add_argument("--target", required=True, choices=SCHEDULE_TARGETS, help="TPU generation")
    parser.add_argument("--shapes", default=None, metavar="S,T",
                        help=f"presets or NxHxV at full size (default: {','.join(DEFAULT_SCHEDULE_SHAPES)})")
    parser.add_argument("--dtype", default="bfloat16", help="dtype of x (and of w unless --w-dtype)")
    parser.add_argument("--w-dtype", default=None, help="dtype of w (default: --dtype)")
    parser.add_argument("--precision", default=None, choices=("default", "highest"),
                        help="MXU precision of the kernels' products (default: the backend's default)")
    parser.add_argument("--kernels", default=",".join(KERNELS), help="comma-separated: forward, backward")
    parser.add_argument("--w-layout", default="hv", choices=("hv", "vh"),
                        help="layout of the head: hv is [H, V], vh is [V, H] (a tied embedding)")
    parser.add_argument("--argmax", action="store_true", help="the forward with return_argmax=True")
    parser.add_argument("--objective", default="loss", choices=OBJECTIVES,
                        help="loss: the plain loss; rl: linear_log_probs with the entropy (the expected logit)")
    common.add_output(parser)
    parser.add_argument("--quiet", action="store_true", help="no progress lines")
    return parser


def main(argv: Sequence[str]) -> int:
    """``ce-bench schedule --target ...``: exit status 1 when any kernel could not be scheduled."""
    from ce_bench import schedule

    parser = schedule_parser()
    args = parser.parse_args(argv)
    try:
        shapes = presets.parse_shapes(args.shapes, reduced_for_cpu=False, default=schedule.DEFAULT_SCHEDULE_SHAPES)
    except ValueError as error:
        parser.error(f"--shapes: {error}")
    try:
        x_dtype = presets.parse_dtypes(args.dtype)[0].name
        w_dtype = presets.parse_dtypes(args.w_dtype)[0].name if args.w_dtype else x_dtype
        kernels = common.parse_kernels(args.kernels, schedule.KERNELS)
    except ValueError as error:
        parser.error(str(error))
    print(f"ce-bench schedule: libtpu's static schedule for TPU {args.target}, no TPU present", flush=True)
    start = time.perf_counter()
    try:
        records = schedule.run_schedule(args.target, shapes, x_dtype, kernels, w_dtype=w_dtype,
                                        precision=args.precision, w_layout=args.w_layout, argmax=args.argmax,
                                        objective=args.objective, quiet=args.quiet)
    except schedule.ScheduleUnavailableError as error:
        print(f"ce-bench schedule: {error}", file=sys.stderr)
        return 1
    print()
    print(schedule.schedule_table(records, args.format))
    if args.json:
        common.save_json(records, args.json)
    print(f"\n{len(records)} rows in {time.perf_counter() - start:.0f} s")
    if any(record.get("error") for record in records):
        print("ce-bench schedule: some kernels could not be scheduled (their rows say why)", file=sys.stderr)
        return 1
    return 0
