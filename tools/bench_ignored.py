"""``ce-bench run`` with the ``xla`` backend beside itself as it was before it skipped ignored tokens.

    uv run python tools/bench_ignored.py --shapes small,medium --dtype float32,bfloat16 --repeats 7 \\
        --ignored 0.5 --ignored-pattern prompts

``xla_every_row`` is ``XlaBackend`` declaring backend contract version 3, so ce_core hands it no live
rows and it computes every token, as every backend did before issue 43; its time does not depend on
how many tokens are ignored. In one interleaved run, ``xla`` over ``xla_every_row`` is then the time
with the ignored tokens skipped over the time with none skipped (with ``--ignored 0``: the cost of the
skip's bookkeeping when nothing is ignored). Every other ``ce-bench run`` flag passes through.
"""

from __future__ import annotations

import sys

import ce_core
from ce_bench.cli import main
from ce_xla import XlaBackend


class XlaComputesEveryRow(XlaBackend):
    """The xla backend as before issue 43: contract version 3, so it is never told which rows are live."""

    contract_version = 3


if __name__ == "__main__":
    ce_core.register_backend("xla_every_row", XlaComputesEveryRow)
    sys.exit(main(["run", "--backends", "xla,xla_every_row", "--memory-shapes", "none", "--no-files", "--no-floor",
                   "--format", "markdown", "--no-progress", *sys.argv[1:]]))
