"""``ce-bench sharding``: per-device temporary memory of the sharded loss on simulated CPU meshes or a
deviceless TPU topology (:mod:`ce_bench.sharded_memory`; compile only unless ``--time``)."""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from ce_bench import presets
from ce_bench.commands import common


def sharding_parser() -> argparse.ArgumentParser:
    """The parser of ``ce-bench sharding``."""
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
    parser.add_argument("--time", type=common.non_negative_int, default=0, metavar="REPEATS",
                        help="also run each compiled program REPEATS times on random inputs, interleaved "
                             "(0: compile only; the shapes must then fit this machine)")
    common.add_output(parser, table_format=False)
    return parser


def parse_meshes(spec: str) -> list[tuple[int, int]]:
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


def main(argv: Sequence[str]) -> int:
    """``ce-bench sharding``."""
    import ce_core
    from ce_bench import sharded_memory

    parser = sharding_parser()
    args = parser.parse_args(argv)
    try:
        shapes = presets.parse_shapes(args.shapes, reduced_for_cpu=False)
    except ValueError as error:
        parser.error(f"--shapes: {error}")
    backends = [b.strip() for b in args.backends.split(",") if b.strip()]
    if not backends:
        parser.error("--backends needs at least one backend")
    common.check_backends(parser, backends, ce_core.installed_backends())
    try:
        dtype = presets.parse_dtypes(args.dtype)[0]
        meshes = parse_meshes(args.meshes)
        calls = common.parse_selection(args.calls, sharded_memory.CALLS,
                                       f"--calls must name some of {sharded_memory.CALLS}, got {args.calls!r}")
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
        common.save_json(records, args.json)
    return common.exit_status([record.status for record in records], "ce-bench sharding")
