"""``ce-bench [run]``: the head-to-head run (:mod:`ce_bench.runner`), the default subcommand."""

from __future__ import annotations

import argparse
import dataclasses
import textwrap
import time
from collections.abc import Sequence

from ce_bench import ignored, presets
from ce_bench.commands import common
from ce_bench.memory import GIB


def run_parser() -> argparse.ArgumentParser:
    """The parser of ``ce-bench`` (the head-to-head run); its help lists the subcommands."""
    description = ("Head-to-head bench of fused linear cross-entropy backends: forward and forward+backward "
                   "time (interleaved, median), tokens/s, ratio to a matmul floor, temporary memory, and error "
                   "against a float64 oracle. Exit status: 2 for a usage error, 1 when every backend row "
                   "failed or was unsupported.")
    parser = argparse.ArgumentParser(
        prog="ce-bench",
        usage="ce-bench [SUBCOMMAND] [options]",
        description=textwrap.fill(description, width=100),
        epilog=common.subcommand_list(),
        formatter_class=argparse.RawDescriptionHelpFormatter)
    common.add_common(parser, default_dtype="float32", default_shapes=presets.DEFAULT_RUN_SHAPES)
    parser.add_argument("--repeats", type=common.positive_int, default=5,
                        help="timed rounds per contender (default: 5)")
    parser.add_argument("--warmup", type=common.positive_int, default=1,
                        help="untimed calls per contender first (default: 1)")
    parser.add_argument("--compile-only", action="store_true",
                        help="compile and report memory only; execute nothing and refuse no shape for memory "
                             "(presets keep their full N)")
    parser.add_argument("--memory-shapes", default=None, metavar="S,T",
                        help="also compile these presets or NxHxV at full N and report their memory without running "
                             "them, with the reference's temporaries over each backend's (default: "
                             f"{','.join(presets.DEFAULT_MEMORY_SHAPES)} when --shapes is not given, else none; "
                             "'none' for none)")
    parser.add_argument("--no-floor", action="store_true", help="do not time the matmul floor")
    parser.add_argument("--oracle-max-elements", type=common.positive_int, default=None, metavar="K",
                        help="measure the error against the float64 oracle only when N*V <= K (default: 2**26)")
    parser.add_argument("--memory-budget", type=common.positive_gib, default=None, metavar="GIB",
                        help="refuse what would need more than this many GiB (default: 80%% of available memory)")
    parser.add_argument("--seed", type=common.non_negative_int, default=0, help="seed of the random inputs")
    parser.add_argument("--ignored", type=fraction, default=0.0, metavar="F",
                        help="ignore about this share of the tokens' labels (default: 0), as --ignored-pattern says")
    parser.add_argument("--ignored-pattern", default="prompts", choices=ignored.PATTERNS,
                        help=f"prompts: the first tokens of each {ignored.DEFAULT_SEQUENCE}-token sequence; padding: "
                             "its last ones (each sequence its own share, about F on average; default: prompts)")
    return parser


def fraction(text: str) -> float:
    """A number in ``[0, 1]`` (an argparse type)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number in [0, 1], got {text!r}") from None
    if not 0.0 <= value <= 1.0:
        raise argparse.ArgumentTypeError(f"expected a number in [0, 1], got {text!r}")
    return value


def memory_shapes(parser: argparse.ArgumentParser, args: argparse.Namespace) -> list[presets.Shape]:
    """``--memory-shapes`` at full N (``--tokens`` applies), or a usage error naming the flag."""
    spec = args.memory_shapes
    if spec is None:
        spec = "" if args.shapes else ",".join(presets.DEFAULT_MEMORY_SHAPES)
    if spec.strip().lower() == "none":
        return []
    try:
        return presets.parse_shapes(spec, reduced_for_cpu=False, default=(), tokens=args.tokens)
    except ValueError as error:
        parser.error(f"--memory-shapes: {error}")


def main(argv: Sequence[str]) -> int:
    """``ce-bench [options]``."""
    parser = run_parser()
    args = parser.parse_args(argv)
    shapes, dtypes = common.parse_shapes_and_dtypes(parser, args, reduced_for_cpu=not args.compile_only,
                                                    default=presets.DEFAULT_RUN_SHAPES)
    compiled_shapes = memory_shapes(parser, args)
    common.quiet_libraries()

    import jax

    from ce_bench import accuracy, contenders, report, runner

    if jax.default_backend() != "cpu":  # presets were reduced for a CPU; use their full size here
        shapes = presets.parse_shapes(args.shapes, reduced_for_cpu=False, tokens=args.tokens)
    names = contenders.parse_names(args.backends)
    common.check_backends(parser, names, contenders.known_names())
    config = runner.RunConfig(
        shapes=shapes, dtypes=dtypes, names=names, reduction=args.reduction, repeats=args.repeats,
        warmup=args.warmup, compile_only=args.compile_only, measure_floor=not args.no_floor,
        oracle_max_elements=args.oracle_max_elements or accuracy.DEFAULT_MAX_ELEMENTS,
        memory_budget_bytes=None if args.memory_budget is None else int(args.memory_budget * GIB),
        seed=args.seed, ignored=args.ignored, ignored_pattern=args.ignored_pattern)
    budget = runner.budget_bytes(config.memory_budget_bytes)
    mode = "compile only" if args.compile_only else f"{args.repeats} interleaved rounds after {args.warmup} warm-up"
    print(f"ce-bench: {runner.device_description()}, jax {jax.__version__}; backends: {', '.join(names)}")
    skipped = f"; {args.ignored:.0%} of tokens ignored ({args.ignored_pattern})" if args.ignored else ""
    print(f"objective={args.reduction}{skipped}; {mode}; memory budget "
          f"{'-' if budget is None else f'{budget / GIB:.1f} GiB'}")
    if compiled_shapes:
        print(f"compiled only, for their memory at full size: {', '.join(shape.label for shape in compiled_shapes)}")
    print(flush=True)
    start = time.perf_counter()
    records = runner.run(config, progress=not args.no_progress)
    if compiled_shapes:
        compile_config = dataclasses.replace(config, shapes=compiled_shapes, compile_only=True)
        records += runner.run(compile_config, progress=not args.no_progress)
    elapsed = time.perf_counter() - start
    title = f"ce-bench on {runner.device_description()}" + (" (compile only)" if args.compile_only else "")
    common.emit(records, args, "ce-bench-compile" if args.compile_only else "ce-bench",
                report.tables(records, args.format), title)
    print(f"\n{len(records)} rows in {elapsed:.0f} s")
    return common.exit_status([record.status for record in records if record.kind == "backend"], "ce-bench")
