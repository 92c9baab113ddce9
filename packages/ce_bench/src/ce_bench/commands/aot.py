"""``ce-bench aot --target ...``: compile every contender for a TPU generation without a TPU
(:mod:`ce_bench.aot`)."""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Sequence

from ce_bench import presets
from ce_bench.commands import common


def aot_parser() -> argparse.ArgumentParser:
    """The parser of ``ce-bench aot``."""
    from ce_bench.aot import TOPOLOGIES

    parser = argparse.ArgumentParser(
        prog="ce-bench aot",
        description="Compile each backend (and tokamax's implementations) for a TPU generation on a machine "
                    "without a TPU (needs libtpu) and report compile status, HBM temporaries and block sizes.")
    parser.add_argument("--target", required=True, choices=sorted(TOPOLOGIES), help="TPU generation")
    common.add_common(parser, default_dtype="bfloat16", default_shapes=presets.DEFAULT_AOT_SHAPES)
    return parser


def main(argv: Sequence[str]) -> int:
    """``ce-bench aot --target ...``."""
    parser = aot_parser()
    args = parser.parse_args(argv)
    shapes, dtypes = common.parse_shapes_and_dtypes(parser, args, reduced_for_cpu=False,
                                                    default=presets.DEFAULT_AOT_SHAPES)
    common.quiet_libraries()
    # libtpu takes /tmp/libtpu_lockfile when JAX first initialises; any other JAX process on this
    # machine (a second bench, a test run) holds it and the topology call then fails. Compiling for
    # a topology that is not there touches no TPU, so several processes may load libtpu at once.
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")

    from ce_bench import aot, contenders, report

    names = None if args.backends is None else contenders.parse_names(args.backends)
    if names is not None:
        common.check_backends(parser, names, contenders.known_names())
    print(f"ce-bench aot: compiling for TPU {args.target} ({aot.TOPOLOGIES[args.target]}) without a TPU\n", flush=True)
    start = time.perf_counter()
    try:
        records = aot.run_aot(args.target, shapes, dtypes, names, reduction=args.reduction,
                              progress=not args.no_progress)
    except aot.AotUnavailableError as error:
        print(f"ce-bench aot: {error}", file=sys.stderr)
        return 1
    elapsed = time.perf_counter() - start
    common.emit(records, args, f"aot-{args.target}", report.compile_table(records, args.format),
                f"ce-bench aot: TPU {args.target} (compiled without a TPU)")
    print(f"\n{len(records)} rows in {elapsed:.0f} s")
    return common.exit_status([record.status for record in records if record.kind == "backend"], "ce-bench aot")
