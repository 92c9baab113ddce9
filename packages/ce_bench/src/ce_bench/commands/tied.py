"""``ce-bench tied``: the temporaries of a tied head passed as the table, as its transpose, or untied
(:mod:`ce_bench.tied`; compile only, for the host or a TPU generation)."""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Sequence

from ce_bench import presets
from ce_bench.commands import common


def tied_parser() -> argparse.ArgumentParser:
    """The parser of ``ce-bench tied``."""
    parser = argparse.ArgumentParser(
        prog="ce-bench tied",
        description="Compile a training step's loss with a head tied to the input embedding, passed as the "
                    "[V, H] table (w_layout='vh'), as its transpose, or untied, and report the temporaries "
                    "and the [V, H]-sized copies in the compiled program (nothing runs).")
    parser.add_argument("--target", default=None, choices=("v5e", "v5p", "v6e", "tpu7x"),
                        help="TPU generation to compile for (needs libtpu); default: this host")
    parser.add_argument("--shapes", default="rl-qwen2.5-1.5b,llama3-8b", metavar="S,T", help="presets or NxHxV")
    parser.add_argument("--dtype", default="bfloat16", help="dtype of x and the table")
    parser.add_argument("--implementation", default=None, help="backend name (default: the platform's chain)")
    common.add_output(parser)
    return parser


def main(argv: Sequence[str]) -> int:
    """``ce-bench tied``: exit status 1 when a compile failed."""
    parser = tied_parser()
    args = parser.parse_args(argv)
    try:
        shapes = presets.parse_shapes(args.shapes, reduced_for_cpu=False)
        dtype = presets.parse_dtypes(args.dtype)[0]
    except ValueError as error:
        parser.error(str(error))
    if args.target is not None:
        os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    common.quiet_libraries()
    from ce_bench import tied

    start = time.perf_counter()
    records = tied.run_tied(shapes, dtype, target=args.target, implementation=args.implementation)
    print(tied.tied_table(records, args.format))
    if args.json:
        common.save_json(records, args.json)
    print(f"\n{len(records)} rows in {time.perf_counter() - start:.0f} s")
    return 0 if all(record["ok"] for record in records) else 1
