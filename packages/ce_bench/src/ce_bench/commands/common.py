"""What the subcommands share: the subcommand list, argparse type helpers, the flags of ``run`` and
``aot``, writing the table, JSON and PNG, and the exit-status rule.

Exit status: 0 when something ran (or compiled), 2 for a usage error (``parser.error``), 1 when every
backend row failed or was unsupported (:func:`exit_status`).
"""

from __future__ import annotations

import argparse
import logging
import math
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ce_bench import objectives, presets

if TYPE_CHECKING:
    from ce_bench.records import Record

DEFAULT_OUT = Path("bench-out")

#: The subcommands, with the one-line description ``ce-bench --help`` lists; ``run`` is the default.
#: Each is the module of this package with its name, whose ``main(argv) -> int`` runs it.
SUBCOMMANDS: dict[str, str] = {
    "run": "head-to-head run: time, memory and error of each backend (the default without a subcommand)",
    "aot": "compile for a TPU generation without a TPU (libtpu): HBM temporaries and block sizes",
    "schedule": "libtpu's static schedule of the pallas_tpu kernels per grid step (no TPU needed)",
    "tune": "choose pallas_tpu's tiles per shape bucket from static schedules; --write regenerates its table",
    "tied": "a head tied to the input embedding: passed as the table, transposed or untied (compile only)",
    "sharding": "per-device temporary memory of the sharded loss on simulated device meshes",
    "report": "the table (and PNG) again, from JSON files of earlier runs",
    "list": "presets and the backends available here",
}

#: Row statuses that mean a backend produced nothing: when every backend row has one, the exit status is 1.
FAILED_STATUSES = ("failed", "unsupported")


def checked[T](convert: Callable[[str], T], ok: Callable[[T], bool], expected: str) -> Callable[[str], T]:
    """An argparse type: ``convert(text)`` when that works and satisfies ``ok``; else an error saying what
    was ``expected`` (argparse adds the flag's name)."""

    def parse(text: str) -> T:
        try:
            value = convert(text)
        except ValueError:
            value = None
        if value is None or not ok(value):
            raise argparse.ArgumentTypeError(f"must be {expected}, got {text!r}")
        return value

    return parse


positive_int = checked(int, lambda value: value >= 1, "a positive integer")
non_negative_int = checked(int, lambda value: value >= 0, "an integer >= 0")
positive_gib = checked(float, lambda value: math.isfinite(value) and value > 0, "a positive number of GiB")


def subcommand_list() -> str:
    """The epilog of ``ce-bench --help``: every subcommand with its description."""
    width = max(len(name) for name in SUBCOMMANDS)
    lines = [f"  {name:<{width}}  {text}" for name, text in SUBCOMMANDS.items()]
    return "subcommands ('ce-bench SUBCOMMAND --help' for the options of each):\n" + "\n".join(lines)


def add_common(parser: argparse.ArgumentParser, *, default_dtype: str, default_shapes: Sequence[str]) -> None:
    """The flags ``run`` and ``aot`` share: contenders, shapes, dtypes, objective and output files."""
    parser.add_argument("--backends", default=None, metavar="A,B",
                        help="comma-separated contenders (default: every ce_core backend available here, plus "
                             "tokamax:xla, tokamax:chunked_xla, tokamax:mosaic_tpu when tokamax is installed; "
                             "'tokamax' expands to all three)")
    parser.add_argument("--shapes", default=None, metavar="S,T",
                        help=f"comma-separated presets ({', '.join(presets.PRESETS)}), groups of model heads "
                             f"({', '.join(presets.SHAPE_GROUPS)}) or NxHxV (default: {','.join(default_shapes)})")
    parser.add_argument("--tokens", type=positive_int, default=None, metavar="N", help="override N of every preset")
    parser.add_argument("--dtype", default=default_dtype, help=f"float32, bfloat16, float16; comma-separated "
                                                               f"for several (default: {default_dtype})")
    parser.add_argument("--objective", "--reduction", dest="reduction", default="mean", choices=objectives.OBJECTIVES,
                        help="what is differentiated: the loss with this reduction (mean, sum, none: the sum of "
                             "per-token losses), or rl: per-token log-probs and entropies (linear_log_probs) through "
                             f"mean(logp) + {objectives.RL_ENTROPY_WEIGHT} mean(entropy), or distill: "
                             f"linear_distillation_loss against a top-{objectives.DISTILL_K} teacher drawn from the "
                             "labels, or distill_dense: against a dense teacher of twice the width (default: mean)")
    add_output(parser, table_format=False)
    parser.add_argument("--plot", default=None, metavar="PATH", help="write a PNG comparing time and memory here")
    parser.add_argument("--out", default=str(DEFAULT_OUT), metavar="DIR",
                        help="directory for the JSON and PNG when --json/--plot are not given (default: bench-out)")
    parser.add_argument("--no-files", action="store_true", help="write no JSON or PNG unless --json/--plot say so")
    parser.add_argument("--format", default="text", choices=("text", "markdown"), help="table format")
    parser.add_argument("--no-progress", action="store_true",
                        help="no progress bar (there is none anyway when stderr is not a terminal)")


def add_output(parser: argparse.ArgumentParser, *, table_format: bool = True,
               json_help: str = "write the records as a JSON list here") -> None:
    """``--json PATH`` and (``table_format``) ``--format text|markdown``: the output flags of the
    subcommands that print one table."""
    parser.add_argument("--json", default=None, metavar="PATH", help=json_help)
    if table_format:
        parser.add_argument("--format", default="text", choices=("text", "markdown"), help="table format")


def quiet_libraries() -> None:
    """tokamax logs an "autotuning cache miss" warning through absl on every new shape; the bench uses
    tokamax's heuristic configs on purpose."""
    logging.getLogger("absl").setLevel(logging.ERROR)


def parse_shapes_and_dtypes(parser: argparse.ArgumentParser, args: argparse.Namespace, *, reduced_for_cpu: bool,
                            default: tuple[str, ...]) -> tuple[list[presets.Shape], list[Any]]:
    """``--shapes`` and ``--dtype``, or a usage error that names the flag."""
    try:
        shapes = presets.parse_shapes(args.shapes, reduced_for_cpu=reduced_for_cpu, default=default,
                                      tokens=args.tokens)
    except ValueError as error:
        parser.error(f"--shapes: {error}")
    try:
        dtypes = presets.parse_dtypes(args.dtype)
    except ValueError as error:
        parser.error(f"--dtype: {error}")
    return shapes, dtypes


def parse_selection(spec: str, known: Sequence[str], error: str) -> list[str]:
    """A comma-separated, non-empty selection of ``known``; else ``ValueError(error)``."""
    chosen = [item.strip() for item in spec.split(",") if item.strip()]
    if not chosen or set(chosen) - set(known):
        raise ValueError(error)
    return chosen


def parse_kernels(spec: str, known: Sequence[str]) -> list[str]:
    """``--kernels`` of ``schedule`` and ``tune``: some of ``known`` (``forward``, ``backward``)."""
    return parse_selection(spec, known, f"--kernels takes {', '.join(known)}, got {spec!r}")


def check_backends(parser: argparse.ArgumentParser, names: Sequence[str], known: Sequence[str]) -> None:
    """A usage error for names in ``--backends`` that are no backend at all (not merely unavailable here)."""
    unknown = [name for name in names if name not in known]
    if unknown:
        parser.error(f"--backends: unknown backend{'s' if len(unknown) > 1 else ''} {', '.join(map(repr, unknown))}; "
                     f"known: {', '.join(known)}")


def save_json(items: Sequence[Record] | Sequence[dict[str, Any]], path: str | Path) -> None:
    """Write ``items`` as a JSON list at ``path`` and say where."""
    from ce_bench.records import write_json

    print(f"\nJSON: {write_json(items, path)}")


def emit(records: Sequence[Record], args: argparse.Namespace, stem: str, table: str, title: str) -> None:
    """Print the table and write the JSON and PNG where ``args`` say (``--json``, ``--plot``, else
    ``--out``/``stem``.json and .png unless ``--no-files``)."""
    from ce_bench.plot import plot

    print(table)
    out = Path(args.out)
    json_path = Path(args.json) if args.json else (None if args.no_files else out / f"{stem}.json")
    plot_path = Path(args.plot) if args.plot else (None if args.no_files else out / f"{stem}.png")
    if json_path is not None:
        save_json(records, json_path)
    if plot_path is not None:
        print(f"PNG:  {plot(records, plot_path, title=title)}")


def exit_status(statuses: Sequence[str], command: str) -> int:
    """1, saying so on stderr, when there were rows and every one failed or was unsupported; else 0."""
    if statuses and all(status in FAILED_STATUSES for status in statuses):
        print(f"{command}: every backend failed or was unsupported (the table says why)", file=sys.stderr)
        return 1
    return 0
