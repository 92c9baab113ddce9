"""``ce-bench list``: the presets and the contenders available here."""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from ce_bench import presets
from ce_bench.commands.common import SUBCOMMANDS


def list_parser() -> argparse.ArgumentParser:
    """The parser of ``ce-bench list`` (no options)."""
    return argparse.ArgumentParser(prog="ce-bench list", description=SUBCOMMANDS["list"].capitalize() + ".")


def main(argv: Sequence[str] = ()) -> int:
    """``ce-bench list``."""
    list_parser().parse_args(argv)
    from ce_bench import contenders

    print("presets (N for aot/--compile-only; CPU runs use 'cpu N'):")
    for preset in presets.PRESETS.values():
        cpu_n = preset.cpu_n if preset.cpu_n is not None else preset.n
        print(f"  {preset.name:<10} N={preset.n:<6} cpu N={cpu_n:<6} H={preset.h:<5} V={preset.v:<7} {preset.source}")
    print(f"default run: {','.join(presets.DEFAULT_RUN_SHAPES)} timed, {','.join(presets.DEFAULT_MEMORY_SHAPES)} "
          f"compiled only; default aot: {','.join(presets.DEFAULT_AOT_SHAPES)}")
    print(f"contenders available here: {', '.join(contenders.default_names())}")
    return 0
