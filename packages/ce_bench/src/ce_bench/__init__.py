"""ce_bench: head-to-head bench of ce_core backends (and tokamax's implementations).

- ``ce-bench``: time, throughput, ratio to a matmul floor, temporary memory and error against a
  float64 oracle, for every backend available here (:mod:`ce_bench.runner`). :mod:`ce_bench.cli` is the
  command line's entry point; each subcommand is a module of :mod:`ce_bench.commands`.
- ``ce-bench aot --target v5p``: compile for a TPU generation without a TPU (:mod:`ce_bench.aot`).
- ``benchmarks/`` at the repository root: the same comparisons under pytest-benchmark.

Modules: :mod:`~ce_bench.presets` (shapes), :mod:`~ce_bench.contenders` (what is compared),
:mod:`~ce_bench.timing`, :mod:`~ce_bench.memory`, :mod:`~ce_bench.floor`, :mod:`~ce_bench.accuracy`
(measurement), :mod:`~ce_bench.records`, :mod:`~ce_bench.report`, :mod:`~ce_bench.plot` (output).
"""

__version__ = "0.2.0"
