"""Core-grid backward kernel: ``dx`` and ``dw`` of the row statistics, logits recomputed per tile.

With cotangents ``(g_lse, g_label, g_sum, g_expected)`` of the statistics, the logit cotangent is

    delta = (p * (g_lse + g_expected * (1 + z - expected)) + g_label * [col == label] + g_sum) * cap'(z)

with ``p = softmax(z)`` and ``expected = sum_j p_j z_j`` (its terms only when the expected logit is
asked for).

and ``dx = delta @ w.T``, ``dw = x.T @ delta``. Grid ``(cores, vocab blocks per core, token
blocks)``, token blocks innermost:

- leading core axis (``parallel``: Mosaic spreads it over the TensorCores of the device the call is
  compiled for, and loops over it on a one-core device): each core owns a contiguous range of vocab
  blocks, so each ``dw`` column block belongs to exactly one core and no per-core copy of ``dw`` exists;
- for one vocab block the ``[Hp, v]`` ``dw`` tile is accumulated in a float32 VMEM scratch over all
  token blocks and written to HBM once, in the dtype of ``w``;
- ``dx`` needs every vocab block, so each core keeps a float32 partial ``[Np, Hp]`` in HBM: the
  first vocab block of a core writes it, later ones read-add-write it with manual DMAs (the read
  is issued before the tile's matmuls and waited after them; the write of one token block is
  waited while the next one computes). The wrapper sums the (at most two) partials: HBM
  temporaries are ``cores * 4 * N * H`` bytes, no float32 ``dw`` at all.

Ragged edges are masked in the kernel: garbage rows of ``x`` in the last token block, garbage
columns of ``w`` in the last vocab block and garbage past ``H`` in both (blocks span ``Hp``, ``H``
rounded up to 128) are zeroed in their VMEM buffers before they enter a product (``0 * NaN`` would
poison ``dx``/``dw``), and ``delta`` is zeroed outside ``[0, N) x [0, V)``.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from ce_core.extend import vary, varying_axes_of
from ce_pallas_tpu import common


@dataclasses.dataclass(frozen=True)
class BackwardConfig(common.KernelConfig):
    """Static shape and tiling of one backward call; ``block_h`` is the hidden chunk of the dx/dw updates.

    ``w_buffers``: VMEM buffers of the ``w`` and ``dw`` blocks. They change once per vocab block, so
    one buffer each is enough for correctness, but then the next block's ``w`` is fetched (and
    the last ``dw`` written back) while the core waits; two let both overlap the steps around a
    vocab-block change, where VMEM allows.
    """

    w_buffers: int = 1


def _backward_kernel(x_ref, w_ref, y_ref, lse_ref, g_lse_ref, g_label_ref, *rest, cfg: BackwardConfig):
    refs = list(rest)
    g_sum_ref = refs.pop(0) if cfg.with_sum else None
    expected_ref, g_expected_ref = (refs.pop(0), refs.pop(0)) if cfg.with_expected else (None, None)
    dw_ref, dxp_hbm, dw_acc, dx_buf, sems = refs

    core, jj, i = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    block = core * cfg.nv_per_core + jj
    nb, b, vb = cfg.nb, cfg.block_b, cfg.block_v
    chunks = [pl.ds(start, cfg.block_h) for start in range(0, cfg.hp, cfg.block_h)]

    def body():
        rows = pl.ds(pl.multiple_of(i * b, b), b)
        slot = i % 2  # dx rows of this token block: read into, accumulated in and written from here
        read = pltpu.make_async_copy(dxp_hbm.at[core, rows], dx_buf.at[slot], sems.at[0])
        write = pltpu.make_async_copy(dx_buf.at[slot], dxp_hbm.at[core, rows], sems.at[1])
        previous_write = pltpu.make_async_copy(dx_buf.at[1 - slot], dxp_hbm.at[core, pl.ds(0, b)], sems.at[1])

        # The slot's last write (two token blocks ago) was waited for in the previous step.
        @pl.when(jj > 0)
        def _():
            read.start()

        @pl.when(jj == 0)
        def _():
            dx_buf[slot] = jnp.zeros(dx_buf.shape[1:], jnp.float32)

        # Garbage rows of x / columns of w in ragged last blocks are zeroed in their VMEM buffers:
        # they would otherwise meet a zero of delta in a product (0 * NaN = NaN).
        if cfg.n % b:

            @pl.when(i == nb - 1)
            def _():
                row = i * b + jax.lax.broadcasted_iota(jnp.int32, x_ref.shape, 0)
                x_ref[...] = jnp.where(row < cfg.n, x_ref[...], jnp.zeros((), x_ref.dtype))

        if cfg.hidden != cfg.hp:
            common.zero_hidden_tail(x_ref, w_ref, cfg.hidden, cfg.hp)

        if cfg.v % vb:

            @pl.when(block == cfg.nv - 1)
            def _():
                col = block * vb + jax.lax.broadcasted_iota(jnp.int32, w_ref.shape, 1)
                w_ref[...] = jnp.where(col < cfg.v, w_ref[...], jnp.zeros((), w_ref.dtype))

        z, t = common.soft_cap(common.matmul(x_ref[...], w_ref[...], cfg.precision), cfg.logit_soft_cap)
        col = block * vb + jax.lax.broadcasted_iota(jnp.int32, z.shape, 1)
        p = jnp.exp(z - lse_ref[...])
        if expected_ref is None or g_expected_ref is None:
            delta = g_lse_ref[...] * p
        else:
            delta = p * (g_lse_ref[...] + g_expected_ref[...] * (1.0 + z - expected_ref[...]))
        delta = delta + jnp.where(col == y_ref[...], g_label_ref[...], 0.0)
        if g_sum_ref is not None:
            delta = delta + g_sum_ref[...]
        if t is not None:
            delta = delta * (1.0 - t * t)
        valid = None
        if cfg.v % vb:
            valid = col < cfg.v
        if cfg.n % b:
            row_ok = (i * b + jax.lax.broadcasted_iota(jnp.int32, z.shape, 0)) < cfg.n
            valid = row_ok if valid is None else valid & row_ok
        if valid is not None:
            delta = jnp.where(valid, delta, 0.0)
        d = delta.astype(common.mxu_dtype(cfg.precision))

        # dw tile: accumulated over token blocks in VMEM, written once. The accumulator is zeroed
        # first and the product added unconditionally, so the MXU result goes straight into it.
        @pl.when(i == 0)
        def _():
            dw_acc[...] = jnp.zeros(dw_acc.shape, jnp.float32)

        for chunk in chunks:
            dw_acc[chunk, :] += common.matmul_tn(x_ref[:, chunk], d, cfg.precision)

        @pl.when(i == nb - 1)
        def _():
            dw_ref[...] = dw_acc[...].astype(dw_ref.dtype)

        # dx partial of this core: read-add-write in HBM, the product added straight into the slot.
        @pl.when(jj > 0)
        def _():
            read.wait()

        for chunk in chunks:
            dx_buf[slot, :, chunk] += common.matmul_nt(d, w_ref[chunk, :], cfg.precision)

        @pl.when(i > 0)
        def _():
            previous_write.wait()

        write.start()

        @pl.when(i == nb - 1)
        def _():
            write.wait()

    if cfg.nv_per_core * cfg.num_cores != cfg.nv:
        pl.when(block < cfg.nv)(body)
    else:
        body()


def backward_call(
    x: jax.Array,
    w: jax.Array,
    labels: jax.Array,
    lse: jax.Array,
    g_lse: jax.Array,
    g_label: jax.Array,
    g_sum: jax.Array | None,
    expected: jax.Array | None,
    g_expected: jax.Array | None,
    cfg: BackwardConfig,
) -> tuple[jax.Array, jax.Array]:
    """``(dx partials float32 [cores, Np, Hp], dw [H, V] in w's dtype)``.

    ``x`` is ``[N, H]``, ``w`` is ``[H, V]``; ``labels`` (int32), ``lse``, ``expected`` and the
    cotangents are ``[N, 1]`` (``g_sum`` only with ``cfg.with_sum``, ``expected`` and ``g_expected``
    only with ``cfg.with_expected``).
    """
    nvc, nv = cfg.nv_per_core, cfg.nv

    def w_block(c, j, i):
        return (0, jnp.minimum(c * nvc + j, nv - 1))

    def rows(c, j, i):
        return (i, 0)

    # w and dw change once per vocab block (every nb steps); see BackwardConfig.w_buffers.
    # (Interpret mode ignores buffer counts.)
    w_buffers = pl.Buffered(cfg.w_buffers)
    column = pl.BlockSpec((cfg.block_b, 1), rows)
    in_specs = [
        pl.BlockSpec((cfg.block_b, cfg.hp), rows),
        common.block_spec((cfg.hp, cfg.block_v), w_block, w_buffers),
        column,
        column,
        column,
        column,
    ]
    operands = [x, w, labels, lse, g_lse, g_label]
    if cfg.with_sum:
        assert g_sum is not None, "cfg.with_sum needs g_sum"
        in_specs.append(column)
        operands.append(g_sum)
    if cfg.with_expected:
        assert expected is not None and g_expected is not None, "cfg.with_expected needs expected and g_expected"
        in_specs += [column, column]
        operands += [expected, g_expected]
    out_specs = [
        common.block_spec((cfg.hp, cfg.block_v), w_block, w_buffers),
        pl.BlockSpec(memory_space=pl.ANY),
    ]
    axes = varying_axes_of(*operands)
    operands = [vary(value, axes) for value in operands]
    out_shape = [
        common.out_type((cfg.hidden, cfg.v), w.dtype, axes),
        common.out_type((cfg.num_cores, cfg.padded_n, cfg.hp), jnp.float32, axes),
    ]
    scratch = [
        pltpu.VMEM((cfg.hp, cfg.block_v), jnp.float32),  # dw accumulator
        pltpu.VMEM((2, cfg.block_b, cfg.hp), jnp.float32),  # dx partial rows: two slots, read-add-write
        pltpu.SemaphoreType.DMA((2,)),
    ]
    dw, dx_partials = pl.pallas_call(
        functools.partial(_backward_kernel, cfg=cfg),
        grid=(cfg.num_cores, nvc, cfg.nb),
        in_specs=in_specs,
        out_specs=out_specs,
        out_shape=out_shape,
        scratch_shapes=scratch,
        compiler_params=pltpu.CompilerParams(
            # The core axis is "parallel": Mosaic spreads it over the TensorCores of the device the
            # call is compiled for (both on v4/v5p megacore) and loops over it on a one-core device.
            dimension_semantics=("parallel", "arbitrary", "arbitrary"),
            vmem_limit_bytes=cfg.vmem_limit_bytes,
        ),
        interpret=cfg.interpret,
        cost_estimate=pl.CostEstimate(
            flops=6 * cfg.n * cfg.hp * cfg.v,
            transcendentals=cfg.n * cfg.v * (2 if cfg.logit_soft_cap is not None else 1),
            bytes_accessed=w.size * w.dtype.itemsize * 2
            + cfg.nv * (x.size * x.dtype.itemsize + 8 * cfg.padded_n * cfg.hp),
        ),
        name="ce_pallas_tpu_backward",
    )(*operands)
    return dx_partials, dw
