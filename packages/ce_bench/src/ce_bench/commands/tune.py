"""``ce-bench tune --target ...``: choose pallas_tpu's tiles per shape bucket from libtpu's static
schedules (:mod:`ce_bench.tune`); ``--write`` regenerates ``ce_pallas_tpu/tuned.py``; ``--shapes``
tunes the user's own problems into the user's tile cache."""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from ce_bench import presets
from ce_bench.commands import common


def tune_parser() -> argparse.ArgumentParser:
    """The parser of ``ce-bench tune``."""
    from ce_bench.schedule import SCHEDULE_TARGETS

    parser = argparse.ArgumentParser(
        prog="ce-bench tune",
        description="Choose pallas_tpu's tiles for a TPU generation without a TPU: per shape bucket, compile "
                    "candidate tiles at the bucket's example shape (today's entry always among them; the VMEM model "
                    "only prefilters, libtpu's compile decides), read their static schedules and keep the one with "
                    "the least estimated kernel time. --write regenerates ce_pallas_tpu/tuned.py: this generation's "
                    "entries for these buckets are replaced, the others kept. --shapes NxHxV tunes your own "
                    "problems instead and writes the winners to your tile cache, which the backend then uses for "
                    "exactly those problems.")
    parser.add_argument("--target", required=True, choices=SCHEDULE_TARGETS, help="TPU generation")
    parser.add_argument("--buckets", default=None, metavar="A,B",
                        help="shape buckets (default: all: small, wide, huge_batch, large_vocab, llama3)")
    parser.add_argument("--kernels", default="forward,backward", help="comma-separated: forward, backward")
    parser.add_argument("--candidates", type=common.positive_int, default=3, metavar="K",
                        help="candidates compiled and measured per kernel and bucket (default: 3)")
    parser.add_argument("--shapes", default=None, metavar="NxHxV,...",
                        help="tune these problems (N tokens per device) instead of the buckets, and write each "
                             "winner to the user's tile cache (see --cache)")
    parser.add_argument("--dtype", default="bfloat16", help="with --shapes: dtype of x (and of w unless --w-dtype)")
    parser.add_argument("--w-dtype", default=None, help="with --shapes: dtype of w (default: --dtype)")
    parser.add_argument("--objective", default="loss", choices=("loss", "rl"),
                        help="with --shapes: loss (the plain loss) or rl (log-probs with the entropy)")
    parser.add_argument("--cache", default=None, metavar="PATH",
                        help="with --shapes: the tile cache file to write (default: $CE_PALLAS_TPU_TILE_CACHE, else "
                             "ce_pallas_tpu/tiles.json in the user's cache directory)")
    parser.add_argument("--dry-run", action="store_true", help="with --shapes: measure, write nothing")
    parser.add_argument("--shape", default=None, metavar="NxHxV",
                        help="measure every bucket at this shape instead of its example shape (a quick check of "
                             "the buckets' search; cannot be written)")
    parser.add_argument("--write", action="store_true",
                        help="write the winners into ce_pallas_tpu/tuned.py (a kernel left out by --kernels keeps its "
                             "tiles and figures)")
    common.add_output(parser, json_help="write every measured candidate here")
    parser.add_argument("--quiet", action="store_true", help="no per-compile progress lines")
    return parser


def _single_shape(spec: str | None) -> tuple[int, int, int] | None:
    """``--shape``: one ``NxHxV`` or preset at full size (None when not given)."""
    if spec is None:
        return None
    parsed = presets.parse_shapes(spec, reduced_for_cpu=False, default=())
    if len(parsed) != 1:
        raise ValueError(f"--shape takes one shape (NxHxV or a preset), got {spec!r}")
    return parsed[0].n, parsed[0].h, parsed[0].v


def _problems(args: argparse.Namespace) -> list[Any]:
    """``--shapes`` with the dtypes and objective: the problems to tune (``ValueError`` saying what is wrong)."""
    from ce_pallas_tpu.tooling.tune import Problem

    x_dtype = presets.parse_dtypes(args.dtype)[0].name
    w_dtype = presets.parse_dtypes(args.w_dtype)[0].name if args.w_dtype else x_dtype
    shapes = presets.parse_shapes(args.shapes, reduced_for_cpu=False, default=())
    return [Problem(shape.n, shape.h, shape.v, x_dtype, w_dtype, args.objective) for shape in shapes]


def _cache_path(args: argparse.Namespace) -> Path | None:
    """The tile cache ``--shapes`` writes (None with ``--dry-run``; ``ValueError`` when it is turned off)."""
    from ce_pallas_tpu import tile_cache

    if args.dry_run:
        return None
    path = Path(args.cache).expanduser() if args.cache else tile_cache.cache_path()
    if path is None:
        raise ValueError(f"the tile cache is off ({tile_cache.CACHE_ENV}); give --cache PATH or --dry-run")
    return path


def _run(args: argparse.Namespace, run: Callable[[], Any], *, written: str, kept: str, total: int) -> int:
    """Run a tune (``run`` returns a :class:`ce_bench.tune.TuneReport`) and print its table: exit status 1
    when it cannot run or nothing of ``total`` buckets or problems could be measured."""
    from ce_bench import tune

    common.quiet_libraries()
    print(f"ce-bench tune: tiles for TPU {args.target} from libtpu's static schedules, no TPU present", flush=True)
    start = time.perf_counter()
    try:
        report = run()
    except tune.TuneUnavailableError as error:
        print(f"ce-bench tune: {error}", file=sys.stderr)
        return 1
    print()
    print(tune.tune_table(report.rows, args.format))
    if report.path is not None:
        print(f"\n{written}: {report.path}")
    if args.json:
        common.save_json(report.rows, args.json)
    print(f"\n{len(report.rows)} candidates measured in {time.perf_counter() - start:.0f} s")
    if report.failed:
        print(f"ce-bench tune: nothing could be measured for {', '.join(report.failed)} ({kept})", file=sys.stderr)
    return 1 if len(report.failed) == total else 0


def _main_problems(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    """``ce-bench tune --shapes ...``: exit status 1 when no problem could be tuned."""
    from ce_bench import tune

    try:
        if args.write or args.shape or args.buckets:
            raise ValueError("--shapes tunes problems into the tile cache; leave out --write, --shape and --buckets")
        problems = _problems(args)
        kernels = common.parse_kernels(args.kernels, tune.KERNELS)
        cache = _cache_path(args)
    except ValueError as error:
        parser.error(str(error))
    return _run(args, lambda: tune.run_tune_problems(args.target, problems, kernels, args.candidates, cache=cache,
                                                     quiet=args.quiet),
                written="tile cache written", kept="nothing written for them", total=len(problems))


def main(argv: Sequence[str]) -> int:
    """``ce-bench tune --target ...``: exit status 1 when no bucket (or problem) could be tuned."""
    from ce_bench import tune

    parser = tune_parser()
    args = parser.parse_args(argv)
    if args.shapes is not None:
        return _main_problems(args, parser)
    try:
        if args.objective != "loss" or args.dtype != "bfloat16" or args.w_dtype or args.cache or args.dry_run:
            raise ValueError("--objective, --dtype, --w-dtype, --cache and --dry-run go with --shapes (the buckets "
                             "are tuned for the plain bfloat16 loss)")
        buckets = tune.parse_buckets(args.buckets)
        kernels = common.parse_kernels(args.kernels, tune.KERNELS)
        shape = _single_shape(args.shape)
        if args.write and shape is not None:
            raise ValueError("--write keeps tiles measured at the buckets' example shapes; leave out --shape")
    except ValueError as error:
        parser.error(str(error))
    return _run(args, lambda: tune.run_tune(args.target, buckets, kernels, args.candidates, write=args.write,
                                            shape=shape, quiet=args.quiet),
                written="table written", kept="entries left as they were", total=len(buckets))
