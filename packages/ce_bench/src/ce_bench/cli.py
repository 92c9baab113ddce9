"""``ce-bench``: the command line. Thin: picks the subcommand and calls its module's ``main``
(:mod:`ce_bench.commands`); those parse, call :mod:`ce_bench.runner` / :mod:`ce_bench.aot` / ...,
print the table, write JSON and a PNG.

    ce-bench [--backends a,b] [--shapes small,llama3-8b,NxHxV] [--dtype float32] [--reduction mean]
             [--repeats 5] [--json PATH] [--plot PATH] [--out DIR] [--compile-only] ...
    ce-bench aot --target v4|v5e|v5p|v6e|tpu7x [--shapes ...] [--dtype bfloat16] ...
    ce-bench schedule --target v5e|v5p|v6e|tpu7x [--shapes ...] [--kernels forward,backward] ...
    ce-bench tune --target v5e|v5p|v6e|tpu7x [--buckets llama3,huge_batch] [--candidates 3] [--write]
    ce-bench tied [--target v5e|v5p|v6e|tpu7x] [--shapes rl-qwen2.5-1.5b,llama3-8b] [--implementation NAME]
    ce-bench sharding [--backends ...] [--shapes llama3-8b] [--meshes 1x1,8x1,2x4,1x8]
                      [--calls wrapper,explicit,auto,auto_stated] [--time REPEATS]
    ce-bench report RESULTS.json [...] [--plot PATH] [--format markdown]
    ce-bench list

Exit status: 0 when something ran (or compiled), 2 for a usage error (an unknown subcommand or
backend, a malformed or out-of-range option, an unreadable report file), 1 when every backend row
failed or was unsupported (``schedule``: when any kernel could not be scheduled; ``tune``: when no bucket
could be tuned).
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Sequence

from ce_bench.commands import run
from ce_bench.commands.common import SUBCOMMANDS
from ce_core.extend import quiet_libtpu_without_tpu


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``ce-bench`` console script: ``run`` when the first argument is an option (or
    there is none), else the named subcommand; an unknown one is a usage error (exit status 2)."""
    quiet_libtpu_without_tpu()  # before JAX's platform discovery loads libtpu
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0].startswith("-"):
        return run.main(argv)
    if argv[0] not in SUBCOMMANDS:
        run.run_parser().error(f"unknown subcommand {argv[0]!r}; one of: {', '.join(SUBCOMMANDS)}")
    return importlib.import_module(f"ce_bench.commands.{argv[0]}").main(argv[1:])


if __name__ == "__main__":
    sys.exit(main())
