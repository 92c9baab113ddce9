"""The ``ce-bench`` subcommands, one module each (``run``, ``aot``, ``schedule``, ``tune``, ``sharding``,
``report``, ``list``), every one with its parser and its ``main(argv) -> int``; :mod:`.common` holds what
they share. :mod:`ce_bench.cli` dispatches to them."""
