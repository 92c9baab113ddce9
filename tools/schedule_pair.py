"""libtpu's static schedule of pallas_tpu's pair kernels (issue 42's speed goals): a dense teacher's distillation.

    ALLOW_MULTIPLE_LIBTPU_LOAD=1 uv run python tools/schedule_pair.py [--generations v5e,v5p,v6e]
        [--pairs qwen3,gemma2] [--divergences forward_kl,jsd] [--tokens 4096] [--passes stats,gradient] [--walk]

Per generation, head pair and divergence, each kernel is compiled at small grids with the default tiles of the
full problem (bf16 everywhere, each head in its model's layout) and fitted back to the full grid
(``total = a + b*kb + c*kv + d*kb*kv`` for the statistics kernel, linear in the vocab blocks per core for one
gradient call, times the chunks). Printed: the estimated milliseconds of each pass beside its MXU minimum
(forward: ``2N(Hs+Ht)V``; the JSD's two statistics passes twice that; gradient: ``2N(Hs+Ht)V + 4N Hs V``) and
their ratio. Only the kernels are counted: the XLA work between gradient calls (slicing a chunk's rows, summing
the cores' ``dx``) is a few ``[chunk, H]`` passes against ``[chunk, V]``-sized matmuls.

A ``"parallel"`` grid axis is split between v5p's two TensorCores and the profiler walks one of them: the
statistics kernel's token blocks and the gradient kernel's core axis count once per core.
"""

from __future__ import annotations

import argparse
import functools
import os
import shutil
import sys
import tempfile
from pathlib import Path

#: ``(student H, layout, teacher H, layout, V)``: Qwen3-0.6B (tied) taught by Qwen3-8B, Gemma-2 2B by 9B (tied).
PAIRS = {"qwen3": (1024, "vh", 4096, "hv", 151936), "gemma2": (2304, "vh", 3584, "vh", 256000)}


def _small(n: int, v: int, block_b: int, block_v: int, cores: int, kb: int, kv: int) -> tuple[int, int]:
    """``(n, v)`` with ``kb`` token blocks and ``kv`` vocab blocks per core, the last ones as ragged as the full
    problem's (and the last core as many blocks short)."""
    last_rows = n - (-(-n // block_b) - 1) * block_b
    nv = -(-v // block_v)
    last_cols = v - (nv - 1) * block_v
    missing = cores * -(-nv // cores) - nv
    return (kb - 1) * block_b + last_rows, (cores * kv - missing - 1) * block_v + last_cols


#: The gradient kernel's ``[rows, 1]`` operands, in :func:`ce_pallas_tpu.pair.pair_grad_call`'s order.
GRAD_ROWS = ("scale", "live", "lse", "teacher_lse", "divergence", "student_term", "g")


def _stats_program(x, w, u, v, scale, *lses, cfg, mode: str, walk_shares: int | None):
    import jax.numpy as jnp

    from ce_pallas_tpu import common, pair

    # ``walk_shares``: the grid walks the token blocks holding a counted token (every one here), as it does for a
    # call with labels (ce_core then hands the backend which tokens count).
    live = jnp.ones((cfg.n,), bool)
    walk = None
    if walk_shares is not None:
        walk = pair.StatsWalk.of(common.blocks_live(live, cfg.block_b), walk_shares, cfg.nv)
    if mode == "given":
        return pair.pair_stats_call(x, w, u, v, scale, cfg, mode, lse=(lses[0][:, 0], lses[1][:, 0]), walk=walk)
    return pair.pair_stats_call(x, w, u, v, scale, cfg, mode, walk=walk)


def stats_operands(pair: str, n: int, v: int, mode: str, sharding) -> list:
    """The statistics kernel's operands for ``n`` tokens and ``v`` vocabulary entries of a :data:`PAIRS` pair (bf16
    hidden states and heads in their layouts, the float32 row scale, and the given lses for the ``"given"`` pass)."""
    import jax
    import jax.numpy as jnp

    hs, s_layout, ht, t_layout, _ = PAIRS[pair]

    def operand(shape, dtype=jnp.bfloat16):
        return jax.ShapeDtypeStruct(shape, jnp.dtype(dtype), sharding=sharding)

    def head(h: int, layout: str):
        return operand((h, v) if layout == "hv" else (v, h))

    column = operand((n, 1), jnp.float32)
    return [operand((n, hs)), head(hs, s_layout), operand((n, ht)), head(ht, t_layout), column,
            *([column, column] if mode == "given" else [])]


def _grad_program(x, w, u, v, *rest, cfg):
    from ce_pallas_tpu import pair

    return pair.pair_grad_call(x, w, u, v, dict(zip(GRAD_ROWS, rest[:-1], strict=True)), rest[-1], cfg)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--generations", default="v5e,v5p,v6e")
    parser.add_argument("--pairs", default=",".join(PAIRS))
    parser.add_argument("--divergences", default="forward_kl,jsd")
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--blocks", default=None, help="STATS_ROWS,CHUNK_ROWS,VOCAB_COLUMNS instead of the rule's")
    parser.add_argument("--passes", default="stats,gradient")
    parser.add_argument("--walk", action="store_true",
                        help="the statistics kernels walking the live token blocks (a call with labels)")
    args = parser.parse_args(argv)
    profile = Path(tempfile.mkdtemp(prefix="pair_schedule_"))
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    os.environ["JAX_PLATFORMS"] = "cpu"
    from ce_pallas_tpu.tooling.schedule.dumps import libtpu_flags, read_kernel_trace

    os.environ["LIBTPU_INIT_ARGS"] = f"{os.environ.get('LIBTPU_INIT_ARGS', '')} {libtpu_flags(profile)}".strip()
    import dataclasses

    import jax
    import jax.numpy as jnp

    from ce_core.extend import PairSpec
    from ce_pallas_tpu import pair
    from ce_pallas_tpu.target import current_target
    from ce_pallas_tpu.tooling.aot import compiling_for
    from ce_pallas_tpu.tooling.schedule.chips import SCHEDULE_CHIPS
    from ce_pallas_tpu.tooling.schedule.grid_fit import BilinearFit

    def cycles_of(fn, operands, op_name: str) -> int:
        shutil.rmtree(profile, ignore_errors=True)
        profile.mkdir(parents=True)
        try:
            jax.jit(fn).lower(*operands).compile()
        except Exception:  # v5e/v6e may fail a VMEM check after the dumps are written
            pass
        return read_kernel_trace(profile, op_name).cycles

    if args.blocks:
        pair.BLOCKS = tuple(int(part) for part in args.blocks.split(","))
    passes = args.passes.split(",")
    n = args.tokens
    bf16 = jnp.dtype(jnp.bfloat16)
    print("| gen | pair | divergence | pass | tiles | est. ms | MXU minimum ms | ratio |")
    print("|---|---|---|---|---|---:|---:|---:|")
    for generation in args.generations.split(","):
        chip = SCHEDULE_CHIPS[generation]
        with compiling_for(generation) as device:
            sharding = jax.sharding.SingleDeviceSharding(device)
            target = current_target()

            def operand(shape, dtype, sharding=sharding):
                return jax.ShapeDtypeStruct(shape, jnp.dtype(dtype), sharding=sharding)

            def head(h: int, v: int, layout: str):
                return operand((h, v) if layout == "hv" else (v, h), bf16)

            for name in args.pairs.split(","):
                hs, s_layout, ht, t_layout, vocab = PAIRS[name]
                for divergence in args.divergences.split(","):
                    spec = PairSpec(divergence, w_layout=s_layout, teacher_w_layout=t_layout)
                    stats_cfg, grad_cfg = pair.make_configs(n, hs, ht, vocab, (bf16, bf16, bf16, bf16), spec, target)
                    cores = target.num_cores  # the statistics kernel's token axis is "parallel"
                    rows = [(stats_cfg, mode) for mode in (("online",) if divergence != "jsd" else ("lses", "given"))]
                    for cfg, mode in rows if "stats" in passes else []:
                        totals = {}
                        for kb in (2, 3):
                            for kv in (2, 3):
                                sn, sv = _small(n, vocab, cfg.block_b, cfg.block_v, 1, kb * cores, kv)
                                small = dataclasses.replace(cfg, n=sn, v=sv)
                                ops = stats_operands(name, sn, sv, mode, sharding)
                                fn = functools.partial(_stats_program, cfg=small, mode=mode,
                                                       walk_shares=cores if args.walk else None)
                                totals[(kb, kv)] = cycles_of(fn, ops, f"ce_pallas_tpu_pair_stats_{mode}")
                        steps_b = -(-cfg.nb // cores)
                        cycles = BilinearFit.of(totals).total(steps_b, cfg.nv)
                        ms = cycles / chip.clock_hz * 1e3
                        floor = 2 * n * (hs + ht) * vocab / (chip.bf16_flops * cores) * 1e3
                        print(f"| {generation} | {name} | {divergence} | stats {mode} | {cfg.block_b}x{cfg.block_v} | "
                              f"{ms:.3f} | {floor:.3f} | {ms / floor:.3f} |", flush=True)
                    if "gradient" not in passes:
                        continue
                    # The gradient: one call per chunk, grid (cores, vocab blocks per core).
                    chunk, chunks = grad_cfg.block_b, -(-n // grad_cfg.block_b)
                    gcores = grad_cfg.num_cores
                    per_core = -(-grad_cfg.nv // gcores)
                    totals = {}
                    for kv in (2, 3):
                        _, sv = _small(chunk, vocab, chunk, grad_cfg.block_v, gcores, 1, kv)
                        small = dataclasses.replace(grad_cfg, v=sv)
                        column = operand((chunk, 1), jnp.float32)
                        padded = (small.hsp, small.nv * small.block_v)
                        running = operand(padded if s_layout == "hv" else padded[::-1], jnp.float32)
                        ops = [operand((chunk, hs), bf16), head(hs, sv, s_layout), operand((chunk, ht), bf16),
                               head(ht, sv, t_layout), *[column] * len(GRAD_ROWS), running]
                        totals[(1, kv)] = cycles_of(
                            functools.partial(_grad_program, cfg=small), ops, "ce_pallas_tpu_pair_grad")
                    fit = BilinearFit.of(totals)
                    ms = fit.total(1, per_core) * chunks / chip.clock_hz * 1e3
                    floor = (2 * n * (hs + ht) * vocab + 4 * n * hs * vocab) / (chip.bf16_flops * cores) * 1e3
                    print(f"| {generation} | {name} | {divergence} | gradient ({gcores} core{'s' * (gcores > 1)}) | "
                          f"{chunk}x{grad_cfg.block_v} | {ms:.3f} | {floor:.3f} | {ms / floor:.3f} |", flush=True)
    shutil.rmtree(profile, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
