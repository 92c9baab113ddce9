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
    from ce_bench.step_schedule import DEFAULT_STEP_PATHS, DEFAULT_STEP_SHAPES, STEP_PATHS, STEPS

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
                        help="layout of the head: hv is [H, V], vh is [V, H] (a tied embedding; with --step every "
                             "path's, the materialised one over x @ w.T)")
    parser.add_argument("--argmax", action="store_true", help="the forward with return_argmax=True")
    parser.add_argument("--objective", default="loss", choices=OBJECTIVES,
                        help="loss: the plain loss; rl: linear_log_probs with the entropy (the expected logit)")
    parser.add_argument("--step", default=None, choices=STEPS,
                        help="estimate a whole training step instead of each kernel: value_and_grad of the mean "
                             "loss over x and w, every op of the program (kernels and XLA ops), per --paths, "
                             "against the 8NHV MXU minimum and the materialised baseline (default shape: "
                             f"{','.join(DEFAULT_STEP_SHAPES)})")
    parser.add_argument("--paths", default=",".join(DEFAULT_STEP_PATHS), metavar="P,Q",
                        help=f"with --step: comma-separated, of {', '.join(STEP_PATHS)} (recompute: today's "
                             "pallas_tpu loss; materialised: optax over jnp.dot's f32 logits; keep_logits: "
                             "linear_cross_entropy(keep_logits=True), skipped where ce_core lacks it)")
    parser.add_argument("--step-tokens", default=None, metavar="N,M",
                        help="with --step: the token counts the step's ops are profiled at, fitted linearly in N "
                             "and extrapolated to each shape's N (default per path: recompute 512,1024; "
                             "materialised 256,512; keep_logits 1024,2048)")
    common.add_output(parser)
    parser.add_argument("--quiet", action="store_true", help="no progress lines")
    return parser


def main(argv: Sequence[str]) -> int:
    """``ce-bench schedule --target ...``: exit status 1 when any kernel could not be scheduled."""
    from ce_bench import schedule

    parser = schedule_parser()
    args = parser.parse_args(argv)
    if args.step:
        return _step_main(parser, args)
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


def parse_step_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> tuple[list[str], list[int] | None]:
    """``(paths, step tokens)`` of ``--step``; ``parser.error`` on a flag that does not apply to it."""
    from ce_bench.step_schedule import STEP_PATHS

    kernel_only = {"--kernels": args.kernels != ",".join(("forward", "backward")), "--argmax": args.argmax,
                   "--objective": args.objective != "loss",
                   "--precision": args.precision is not None, "--w-dtype": args.w_dtype is not None}
    given = [flag for flag, on in kernel_only.items() if on]
    if given:
        parser.error(f"--step measures the plain loss with default options; {', '.join(given)} do not apply")
    paths = [p.strip() for p in args.paths.split(",") if p.strip()]
    unknown = [p for p in paths if p not in STEP_PATHS]
    if not paths or unknown:
        parser.error(f"--paths: unknown {unknown or 'empty'}; choose from {', '.join(STEP_PATHS)}")
    tokens = None
    if args.step_tokens:
        try:
            tokens = [int(t) for t in args.step_tokens.split(",") if t.strip()]
        except ValueError:
            tokens = []
        if len(tokens) < 2 or min(tokens) < 1:
            parser.error(f"--step-tokens: two or more positive token counts, got {args.step_tokens!r}")
    return paths, tokens


def _step_main(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    """``ce-bench schedule --step value_and_grad``: the whole step per shape and path."""
    from ce_bench import step_schedule
    from ce_bench.schedule import ScheduleUnavailableError

    paths, tokens = parse_step_args(parser, args)
    try:
        shapes = presets.parse_shapes(args.shapes, reduced_for_cpu=False, default=step_schedule.DEFAULT_STEP_SHAPES)
        dtype = presets.parse_dtypes(args.dtype)[0].name
    except ValueError as error:
        parser.error(str(error))
    print(f"ce-bench schedule --step {args.step}: libtpu's static schedule of the whole step for TPU {args.target}, "
          "no TPU present", flush=True)
    start = time.perf_counter()
    try:
        records = step_schedule.run_step_schedule(args.target, shapes, paths, tokens, dtype=dtype,
                                                  w_layout=args.w_layout, quiet=args.quiet)
    except ScheduleUnavailableError as error:
        print(f"ce-bench schedule: {error}", file=sys.stderr)
        return 1
    for record in records:
        record["step"] = args.step
    print()
    print(step_schedule.step_table(records, args.format))
    if any(record.get("extrapolated") for record in records):
        print("\nops ms: the step's ops profiled at the listed token counts, fitted linearly in N and extrapolated "
              "to the shape's N; kernels ms: the pallas kernels' grid fit at full size (ce-bench schedule).")
    if args.json:
        common.save_json(records, args.json)
    print(f"\n{len(records)} rows in {time.perf_counter() - start:.0f} s")
    if any(record.get("error") for record in records):
        print("ce-bench schedule: some paths could not be estimated (their rows say why)", file=sys.stderr)
        return 1
    return 0
