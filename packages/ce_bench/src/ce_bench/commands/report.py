"""``ce-bench report RESULTS.json ...``: the table (and optionally the PNG) again, from JSON files of
earlier runs (:mod:`ce_bench.report`)."""

from __future__ import annotations

import argparse
from collections.abc import Sequence


def report_parser() -> argparse.ArgumentParser:
    """The parser of ``ce-bench report``."""
    parser = argparse.ArgumentParser(prog="ce-bench report",
                                     description="Print the table of JSON records written by ce-bench or "
                                                 "ce-bench aot (several files are concatenated).")
    parser.add_argument("paths", nargs="+", metavar="JSON")
    parser.add_argument("--plot", default=None, metavar="PATH", help="also draw the PNG here")
    parser.add_argument("--format", default="text", choices=("text", "markdown"), help="table format")
    return parser


def main(argv: Sequence[str]) -> int:
    """``ce-bench report``: a file that cannot be read as records is a usage error."""
    parser = report_parser()
    args = parser.parse_args(argv)
    from ce_bench import report
    from ce_bench.records import read_json

    records = []
    for path in args.paths:
        try:
            records += read_json(path)
        except (OSError, ValueError, TypeError) as error:  # missing, not JSON, or not a list of records
            parser.error(f"cannot read records from {path}: {error}")
    print(report.tables(records, args.format))
    if args.plot:
        from ce_bench.plot import plot

        devices = sorted({record.device for record in records if record.device})
        print(f"\nPNG:  {plot(records, args.plot, title='ce-bench: ' + '; '.join(devices))}")
    return 0
