"""Where a streamed forward step's time goes: the kernel against two stripped-down steps, from libtpu's
static schedule (no TPU needed).

Each variant is one Pallas kernel that takes a ``[b, bv]`` logit tile per grid step and folds it into
the online statistics (the sum of exps against a reference, the label logit, and with ``--objective
rl`` the weighted sum of the entropy's expected logit):

- ``kernel``: ce_pallas_tpu's own streamed forward at tiles ``b/all/bv``, the head ``[H, V]`` or with
  ``--w-layout vh`` ``[V, H]`` (whose streamed kernel leaves the label logit to the wrapper).
- ``lanes``: the same per-lane statistics (``[b, 128]`` state in VMEM, 128 columns folded at a time)
  and nothing else: no redo, no second state slot, no exact first step. ``--row-chunk R`` takes
  ``x``'s rows ``R`` at a time through the whole ``w`` tile, so a row's state could stay in registers;
  ``--without-label`` leaves the label pick out.
- ``tokens-on-lanes``: the logits transposed (``w [V, H] @ x^T [H, N]``, tokens on lanes), so a token's
  state is one column of an ``[8, b]`` tile and 8 vocab rows are folded at a time.

Each is compiled for two token blocks by two and by three vocab blocks through libtpu's deviceless
topology, with the static-profile dumps of :mod:`ce_pallas_tpu.tooling.schedule.dumps`; the difference
is two interior steps. Printed per step: libtpu's estimated cycles, the MXU minimum and their ratio,
and the ops per float32 logit register (8 x 128 logits) that tell the variants apart: vector loads and
stores, vector adds, the lane broadcasts. docs/notes/2026-11-27-label-gap.md (and
docs/notes/2026-11-27-label-logit-beside-kernel.md) has the figures this gave.

    ALLOW_MULTIPLE_LIBTPU_LOAD=1 uv run python benchmarks/tpu_forward_layouts.py --tokens 2048 --vocab 2048 \\
        --hidden 1024 --objective rl
"""

from __future__ import annotations

import argparse
import collections
import functools
import json
import math
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

VARIANTS = ("kernel", "lanes", "tokens-on-lanes")
#: The ops printed per logit register, in this order.
SHOWN_OPS = ("vld", "vst", "vadd.f32", "vsub.s32", "vbcast.lane.b32.xlu0", "vbcast.lane.b32.xlu1")
_OP = re.compile(r"^  %[^=]+= ([a-z0-9_.]+)")
SUBLANES, LANES = 8, 128


def count_ops(bundles: Path) -> collections.Counter[str]:
    """How often each op occurs in libtpu's executed-bundles trace."""
    counts: collections.Counter[str] = collections.Counter()
    with bundles.open() as lines:
        for line in lines:
            match = _OP.match(line)
            if match:
                counts[match.group(1)] += 1
    return counts


def per_step(totals: dict[int, float], token_blocks: int) -> float:
    """One interior step's share, from totals at 2 and 3 vocab blocks (``token_blocks`` rows of steps)."""
    return (totals[3] - totals[2]) / token_blocks


# ---------------------------------------------------------------------------------------------
# The stripped-down steps (traced inside the worker process).


def _zero_state(state_refs) -> None:
    """A token block's statistics before its first vocab block."""
    import jax.numpy as jnp

    for ref in state_refs:
        ref[...] = jnp.zeros_like(ref)


def _lanes_kernel(x_ref, w_ref, y_ref, lse_ref, label_out, expected_out, r_ref, s_ref, label_ref, weighted_ref,
                  flag_ref, *, block_v: int, rl: bool, row_chunk: int, label_pick: bool = True):
    import jax
    import jax.numpy as jnp
    from jax.experimental import pallas as pl

    j = pl.program_id(1)
    state_refs = (r_ref, s_ref, label_ref, weighted_ref)
    pl.when(j == 0)(functools.partial(_zero_state, state_refs))

    largest = jnp.float32(0.0)  # the sums are positive
    for start in range(0, x_ref.shape[0], row_chunk):
        rows = pl.ds(start, row_chunk)
        z = jnp.dot(x_ref[rows, :], w_ref[...], preferred_element_type=jnp.float32)
        gap = (jnp.broadcast_to(y_ref[rows, :] - j * block_v, (row_chunk, LANES))
               - jax.lax.broadcasted_iota(jnp.int32, (row_chunk, LANES), 1))
        r, s, label, weighted = (ref[rows, :] for ref in state_refs)
        for g in range(0, block_v, LANES):
            zg = z[:, g:g + LANES]
            e = jnp.exp(zg - r)
            s = s + e
            if label_pick:
                label = jnp.where(gap == g, zg, label)
            if rl:
                weighted = weighted + e * zg
        s_ref[rows, :], label_ref[rows, :], weighted_ref[rows, :] = s, label, weighted
        largest = jnp.maximum(largest, jnp.max(s))
    flag_ref[0] = jnp.logical_not(largest <= math.exp(30.0)).astype(jnp.int32)

    @pl.when(j == pl.num_programs(1) - 1)
    def _():
        lse_ref[...] = jnp.log(jnp.sum(s_ref[...], axis=1, keepdims=True))
        label_out[...] = jnp.sum(label_ref[...], axis=1, keepdims=True)
        expected_out[...] = jnp.sum(weighted_ref[...], axis=1, keepdims=True)


def _tokens_on_lanes_kernel(xt_ref, w_ref, y_ref, lse_ref, label_out, expected_out, r_ref, s_ref, label_ref,
                            weighted_ref, flag_ref, *, block_v: int, rl: bool):
    import jax
    import jax.numpy as jnp
    from jax.experimental import pallas as pl

    j = pl.program_id(1)
    state_refs = (r_ref, s_ref, label_ref, weighted_ref)
    pl.when(j == 0)(functools.partial(_zero_state, state_refs))

    z = jnp.dot(w_ref[...], xt_ref[...], preferred_element_type=jnp.float32)  # [bv, b]
    b = z.shape[1]
    gap = (jnp.broadcast_to(y_ref[...] - j * block_v, (SUBLANES, b))
           - jax.lax.broadcasted_iota(jnp.int32, (SUBLANES, b), 0))
    r, s, label, weighted = (ref[...] for ref in state_refs)
    for g in range(0, block_v, SUBLANES):
        zg = z[g:g + SUBLANES, :]
        e = jnp.exp(zg - r)
        s = s + e
        label = jnp.where(gap == g, zg, label)
        if rl:
            weighted = weighted + e * zg
    s_ref[...], label_ref[...], weighted_ref[...] = s, label, weighted
    flag_ref[0] = jnp.logical_not(jnp.max(s) <= math.exp(30.0)).astype(jnp.int32)

    @pl.when(j == pl.num_programs(1) - 1)
    def _():
        lse_ref[...] = jnp.log(jnp.sum(s_ref[...], axis=0, keepdims=True))
        label_out[...] = jnp.sum(label_ref[...], axis=0, keepdims=True)
        expected_out[...] = jnp.sum(weighted_ref[...], axis=0, keepdims=True)


def _stripped_call(variant: str, n: int, h: int, v: int, args: argparse.Namespace) -> Any:
    """``(fn, operand shapes)`` of a stripped-down variant with ``n`` tokens and ``v`` vocab entries."""
    import jax
    import jax.numpy as jnp
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import tpu as pltpu

    b, bv, rl = args.tokens, args.vocab, args.objective == "rl"
    if variant == "lanes":
        kernel = functools.partial(_lanes_kernel, block_v=bv, rl=rl, row_chunk=args.row_chunk or b,
                                   label_pick=not args.without_label)
        specs = [pl.BlockSpec((b, h), lambda i, j: (i, 0)), pl.BlockSpec((h, bv), lambda i, j: (0, j)),
                 pl.BlockSpec((b, 1), lambda i, j: (i, 0))]
        row, row_shape, state = pl.BlockSpec((b, 1), lambda i, j: (i, 0)), (n, 1), (b, LANES)
        shapes = ((n, h), (h, v), (n, 1))
    else:
        kernel = functools.partial(_tokens_on_lanes_kernel, block_v=bv, rl=rl)
        specs = [pl.BlockSpec((h, b), lambda i, j: (0, i)), pl.BlockSpec((bv, h), lambda i, j: (j, 0)),
                 pl.BlockSpec((1, b), lambda i, j: (0, i))]
        row, row_shape, state = pl.BlockSpec((1, b), lambda i, j: (0, i)), (1, n), (SUBLANES, b)
        shapes = ((h, n), (v, h), (1, n))
    call = pl.pallas_call(
        kernel, grid=(n // b, v // bv), in_specs=specs, out_specs=[row] * 3,
        out_shape=[jax.ShapeDtypeStruct(row_shape, jnp.float32)] * 3,
        scratch_shapes=[pltpu.VMEM(state, jnp.float32)] * 4 + [pltpu.SMEM((1,), jnp.int32)],
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary"),
                                             vmem_limit_bytes=100 * 2**20),
        name="layout_probe")
    dtypes = (jnp.bfloat16, jnp.bfloat16, jnp.int32)
    return call, tuple(zip(shapes, dtypes, strict=True))


def _compile(variant: str, vocab_blocks: int, args: argparse.Namespace, device: Any) -> str:
    """Compile ``variant`` at 2 token blocks by ``vocab_blocks``; returns the kernel's op name."""
    import jax

    from ce_core import StatsSpec
    from ce_pallas_tpu.tooling.schedule.programs import kernel_config, kernel_program

    n, v, sharding = 2 * args.tokens, vocab_blocks * args.vocab, jax.sharding.SingleDeviceSharding(device)
    if variant == "kernel":
        spec = StatsSpec(with_expected=args.objective == "rl", w_layout=args.w_layout)
        cfg = kernel_config("forward", n, args.hidden, v, "bfloat16", "bfloat16", spec, (args.tokens, None, args.vocab))
        fn, operands = kernel_program("forward", cfg, "bfloat16", "bfloat16", sharding)
        jax.jit(fn).lower(*operands).compile()
        return "ce_pallas_tpu_forward"
    fn, shapes = _stripped_call(variant, n, args.hidden, v, args)
    jax.jit(fn).lower(*(jax.ShapeDtypeStruct(s, d, sharding=sharding) for s, d in shapes)).compile()
    return "layout_probe"


def _worker(variant: str, args: argparse.Namespace) -> None:
    """One variant's figures as a JSON line (runs in a process started with the dump flags)."""
    from ce_pallas_tpu.tooling import aot
    from ce_pallas_tpu.tooling.schedule.chips import mxu_cycles
    from ce_pallas_tpu.tooling.schedule.dumps import read_kernel_trace

    profile = Path(os.environ["LAYOUT_PROBE_DIR"])
    cycles: dict[int, float] = {}
    ops: dict[int, collections.Counter[str]] = {}
    with aot.compiling_for(args.target) as device:
        for vocab_blocks in (2, 3):
            shutil.rmtree(profile, ignore_errors=True)
            profile.mkdir(parents=True)
            name = _compile(variant, vocab_blocks, args, device)
            cycles[vocab_blocks] = read_kernel_trace(profile, name).cycles
            ops[vocab_blocks] = count_ops(next(profile.glob(f"{name}*_bundles.txt")))
    registers = args.tokens * args.vocab / (SUBLANES * LANES)
    hp = -(-args.hidden // LANES) * LANES
    print(json.dumps({
        "variant": variant, "cycles": per_step(cycles, 2),
        "mxu": mxu_cycles(args.target, "forward", args.tokens, hp, args.vocab),
        "ops": {op: per_step({k: float(c[op]) for k, c in ops.items()}, 2) / registers for op in SHOWN_OPS},
        "all_ops": {op: per_step({k: float(c[op]) for k, c in ops.items()}, 2) / registers
                    for op in set(ops[2]) | set(ops[3])},
    }))


def _run_variant(variant: str, argv: list[str]) -> dict[str, Any]:
    """Start :func:`_worker` in a fresh process: libtpu reads its flags once per process."""
    from ce_pallas_tpu.tooling.schedule.dumps import libtpu_flags

    with tempfile.TemporaryDirectory() as root:
        profile = Path(root) / "profile"
        env = dict(os.environ, LIBTPU_INIT_ARGS=libtpu_flags(profile), LAYOUT_PROBE_DIR=str(profile),
                   CE_PALLAS_TPU_TILE_CACHE="off")
        done = subprocess.run([sys.executable, __file__, "--worker", variant, *argv], env=env, check=True,
                              capture_output=True, text=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="The streamed forward step against two stripped-down steps "
                                     "(libtpu's static schedule).")
    parser.add_argument("--target", default="v6e", choices=("v5e", "v5p", "v6e", "tpu7x"))
    parser.add_argument("--tokens", type=int, default=1024, help="rows of a step's tile (b)")
    parser.add_argument("--vocab", type=int, default=2048, help="columns of a step's tile (bv)")
    parser.add_argument("--hidden", type=int, default=1024, help="H, whole in every step")
    parser.add_argument("--objective", choices=("loss", "rl"), default="loss")
    parser.add_argument("--row-chunk", type=int, default=None, help="lanes: x's rows per product (default: b)")
    parser.add_argument("--without-label", action="store_true",
                        help="lanes: no label pick (the label logit taken outside the kernel)")
    parser.add_argument("--w-layout", choices=("hv", "vh"), default="hv", help="kernel: the head's layout")
    parser.add_argument("--all-ops", action="store_true", help="also print every op's count per register")
    parser.add_argument("--variants", default=",".join(VARIANTS), help=f"comma-separated, of {', '.join(VARIANTS)}")
    parser.add_argument("--worker", choices=VARIANTS, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    for name in ("tokens", "vocab"):
        if getattr(args, name) % LANES:
            parser.error(f"--{name} must be a multiple of {LANES}, got {getattr(args, name)}")
    if args.row_chunk is not None and (args.row_chunk % SUBLANES or args.tokens % args.row_chunk):
        parser.error(f"--row-chunk must be a multiple of {SUBLANES} that divides --tokens, got {args.row_chunk}")
    unknown = set(args.variants.split(",")) - set(VARIANTS)
    if unknown:
        parser.error(f"--variants: unknown {sorted(unknown)}")
    return args


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    if args.worker:
        _worker(args.worker, args)
        return 0
    print(f"{args.target}, {args.objective}, tiles {args.tokens}/all/{args.vocab}, H={args.hidden}"
          + (f", row chunk {args.row_chunk}" if args.row_chunk else "")
          + (", kernel's head [V, H]" if args.w_layout == "vh" else "")
          + (", lanes without the label pick" if args.without_label else ""))
    print("| variant | cycles/step | MXU min | ratio | " + " | ".join(SHOWN_OPS) + " |")
    print("|---|---:|---:|---:|" + "---:|" * len(SHOWN_OPS))
    for variant in args.variants.split(","):
        row = _run_variant(variant, argv)
        ops = " | ".join(f"{row['ops'][op]:.2f}" for op in SHOWN_OPS)
        if args.all_ops:
            counts = sorted(((c, op) for op, c in row["all_ops"].items() if abs(c) >= 0.01), reverse=True)
            print(f"{variant}, every op per register: " + ", ".join(f"{op} {c:.2f}" for c, op in counts))
        print(f"| {variant} | {row['cycles']:.0f} | {row['mxu']:.0f} | {row['cycles'] / row['mxu']:.3f} | {ops} |",
              flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
