"""``ce-bench``: the command line. Thin: parse, call :mod:`ce_bench.runner` / :mod:`ce_bench.aot`,
print the table, write JSON and a PNG.

    ce-bench [--backends a,b] [--shapes small,llama3-8b,NxHxV] [--dtype float32] [--reduction mean]
             [--repeats 5] [--json PATH] [--plot PATH] [--out DIR] [--compile-only] ...
    ce-bench aot --target v4|v5e|v5p|v6e|tpu7x [--shapes ...] [--dtype bfloat16] ...
    ce-bench schedule --target v5e|v5p|v6e|tpu7x [--shapes ...] [--kernels forward,backward] ...
    ce-bench tune --target v5e|v5p|v6e|tpu7x [--buckets llama3,huge_batch] [--candidates 3] [--write]
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

import argparse
import logging
import math
import os
import sys
import textwrap
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ce_bench import objectives, presets
from ce_bench.memory import GIB
from ce_core.contract.tpu_host import quiet_libtpu_without_tpu

if TYPE_CHECKING:
    from ce_bench.records import Record

DEFAULT_OUT = Path("bench-out")

#: The subcommands, with the one-line description ``ce-bench --help`` lists; ``run`` is the default.
SUBCOMMANDS: dict[str, str] = {
    "run": "head-to-head run: time, memory and error of each backend (the default without a subcommand)",
    "aot": "compile for a TPU generation without a TPU (libtpu): HBM temporaries and block sizes",
    "schedule": "libtpu's static schedule of the pallas_tpu kernels per grid step (no TPU needed)",
    "tune": "choose pallas_tpu's tiles per shape bucket from static schedules; --write regenerates its table",
    "sharding": "per-device temporary memory of the sharded loss on simulated device meshes",
    "report": "the table (and PNG) again, from JSON files of earlier runs",
    "list": "presets and the backends available here",
}

#: Row statuses that mean a backend produced nothing: when every backend row has one, the exit status is 1.
FAILED_STATUSES = ("failed", "unsupported")


def _checked[T](convert: Callable[[str], T], ok: Callable[[T], bool], expected: str) -> Callable[[str], T]:
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


_positive_int = _checked(int, lambda value: value >= 1, "a positive integer")
_non_negative_int = _checked(int, lambda value: value >= 0, "an integer >= 0")
_positive_gib = _checked(float, lambda value: math.isfinite(value) and value > 0, "a positive number of GiB")


def _subcommand_list() -> str:
    width = max(len(name) for name in SUBCOMMANDS)
    lines = [f"  {name:<{width}}  {text}" for name, text in SUBCOMMANDS.items()]
    return "subcommands ('ce-bench SUBCOMMAND --help' for the options of each):\n" + "\n".join(lines)


def _common(parser: argparse.ArgumentParser, *, default_dtype: str, default_shapes: Sequence[str]) -> None:
    parser.add_argument("--backends", default=None, metavar="A,B",
                        help="comma-separated contenders (default: every ce_core backend available here, plus "
                             "tokamax:xla, tokamax:chunked_xla, tokamax:mosaic_tpu when tokamax is installed; "
                             "'tokamax' expands to all three)")
    parser.add_argument("--shapes", default=None, metavar="S,T",
                        help=f"comma-separated presets ({', '.join(presets.PRESETS)}) or NxHxV "
                             f"(default: {','.join(default_shapes)})")
    parser.add_argument("--tokens", type=_positive_int, default=None, metavar="N", help="override N of every preset")
    parser.add_argument("--dtype", default=default_dtype, help=f"float32, bfloat16, float16; comma-separated "
                                                               f"for several (default: {default_dtype})")
    parser.add_argument("--objective", "--reduction", dest="reduction", default="mean", choices=objectives.OBJECTIVES,
                        help="what is differentiated: the loss with this reduction (mean, sum, none: the sum of "
                             "per-token losses), or rl: per-token log-probs and entropies (linear_log_probs) through "
                             f"mean(logp) + {objectives.RL_ENTROPY_WEIGHT} mean(entropy) (default: mean)")
    parser.add_argument("--json", default=None, metavar="PATH", help="write the records as a JSON list here")
    parser.add_argument("--plot", default=None, metavar="PATH", help="write a PNG comparing time and memory here")
    parser.add_argument("--out", default=str(DEFAULT_OUT), metavar="DIR",
                        help="directory for the JSON and PNG when --json/--plot are not given (default: bench-out)")
    parser.add_argument("--no-files", action="store_true", help="write no JSON or PNG unless --json/--plot say so")
    parser.add_argument("--format", default="text", choices=("text", "markdown"), help="table format")
    parser.add_argument("--no-progress", action="store_true",
                        help="no progress bar (there is none anyway when stderr is not a terminal)")


def run_parser() -> argparse.ArgumentParser:
    """The parser of ``ce-bench`` (the head-to-head run)."""
    description = ("Head-to-head bench of fused linear cross-entropy backends: forward and forward+backward "
                   "time (interleaved, median), tokens/s, ratio to a matmul floor, temporary memory, and error "
                   "against a float64 oracle. Exit status: 2 for a usage error, 1 when every backend row "
                   "failed or was unsupported.")
    parser = argparse.ArgumentParser(
        prog="ce-bench",
        usage="ce-bench [SUBCOMMAND] [options]",
        description=textwrap.fill(description, width=100),
        epilog=_subcommand_list(),
        formatter_class=argparse.RawDescriptionHelpFormatter)
    _common(parser, default_dtype="float32", default_shapes=presets.DEFAULT_RUN_SHAPES)
    parser.add_argument("--repeats", type=_positive_int, default=5, help="timed rounds per contender (default: 5)")
    parser.add_argument("--warmup", type=_positive_int, default=1,
                        help="untimed calls per contender first (default: 1)")
    parser.add_argument("--compile-only", action="store_true",
                        help="compile and report memory only; execute nothing and refuse no shape for memory "
                             "(presets keep their full N)")
    parser.add_argument("--no-floor", action="store_true", help="do not time the matmul floor")
    parser.add_argument("--oracle-max-elements", type=_positive_int, default=None, metavar="K",
                        help="measure the error against the float64 oracle only when N*V <= K (default: 2**26)")
    parser.add_argument("--memory-budget", type=_positive_gib, default=None, metavar="GIB",
                        help="refuse what would need more than this many GiB (default: 80%% of available memory)")
    parser.add_argument("--seed", type=_non_negative_int, default=0, help="seed of the random inputs")
    return parser


def aot_parser() -> argparse.ArgumentParser:
    """The parser of ``ce-bench aot``."""
    from ce_bench.aot import TOPOLOGIES

    parser = argparse.ArgumentParser(
        prog="ce-bench aot",
        description="Compile each backend (and tokamax's implementations) for a TPU generation on a machine "
                    "without a TPU (needs libtpu) and report compile status, HBM temporaries and block sizes.")
    parser.add_argument("--target", required=True, choices=sorted(TOPOLOGIES), help="TPU generation")
    _common(parser, default_dtype="bfloat16", default_shapes=presets.DEFAULT_AOT_SHAPES)
    return parser


def _outputs(args: argparse.Namespace, stem: str) -> tuple[Path | None, Path | None]:
    out = Path(args.out)
    json_path = Path(args.json) if args.json else (None if args.no_files else out / f"{stem}.json")
    plot_path = Path(args.plot) if args.plot else (None if args.no_files else out / f"{stem}.png")
    return json_path, plot_path


def _emit(records: Sequence[Record], args: argparse.Namespace, stem: str, table: str, title: str) -> None:
    """Print the table and write the JSON and PNG where ``args`` say."""
    from ce_bench.plot import plot
    from ce_bench.records import write_json

    print(table)
    json_path, plot_path = _outputs(args, stem)
    if json_path is not None:
        print(f"\nJSON: {write_json(records, json_path)}")
    if plot_path is not None:
        print(f"PNG:  {plot(records, plot_path, title=title)}")


def _quiet_libraries() -> None:
    # tokamax logs an "autotuning cache miss" warning through absl on every new shape; the bench
    # uses tokamax's heuristic configs on purpose.
    logging.getLogger("absl").setLevel(logging.ERROR)


def _parse_shapes_and_dtypes(parser: argparse.ArgumentParser, args: argparse.Namespace, *, reduced_for_cpu: bool,
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


def _check_backends(parser: argparse.ArgumentParser, names: Sequence[str], known: Sequence[str]) -> None:
    """A usage error for names in ``--backends`` that are no backend at all (not merely unavailable here)."""
    unknown = [name for name in names if name not in known]
    if unknown:
        parser.error(f"--backends: unknown backend{'s' if len(unknown) > 1 else ''} {', '.join(map(repr, unknown))}; "
                     f"known: {', '.join(known)}")


def _all_failed(statuses: Sequence[str]) -> bool:
    """Whether there were rows and every one of them failed or was unsupported."""
    return bool(statuses) and all(status in FAILED_STATUSES for status in statuses)


def _report_all_failed(command: str) -> int:
    print(f"{command}: every backend failed or was unsupported (the table says why)", file=sys.stderr)
    return 1


def main_run(argv: Sequence[str]) -> int:
    """``ce-bench [options]``."""
    parser = run_parser()
    args = parser.parse_args(argv)
    shapes, dtypes = _parse_shapes_and_dtypes(parser, args, reduced_for_cpu=not args.compile_only,
                                              default=presets.DEFAULT_RUN_SHAPES)
    _quiet_libraries()

    import jax

    from ce_bench import accuracy, contenders, report, runner

    if jax.default_backend() != "cpu":  # presets were reduced for a CPU; use their full size here
        shapes = presets.parse_shapes(args.shapes, reduced_for_cpu=False, tokens=args.tokens)
    names = contenders.parse_names(args.backends)
    _check_backends(parser, names, contenders.known_names())
    config = runner.RunConfig(
        shapes=shapes, dtypes=dtypes, names=names, reduction=args.reduction, repeats=args.repeats,
        warmup=args.warmup, compile_only=args.compile_only, measure_floor=not args.no_floor,
        oracle_max_elements=args.oracle_max_elements or accuracy.DEFAULT_MAX_ELEMENTS,
        memory_budget_bytes=None if args.memory_budget is None else int(args.memory_budget * GIB),
        seed=args.seed)
    budget = runner.budget_bytes(config.memory_budget_bytes)
    mode = "compile only" if args.compile_only else f"{args.repeats} interleaved rounds after {args.warmup} warm-up"
    print(f"ce-bench: {runner.device_description()}, jax {jax.__version__}; backends: {', '.join(names)}")
    print(f"objective={args.reduction}; {mode}; memory budget "
          f"{'-' if budget is None else f'{budget / GIB:.1f} GiB'}\n", flush=True)
    start = time.perf_counter()
    records = runner.run(config, progress=not args.no_progress)
    elapsed = time.perf_counter() - start
    table = (report.compile_table if args.compile_only else report.run_table)(records, args.format)
    title = f"ce-bench on {runner.device_description()}" + (" (compile only)" if args.compile_only else "")
    _emit(records, args, "ce-bench-compile" if args.compile_only else "ce-bench", table, title)
    print(f"\n{len(records)} rows in {elapsed:.0f} s")
    if _all_failed([record.status for record in records if record.kind == "backend"]):
        return _report_all_failed("ce-bench")
    return 0


def main_aot(argv: Sequence[str]) -> int:
    """``ce-bench aot --target ...``."""
    parser = aot_parser()
    args = parser.parse_args(argv)
    shapes, dtypes = _parse_shapes_and_dtypes(parser, args, reduced_for_cpu=False, default=presets.DEFAULT_AOT_SHAPES)
    _quiet_libraries()
    # libtpu takes /tmp/libtpu_lockfile when JAX first initialises; any other JAX process on this
    # machine (a second bench, a test run) holds it and the topology call then fails. Compiling for
    # a topology that is not there touches no TPU, so several processes may load libtpu at once.
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")

    from ce_bench import aot, contenders, report

    names = None if args.backends is None else contenders.parse_names(args.backends)
    if names is not None:
        _check_backends(parser, names, contenders.known_names())
    print(f"ce-bench aot: compiling for TPU {args.target} ({aot.TOPOLOGIES[args.target]}) without a TPU\n", flush=True)
    start = time.perf_counter()
    try:
        records = aot.run_aot(args.target, shapes, dtypes, names, reduction=args.reduction,
                              progress=not args.no_progress)
    except aot.AotUnavailableError as error:
        print(f"ce-bench aot: {error}", file=sys.stderr)
        return 1
    elapsed = time.perf_counter() - start
    _emit(records, args, f"aot-{args.target}", report.compile_table(records, args.format),
          f"ce-bench aot: TPU {args.target} (compiled without a TPU)")
    print(f"\n{len(records)} rows in {elapsed:.0f} s")
    if _all_failed([record.status for record in records if record.kind == "backend"]):
        return _report_all_failed("ce-bench aot")
    return 0


def schedule_parser() -> argparse.ArgumentParser:
    """The parser of ``ce-bench schedule``."""
    from ce_bench.schedule import DEFAULT_SCHEDULE_SHAPES, KERNELS, SCHEDULE_TARGETS

    parser = argparse.ArgumentParser(
        prog="ce-bench schedule",
        description="Static schedule of the pallas_tpu kernels from libtpu's compiler (no TPU needed): per grid "
                    "step, the estimated cycles and bundles against the fewest cycles the step's matmuls need on "
                    "the generation's MXUs, and the step's HBM time against its MXU time.")
    parser.add_argument("--target", required=True, choices=SCHEDULE_TARGETS, help="TPU generation")
    parser.add_argument("--shapes", default=None, metavar="S,T",
                        help=f"presets or NxHxV at full size (default: {','.join(DEFAULT_SCHEDULE_SHAPES)})")
    parser.add_argument("--dtype", default="bfloat16", help="dtype of x (and of w unless --w-dtype)")
    parser.add_argument("--w-dtype", default=None, help="dtype of w (default: --dtype)")
    parser.add_argument("--precision", default=None, choices=("default", "highest"),
                        help="MXU precision of the kernels' products (default: the backend's default)")
    parser.add_argument("--kernels", default=",".join(KERNELS), help="comma-separated: forward, backward")
    parser.add_argument("--json", default=None, metavar="PATH", help="write the records as a JSON list here")
    parser.add_argument("--format", default="text", choices=("text", "markdown"), help="table format")
    parser.add_argument("--quiet", action="store_true", help="no progress lines")
    return parser


def main_schedule(argv: Sequence[str]) -> int:
    """``ce-bench schedule --target ...``."""
    from ce_bench import schedule

    parser = schedule_parser()
    args = parser.parse_args(argv)
    try:
        shapes = presets.parse_shapes(args.shapes, reduced_for_cpu=False, default=schedule.DEFAULT_SCHEDULE_SHAPES)
    except ValueError as error:
        parser.error(f"--shapes: {error}")
    try:
        x_dtype = presets.parse_dtypes(args.dtype)[0].name
        w_dtype = presets.parse_dtypes(args.w_dtype)[0].name if args.w_dtype else x_dtype
        kernels = [kernel.strip() for kernel in args.kernels.split(",") if kernel.strip()]
        if not kernels or set(kernels) - set(schedule.KERNELS):
            raise ValueError(f"--kernels takes {', '.join(schedule.KERNELS)}, got {args.kernels!r}")
    except ValueError as error:
        parser.error(str(error))
    print(f"ce-bench schedule: libtpu's static schedule for TPU {args.target}, no TPU present", flush=True)
    start = time.perf_counter()
    try:
        records = schedule.run_schedule(args.target, shapes, x_dtype, kernels, w_dtype=w_dtype,
                                        precision=args.precision, quiet=args.quiet)
    except schedule.ScheduleUnavailableError as error:
        print(f"ce-bench schedule: {error}", file=sys.stderr)
        return 1
    print()
    print(schedule.schedule_table(records, args.format))
    if args.json:
        import json

        path = Path(args.json)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(records, indent=2) + "\n", encoding="utf-8")
        print(f"\nJSON: {path}")
    print(f"\n{len(records)} rows in {time.perf_counter() - start:.0f} s")
    if any(record.get("error") for record in records):
        print("ce-bench schedule: some kernels could not be scheduled (their rows say why)", file=sys.stderr)
        return 1
    return 0


def tune_parser() -> argparse.ArgumentParser:
    """The parser of ``ce-bench tune``."""
    from ce_bench.schedule import SCHEDULE_TARGETS

    parser = argparse.ArgumentParser(
        prog="ce-bench tune",
        description="Choose pallas_tpu's tiles for a TPU generation without a TPU: per shape bucket, compile "
                    "candidate tiles at the bucket's example shape (today's entry always among them; the VMEM model "
                    "only prefilters, libtpu's compile decides), read their static schedules and keep the one with "
                    "the least estimated kernel time. --write regenerates ce_pallas_tpu/tuned.py: this generation's "
                    "entries for these buckets are replaced, the others kept.")
    parser.add_argument("--target", required=True, choices=SCHEDULE_TARGETS, help="TPU generation")
    parser.add_argument("--buckets", default=None, metavar="A,B",
                        help="shape buckets (default: all: small, wide, huge_batch, large_vocab, llama3)")
    parser.add_argument("--kernels", default="forward,backward", help="comma-separated: forward, backward")
    parser.add_argument("--candidates", type=_positive_int, default=3, metavar="K",
                        help="candidates compiled and measured per kernel and bucket (default: 3)")
    parser.add_argument("--shape", default=None, metavar="NxHxV",
                        help="measure every bucket at this shape instead of its example shape (a quick check; "
                             "cannot be written)")
    parser.add_argument("--write", action="store_true",
                        help="write the winners into ce_pallas_tpu/tuned.py (a kernel left out by --kernels keeps its "
                             "tiles and figures)")
    parser.add_argument("--json", default=None, metavar="PATH", help="write every measured candidate here")
    parser.add_argument("--format", default="text", choices=("text", "markdown"), help="table format")
    parser.add_argument("--quiet", action="store_true", help="no per-compile progress lines")
    return parser


def main_tune(argv: Sequence[str]) -> int:
    """``ce-bench tune --target ...``: regenerate pallas_tpu's tuned tiles from libtpu's static schedules."""
    from ce_bench import tune

    parser = tune_parser()
    args = parser.parse_args(argv)
    shape = None
    try:
        buckets = tune.parse_buckets(args.buckets)
        kernels = [kernel.strip() for kernel in args.kernels.split(",") if kernel.strip()]
        if not kernels or set(kernels) - set(tune.KERNELS):
            raise ValueError(f"--kernels takes {', '.join(tune.KERNELS)}, got {args.kernels!r}")
        if args.shape is not None:
            parsed = presets.parse_shapes(args.shape, reduced_for_cpu=False, default=())
            if len(parsed) != 1:
                raise ValueError(f"--shape takes one shape (NxHxV or a preset), got {args.shape!r}")
            shape = (parsed[0].n, parsed[0].h, parsed[0].v)
        if args.write and shape is not None:
            raise ValueError("--write keeps tiles measured at the buckets' example shapes; leave out --shape")
    except ValueError as error:
        parser.error(str(error))
    _quiet_libraries()
    print(f"ce-bench tune: tiles for TPU {args.target} from libtpu's static schedules, no TPU present", flush=True)
    start = time.perf_counter()
    try:
        report = tune.run_tune(args.target, buckets, kernels, args.candidates, write=args.write, shape=shape,
                               quiet=args.quiet)
    except tune.TuneUnavailableError as error:
        print(f"ce-bench tune: {error}", file=sys.stderr)
        return 1
    print()
    print(tune.tune_table(report.rows, args.format))
    if report.path is not None:
        print(f"\ntable written: {report.path}")
    if args.json:
        import json

        path = Path(args.json)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(report.rows, indent=2) + "\n", encoding="utf-8")
        print(f"\nJSON: {path}")
    print(f"\n{len(report.rows)} candidates measured in {time.perf_counter() - start:.0f} s")
    if report.failed:
        print(f"ce-bench tune: nothing could be measured for {', '.join(report.failed)} (entries left as they were)",
              file=sys.stderr)
    if len(report.failed) == len(buckets):
        return 1
    return 0


def _parse_meshes(spec: str) -> list[tuple[int, int]]:
    """``--meshes``: comma-separated ``DATAxVOCAB`` pairs of positive integers."""
    meshes = []
    for item in spec.split(","):
        try:
            data, vocab = (int(part) for part in item.strip().lower().split("x"))
        except ValueError:  # not two parts, or not integers
            data = vocab = 0
        if min(data, vocab) < 1:
            raise ValueError(f"--meshes must be DATAxVOCAB pairs of positive integers, got {spec!r}")
        meshes.append((data, vocab))
    return meshes


def main_sharding(argv: Sequence[str]) -> int:
    """``ce-bench sharding``: per-device temporary memory of the sharded loss on simulated CPU meshes
    (:mod:`ce_bench.sharded_memory`; compile only)."""
    import ce_core
    from ce_bench import sharded_memory

    parser = argparse.ArgumentParser(
        prog="ce-bench sharding",
        description="Compile value_and_grad of ce_core.sharded_linear_cross_entropy on data x vocab meshes of "
                    f"{sharded_memory.DEVICE_COUNT} simulated CPU devices and report per-device temporary memory.")
    parser.add_argument("--backends", default="reference,xla", help="comma-separated ce_core backends")
    parser.add_argument("--shapes", default="llama3-8b", help="presets or NxHxV (full size: nothing runs)")
    parser.add_argument("--dtype", default="bfloat16", help="dtype of x and w")
    parser.add_argument("--meshes", default=",".join(f"{d}x{m}" for d, m in sharded_memory.DEFAULT_MESHES),
                        help="comma-separated DATAxVOCAB mesh shapes")
    parser.add_argument("--calls", default="wrapper",
                        help="comma-separated ways of calling the loss: wrapper (sharded_linear_cross_entropy), "
                             "explicit (plain call, Explicit mesh axes), auto (plain call, Auto axes / GSPMD, default "
                             "layout), auto_stated (plain call, Auto axes, in_specs stating the inputs' layout)")
    parser.add_argument("--topology", default=None, metavar="NAME",
                        help="compile for the devices of a deviceless TPU topology such as v5p:2x2x1 instead of "
                             "simulated CPU devices (libtpu; compile only)")
    parser.add_argument("--time", type=_non_negative_int, default=0, metavar="REPEATS",
                        help="also run each compiled program REPEATS times on random inputs, interleaved "
                             "(0: compile only; the shapes must then fit this machine)")
    parser.add_argument("--json", default=None, metavar="PATH", help="write the records as a JSON list here")
    args = parser.parse_args(argv)
    try:
        shapes = presets.parse_shapes(args.shapes, reduced_for_cpu=False)
    except ValueError as error:
        parser.error(f"--shapes: {error}")
    backends = [b.strip() for b in args.backends.split(",") if b.strip()]
    if not backends:
        parser.error("--backends needs at least one backend")
    _check_backends(parser, backends, ce_core.installed_backends())
    try:
        dtype = presets.parse_dtypes(args.dtype)[0]
        meshes = _parse_meshes(args.meshes)
        calls = [c.strip() for c in args.calls.split(",") if c.strip()]
        unknown = sorted(set(calls) - set(sharded_memory.CALLS))
        if unknown or not calls:
            raise ValueError(f"--calls must name some of {sharded_memory.CALLS}, got {args.calls!r}")
        if args.time and args.topology:
            raise ValueError("--time runs the programs; a --topology has no devices to run them on")
    except ValueError as error:
        parser.error(str(error))
    sharded_memory.request_simulated_devices(max(sharded_memory.DEVICE_COUNT, *(d * m for d, m in meshes)))
    records = []
    for shape in shapes:
        records += sharded_memory.sweep(backends, shape.n, shape.h, shape.v, dtype.name, meshes, calls, args.topology)
    if args.time:
        sharded_memory.time_calls(records, repeats=args.time)
    print(sharded_memory.format_table(records))
    if args.json:
        from ce_bench.records import write_json

        print(f"\nJSON: {write_json(records, args.json)}")
    if records and all(record.status not in ("ok", "compiled") for record in records):
        return _report_all_failed("ce-bench sharding")
    return 0


def main_report(argv: Sequence[str]) -> int:
    """``ce-bench report``: the table (and optionally the PNG) again, from JSON files of earlier runs."""
    parser = argparse.ArgumentParser(prog="ce-bench report",
                                     description="Print the table of JSON records written by ce-bench or "
                                                 "ce-bench aot (several files are concatenated).")
    parser.add_argument("paths", nargs="+", metavar="JSON")
    parser.add_argument("--plot", default=None, metavar="PATH", help="also draw the PNG here")
    parser.add_argument("--format", default="text", choices=("text", "markdown"), help="table format")
    args = parser.parse_args(argv)
    from ce_bench import report
    from ce_bench.records import read_json

    records = []
    for path in args.paths:
        try:
            records += read_json(path)
        except (OSError, ValueError, TypeError) as error:  # missing, not JSON, or not a list of records
            parser.error(f"cannot read records from {path}: {error}")
    timed = any(record.fwd_bwd_ms is not None for record in records)
    print((report.run_table if timed else report.compile_table)(records, args.format))
    if args.plot:
        from ce_bench.plot import plot

        devices = sorted({record.device for record in records if record.device})
        print(f"\nPNG:  {plot(records, args.plot, title='ce-bench: ' + '; '.join(devices))}")
    return 0


def main_list(argv: Sequence[str] = ()) -> int:
    """``ce-bench list``: presets and the contenders available here."""
    argparse.ArgumentParser(prog="ce-bench list", description=SUBCOMMANDS["list"].capitalize() + ".").parse_args(argv)
    from ce_bench import contenders

    print("presets (N for aot/--compile-only; CPU runs use 'cpu N'):")
    for preset in presets.PRESETS.values():
        cpu_n = preset.cpu_n if preset.cpu_n is not None else preset.n
        print(f"  {preset.name:<10} N={preset.n:<6} cpu N={cpu_n:<6} H={preset.h:<5} V={preset.v:<7} {preset.source}")
    print(f"default run: {','.join(presets.DEFAULT_RUN_SHAPES)}; default aot: {','.join(presets.DEFAULT_AOT_SHAPES)}")
    print(f"contenders available here: {', '.join(contenders.default_names())}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``ce-bench`` console script."""
    quiet_libtpu_without_tpu()  # before JAX's platform discovery loads libtpu
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0].startswith("-"):
        return main_run(argv)
    handlers: dict[str, Callable[[Sequence[str]], int]] = {
        "run": main_run, "aot": main_aot, "schedule": main_schedule, "tune": main_tune, "sharding": main_sharding,
        "report": main_report, "list": main_list,
    }
    assert set(handlers) == set(SUBCOMMANDS)
    handler = handlers.get(argv[0])
    if handler is None:
        run_parser().error(f"unknown subcommand {argv[0]!r}; one of: {', '.join(SUBCOMMANDS)}")
    return handler(argv[1:])


if __name__ == "__main__":
    sys.exit(main())
