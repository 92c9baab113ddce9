"""Streaming forward kernel: per-token lse, label logit, logit sum, expected logit and max logit with its
lowest index, of ``s * cap(x @ w)``.

Grid ``(cores, token blocks, vocab blocks per core, hidden blocks)``:

- the leading core axis (``parallel``, spread over the device's TensorCores by Mosaic) gives each
  TensorCore a contiguous half of the vocab blocks (one core on v5e/v6e/TPU7x), so even a single
  token block keeps both cores of a v4/v5p busy; each core
  writes its own partial statistics, which the wrapper merges (``logaddexp`` / sum, ``[N]``-sized);
- token blocks are independent (``PARALLEL``); the vocab and hidden axes are reductions
  (``ARBITRARY``), hidden innermost.

A logit tile ``[block_b, block_v]`` exists only in VMEM. Two kernels, one per way of taking the
hidden dimension. Blocked (:func:`_blocked_kernel`): the tile is accumulated over hidden blocks in a
VMEM scratch and an online logsumexp keeps a running max and sum per row
(:func:`ce_pallas_tpu.tile_stats.row_update`). Whole (the default, :func:`_streamed_kernel`): the
step is *streamed*: the statistics are kept per row and lane (``[b, 128]``, each lane seeing every
128th column) against a reference per lane fixed before the step, the lane's maximum over the
earlier blocks, so the exps of a column chunk need nothing but that chunk's logits. libtpu's
scheduler then interleaves the vector and EUP work with the matmul; an online max instead makes
every exp of a tile wait for the tile's maximum, which the scheduler packs after the product
(0.05-0.15 of a step). A logit more than ``OVERFLOW_MARGIN`` (30 nats) above its lane's reference
shows as a lane sum past ``exp(30)``, and the step is redone exactly (the reference moved to the
maximum first), as are the first block of a row (no reference yet) and a ragged last block. With
logits of order 1 to 10 only the first block of each row is redone. On TPUs with 256-wide MXUs
(v6e, TPU7x) the product is formed in chunks of 256 columns (``ForwardConfig.column_chunk``).
The lanes are reduced to rows once, at the last step.

The soft cap is applied in the kernel; the label logit is picked by comparing a column iota with
the label (no ``one_hot``, no gather: both fail to lower on v4), except in the streamed kernel with a
``[V, H]`` head, which takes no labels: there the wrapper gathers one row of ``w`` per token
(:func:`label_logits`, a row gather XLA runs beside the kernel; ``ForwardConfig.label_in_kernel``
says which, and why a ``[H, V]`` head keeps the pick); vocab columns past ``V`` in a
ragged last block hold garbage and are masked to ``-inf`` (to 0 in the sum). Rows past ``N`` in a
ragged last token block produce garbage that Pallas never writes back. When ``H`` is not a
multiple of 128 the blocks span its round-up ``Hp`` and the garbage past ``H`` is zeroed in both
operands' VMEM buffers first; nothing is padded in HBM.

The head comes as ``w [H, V]`` (``w_layout="hv"``, blocks ``[block_h, block_v]``) or ``w [V, H]``
(``"vh"``, a tied embedding: blocks ``[block_v, block_h]``, the product an NT matmul contracting on H,
so w is never transposed or copied). With ``with_argmax`` each lane also keeps its top logit and the
index of its first occurrence (a strict compare per column); rows take the lowest index among
their lanes at the top, and the wrapper the lowest among the cores at the top (:func:`merge_argmax`).
Garbage columns are ``-inf`` for it, and garbage rows are never written. Its compare and two
selects per logit cost 0.002-0.004 of the static schedule's ratio on v5e/v5p but 0.055 on v6e at
8192x4096x128256, where the step is bound by vector ops (a pairwise tree over column groups cost
the same; a max alone 0.020). With ``with_row_scale``
a float32 column ``s [N, 1]``, blocked like the labels, multiplies the capped logits of each row
before any statistic.

Handed :class:`ce_pallas_tpu.common.LiveBlocks` (contract version 4: the token blocks holding a live
token), the grid walks those blocks first: a dead step keeps the last live step's block indices (the
vocab and hidden axes pinned to their last), so nothing is fetched, and takes no branch; its rows of
the outputs are never written. The token axis is then "arbitrary" (the dead steps revisit a block).
"""

from __future__ import annotations

import dataclasses
import functools
from types import EllipsisType
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from ce_core.extend import vary_like
from ce_pallas_tpu import common, tile_stats
from ce_pallas_tpu.layout import LANES, SUBLANES, cdiv, forward_column_chunk


@dataclasses.dataclass(frozen=True)
class ForwardConfig(common.KernelConfig):
    """Static shape and tiling of one forward call; ``block_h`` is the hidden block (``hp``: unblocked).
    ``mxu_side`` sets the streamed step's column chunks. ``keep_logits``: the call also writes each
    step's raw logits ``x @ w`` (float32, before the cap and the row scale) to an output in blocks of
    the grid's tiles, for the gradient pass of :mod:`ce_pallas_tpu.kept_logits`. ``kept_bf16``: those
    logits go out in bf16 below each lane's maximum over the step's block (:func:`_keep_below_lane_max`)."""

    keep_logits: bool = False
    #: Keep the logits as ``bf16(z - m)``, ``m`` the maximum of the step's columns in each lane (float32
    #: ``[rows, 128]`` a vocab block, a second kept output): half the bytes of float32, and the gradients of
    #: bf16 inputs as accurate (an entry near its row's maximum is near its lane's, so it loses no more
    #: than ``delta``'s own bf16 rounding; docs/notes/2026-12-03-kept-logits-bf16.md). The hidden size whole.
    kept_bf16: bool = False
    #: With :attr:`kept_bf16`, the columns that share a lane maximum (0: the whole block): a multiple of the
    #: column chunk dividing ``block_v``. A group's logits are stored while the later groups' products run,
    #: where the whole block's wait for its last product, for 128 float32 maxima per group and row
    #: (docs/notes/2026-12-04-kept-store-whole-block.md).
    kept_maxima_columns: int = 0

    @property
    def maxima_columns(self) -> int:
        """The columns that share a lane maximum with :attr:`kept_bf16` (:attr:`kept_maxima_columns`)."""
        return self.kept_maxima_columns or self.block_v

    @property
    def label_in_kernel(self) -> bool:
        """Whether the kernel picks each row's label logit. With a ``[V, H]`` head and the hidden
        dimension whole, the wrapper takes it instead (:func:`label_logits`: one row of ``w`` per
        token), and a streamed step saves a compare, a select, and the label state's load and store per
        logit register (v6e, Qwen3-0.6B's RL forward: 1.211 -> 1.065 of the MXU minimum,
        docs/notes/2026-11-27-label-logit-beside-kernel.md). A ``[H, V]`` head's label column would be a
        strided gather, for which XLA copies all of ``w``."""
        return self.w_layout == "hv" or self.nh > 1

    @property
    def n_stats(self) -> int:
        """Statistics per row the kernel gives: lse, the label logit (when :attr:`label_in_kernel`),
        then the logit sum, the expected logit, and the max logit with its index, if asked."""
        return 1 + self.label_in_kernel + self.with_sum + self.with_expected + 2 * self.with_argmax

    @property
    def column_chunk(self) -> int | None:
        """With the hidden dimension whole, a step forms its logit tile and takes its statistics in
        pieces of this many vocab columns (``None``: in one piece)."""
        return forward_column_chunk(self.mxu_side, self.block_v)

    @property
    def column_chunks(self) -> list[int]:
        """The first vocab column of each piece of a step's logit tile."""
        return list(range(0, self.block_v, self.column_chunk or self.block_v))


def _split_kept(refs, cfg: ForwardConfig):
    """The kept-logits outputs' refs ``(logits, lane maxima)`` (the outputs after the statistics; None
    without them) and the other refs."""
    if not cfg.keep_logits:
        return (None, None), refs
    kept = 1 + cfg.kept_bf16
    z_ref, m_ref = refs[cfg.n_stats], refs[cfg.n_stats + 1] if cfg.kept_bf16 else None
    return (z_ref, m_ref), (*refs[: cfg.n_stats], *refs[cfg.n_stats + kept :])


def _keep(z_ref, logits: jax.Array, first: int) -> jax.Array:
    """The raw logits of columns ``first...`` of the step's tile into the kept-logits block; returns them."""
    if z_ref is not None:
        z_ref[:, pl.ds(first, logits.shape[1])] = logits
    return logits


def _step_chunks(x_ref, w_ref, kept_refs, block_start, cfg: ForwardConfig, ragged: bool):
    """``(first column, raw logits)`` of the step's column chunks: each formed and kept (where the logits are)
    as it is asked for, so that its statistics are taken before the next chunk's product; with
    :attr:`ForwardConfig.kept_bf16` a lane-maxima group's chunks at a time (:func:`_keep_below_lane_max`)."""
    z_ref, m_ref = kept_refs
    if m_ref is not None:
        for group in range(0, cfg.block_v, cfg.maxima_columns):
            firsts = [first for first in cfg.column_chunks if group <= first < group + cfg.maxima_columns]
            yield from zip(firsts, _keep_below_lane_max(x_ref, w_ref, kept_refs, block_start, group, firsts, cfg,
                                                        ragged), strict=True)
        return
    for first in cfg.column_chunks:
        yield first, _keep(z_ref, _chunk(x_ref, w_ref, first, cfg), first)


def _keep_below_lane_max(x_ref, w_ref, kept_refs, block_start, group: int, firsts: list[int], cfg: ForwardConfig,
                         ragged: bool) -> list[jax.Array]:
    """The raw logits (float32) of the column chunks at ``firsts``, the lane-maxima group of the step's
    columns that starts at ``group``, all formed first: ``m``, each lane's maximum over them (``[b, 128]``,
    an elementwise max of their 128-wide column groups, no cross-lane work), goes into the lane maxima's
    block and ``bf16(z - m)`` into the kept block. Columns past ``V`` (``ragged``: the step may hold some)
    take no part in ``m``; a lane with none before ``V`` takes ``m = 0``."""
    z_ref, m_ref = kept_refs
    chunks = [_chunk(x_ref, w_ref, first, cfg) for first in firsts]
    lanes = [(first + g, chunk[:, g:g + LANES]) for first, chunk in zip(firsts, chunks, strict=True)
             for g in range(0, chunk.shape[1], LANES)]
    if ragged:
        lane = jax.lax.broadcasted_iota(jnp.int32, (cfg.block_b, LANES), 1)
        counted = [jnp.where(lane < cfg.v - block_start - start, zg, -jnp.inf) for start, zg in lanes]
        m = functools.reduce(jnp.maximum, counted)
        m = jnp.where(m == -jnp.inf, 0.0, m)
    else:
        m = functools.reduce(jnp.maximum, [zg for _, zg in lanes])
    # The group's logits in one store: stored a 128-column group at a time, Mosaic packs each float32
    # register into a bf16 one of its own and stores it half empty (twice the packs and stores; v6e's
    # forward at H 896: 1.213 -> 1.172 of its MXU minimum, docs/notes/2026-12-04-kept-store-whole-block.md).
    z_ref[:, pl.ds(group, cfg.maxima_columns)] = jnp.concatenate([(zg - m).astype(z_ref.dtype) for _, zg in lanes],
                                                                 axis=1)
    m_ref[:, pl.ds(group // cfg.maxima_columns * LANES, LANES)] = m
    return chunks


def _split_refs(refs, cfg: ForwardConfig):
    """The kernel's output refs ``(lse, label, sum, expected, max, argmax)`` and statistic scratch refs
    ``(max or reference, sum of exp, label, logit sum, weighted sum, top, top index)``, absent ones
    None, and the other scratch."""
    out_refs, scratch = list(refs[: cfg.n_stats]), list(refs[cfg.n_stats :])
    stat_refs = scratch[: cfg.n_stats + 1]

    def take(refs_left: list, present: bool):
        return refs_left.pop(0) if present else None

    outs = (out_refs.pop(0), take(out_refs, cfg.label_in_kernel), take(out_refs, cfg.with_sum),
            take(out_refs, cfg.with_expected), take(out_refs, cfg.with_argmax), take(out_refs, cfg.with_argmax))
    stats = (stat_refs.pop(0), stat_refs.pop(0), take(stat_refs, cfg.label_in_kernel), take(stat_refs, cfg.with_sum),
             take(stat_refs, cfg.with_expected), take(stat_refs, cfg.with_argmax), take(stat_refs, cfg.with_argmax))
    return outs, stats, scratch[cfg.n_stats + 1 :]


class _Step(NamedTuple):
    """Where a grid step is: token block ``i``, vocab block ``j`` of its core, hidden block ``k``; ``live``:
    whether the step has work (False on the dead steps of a grid walking :class:`common.LiveBlocks`)."""

    i: jax.Array
    j: jax.Array
    k: jax.Array
    block: jax.Array  # the global vocab block
    last_step: jax.Array  # the core's last step for this token block
    guarded: bool  # the last core may have a block fewer than the others
    in_range: jax.Array | bool  # the step has a vocab block (always, unless guarded)
    live: jax.Array | bool  # the step's token block holds a live token (always, without prefetch)


def _grid_step(cfg: ForwardConfig, prefetch) -> _Step:
    core, j, k = pl.program_id(0), pl.program_id(2), pl.program_id(3)
    i, live = common.step_block(pl.program_id(1), prefetch)
    block = core * cfg.nv_per_core + j
    last_step = (j == cfg.nv_per_core - 1) & (k == cfg.nh - 1)
    guarded = cfg.nv_per_core * cfg.num_cores != cfg.nv
    in_range = block < cfg.nv if guarded else True
    return _Step(i, j, k, block, last_step, guarded, in_range, live)


def _slot(ref, at: EllipsisType | jax.Array) -> EllipsisType | jax.Array:
    """The index of slot ``at`` of a statistic's ref: the whole ref where it has no slots (the blocked
    kernel's statistics, the streamed kernel's reference)."""
    return ... if ref.ndim == 2 else at


def _read_state(stat_refs, at: EllipsisType | jax.Array = ...) -> tile_stats.State:
    r, sum_exp, label, total, weighted, top, top_index = (None if ref is None else ref[_slot(ref, at)]
                                                          for ref in stat_refs)
    assert r is not None and sum_exp is not None
    return r, sum_exp, label, total, weighted, top, top_index


def _write_state(stat_refs, state: tile_stats.State, at: EllipsisType | jax.Array = ..., *,
                 reference: bool = True) -> None:
    """The statistics into their refs (slot ``at``); ``reference=False`` leaves the reference's ref as it is."""
    for index, (ref, value) in enumerate(zip(stat_refs, state, strict=True)):
        if ref is not None and value is not None and (reference or index > 0):
            ref[_slot(ref, at)] = value


def _initial_state(stat_refs) -> tile_stats.State:
    shape = stat_refs[0].shape[-2:]
    zeros = jnp.zeros(shape, jnp.float32)
    lowest = jnp.full(shape, -jnp.inf, jnp.float32)
    argmax = stat_refs[6] is not None
    label, total, weighted = (None if ref is None else zeros for ref in stat_refs[2:5])
    return (lowest, zeros, label, total, weighted,
            lowest if argmax else None, jnp.zeros(shape, jnp.int32) if argmax else None)


def _write_outputs(outs, rows: tile_stats.State) -> None:
    """The per-row statistics as the kernel's outputs: lse, label logit, logit sum, expected logit, max
    logit and its index."""
    lse_ref, label_ref, sum_ref, expected_ref, max_ref, argmax_ref = outs
    m, sum_exp, label, total, weighted, top, top_index = rows
    lse_ref[...] = m + jnp.log(sum_exp)
    if label_ref is not None and label is not None:
        label_ref[...] = label
    if sum_ref is not None and total is not None:
        sum_ref[...] = total
    if expected_ref is not None and weighted is not None:
        expected_ref[...] = weighted / sum_exp
    if max_ref is not None and argmax_ref is not None and top is not None and top_index is not None:
        max_ref[...] = top
        argmax_ref[...] = top_index


# ---------------------------------------------------------------------------------------------
# The streamed kernel: the hidden dimension whole (the default).


def _zero_hidden_tail(x_ref, w_ref, cfg: ForwardConfig) -> None:
    """The garbage past ``H`` zeroed in both blocks; a ``[V, H]`` block has it in its last columns, as x."""
    if cfg.w_layout == "vh":
        common.zero_hidden_tail(x_ref, None, cfg.hidden, cfg.hp)
        common.zero_hidden_tail(w_ref, None, cfg.hidden, cfg.hp)
    else:
        common.zero_hidden_tail(x_ref, w_ref, cfg.hidden, cfg.hp)


def _split_row_scale(refs, cfg: ForwardConfig):
    """The row scale's ref (None without one) and the kernel's remaining refs."""
    return (refs[0], refs[1:]) if cfg.with_row_scale else (None, refs)


def _split_labels(refs, cfg: ForwardConfig):
    """The labels' ref (None when the wrapper takes the label logit) and the kernel's remaining refs."""
    return (refs[0], refs[1:]) if cfg.label_in_kernel else (None, refs)


def _streamed_kernel(x_ref, w_ref, *refs, cfg: ForwardConfig, prefetch=None):
    """Per-lane statistics (see the module docs), in two slots, so that a step reads the previous
    step's and writes its own before its overflow check is known, and a redo still finds the state
    from before the step; the reference has one, since only an exact step moves it."""
    y_ref, refs = _split_labels(refs, cfg)
    s_ref, refs = _split_row_scale(refs, cfg)
    kept_refs, refs = _split_kept(refs, cfg)
    outs, stat_refs, (redo_ref,) = _split_refs(refs, cfg)
    step = _grid_step(cfg, prefetch)
    if cfg.hidden != cfg.hp:
        _zero_hidden_tail(x_ref, w_ref, cfg)
    block_start = step.block * cfg.block_v

    # The labels are read here, before the branches: read first inside them, libtpu's TPU7x profiler
    # aborts on the program ("No DMA issue node found for sync flag"), as if the block's DMA wait had
    # moved into a branch that a step may skip or take twice. Their gap is built in each branch
    # (:func:`_label_gap`).
    labels = None if y_ref is None else y_ref[...]
    previous, current = (step.j + 1) % 2, step.j % 2

    # Taken exactly: the first block of a row (no reference yet) and a ragged last block.
    exact = step.j == 0
    if cfg.v % cfg.block_v:
        exact = exact | (step.block == cfg.nv - 1)
    # A dead step (no live token in its block) takes neither branch and writes nothing.
    redo_ref[0] = common.both(exact, step.live).astype(jnp.int32)

    if cfg.block_v % LANES == 0:  # else the block is the row's only one (block_v == V), always taken exactly
        pl.when(common.both(step.in_range & jnp.logical_not(exact), step.live))(
            lambda: _streamed_step(x_ref, w_ref, s_ref, kept_refs, labels, block_start, stat_refs, redo_ref, step.i,
                                   previous, current, cfg))
    pl.when(step.in_range & (redo_ref[0] != 0))(
        lambda: _exact_step(x_ref, w_ref, labels, s_ref, kept_refs, block_start, stat_refs, step.j, previous,
                            current, cfg))
    pl.when(common.both(step.last_step, step.live))(lambda: _finish_streamed(outs, stat_refs, step, previous, current))


def _product(x_ref, w_ref, first: int, width: int, cfg: ForwardConfig) -> jax.Array:
    """The raw logits of the ``width`` vocab columns of the block that start at column ``first``."""
    if cfg.w_layout == "vh":  # vocab entries are the block's rows: contract both operands on H
        return common.matmul_nt(x_ref[...], w_ref[pl.ds(first, width), :], cfg.precision)
    return common.matmul(x_ref[...], w_ref[:, pl.ds(first, width)], cfg.precision)


def _chunk(x_ref, w_ref, first: int, cfg: ForwardConfig) -> jax.Array:
    """The raw logits of the streamed step's column chunk that starts at column ``first``."""
    return _product(x_ref, w_ref, first, cfg.column_chunk or cfg.block_v, cfg)


def _row_scale(s_ref) -> jax.Array | None:
    return None if s_ref is None else s_ref[...]


def _label_gap(labels: jax.Array | None, block_start, cfg: ForwardConfig) -> jax.Array | None:
    """``label - block_start - lane``, ``[b, 128]``: where each row's label falls in a column group.

    Built inside each step's branch, not before the branches: a branch is its own basic block, and
    only there can libtpu's scheduler overlap these per-row broadcasts with the step's matmul (v6e,
    1024/all/2048: 3.7% of a step when they came first, docs/notes/2026-11-27-label-gap.md). None without
    labels.
    """
    if labels is None:
        return None
    return (jnp.broadcast_to(labels - block_start, (cfg.block_b, LANES))
            - jax.lax.broadcasted_iota(jnp.int32, (cfg.block_b, LANES), 1))


def _streamed_step(x_ref, w_ref, s_ref, kept_refs, labels, block_start, stat_refs, redo_ref, i, previous, current,
                   cfg: ForwardConfig) -> None:
    """The block's exps against each lane's reference as it stands; asks for a redo on overflow."""
    state = _read_state(stat_refs, previous)
    scale = _row_scale(s_ref)
    gap = _label_gap(labels, block_start, cfg)
    for first, chunk in _step_chunks(x_ref, w_ref, kept_refs, block_start, cfg, ragged=False):
        state = tile_stats.streamed_lane_update(chunk, gap, state, cfg, first, block_start + first, scale)
    # The reference has one slot: a streamed step leaves it as it is, so it is not written back.
    _write_state(stat_refs, state, current, reference=False)
    # The garbage rows of a ragged token block are left out, so they never force a redo.
    sums = state[1]
    if cfg.n % cfg.block_b:
        sums = jnp.where(jax.lax.broadcasted_iota(jnp.int32, sums.shape, 0) < cfg.n - i * cfg.block_b, sums, 0.0)
    redo_ref[0] = tile_stats.overflowed(sums, interpreted=bool(cfg.interpret)).astype(jnp.int32)


def _exact_step(x_ref, w_ref, labels, s_ref, kept_refs, block_start, stat_refs, j, previous, current,
                cfg: ForwardConfig) -> None:
    """The block taken exactly: each lane's reference moved up to its maximum first."""
    fresh = _initial_state(stat_refs)
    state = fresh if cfg.nv_per_core == 1 else tile_stats.select(j == 0, fresh, _read_state(stat_refs, previous))
    scale = _row_scale(s_ref)
    gap = _label_gap(labels, block_start, cfg)
    for first, chunk in _step_chunks(x_ref, w_ref, kept_refs, block_start, cfg, ragged=cfg.v % cfg.block_v != 0):
        state = tile_stats.exact_lane_update(chunk, block_start + first, labels, gap, state, cfg, first, scale)
    _write_state(stat_refs, state, current)


def _finish_streamed(outs, stat_refs, step: _Step, previous, current) -> None:
    """The lanes reduced to rows, as the outputs."""
    # A core one block short took nothing at its last step: its state is a step older.
    slot = jnp.where(step.in_range, current, previous) if step.guarded else current
    _write_outputs(outs, tile_stats.lanes_to_rows(_read_state(stat_refs, slot)))


# ---------------------------------------------------------------------------------------------
# The blocked kernel: the hidden dimension in blocks.


def _blocked_kernel(x_ref, w_ref, y_ref, *refs, cfg: ForwardConfig, prefetch=None):
    """The logit tile summed over hidden blocks in a VMEM scratch, then per-row online statistics."""
    s_ref, refs = _split_row_scale(refs, cfg)
    (z_ref, _), refs = _split_kept(refs, cfg)
    outs, stat_refs, (acc_ref,) = _split_refs(refs, cfg)
    step = _grid_step(cfg, prefetch)
    pl.when((step.j == 0) & (step.k == 0))(lambda: _write_state(stat_refs, _initial_state(stat_refs)))

    def accumulate():
        _accumulate_hidden_block(x_ref, w_ref, y_ref, s_ref, z_ref, acc_ref, stat_refs, step, cfg)

    if step.guarded or step.live is not True:
        pl.when(common.both(step.in_range, step.live))(accumulate)
    else:
        accumulate()
    pl.when(common.both(step.last_step, step.live))(lambda: _write_outputs(outs, _read_state(stat_refs)))


def _accumulate_hidden_block(x_ref, w_ref, y_ref, s_ref, z_ref, acc_ref, stat_refs, step: _Step,
                             cfg: ForwardConfig) -> None:
    """This hidden block's part of the logit tile; after the last one, the tile's row statistics."""
    k = step.k
    if cfg.hidden != cfg.hp:
        pl.when(k == cfg.nh - 1)(lambda: _zero_hidden_tail(x_ref, w_ref, cfg))
    part = _product(x_ref, w_ref, 0, cfg.block_v, cfg)

    @pl.when(k == 0)
    def _():
        acc_ref[...] = part

    @pl.when(k > 0)
    def _():
        acc_ref[...] += part

    @pl.when(k == cfg.nh - 1)
    def _():
        rows = tile_stats.row_update(_keep(z_ref, acc_ref[...], 0), step.block * cfg.block_v, y_ref[...],
                                     _read_state(stat_refs), cfg, _row_scale(s_ref))
        _write_state(stat_refs, rows)


def forward_call(x: jax.Array, w: jax.Array, labels: jax.Array, cfg: ForwardConfig,
                 row_scale: jax.Array | None = None,
                 kept_shape: tuple[int, int] | None = None,
                 live_blocks: common.LiveBlocks | None = None,
                 logits_into: jax.Array | None = None) -> tuple[jax.Array, ...]:
    """Per-core partial statistics, each ``[cores, N, 1]``: ``(lse[, label][, sum][, expected][, max,
    argmax])``, float32 but argmax int32; the label logit when ``cfg.label_in_kernel`` (else
    :func:`label_logits` gives it). With ``cfg.keep_logits`` an output follows: the raw logits,
    float32 ``kept_shape``, at least ``[padded N, cores * vocab blocks per core * block_v]``, step
    ``(i, block)`` writing block ``(i, block)`` (a core a block short writes its last step's into
    the block past ``V``'s, never read); rows past ``N`` and columns past ``V`` hold garbage.

    ``x`` is ``[N, H]``, ``w`` is ``[H, V]`` (``cfg.w_layout == "hv"``) or ``[V, H]`` (``"vh"``),
    ``labels`` is int32 ``[N, 1]``, ``row_scale`` float32 ``[N, 1]`` exactly when ``cfg.with_row_scale``.

    With ``live_blocks`` (of ``cfg.block_b``-row blocks) the grid walks the live token blocks only: a dead
    block is never read, and its rows of every output are never written (garbage, for the caller to mask).

    With ``cfg.kept_bf16`` the kept logits are bf16 below their lane maxima, which follow as the very last
    output (float32 :func:`kept_maxima_shape`; column ``c`` of the logits is ``bf16 value + maxima[row, (c //
    block_v) * 128 + c % 128]``).

    ``logits_into`` (``kept_shape``, in the kept logits' dtype, with ``cfg.keep_logits``) is donated: the kept
    logits are written into it in place, so a chunk loop carries one logits buffer (blocks the grid does not
    write keep what they held).
    """
    nvc, nv = cfg.nv_per_core, cfg.nv
    if cfg.with_row_scale != (row_scale is not None):
        raise ValueError("forward_call: row_scale must be given exactly when cfg.with_row_scale")
    skipping = live_blocks is not None

    def w_block(c, i, j, k):
        block = jnp.minimum(c * nvc + j, nv - 1)
        return (block, k) if cfg.w_layout == "vh" else (k, block)

    # x stays resident across the vocab loop when the hidden axis is not blocked: one buffer is
    # enough (it changes once per token block), which halves its VMEM. (Interpret mode ignores it.)
    x_mode = pl.Buffered(1) if cfg.nh == 1 else None
    in_specs = [
        common.block_spec((cfg.block_b, cfg.block_h), lambda c, i, j, k: (i, k), x_mode),
        pl.BlockSpec((cfg.block_v, cfg.block_h) if cfg.w_layout == "vh" else (cfg.block_h, cfg.block_v), w_block),
    ]
    inputs = [x, w]
    if cfg.label_in_kernel:
        in_specs.append(pl.BlockSpec((cfg.block_b, 1), lambda c, i, j, k: (i, 0)))
        inputs.append(labels)
    if row_scale is not None:
        in_specs.append(pl.BlockSpec((cfg.block_b, 1), lambda c, i, j, k: (i, 0)))
        inputs.append(row_scale)
    num_out = cfg.n_stats
    stat_spec = pl.BlockSpec((pl.squeezed, cfg.block_b, 1), lambda c, i, j, k: (c, i, 0))
    aliases, kernel_inputs = {}, len(in_specs)
    kept_dtype = jnp.bfloat16 if cfg.kept_bf16 else jnp.float32
    if cfg.kept_bf16 and not (cfg.keep_logits and cfg.nh == 1 and cfg.block_v % LANES == 0):
        raise ValueError("forward_call: kept_bf16 needs keep_logits, the hidden size whole and block_v a multiple "
                         f"of {LANES}")
    chunk = cfg.column_chunk or cfg.block_v
    if cfg.kept_bf16 and (cfg.block_v % cfg.maxima_columns or cfg.maxima_columns % chunk):
        raise ValueError(f"forward_call: kept_maxima_columns={cfg.kept_maxima_columns} must divide block_v="
                         f"{cfg.block_v} and be a multiple of the column chunk ({chunk})")
    if logits_into is not None:
        if not cfg.keep_logits or logits_into.shape != kept_shape or logits_into.dtype != kept_dtype:
            raise ValueError(f"forward_call: logits_into must be {jnp.dtype(kept_dtype).name} {kept_shape} with "
                             f"cfg.keep_logits, got {logits_into.dtype} {logits_into.shape}")
        in_specs.append(pl.BlockSpec(memory_space=pl.ANY))  # never read: only its buffer is reused
        inputs.append(logits_into)
    if live_blocks is not None:
        inputs = [*live_blocks, *inputs]
    if logits_into is not None:
        aliases = {len(inputs) - 1: num_out}  # the kept logits, the output after the statistics
    axes, inputs = common.per_device_operands(inputs, cfg.interpret)
    # The last statistic is the argmax, the only integer one.
    out_dtypes = [jnp.float32] * (num_out - 1) + [jnp.int32 if cfg.with_argmax else jnp.float32]
    out_shape = [common.out_type((cfg.num_cores, cfg.n, 1), dtype, axes) for dtype in out_dtypes]
    out_specs = [stat_spec] * num_out
    if cfg.keep_logits:
        if kept_shape is None or kept_shape[0] < cfg.padded_n or kept_shape[1] < cfg.num_cores * nvc * cfg.block_v:
            raise ValueError(f"forward_call: kept_shape {kept_shape} does not hold the grid's logit blocks")
        out_specs.append(pl.BlockSpec((cfg.block_b, cfg.block_v), lambda c, i, j, k: (i, c * nvc + j)))
        out_shape.append(common.out_type(kept_shape, kept_dtype, axes))
        if cfg.kept_bf16:  # the lane maxima: 128 a row and lane-maxima group
            out_specs.append(pl.BlockSpec((cfg.block_b, cfg.block_v // cfg.maxima_columns * LANES),
                                          lambda c, i, j, k: (i, c * nvc + j)))
            out_shape.append(common.out_type(kept_maxima_shape(kept_shape, cfg.maxima_columns), jnp.float32, axes))
    # Running max (streamed: reference), sum of exp (, label logit)(, logit sum)(, weighted sum)(, top
    # logit, its index), per row, or per row and lane when streamed.
    stat_dtypes = [jnp.float32] * cfg.n_stats + [jnp.int32 if cfg.with_argmax else jnp.float32]
    if cfg.nh > 1:
        scratch = [pltpu.VMEM((cfg.block_b, 1), dtype) for dtype in stat_dtypes]
        scratch.append(pltpu.VMEM((cfg.block_b, cfg.block_v), jnp.float32))  # logits summed over hidden blocks
    else:
        # Two slots each (the step's input and its output, so that a redo finds the input), but one for
        # the reference, which only an exact step moves (and it reads it before writing it).
        scratch = [pltpu.VMEM((cfg.block_b, LANES) if index == 0 else (2, cfg.block_b, LANES), dtype)
                   for index, dtype in enumerate(stat_dtypes)]
        scratch.append(pltpu.SMEM((1,), jnp.int32))  # whether this step is taken exactly
    kernel = functools.partial(_blocked_kernel if cfg.nh > 1 else _streamed_kernel, cfg=cfg)
    if logits_into is not None:
        kernel = common.without_ref(kernel, kernel_inputs)
    return pl.pallas_call(
        common.with_prefetch(kernel, skipping),
        # A dead step keeps the last live step's vocab and hidden blocks too.
        **common.grid_arguments((cfg.num_cores, cfg.nb, nvc, cfg.nh), in_specs, out_specs, scratch, skipping,
                                token_axis=1, pinned={2: nvc - 1, 3: cfg.nh - 1}),
        out_shape=out_shape,
        input_output_aliases=aliases,
        compiler_params=pltpu.CompilerParams(
            # The core axis is "parallel", not "core_parallel": Mosaic spreads it over the TensorCores
            # of the device the call is compiled for (both on v4/v5p megacore), and a one-core device
            # (a v4 topology without megacore) loops over it instead of refusing to compile. Walking the
            # live token blocks, the token axis is "arbitrary": its dead steps revisit the last live
            # block's outputs, which needs the steps in order.
            dimension_semantics=("parallel", "arbitrary" if skipping else "parallel", "arbitrary", "arbitrary"),
            vmem_limit_bytes=cfg.vmem_limit_bytes,
        ),
        interpret=cfg.interpret,
        cost_estimate=pl.CostEstimate(
            flops=2 * cfg.n * cfg.hp * cfg.v,
            transcendentals=cfg.n * cfg.v * (2 if cfg.logit_soft_cap is not None else 1),
            bytes_accessed=x.size * x.dtype.itemsize + cfg.nb * w.size * w.dtype.itemsize,
        ),
        name="ce_pallas_tpu_forward",
    )(*inputs)


def kept_maxima_shape(kept_shape: tuple[int, int], maxima_columns: int) -> tuple[int, int]:
    """The lane maxima of bf16 kept logits (:attr:`ForwardConfig.kept_bf16`): 128 per row and lane-maxima group
    of ``maxima_columns`` columns (:attr:`ForwardConfig.maxima_columns`; a last group in part past the buffer's
    columns included)."""
    return kept_shape[0], cdiv(kept_shape[1], maxima_columns) * LANES


#: The most bytes of gathered ``w`` rows :func:`label_logits` holds at once: it takes the tokens in
#: chunks of at most this many bytes of rows, so a tied head's temporaries stay those of an untied one
#: (within 8 MiB; ``test_pallas_tied_memory.py``).
LABEL_ROWS_BYTES = 4 * 2**20
#: A ``[V, H]`` head of at most ``LABEL_STAGED_BYTES`` is gathered by :func:`label_logits` from column slices of at
#: most ``LABEL_COLUMNS_BYTES`` each (XLA may stage a small gather operand whole in scoped VMEM).
LABEL_STAGED_BYTES = 64 * 2**20
LABEL_COLUMNS_BYTES = 8 * 2**20


def label_logits(x: jax.Array, w: jax.Array, labels: jax.Array, cfg: ForwardConfig,
                 row_scale: jax.Array | None = None) -> jax.Array:
    """The rows' label logits ``[N]``, ``s * cap(x_n . w[y_n])`` from a ``[V, H]`` head (one row of ``w``
    per token), 0 where a label is outside ``[0, V)``: what the kernel gives when not
    ``cfg.label_in_kernel``. The operands are rounded to the products' dtype as the kernel's MXU takes
    them, and the products summed in float32. The tokens go in chunks of :data:`LABEL_ROWS_BYTES` of
    rows (the last one moved back to end at ``N``, overlapping the one before)."""
    if cfg.w_layout != "vh":
        raise ValueError(f"label_logits: takes a [V, H] head, got w_layout={cfg.w_layout!r}")
    n = x.shape[0]
    y = labels.reshape(-1, 1)
    scale = None if row_scale is None else row_scale.reshape(-1, 1)
    row_bytes = w.shape[1] * w.dtype.itemsize
    chunk = max(SUBLANES, LABEL_ROWS_BYTES // row_bytes // SUBLANES * SUBLANES)
    if chunk >= n:
        return _label_logits_of(x, w, y, scale, cfg)

    def body(index, out):
        start = jnp.minimum(index * chunk, n - chunk)

        def part(a: jax.Array) -> jax.Array:
            return jax.lax.dynamic_slice_in_dim(a, start, chunk)

        logits = _label_logits_of(part(x), w, part(y), None if scale is None else part(scale), cfg)
        return jax.lax.dynamic_update_slice(out, logits, (start,))

    # Inside a shard_map the carry varies over the manual axes that the operands vary over.
    initial = vary_like(jnp.zeros((n,), jnp.float32), x, w, y, scale)
    return jax.lax.fori_loop(0, pl.cdiv(n, chunk), body, initial)


def _label_logits_of(x: jax.Array, w: jax.Array, y: jax.Array, scale: jax.Array | None,
                     cfg: ForwardConfig) -> jax.Array:
    """:func:`label_logits` of one chunk of tokens (``y`` and ``scale`` ``[n, 1]`` columns, ``scale``
    None: 1)."""
    hit = (y >= 0) & (y < cfg.v)
    ids = jnp.where(hit, y, 0)[:, 0]
    bf16 = common.mxu_dtype(cfg.precision) == jnp.bfloat16

    def operand(a: jax.Array) -> jax.Array:
        # reduce_precision, not a cast there and back, which XLA may drop (excess precision allowed)
        a = a.astype(jnp.float32)
        return jax.lax.reduce_precision(a, exponent_bits=8, mantissa_bits=7) if bf16 else a

    # TPU's XLA may stage a small gather operand whole in scoped VMEM: a [V, H] head just short of its 32 MiB
    # limit then did not compile (v6e, 1898 x 4328 bf16: 35.7 MiB with padding). Such heads are gathered from
    # column slices of at most LABEL_COLUMNS_BYTES; larger ones (every model head) in one gather, as before.
    staged = w.size * w.dtype.itemsize <= LABEL_STAGED_BYTES
    column_bytes = w.shape[0] * w.dtype.itemsize
    width = max(LANES, LABEL_COLUMNS_BYTES // column_bytes // LANES * LANES) if staged else w.shape[1]
    products = [jnp.sum(operand(x[:, start:start + width]) * operand(jnp.take(w[:, start:start + width], ids, axis=0)),
                        axis=1, keepdims=True) for start in range(0, w.shape[1], width)]
    raw = functools.reduce(jnp.add, products)
    return jnp.where(hit, tile_stats.logits(raw, cfg, scale), 0.0)[:, 0]


def merge_cores(partials: jax.Array, how: str) -> jax.Array:
    """Combine per-core partial statistics ``[cores, N, 1]`` into ``[N]`` (``how``: logsumexp or sum)."""
    if partials.shape[0] == 1:
        return partials[0, :, 0]
    if how == "logsumexp":
        return jax.nn.logsumexp(partials[:, :, 0], axis=0)
    return jnp.sum(partials[:, :, 0], axis=0)


def merge_argmax(max_partials: jax.Array, argmax_partials: jax.Array) -> tuple[jax.Array, jax.Array]:
    """The rows' max logit and its lowest index ``[N]`` from the cores' ``[cores, N, 1]`` partials: the
    largest max, and the lowest index among the cores that reach it."""
    if max_partials.shape[0] == 1:
        return max_partials[0, :, 0], argmax_partials[0, :, 0]
    top = jnp.max(max_partials[:, :, 0], axis=0)
    at_top = max_partials[:, :, 0] == top[None, :]
    index = jnp.min(jnp.where(at_top, argmax_partials[:, :, 0], tile_stats.NO_INDEX), axis=0)
    return top, index


def merge_expected(lse_partials: jax.Array, expected_partials: jax.Array, lse: jax.Array) -> jax.Array:
    """The rows' expected logit from the cores' ``[cores, N, 1]`` partials: each core's weighted by its
    share ``exp(lse_core - lse)`` of the row's probability mass."""
    if expected_partials.shape[0] == 1:
        return expected_partials[0, :, 0]
    share = jnp.exp(lse_partials[:, :, 0] - lse[None, :])
    return jnp.sum(share * expected_partials[:, :, 0], axis=0)
