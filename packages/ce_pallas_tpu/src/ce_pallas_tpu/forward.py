"""Streaming forward kernel: per-token lse, label logit, logit sum and expected logit of ``cap(x @ w)``.

Grid ``(cores, token blocks, vocab blocks per core, hidden blocks)``:

- the leading core axis (``parallel``, spread over the device's TensorCores by Mosaic) gives each
  TensorCore a contiguous half of the vocab blocks (one core on v5e/v6e/TPU7x), so even a single
  token block keeps both cores of a v4/v5p busy; each core
  writes its own partial statistics, which the wrapper merges (``logaddexp`` / sum, ``[N]``-sized);
- token blocks are independent (``PARALLEL``); the vocab and hidden axes are reductions
  (``ARBITRARY``), hidden innermost.

A logit tile ``[b, v]`` exists only in VMEM (accumulated over hidden blocks in a VMEM scratch when
the hidden dimension is blocked). An online logsumexp keeps a running max and sum per row in VMEM
scratch across vocab blocks (and, for the entropy, the sum of ``exp(z - max) z``, rescaled with the
sum of exp, whose ratio to it is the expected logit). With the hidden dimension whole (the
default), the vocab loop is software-pipelined: a step forms the logits of its block in one slot of
a two-slot scratch while the vector units take the statistics of the previous block from the other
slot, so the exp/max/sum work overlaps the MXU instead of following it (it costs 0.08-0.13 of a
step otherwise). On TPUs whose MXUs are 256 wide (v6e, TPU7x), which outpace the vector units
more, a step does this in chunks of 256 columns (``ForwardConfig.column_chunk``): left whole,
libtpu's scheduler packs the statistics after the product, where they run alone.

The soft cap is applied in the kernel; the label logit is picked by comparing a column iota with
the label (no ``one_hot``, no gather: both fail to lower on v4); vocab columns past ``V`` in a
ragged last block hold garbage and are masked to ``-inf`` (to 0 in the sum). Rows past ``N`` in a
ragged last token block produce garbage that Pallas never writes back. When ``H`` is not a
multiple of 128 the blocks span its round-up ``Hp`` and the garbage past ``H`` is zeroed in both
operands' VMEM buffers first; nothing is padded in HBM.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from ce_core.varying import vary, varying_axes_of
from ce_pallas_tpu import common
from ce_pallas_tpu.layout import forward_column_chunk


@dataclasses.dataclass(frozen=True)
class ForwardConfig(common.KernelConfig):
    """Static shape and tiling of one forward call; ``h`` is the hidden block (``hp``: unblocked).

    ``mxu_side``: the width of the generation's MXUs, which sets the step's column chunks.
    """

    mxu_side: int = 128

    @property
    def column_chunk(self) -> int | None:
        """With the hidden dimension whole, a step forms its logit tile and takes the statistics of the
        previous one in pieces of this many vocab columns (``None``: in one piece)."""
        return forward_column_chunk(self.mxu_side, self.vb)

    @property
    def column_chunks(self) -> list[int]:
        """The first vocab column of each piece of a step's logit tile."""
        return list(range(0, self.vb, self.column_chunk or self.vb))


def _update(z_raw, start, y, state, cfg: ForwardConfig, *, may_be_last: bool = True):
    """The online statistics ``(max, sum of exp, label logit, logit sum, weighted sum)`` after one tile.

    The logit sum and the weighted sum ``sum_j exp(z_j - max) z_j`` (the expected logit times the
    sum of exp) are ``None`` unless asked for. ``start`` is the global id of the tile's first
    column; columns at or past ``V`` (garbage in a ragged last block) count for nothing, and labels
    outside ``[0, V)`` never hit. Pass ``may_be_last=False`` for a tile that is known not to be the
    ragged last one: it is not masked.
    """
    m, sum_exp, label, total, weighted = state
    z, _ = common.soft_cap(z_raw, cfg.logit_soft_cap)
    local = jax.lax.broadcasted_iota(jnp.int32, z.shape, 1)
    if cfg.v % cfg.vb and may_be_last:
        valid = local < cfg.v - start
        z_lse = jnp.where(valid, z, -jnp.inf)
        z_owned = jnp.where(valid, z, 0.0)
    else:
        valid, z_lse, z_owned = None, z, z
    m_new = jnp.maximum(m, jnp.max(z_lse, axis=1, keepdims=True))
    rescale = jnp.exp(m - m_new)
    exps = jnp.exp(z_lse - m_new)
    sum_exp = sum_exp * rescale + jnp.sum(exps, axis=1, keepdims=True)
    hit = local == y - start
    if valid is not None:
        hit = hit & valid
    label = label + jnp.sum(jnp.where(hit, z, 0.0), axis=1, keepdims=True)
    if total is not None:
        total = total + jnp.sum(z_owned, axis=1, keepdims=True)
    if weighted is not None:
        weighted = weighted * rescale + jnp.sum(exps * z_owned, axis=1, keepdims=True)
    return m_new, sum_exp, label, total, weighted


def _forward_kernel(x_ref, w_ref, y_ref, *refs, cfg: ForwardConfig):
    out_refs, scratch = refs[: cfg.n_stats], refs[cfg.n_stats :]
    lse_ref, label_ref, *optional_out = out_refs
    sum_ref = optional_out.pop(0) if cfg.with_sum else None
    expected_ref = optional_out.pop(0) if cfg.with_expected else None
    m_sc, l_sc, label_sc, *optional_sc = scratch[: cfg.n_stats + 1]
    sum_sc = optional_sc.pop(0) if cfg.with_sum else None
    weighted_sc = optional_sc.pop(0) if cfg.with_expected else None
    stat_refs = (m_sc, l_sc, label_sc, sum_sc, weighted_sc)

    core, j, k = pl.program_id(0), pl.program_id(2), pl.program_id(3)
    block = core * cfg.nv_per_core + j  # global vocab block
    last_step = (j == cfg.nv_per_core - 1) & (k == cfg.nh - 1)
    guarded = cfg.nv_per_core * cfg.num_cores != cfg.nv  # the last core may have a block fewer
    in_range = block < cfg.nv if guarded else True

    def read_state():
        return tuple(None if ref is None else ref[...] for ref in stat_refs)

    def write_state(state):
        for ref, value in zip(stat_refs, state, strict=True):
            if ref is not None:
                ref[...] = value

    def initial_state():
        shape = m_sc.shape
        zeros = jnp.zeros(shape, jnp.float32)
        return (jnp.full(shape, -jnp.inf, jnp.float32), zeros, zeros, None if sum_sc is None else zeros,
                None if weighted_sc is None else zeros)

    if cfg.nh == 1:
        # Software-pipelined over vocab blocks: step j forms the logits of block j in one slot of
        # a two-slot VMEM scratch while the vector units take the statistics of block j-1 from
        # the other, so the exp/max/sum tail overlaps the next matmul instead of following it.
        # The first step of a token block discards what it took from the stale slot; the last
        # step also takes its own block (the one tail per token block that is not hidden).
        z_sc = scratch[-1]
        if cfg.hidden != cfg.hp:
            common.zero_hidden_tail(x_ref, w_ref, cfg.hidden, cfg.hp)

        def step(cur: int, prev: int):
            # Block j-1 is never the ragged last one here: that one is the last of its core, and
            # is taken by the drain below or, on a core one block short, by the branch after it.
            # In column chunks, each chunk's product followed in program order by the statistics of
            # the same columns of block j-1, so libtpu's scheduler interleaves them with the MXU work.
            taken = read_state()
            for first in cfg.column_chunks:
                cols = pl.ds(first, cfg.column_chunk or cfg.vb)
                z_sc[cur, :, cols] = common.matmul(x_ref[...], w_ref[:, cols], cfg.precision)
                taken = _update(z_sc[prev, :, cols], (block - 1) * cfg.vb + first, y_ref[...], taken, cfg,
                                may_be_last=False)
            fresh = initial_state()
            write_state(tuple(None if t is None or f is None else jnp.where(j == 0, f, t)
                              for t, f in zip(taken, fresh, strict=True)))

        pl.when((j % 2 == 0) & in_range)(lambda: step(0, 1))
        pl.when((j % 2 == 1) & in_range)(lambda: step(1, 0))
        if guarded:  # the last step of a core one block short: only the previous block is left

            @pl.when(jnp.logical_not(in_range))
            def _():
                write_state(_update(z_sc[(j + 1) % 2], (block - 1) * cfg.vb, y_ref[...], read_state(), cfg))

        drain = last_step & in_range if guarded else last_step

        @pl.when(drain)
        def _():
            write_state(_update(z_sc[j % 2], block * cfg.vb, y_ref[...], read_state(), cfg))

    else:
        acc_sc = scratch[-1]

        @pl.when((j == 0) & (k == 0))
        def _init():
            write_state(initial_state())

        def accumulate():
            if cfg.hidden != cfg.hp:
                pl.when(k == cfg.nh - 1)(lambda: common.zero_hidden_tail(x_ref, w_ref, cfg.hidden, cfg.hp))
            part = common.matmul(x_ref[...], w_ref[...], cfg.precision)

            @pl.when(k == 0)
            def _():
                acc_sc[...] = part

            @pl.when(k > 0)
            def _():
                acc_sc[...] += part

            @pl.when(k == cfg.nh - 1)
            def _():
                write_state(_update(acc_sc[...], block * cfg.vb, y_ref[...], read_state(), cfg))

        if guarded:
            pl.when(in_range)(accumulate)
        else:
            accumulate()

    @pl.when(last_step)
    def _finish():
        lse_ref[...] = m_sc[...] + jnp.log(l_sc[...])
        label_ref[...] = label_sc[...]
        if sum_ref is not None and sum_sc is not None:
            sum_ref[...] = sum_sc[...]
        if expected_ref is not None and weighted_sc is not None:
            expected_ref[...] = weighted_sc[...] / l_sc[...]


def forward_call(x: jax.Array, w: jax.Array, labels: jax.Array, cfg: ForwardConfig) -> tuple[jax.Array, ...]:
    """Per-core partial statistics, each float32 ``[cores, N, 1]``: ``(lse, label[, sum][, expected])``.

    ``x`` is ``[N, H]``, ``w`` is ``[H, V]``, ``labels`` is int32 ``[N, 1]``.
    """
    nvc, nv = cfg.nv_per_core, cfg.nv

    def w_block(c, i, j, k):
        return (k, jnp.minimum(c * nvc + j, nv - 1))

    # x stays resident across the vocab loop when the hidden axis is not blocked: one buffer is
    # enough (it changes once per token block), which halves its VMEM. (Interpret mode ignores it.)
    x_mode = pl.Buffered(1) if cfg.nh == 1 else None
    in_specs = [
        common.block_spec((cfg.b, cfg.h), lambda c, i, j, k: (i, k), x_mode),
        pl.BlockSpec((cfg.h, cfg.vb), w_block),
        pl.BlockSpec((cfg.b, 1), lambda c, i, j, k: (i, 0)),
    ]
    num_out = cfg.n_stats
    stat_spec = pl.BlockSpec((pl.squeezed, cfg.b, 1), lambda c, i, j, k: (c, i, 0))
    axes = varying_axes_of(x, w, labels)
    x, w, labels = (vary(value, axes) for value in (x, w, labels))
    out_shape = [common.out_type((cfg.num_cores, cfg.n, 1), jnp.float32, axes)] * num_out
    # Running max, running sum of exp, label logit (, logit sum)(, weighted sum) per row.
    scratch = [pltpu.VMEM((cfg.b, 1), jnp.float32)] * (cfg.n_stats + 1)
    if cfg.nh > 1:
        scratch.append(pltpu.VMEM((cfg.b, cfg.vb), jnp.float32))  # logits summed over hidden blocks
    else:
        scratch.append(pltpu.VMEM((2, cfg.b, cfg.vb), jnp.float32))  # two slots of logits
    return pl.pallas_call(
        functools.partial(_forward_kernel, cfg=cfg),
        grid=(cfg.num_cores, cfg.nb, nvc, cfg.nh),
        in_specs=in_specs,
        out_specs=[stat_spec] * num_out,
        out_shape=out_shape,
        scratch_shapes=scratch,
        compiler_params=pltpu.CompilerParams(
            # The core axis is "parallel", not "core_parallel": Mosaic spreads it over the TensorCores
            # of the device the call is compiled for (both on v4/v5p megacore), and a one-core device
            # (a v4 topology without megacore) loops over it instead of refusing to compile.
            dimension_semantics=("parallel", "parallel", "arbitrary", "arbitrary"),
            vmem_limit_bytes=cfg.vmem_limit_bytes,
        ),
        interpret=cfg.interpret,
        cost_estimate=pl.CostEstimate(
            flops=2 * cfg.n * cfg.hp * cfg.v,
            transcendentals=cfg.n * cfg.v * (2 if cfg.logit_soft_cap is not None else 1),
            bytes_accessed=x.size * x.dtype.itemsize + cfg.nb * w.size * w.dtype.itemsize,
        ),
        name="ce_pallas_tpu_forward",
    )(x, w, labels)


def merge_cores(partials: jax.Array, how: str) -> jax.Array:
    """Combine per-core partial statistics ``[cores, N, 1]`` into ``[N]`` (``how``: logsumexp or sum)."""
    if partials.shape[0] == 1:
        return partials[0, :, 0]
    if how == "logsumexp":
        return jax.nn.logsumexp(partials[:, :, 0], axis=0)
    return jnp.sum(partials[:, :, 0], axis=0)


def merge_expected(lse_partials: jax.Array, expected_partials: jax.Array, lse: jax.Array) -> jax.Array:
    """The rows' expected logit from the cores' ``[cores, N, 1]`` partials: each core's weighted by its
    share ``exp(lse_core - lse)`` of the row's probability mass."""
    if expected_partials.shape[0] == 1:
        return expected_partials[0, :, 0]
    share = jnp.exp(lse_partials[:, :, 0] - lse[None, :])
    return jnp.sum(share * expected_partials[:, :, 0], axis=0)
