"""Core-grid backward kernel: ``dx`` and ``dw`` of the row statistics, logits recomputed per tile.

With cotangents ``(g_lse, g_label, g_sum, g_expected)`` of the statistics, the logit cotangent is

    delta = (p * (g_lse + g_expected * (1 + z - expected)) + g_label * [col == label] + g_sum) * cap'(z)

with ``p = softmax(z)`` and ``expected = sum_j p_j z_j`` (its terms only when the expected logit is
asked for). With a row scale (``cfg.with_row_scale``) the logits are ``z = s_i cap(u)`` and the
cotangent above is multiplied by ``s_i cap'(u)`` instead of ``cap'(u)``.

``dx = delta @ w.T``, ``dw = x.T @ delta`` for ``w [H, V]`` (``cfg.w_layout == "hv"``, blocks
``[Hp, block_v]``); for ``w [V, H]`` (``"vh"``, blocks ``[block_v, Hp]``) the logits are the NT product
``x @ w_blk.T``, ``dx += delta @ w_blk`` and ``dw_blk += delta.T @ x`` (``[block_v, Hp]``, ``dw`` in
``w``'s layout): every product contracts in place, and no ``[V, H]`` array is transposed or copied.
Where ``Hp`` is not a whole number of the MXU's width (``BackwardConfig.dw_transposed``), the ``dw``
tile is accumulated as ``x.T @ delta`` instead and only the finished tile is transposed, once per
vocab block (kept-logits mode, ``BackwardConfig.kept_dw_transposed``: the float32 running sum between chunks is
held so too, and only the last chunk's tiles are transposed).

Grid ``(cores, vocab blocks per core, token blocks)``, token blocks innermost:

- leading core axis (``parallel``: Mosaic spreads it over the TensorCores of the device the call is
  compiled for, and loops over it on a one-core device): each core owns a contiguous range of vocab
  blocks, so each ``dw`` column block belongs to exactly one core and no per-core copy of ``dw`` exists;
- for one vocab block the ``[Hp, block_v]`` (``"vh"``: ``[block_v, Hp]``) ``dw`` tile is accumulated
  in a float32 VMEM scratch over all token blocks and written to HBM once, in the dtype of ``w``: cast
  into one staging buffer and copied out by a manual DMA that runs under the next vocab block's steps
  (waited for only before the staging buffer is refilled, a vocab block later, and at the core's end).
  A pipelined ``dw`` output would take a block per ``w`` buffer, and with one buffer its write-back
  would stall the core; the staging buffer is the one block either way;
- ``dx`` needs every vocab block, so each core keeps a float32 partial ``[Np, Hp]`` in HBM: the
  first vocab block of a core writes it, later ones read-add-write it with manual DMAs (the read
  is issued before the tile's matmuls and waited after them; the write of one token block is
  waited while the next one computes). The wrapper sums the (at most two) partials: HBM
  temporaries are ``cores * 4 * N * H`` bytes, no float32 ``dw`` at all.

Ragged edges are masked in the kernel: garbage rows of ``x`` in the last token block, garbage
vocab entries of ``w`` in the last vocab block and garbage past ``H`` in both (blocks span ``Hp``, ``H``
rounded up to 128) are zeroed in their VMEM buffers before they enter a product (``0 * NaN`` would
poison ``dx``/``dw``), and the per-row inputs of rows past ``N`` are zeroed, so that their ``delta`` is
0; nothing is masked per logit (:func:`_logit_cotangent` says why the columns past ``V`` need nothing).

A grid step, in program order: the ``dx`` rows' read started (:func:`_begin_dx_rows`), the ragged
operands masked (:func:`_mask_ragged_operands`), ``delta`` formed (:func:`_logit_cotangent`), then
the ``dw`` step (:func:`_dw_step`; at a vocab block's last token block, :func:`_write_dw`) and the
``dx`` step (:func:`_dx_step`), the products in ``block_h``-row chunks of the hidden dimension.

Handed :class:`ce_pallas_tpu.common.LiveBlocks` (contract version 4), each vocab block's sweep walks the
live token blocks first, and its dead steps keep the last live block's indices and skip every product
and ``dx`` DMA (:class:`_TokenStep`: what follows the token *block*, row masks and ``dx`` offsets, and what
follows the grid *position*, the ``dw`` accumulator's zeroing and write); a dead block's ``dx`` rows are
never written.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from ce_pallas_tpu import common
from ce_pallas_tpu.layout import LANES


@dataclasses.dataclass(frozen=True)
class BackwardConfig(common.KernelConfig):
    """Static shape and tiling of one backward call; ``block_h`` is the hidden chunk of the dx/dw updates.

    ``w_buffers``: VMEM buffers of the ``w`` blocks. They change once per vocab block, so one buffer
    is enough for correctness, but then the next block's ``w`` is fetched while the core waits; two
    let the fetch overlap the steps before a vocab-block change, where VMEM allows. (``dw`` has one
    staging buffer whatever this is; its write-back never stalls the core.)
    """

    w_buffers: int = 1
    #: Take the logits from the forward's kept ones (:mod:`ce_pallas_tpu.kept_logits`) instead of
    #: recomputing them, and add ``dw`` onto a float32 running sum (padded to whole vocab blocks).
    kept_logits: bool = False
    #: Kept-logits mode: whether ``dw`` starts from the running float32 sum of earlier chunks (False: the
    #: first chunk, whose slots start at zero) and whether it ends in that sum (False: the last chunk,
    #: which writes the finished ``dw`` in ``w``'s dtype and exact shape, as the recompute kernel does).
    dw_from_running: bool = True
    dw_to_running: bool = True
    #: Kept-logits mode: the hidden size taken in this many equal tiles, one after another, each a walk
    #: over the core's vocab blocks with its own slice of ``x``, ``dx``, ``w`` and ``dw`` in VMEM (the
    #: kept logits read and ``delta`` formed once per tile). A wide head's chunk-resident ``x`` and ``dx``
    #: and its ``[Hp, block_v]`` ``dw`` slots then fit VMEM beside larger chunks and vocab blocks
    #: (:func:`ce_pallas_tpu.kept_logits.plan_chunks`). Needs ``H`` a whole number of 128-wide tiles.
    hidden_split: int = 1
    #: Kept-logits mode in hidden tiles: the first tile writes each block's ``delta`` over its kept logits
    #: (packed, :func:`_tile_cotangent`) and later tiles read it back, so ``delta`` is formed once per
    #: chunk instead of once per tile, for one more write of the chunk's (bf16: half its) logits' bytes.
    #: The plan sets it where the schedule measured a gain (:attr:`ce_pallas_tpu.target.ChipFacts.delta_over_logits`).
    delta_over_logits: bool = False
    #: Kept-logits mode, ``[H, V]`` head: the chunk's ``x`` held resident as ``x.T`` (``[Hp, Np]``, transposed
    #: and zero-padded by XLA before the call, :func:`_inputs`), so the ``dw`` product ``x.T @ delta`` takes
    #: its block as it is instead of transposing the block's ``x`` rows at every step. The plan sets it
    #: where the schedule measured a gain (:attr:`ce_pallas_tpu.target.ChipFacts.kept_x_transposed`).
    x_transposed: bool = False
    #: Kept-logits mode, the hidden size whole: the chunk's resident ``dx`` held transposed (``[Hp, Np]``) and
    #: formed as ``w.T @ delta.T``, so that ``Hp`` is the product's streamed side, not its output columns: on a
    #: 256-wide MXU an ``Hp`` that is not a multiple of 256 (Qwen2.5-0.5B's 896) then costs its own rows instead of
    #: a whole last 256. The partials leave the kernel ``[cores, Hp, Np]`` and XLA transposes them back
    #: (:func:`backward_call`). The plan sets it where the schedule measured a gain
    #: (:attr:`ce_pallas_tpu.target.ChipFacts.kept_dx_transposed`).
    dx_transposed: bool = False
    #: Kept-logits mode, ``[V, H]`` head, the hidden size whole: ``dw`` held as ``[Hp, V]`` (the ``[H, V]`` head's
    #: layout) in the VMEM slots and the float32 running sum between chunks, formed as ``x.T @ delta`` from ``x``
    #: held transposed (:attr:`x_transposed`), so that ``Hp`` is the product's streamed side, not its padded output
    #: columns, and no block of ``x`` or ``delta`` is transposed for the product; the last chunk transposes each
    #: finished tile as it stages it in ``w``'s layout (:func:`_stage_dw`). The label's term then goes into ``delta``
    #: (no :attr:`label_rows`: they add rows of a ``[V, H]`` tile). The plan sets it where the schedule measured a
    #: gain (:attr:`ce_pallas_tpu.target.ChipFacts.kept_dw_transposed`).
    kept_dw_transposed: bool = False
    #: Kept-logits mode, a chunk not adding onto the running sum (the first, or the only one): its ``dw`` slots
    #: start at zero by a DMA from a zero block in HBM, started as the running sum's reads are (a block ahead),
    #: instead of a vector pass over the slot at each vocab block's first step. The plan sets it where the
    #: schedule measured a gain (:attr:`ce_pallas_tpu.target.ChipFacts.kept_dw_zeros_by_dma`).
    dw_zeros_by_dma: bool = False
    #: Kept-logits mode: the token block of the kept logits' buffer this call's first row is (a piece of a
    #: longer chunk, :attr:`ce_pallas_tpu.kept_logits.KeptPlan.pieces`); the call reads its rows from there.
    logits_row_block: int = 0
    #: Kept-logits mode: the caller folded each row's ``|g_lse|`` into its ``lse`` (``lse - log|g_lse|``) and its
    #: sign into ``x`` and ``dx`` (``g_label`` and ``g_sum`` signed alike), so ``delta``'s softmax term is one ``exp``
    #: with no product per logit (:func:`ce_pallas_tpu.kept_logits.fold_cotangent`; v6e, Qwen3-0.6B's kept backward:
    #: 1.285 -> 1.248 of its MXU minimum). With the entropy's terms the entropy's cotangent ``b`` is folded so, and
    #: the ``g_lse`` column holds the row's ``a / b``: ``exp(z - lse') (a / b + z)``
    #: (:func:`ce_pallas_tpu.kept_logits.fold_entropy_cotangent`). Kept mode only: the signed ``x`` feeds only the
    #: ``dw`` product there, where a recompute would take it into the logits.
    cotangent_in_exponent: bool = False
    #: Kept-logits mode, ``[V, H]`` head (the entropy's terms too): ``delta`` takes no label term (no compare
    #: and select per logit); the caller hands each vocab block's labelled rows instead (sorted by label, in SMEM:
    #: :class:`LabelRows`), and the kernel adds ``c x`` onto the row of the ``dw`` slot each label falls on, ``c`` the
    #: term's share of that entry of ``delta`` as the kernel would have rounded it (``dx``'s share, ``c w[y]``, the
    #: caller adds: :func:`ce_pallas_tpu.label_rows.label_rows`). v6e, Qwen3-0.6B's kept backward (a call of one
    #: 4096-token chunk): 1.242 -> 1.171 of its MXU minimum; with the entropy's terms, the RL objective's backward
    #: at Qwen3-0.6B's head: 1.414 -> 1.329 (docs/notes/2026-12-04-rl-objective-matrix.md).
    label_rows: bool = False
    #: Kept-logits mode, the hidden size whole: the kept logits are bf16 below their lanes' maxima
    #: (:attr:`ce_pallas_tpu.forward.ForwardConfig.kept_bf16`), which the call reads beside them; ``kept_block_v``
    #: is the forward's vocab block (one lane maximum per row, lane and such block), a multiple or a divisor of
    #: ``block_v``.
    kept_bf16: bool = False
    kept_block_v: int = 0

    @property
    def dw_slots_read(self) -> bool:
        """Whether each ``dw`` slot is filled by a DMA before its vocab block: the running sum, or zeros."""
        return self.dw_from_running or self.dw_zeros_by_dma

    @property
    def hidden_tile(self) -> int:
        """The hidden entries of one tile (:attr:`hidden_split`): ``Hp`` unsplit."""
        return self.hp // self.hidden_split

    @property
    def tile_hidden(self) -> int:
        """The tile's entries that are real (``H`` unsplit; a split tile has no padding)."""
        return self.hidden if self.hidden_split == 1 else self.hidden_tile

    @property
    def dw_transposed(self) -> bool:
        """Whether a ``[V, H]`` head's ``dw`` tile is accumulated as ``[Hp, block_v]`` (``x.T @ delta``,
        as for an ``[H, V]`` head) and transposed on its way out, once per vocab block.

        ``delta.T @ x`` gives ``[block_v, Hp]`` with ``Hp`` as the MXU's output columns: where ``Hp`` is
        not a whole number of the MXU's width (H=896 on v6e's 256-wide MXUs: 3.5) the last pass is
        half empty, an eighth of that product wasted; ``x.T @ delta`` has ``block_v`` there (v6e,
        Qwen2.5-0.5B's tied RL backward: 1.168 -> 1.136 of the MXU minimum,
        docs/notes/2026-11-27-tied-heads-backwards.md)."""
        if self.kept_logits:
            return self.kept_dw_transposed
        return (self.w_layout == "vh" and self.hidden == self.hp and self.hp % self.mxu_side != 0
                and self.block_v % self.mxu_side == 0)

    @property
    def dw_acc_shape(self) -> tuple[int, int]:
        """The float32 ``dw`` accumulator: a ``w`` block, or ``[Hp, block_v]`` when :attr:`dw_transposed`."""
        return (self.hp, self.block_v) if self.dw_transposed else _w_block_shape(self)


class LabelRows(NamedTuple):
    """A chunk's labelled rows for :attr:`BackwardConfig.label_rows`, sorted by label: entry ``k`` adds
    ``coefficient[k] * x[token[k]]`` to row ``row[k]`` of its vocab block's ``dw`` tile, and vocab block ``b``'s
    entries are ``first[b]`` to ``first[b + 1]`` (int32 ``[nv + 1]``; ``token`` and ``row`` int32, ``coefficient``
    float32, ``[N]``; entries past ``first[nv]`` add nothing)."""

    first: jax.Array
    token: jax.Array
    row: jax.Array
    coefficient: jax.Array


class _Rows(NamedTuple):
    """The kernel's per-row ``[block_b, 1]`` inputs: labels, the row scale, lse, the cotangents of the
    statistics and (for the entropy) the rows' expected logit; absent ones None."""

    y: Any
    scale: Any | None
    lse: Any
    g_lse: Any
    g_label: Any
    g_sum: Any | None
    expected: Any | None
    g_expected: Any | None


class _DwWrite(NamedTuple):
    """The DMAs that copy the ``dw`` staging buffer to this step's vocab block of ``dw`` in HBM.

    ``full`` copies a whole block. A ragged last block (``V`` not a multiple of ``block_v``) is copied
    by ``tail``: its columns up to the last whole 128 (sublane group for a ``[V, H]`` head) straight
    from the staging buffer, then the rest through a buffer of exactly their shape (Mosaic slices a
    VMEM window only at whole layout tiles). ``remainder_source`` is the staging buffer's window that
    fills that buffer (None: no such rest).
    """

    full: Any
    tail: tuple[Any, ...]
    remainder_source: Any | None


class _RowSlab(NamedTuple):
    """Kept-logits mode's per-row inputs: one float32 slab resident in VMEM for the whole grid, fetched once per
    core (:func:`_inputs`), holding the :class:`_Rows` fields present (``fields``, in that order; the labels' int32
    bits stored as float32). Each ``[N, 1]`` column moved on its own would be fetched whole 128-lane tiles at a
    time (512 bytes a row) at every step of the token-innermost grid: v6e, Llama-3 70B's RL backward in 1024-token
    blocks, 3 of a step's 18.4 MB.

    Its layout (:func:`_slab_by_field`): ``[k Np, 1]``, the fields one after another, each at lane 0, where that fits
    the VMEM the plan counts for the columns; else ``[Np, k]``, 512 bytes a row for all fields, whose field at
    lane ``k`` is moved to lane 0 before it is broadcast along a step's lanes, at every step (v5p, Qwen2.5-0.5B's
    RL backward: 1.114 of its MXU minimum by field, 1.145 packed, 1.118 as columns fetched every step)."""

    slab: Any
    fields: tuple[str, ...]


class _DxRows(NamedTuple):
    """The step's ``dx`` rows: the VMEM slot they are read into, accumulated in and written from, and
    the DMAs that read them from and write them to the core's partial in HBM."""

    slot: jax.Array
    read: Any
    write: Any
    previous_write: Any  # the other slot's write, one token block earlier


class _TokenStep(NamedTuple):
    """The token axis of a grid step: ``position`` (the step's index along it), ``block`` (the token block
    it takes: the position itself, or the live block it walks with :class:`common.LiveBlocks`), ``live``
    (the step has work) and ``last_live`` (the position of the last step with work, which waits for the
    ``dx`` rows' last write)."""

    position: jax.Array
    block: jax.Array
    live: jax.Array | bool
    last_live: jax.Array | int


def _token_step(prefetch, cfg: BackwardConfig) -> _TokenStep:
    position = pl.program_id(2)
    block, live = common.step_block(position, prefetch)
    last_live = cfg.nb - 1 if prefetch is None else prefetch[1][0] - 1
    return _TokenStep(position, block, live, last_live)


def _backward_kernel(x_ref, w_ref, y_ref, *rest, cfg: BackwardConfig, prefetch=None):
    refs = list(rest)
    if cfg.kept_logits:  # y_ref is the slab of every per-row input (:class:`_RowSlab`)
        z_ref = refs.pop(0)
        m_ref = refs.pop(0) if cfg.kept_bf16 else None
        running_in = refs.pop(0) if cfg.dw_slots_read else None  # the running sum, or a zero block
        label_refs = LabelRows(*(refs.pop(0) for _ in LabelRows._fields)) if cfg.label_rows else None
        dw_hbm, dxp_hbm = refs.pop(0), refs.pop(0)
        z_hbm = refs.pop(0) if cfg.delta_over_logits else None  # aliased to the kept logits
        dw_slots, dx_acc, sems, *staging = refs
        if cfg.dw_from_running and cfg.dw_to_running:
            running_in = dw_hbm  # aliased: read and written in place
        _kept_kernel(x_ref, w_ref, (z_ref, z_hbm, m_ref), _RowSlab(y_ref, _row_fields(cfg)), running_in, dw_hbm,
                     dxp_hbm, dw_slots, dx_acc, sems, staging, _token_step(prefetch, cfg), cfg, label_refs)
        return
    scale_ref = refs.pop(0) if cfg.with_row_scale else None
    lse_ref, g_lse_ref, g_label_ref = refs.pop(0), refs.pop(0), refs.pop(0)
    g_sum_ref = refs.pop(0) if cfg.with_sum else None
    expected_ref, g_expected_ref = (refs.pop(0), refs.pop(0)) if cfg.with_expected else (None, None)
    rows = _Rows(y_ref, scale_ref, lse_ref, g_lse_ref, g_label_ref, g_sum_ref, expected_ref, g_expected_ref)
    dw_hbm, dxp_hbm, dw_acc, dw_stage, dx_buf, sems, *rest_buf = refs
    dw_remainder = rest_buf[0] if rest_buf else None

    core, jj = pl.program_id(0), pl.program_id(1)
    t = _token_step(prefetch, cfg)
    block = core * cfg.nv_per_core + jj  # the global vocab block

    def work():
        dx_rows = _dx_rows(dxp_hbm, dx_buf, sems, core, t, cfg)
        _begin_dx_rows(dx_rows, dx_buf, jj)
        _mask_ragged_operands(x_ref, w_ref, t.block, block, cfg)
        d = _logit_cotangent(x_ref, w_ref, None, rows, t.block, block, cfg)
        _dw_step(x_ref, d, dw_acc, cfg)
        _dx_step(w_ref, d, dx_buf, dx_rows, t, jj, cfg)

    def step():
        _zero_dw(dw_acc, t.position)
        common.when_live(t.live, work)
        write = _dw_write(dw_hbm, dw_stage, dw_remainder, sems, block, cfg)
        _write_dw(dw_acc, dw_stage, dw_remainder, write, t.position, jj, block, cfg)

    if cfg.nv_per_core * cfg.num_cores != cfg.nv:  # the last core may have a block fewer
        pl.when(block < cfg.nv)(step)
    else:
        step()


def _kept_kernel(x_ref, w_ref, z_refs, rows: _RowSlab, running_in, dw_hbm, dxp_hbm, dw_slots, dx_acc, sems,
                 staging, t: _TokenStep, cfg: BackwardConfig, label_refs: LabelRows | None = None) -> None:
    """Kept-logits mode (:mod:`ce_pallas_tpu.kept_logits`): ``delta`` from the forward's logits; the chunk's
    ``x``, float32 ``dx`` and per-row inputs (:class:`_RowSlab`) resident in VMEM; ``dw`` accumulated onto the
    running sum in two VMEM slots that DMAs fill and empty (:func:`_running_dw_dmas`), so no vector pass zeroes,
    stages or adds a tile.
    The first chunk's slots start at zero instead (:attr:`BackwardConfig.dw_from_running`: zeros read in by the
    same DMAs with :attr:`BackwardConfig.dw_zeros_by_dma`, else a vector pass); the last
    chunk's go out through the recompute kernel's staging buffer in ``w``'s dtype
    (:attr:`BackwardConfig.dw_to_running`). The running sum's DMAs follow the grid's positions, so a dead
    step (:class:`common.LiveBlocks`) still moves ``dw``; only its products and ``dx`` rows are skipped. In
    hidden tiles ``delta`` is formed by the first tile only (:attr:`BackwardConfig.delta_over_logits`)."""
    core, (h, jj) = pl.program_id(0), _hidden_and_vocab_step(pl.program_id(1), cfg)
    i, position = t.block, t.position
    block = core * cfg.nv_per_core + jj
    slot = jj % 2
    z_ref, z_hbm, m_ref = z_refs

    def delta_and_dw() -> tuple[jax.Array, Any]:
        d, delta_write = _tile_cotangent(z_ref, z_hbm, sems, rows, h, i, block, cfg, m_ref)
        x_rows = x_ref.at[:, _token_rows(i, cfg)] if cfg.x_transposed else x_ref.at[_token_rows(i, cfg)]
        _dw_step(x_rows, d, dw_slots.at[slot], cfg)
        return d, delta_write

    def dx(d: jax.Array) -> None:
        rows = _token_rows(i, cfg)
        _dx_resident_step(w_ref, d, dx_acc.at[:, rows] if cfg.dx_transposed else dx_acc.at[rows], jj, cfg)

    def write_dw() -> None:
        if cfg.dw_to_running:
            _running_dw_write(dw_hbm, dw_slots, sems, jj, position, block, h, cfg)
        else:
            dw_stage, *remainder = staging
            dw_remainder = remainder[0] if remainder else None
            write = _dw_write(dw_hbm, dw_stage, dw_remainder, sems, block, cfg, h)
            _write_dw(dw_slots.at[slot], dw_stage, dw_remainder, write, position, jj, block, cfg)

    def step():
        _prepare_resident_x(x_ref, jj, position, cfg)
        _mask_ragged_operands(None, w_ref, i, block, cfg)
        if not cfg.delta_over_logits:  # there the first tile masks them (:func:`_tile_cotangent`)
            common.when_live(t.live, lambda: _mask_ragged_logits(z_ref, i, block, cfg, m_ref))
        _running_dw_dmas(running_in, dw_hbm, dw_slots, sems, jj, position, block, h, cfg)
        if not cfg.dw_slots_read:
            _zero_dw(dw_slots.at[slot], position)
        if label_refs is not None:  # the slot holds its running sum (or zeros) by now
            refs = label_refs
            pl.when(position == 0)(lambda: _add_label_rows(x_ref, dw_slots.at[slot], refs, block, cfg))
        # The dw block's write (at the token walk's end) between the two products: v6e, Llama-3 8B's head, the
        # dx product ahead of it ran at 1.113 of the MXU minimum, 1.062 so. A dead step writes it alone.
        def products_and_write():
            d, delta_write = delta_and_dw()
            write_dw()
            dx(d)
            if delta_write is not None:  # the input buffer it reads is refilled two steps on
                pl.when(h == 0)(delta_write.wait)

        common.when_live(t.live, products_and_write)
        if t.live is not True:
            pl.when(jnp.logical_not(t.live))(write_dw)

    if cfg.nv_per_core * cfg.num_cores != cfg.nv:  # the last core may have a block fewer
        pl.when(block < cfg.nv)(step)
    else:
        step()
    common.when_live(t.live, lambda: _write_resident_dx(dx_acc, dxp_hbm, sems, core, jj, i, h, cfg))


#: Label rows a loop iteration adds (:func:`_add_label_rows`): independent row updates the scheduler can overlap.
_LABEL_ROWS_UNROLL = 4


def _label_row_range(label_refs: LabelRows, block) -> tuple[Any, Any]:
    """The entries of vocab block ``block`` in :class:`LabelRows` (a function of its own: libtpu's static profiler
    reads no SMEM data, so the schedule tools put a static range in its place: ``tooling.schedule.worker``)."""
    return label_refs.first[block], label_refs.first[block + 1]


def _add_label_rows(x_ref, slot_ref, label_refs: LabelRows, block, cfg: BackwardConfig) -> None:
    """:attr:`BackwardConfig.label_rows`: for each labelled row of vocab block ``block`` (:class:`LabelRows`),
    ``coefficient * x[token]`` added onto the ``dw`` slot's row of its label (``[block_v, tile]``, float32). The
    token's ``x`` row is taken from its aligned group of sublanes (a dynamic row of a packed dtype is not
    addressable) by a select and a sum over the group."""
    group = 8 * 4 // jnp.dtype(x_ref.dtype).itemsize  # the rows of one sublane tile of x

    def add(k):
        token, row, coefficient = label_refs.token[k], label_refs.row[k], label_refs.coefficient[k]
        rows = x_ref[pl.ds(pl.multiple_of(token // group * group, group), group), :].astype(jnp.float32)
        pick = jax.lax.broadcasted_iota(jnp.int32, rows.shape, 0) == token % group
        x_row = jnp.sum(jnp.where(pick, rows, 0.0), axis=0, keepdims=True)
        slot_ref[pl.ds(row, 1), :] += coefficient * x_row

    start, stop = _label_row_range(label_refs, block)
    whole = (stop - start) // _LABEL_ROWS_UNROLL

    def unrolled(g, carry):
        for u in range(_LABEL_ROWS_UNROLL):
            add(start + g * _LABEL_ROWS_UNROLL + u)
        return carry

    def single(k, carry):
        add(k)
        return carry

    jax.lax.fori_loop(0, whole, unrolled, 0)
    jax.lax.fori_loop(start + whole * _LABEL_ROWS_UNROLL, stop, single, 0)


def _tile_cotangent(z_ref, z_hbm, sems, rows: _RowSlab, h, i, block, cfg: BackwardConfig,
                    m_ref=None) -> tuple[jax.Array, Any]:
    """``(delta, its write-back or None)`` of a kept-logits step. Unsplit, ``delta`` from the kept logits.
    In hidden tiles (:attr:`BackwardConfig.delta_over_logits`) the first tile masks the ragged logits, forms
    ``delta`` and stores it over them: its bits, exactly the products' operand, packed into the block's first
    rows (a bf16 ``delta``'s rows in pairs, half the block; a float32 one the whole block), in VMEM and, by a
    DMA the caller waits for after the products, over the kept logits in HBM. Later tiles unpack that
    ``delta`` instead of forming it again: no per-logit work."""
    if not cfg.delta_over_logits:
        return _logit_cotangent(None, None, z_ref, rows, i, block, cfg, m_ref), None
    dtype = common.mxu_dtype(cfg.precision)
    packed_rows = cfg.block_b * jnp.dtype(dtype).itemsize // 4
    packed = z_ref.at[pl.ds(0, packed_rows)]
    window = z_hbm.at[pl.ds(pl.multiple_of(i * cfg.block_b, cfg.block_b), packed_rows),
                      pl.ds(pl.multiple_of(block * cfg.block_v, cfg.block_v), cfg.block_v)]
    write = pltpu.make_async_copy(packed, window, sems.at[3])

    @pl.when(h == 0)
    def _():
        _mask_ragged_logits(z_ref, i, block, cfg)
        d = _logit_cotangent(None, None, z_ref, rows, i, block, cfg)
        packed[...] = d if packed_rows == cfg.block_b else pltpu.bitcast(d, jnp.float32)
        write.start()

    bits = packed[...]
    return bits if packed_rows == cfg.block_b else pltpu.bitcast(bits, dtype), write


def _hidden_and_vocab_step(j, cfg: BackwardConfig) -> tuple[Any, Any]:
    """``(hidden tile, vocab step of the core)`` of the grid's second index: the tiles of a split hidden
    size (:attr:`BackwardConfig.hidden_split`) each walk the core's vocab blocks in turn."""
    if cfg.hidden_split == 1:
        return 0, j
    return j // cfg.nv_per_core, j % cfg.nv_per_core


def _hidden_entries(h, cfg: BackwardConfig) -> slice | pl.Slice:
    """Hidden tile ``h``'s entries of a full-width HBM array (all of them unsplit)."""
    if cfg.hidden_split == 1:
        return slice(None)
    return pl.ds(pl.multiple_of(h * cfg.hidden_tile, cfg.hidden_tile), cfg.hidden_tile)


def _running_dw_copy(dw_hbm, dw_slots, sems, block, slot, h, cfg: BackwardConfig, *, read: bool):
    """The DMA between vocab block ``block`` (hidden tile ``h``) of the running ``dw`` in HBM and VMEM
    slot ``slot``; for a chunk that does not add onto the running sum (:attr:`BackwardConfig.dw_zeros_by_dma`)
    the read is of the whole zero block ``dw_hbm`` instead."""
    if read and not cfg.dw_from_running:
        return pltpu.make_async_copy(dw_hbm, dw_slots.at[slot], sems.at[0])
    first = 0 if cfg.nv == 1 else pl.multiple_of(block * cfg.block_v, cfg.block_v)
    entries, hidden = pl.ds(first, cfg.block_v), _hidden_entries(h, cfg)
    window = dw_hbm.at[hidden, entries] if _running_dw_is_hv(cfg) else dw_hbm.at[entries, hidden]
    if read:
        return pltpu.make_async_copy(window, dw_slots.at[slot], sems.at[0])
    return pltpu.make_async_copy(dw_slots.at[slot], window, sems.at[2])


def _running_dw_is_hv(cfg: BackwardConfig) -> bool:
    """Whether the running float32 ``dw`` (and each slot) is ``[Hp, V]``: an ``[H, V]`` head's, or a ``[V, H]`` one's
    held transposed (:attr:`BackwardConfig.kept_dw_transposed`)."""
    return cfg.w_layout == "hv" or cfg.kept_dw_transposed


def running_dw_shape(cfg: BackwardConfig) -> tuple[int, int]:
    """The float32 running ``dw`` of a kept backward: whole vocab blocks by ``Hp``, in ``w``'s layout or held
    transposed (:attr:`BackwardConfig.kept_dw_transposed`)."""
    entries = cfg.nv * cfg.block_v
    return (cfg.hp, entries) if _running_dw_is_hv(cfg) else (entries, cfg.hp)


def _core_last_block(jj, block, cfg: BackwardConfig):
    """Whether vocab block ``block`` is the core's last one with a block (the last core may be one short)."""
    return (jj == cfg.nv_per_core - 1) | (block == cfg.nv - 1)


def _running_dw_dmas(running_in, dw_hbm, dw_slots, sems, jj, i, block, h, cfg: BackwardConfig) -> None:
    """Vocab block ``jj`` of a core accumulates in slot ``jj % 2``, which must hold the running ``dw``'s
    block first (zeros in the first chunk, :attr:`BackwardConfig.dw_from_running`, where they come by DMA:
    :attr:`BackwardConfig.dw_zeros_by_dma`; else nothing is read and the slot is zeroed by a vector pass): the core's
    first block reads it now; later ones wait for the read started halfway through the block before.
    Halfway through this block the other slot's write to the running sum (the block before) is waited
    for (the last chunk stages its tiles synchronously instead), and the next block's read into it started."""
    slot = jj % 2
    if cfg.dw_slots_read:
        this = _running_dw_copy(running_in, dw_slots, sems, block, slot, h, cfg, read=True)

        @pl.when((jj == 0) & (i == 0))
        def _():
            this.start()

        pl.when(i == 0)(this.wait)

    @pl.when(i == cfg.nb // 2)
    def _():
        if cfg.dw_to_running:

            @pl.when(jj > 0)
            def _():
                _running_dw_copy(dw_hbm, dw_slots, sems, block - 1, 1 - slot, h, cfg, read=False).wait()

        if cfg.dw_slots_read:

            @pl.when(jnp.logical_not(_core_last_block(jj, block, cfg)))
            def _():
                _running_dw_copy(running_in, dw_slots, sems, block + 1, 1 - slot, h, cfg, read=True).start()


def _running_dw_write(dw_hbm, dw_slots, sems, jj, i, block, h, cfg: BackwardConfig) -> None:
    """After the vocab block's last token block, its slot written back to the running ``dw`` (waited for
    halfway through the next block, or now at the core's last)."""
    write = _running_dw_copy(dw_hbm, dw_slots, sems, block, jj % 2, h, cfg, read=False)

    @pl.when(i == cfg.nb - 1)
    def _():
        write.start()
        pl.when(_core_last_block(jj, block, cfg))(write.wait)


def _token_rows(i, cfg: BackwardConfig, first: int = 0) -> pl.Slice:
    """Token block ``i``'s rows of a chunk-resident buffer (kept-logits mode) whose rows start at ``first``."""
    if cfg.nb == 1:
        return pl.ds(first, cfg.block_b)
    start = i * cfg.block_b if first == 0 else first + i * cfg.block_b
    return pl.ds(pl.multiple_of(start, cfg.block_b), cfg.block_b)


def _prepare_resident_x(x_ref, jj, i, cfg: BackwardConfig) -> None:
    """Kept-logits mode holds the chunk's ``x`` (its hidden tile's columns) in VMEM for the whole grid,
    fetched once per core and tile: its rows past ``N`` and columns past ``H`` are zeroed at the tile's first
    step."""
    if cfg.x_transposed or (cfg.n == cfg.padded_n and cfg.hidden == cfg.hp):  # x.T comes padded
        return

    @pl.when((jj == 0) & (i == 0))
    def _():
        if cfg.n != cfg.padded_n:
            row = jax.lax.broadcasted_iota(jnp.int32, x_ref.shape, 0)
            x_ref[...] = jnp.where(row < cfg.n, x_ref[...], jnp.zeros((), x_ref.dtype))
        if cfg.hidden != cfg.hp:
            common.zero_hidden_tail(x_ref, None, cfg.hidden, cfg.hp)


def _dx_resident_step(w_ref, d: jax.Array, dx_rows, jj, cfg: BackwardConfig) -> None:
    """Kept-logits mode: the core's dx partial of the whole chunk stays in VMEM across its vocab blocks
    (no HBM round trip per step); this token block's rows zeroed at the core's first vocab block, and
    the product added unconditionally, so the MXU result goes straight into them. With
    :attr:`BackwardConfig.dx_transposed` the rows are columns of ``dx.T``, and the product ``w.T @ delta.T``."""

    @pl.when(jj == 0)
    def _():
        dx_rows[...] = jnp.zeros(dx_rows.shape, jnp.float32)

    for chunk in _hidden_chunks(cfg):
        if cfg.dx_transposed:
            if cfg.w_layout == "vh":
                dx_rows[chunk, :] += common.matmul_tt(w_ref[:, chunk], d, cfg.precision)
            else:
                dx_rows[chunk, :] += common.matmul_nt(w_ref[chunk, :], d, cfg.precision)
        elif cfg.w_layout == "vh":
            dx_rows[:, chunk] += common.matmul(d, w_ref[:, chunk], cfg.precision)
        else:
            dx_rows[:, chunk] += common.matmul_nt(d, w_ref[chunk, :], cfg.precision)


def _write_resident_dx(dx_acc, dxp_hbm, sems, core, jj, i, h, cfg: BackwardConfig) -> None:
    """At the core's last vocab block, each token block's finished dx rows (of hidden tile ``h``) copied to
    the core's partial."""
    rows, hidden = _token_rows(i, cfg), _hidden_entries(h, cfg)
    source, destination = ((dx_acc.at[:, rows], dxp_hbm.at[core, hidden, rows]) if cfg.dx_transposed
                           else (dx_acc.at[rows], dxp_hbm.at[core, rows, hidden]))
    copy = pltpu.make_async_copy(source, destination, sems.at[1])

    @pl.when(jj == cfg.nv_per_core - 1)
    def _():
        copy.start()
        copy.wait()


def _hidden_chunks(cfg: BackwardConfig) -> list[pl.Slice]:
    """The ``block_h``-row chunks of the hidden dimension in which the dw and dx products are formed."""
    return [pl.ds(start, cfg.block_h) for start in range(0, cfg.hidden_tile, cfg.block_h)]


def _dx_rows(dxp_hbm, dx_buf, sems, core, t: _TokenStep, cfg: BackwardConfig) -> _DxRows:
    # One token block is the whole of N, which need not be a multiple of 8: its rows start at the
    # static 0 (Mosaic cannot prove i * N aligned to the 8-row tiles, though i is always 0 then).
    start = 0 if cfg.nb == 1 else pl.multiple_of(t.block * cfg.block_b, cfg.block_b)
    rows = pl.ds(start, cfg.block_b)
    slot = t.position % 2  # consecutive steps alternate slots
    read = pltpu.make_async_copy(dxp_hbm.at[core, rows], dx_buf.at[slot], sems.at[0])
    write = pltpu.make_async_copy(dx_buf.at[slot], dxp_hbm.at[core, rows], sems.at[1])
    previous_write = pltpu.make_async_copy(dx_buf.at[1 - slot], dxp_hbm.at[core, pl.ds(0, cfg.block_b)], sems.at[1])
    return _DxRows(slot, read, write, previous_write)


def _begin_dx_rows(dx_rows: _DxRows, dx_buf, jj) -> None:
    """The core's dx partial rows of this token block: read from HBM (waited for in :func:`_dx_step`),
    or zeros at the core's first vocab block."""

    # The slot's last write (two token blocks ago) was waited for in the previous step.
    @pl.when(jj > 0)
    def _():
        dx_rows.read.start()

    @pl.when(jj == 0)
    def _():
        dx_buf[dx_rows.slot] = jnp.zeros(dx_buf.shape[1:], jnp.float32)


def _mask_ragged_operands(x_ref, w_ref, i, block, cfg: BackwardConfig) -> None:
    """Garbage rows of x / columns of w in ragged last blocks, and past ``H`` in both, zeroed in their
    VMEM buffers: they would otherwise meet a zero of delta in a product (0 * NaN = NaN). ``x_ref``
    None: ``w`` only."""
    if x_ref is not None and cfg.n % cfg.block_b:

        @pl.when(i == cfg.nb - 1)
        def _():
            row = i * cfg.block_b + jax.lax.broadcasted_iota(jnp.int32, x_ref.shape, 0)
            x_ref[...] = jnp.where(row < cfg.n, x_ref[...], jnp.zeros((), x_ref.dtype))

    vh = cfg.w_layout == "vh"
    if cfg.hidden != cfg.hp:
        common.zero_hidden_tail(x_ref, None if vh else w_ref, cfg.hidden, cfg.hp)  # (either may be None)
        if vh:  # the hidden tail is the last 128 columns of a [block_v, Hp] block
            tail = pl.ds(cfg.hp - LANES, LANES)
            cols = jax.lax.broadcasted_iota(jnp.int32, (w_ref.shape[0], LANES), 1)
            valid = cfg.hidden - (cfg.hp - LANES)
            w_ref[:, tail] = jnp.where(cols < valid, w_ref[:, tail], jnp.zeros((), w_ref.dtype))

    if cfg.v % cfg.block_v:

        @pl.when(block == cfg.nv - 1)
        def _():
            entry = block * cfg.block_v + jax.lax.broadcasted_iota(jnp.int32, w_ref.shape, 0 if vh else 1)
            w_ref[...] = jnp.where(entry < cfg.v, w_ref[...], jnp.zeros((), w_ref.dtype))


def _mask_ragged_logits(z_ref, i, block, cfg: BackwardConfig, m_ref=None) -> None:
    """Kept logits of rows past ``N`` and columns past ``V`` (garbage, or never written) made 0 in their
    VMEM buffer, as the recomputed ones are there (their operands are zeroed), so ``delta`` stays finite; the
    lane maxima of bf16 kept logits (``m_ref``) of rows past ``N`` and of forward blocks past ``V``'s too (a column
    past ``V`` in ``V``'s block has its lane's maximum, finite: :func:`ce_pallas_tpu.forward._keep_below_lane_max`)."""
    if cfg.n % cfg.block_b:

        @pl.when(i == cfg.nb - 1)
        def _():
            for ref in (z_ref,) if m_ref is None else (z_ref, m_ref):
                row = i * cfg.block_b + jax.lax.broadcasted_iota(jnp.int32, ref.shape, 0)
                ref[...] = jnp.where(row < cfg.n, ref[...], jnp.zeros((), ref.dtype))

    if cfg.v % cfg.block_v:

        @pl.when(block == cfg.nv - 1)
        def _():
            col = block * cfg.block_v + jax.lax.broadcasted_iota(jnp.int32, z_ref.shape, 1)
            z_ref[...] = jnp.where(col < cfg.v, z_ref[...], 0.0)
            if m_ref is not None and cfg.block_v > cfg.kept_block_v:  # the forward wrote no block past V's
                group = jax.lax.broadcasted_iota(jnp.int32, m_ref.shape, 1) // LANES
                m_ref[...] = jnp.where(block * cfg.block_v + group * cfg.kept_block_v < cfg.v, m_ref[...], 0.0)


def _row_fields(cfg: BackwardConfig) -> tuple[str, ...]:
    """The :class:`_Rows` fields a call takes, in order (:func:`_inputs`)."""
    optional = {"scale": cfg.with_row_scale, "g_sum": cfg.with_sum, "expected": cfg.with_expected,
                "g_expected": cfg.with_expected}
    return tuple(name for name in _Rows._fields if optional.get(name, True))


def _slab_by_field(cfg: BackwardConfig) -> bool:
    """Whether the kept backward's :class:`_RowSlab` is ``[k Np, 1]`` (each field at lane 0): where its
    ``k * Np * 512`` bytes of VMEM are at most the two ``[block_b, 1]`` buffers a field that
    ``kept_logits._backward_need`` counts, so at most two token blocks; ``[Np, k]`` otherwise."""
    return cfg.nb <= 2


def _read_rows(rows: _Rows | _RowSlab, i, cfg: BackwardConfig) -> _Rows:
    """Token block ``i``'s per-row inputs as ``[block_b, 1]`` values (absent ones None)."""
    if isinstance(rows, _Rows):
        return _Rows(*(None if ref is None else ref[...] for ref in rows))
    if _slab_by_field(cfg):
        values = {name: rows.slab[_token_rows(i, cfg, k * cfg.padded_n), :] for k, name in enumerate(rows.fields)}
    else:
        block = rows.slab[_token_rows(i, cfg)]
        values = {name: block[:, k:k + 1] for k, name in enumerate(rows.fields)}
    values["y"] = jax.lax.bitcast_convert_type(values["y"], jnp.int32)
    return _Rows(*(values.get(name) for name in _Rows._fields))


def _row_values(rows: _Rows | _RowSlab, i, cfg: BackwardConfig) -> _Rows:
    """The per-row inputs of the step as values. In a ragged last token block the rows past ``N``
    hold garbage (NaN, say): their coefficients are zeroed and their ``lse``, ``expected`` and scale
    made 0, so that their ``delta`` is exactly 0 (their ``x`` rows are zeros, so their logits are 0 and
    ``p`` is 1) and no per-logit mask is needed. With :attr:`BackwardConfig.cotangent_in_exponent` their
    ``lse`` (which carries ``g_lse``) is made ``+inf`` instead: ``p`` is 0."""
    values = _read_rows(rows, i, cfg)
    if cfg.n % cfg.block_b == 0:
        return values
    row_ok = (i * cfg.block_b + jax.lax.broadcasted_iota(jnp.int32, (cfg.block_b, 1), 0)) < cfg.n

    def zeroed(value, past_n=0.0):
        return None if value is None else jnp.where(row_ok, value, jnp.full((), past_n, value.dtype))

    fill = {"lse": jnp.inf} if cfg.cotangent_in_exponent else {}  # a row's value past N, 0 unless named
    # (A garbage label meets g_label = 0.)
    return _Rows(values.y, *(zeroed(getattr(values, name), fill.get(name, 0.0)) for name in _Rows._fields[1:]))


def _across_block(per_lane: jax.Array, cfg: BackwardConfig) -> jax.Array:
    """``[b, block_v]`` of a ``[b, 128 r]`` array of lane maxima's shape: each column ``c`` takes its lane's
    entry of its forward vocab block (:attr:`BackwardConfig.kept_block_v`; ``r`` of them in the block, or one
    that spans it). The pieces are whole vector registers: placed side by side, not copied."""
    lanes = [(column // cfg.kept_block_v) % (per_lane.shape[1] // LANES) * LANES
             for column in range(0, cfg.block_v, LANES)]
    return jnp.concatenate([per_lane[:, lane:lane + LANES] for lane in lanes], axis=1)


def _logit_cotangent(x_ref, w_ref, z_ref, rows: _Rows | _RowSlab, i, block, cfg: BackwardConfig,
                     m_ref=None) -> jax.Array:
    """``delta`` of the tile (see the module docs) from its recomputed logits, in the products' dtype.

    Nothing is masked per logit. Rows past ``N`` get a ``delta`` of exactly 0 (:func:`_row_values`).
    Columns past ``V`` in a ragged last vocab block get a finite one: their ``w`` entries were zeroed
    (:func:`_mask_ragged_operands`), so their logits are 0 and they add nothing to ``dx``; their ``dw``
    columns are never written (:func:`_dw_write`), and no label falls on them."""
    row = _row_values(rows, i, cfg)
    # Columns are counted from the block's first, and the per-row terms carry the offset, so no
    # per-logit work goes into global column numbers.
    first = block * cfg.block_v
    col = jax.lax.broadcasted_iota(jnp.int32, (cfg.block_b, cfg.block_v), 1)
    # A kept block: float32, or bf16 below its lanes' maxima (softmax_cotangent folds them back in).
    if z_ref is not None:
        raw = z_ref[...] if m_ref is None else z_ref[...].astype(jnp.float32)
    else:
        product = common.matmul_nt if cfg.w_layout == "vh" else common.matmul
        raw = product(x_ref[...], w_ref[...], cfg.precision)
    # With cotangent_in_exponent g_lse (the entropy's b) is in the lse already, its sign in x and dx.
    maximum = None if m_ref is None else m_ref[...]
    delta, t = common.softmax_cotangent(raw, row.lse, row.scale, cfg.logit_soft_cap, maximum,
                                        functools.partial(_across_block, cfg=cfg),
                                        **common.softmax_cotangent_rows(cfg.cotangent_in_exponent, row.g_lse,
                                                                        row.expected, row.g_expected))
    if not cfg.label_rows:  # else added by rows (:func:`_add_label_rows`)
        delta = delta + jnp.where(col == row.y - first, row.g_label, 0.0)
    return common.delta_row_terms(delta, row.g_sum, t, row.scale).astype(common.mxu_dtype(cfg.precision))


def _zero_dw(dw_acc, position) -> None:
    """The dw accumulator zeroed at a vocab block's first step (kept-logits mode after the first chunk
    does not: it holds the running sum's block already), live or not, so the product is added
    unconditionally (:func:`_dw_step`) and a block with no live token writes zeros."""

    @pl.when(position == 0)
    def _():
        dw_acc[...] = jnp.zeros(dw_acc.shape, jnp.float32)


def _dw_step(x_ref, d: jax.Array, dw_acc, cfg: BackwardConfig) -> None:
    """The dw tile, accumulated over token blocks in VMEM (zeroed first, :func:`_zero_dw`): the product is
    added unconditionally, so the MXU result goes straight into it. (Stored instead of added at a walk's
    first step, under ``pl.when``, the kept backward ran slower: v6e, Llama-3 8B's head, 1.199 -> 1.227.)"""
    for chunk in _hidden_chunks(cfg):
        if cfg.x_transposed:  # x_ref holds x.T's columns of the block's rows
            dw_acc[chunk, :] += common.matmul(x_ref[chunk, :], d, cfg.precision)
        elif cfg.w_layout == "vh" and not cfg.dw_transposed:
            dw_acc[:, chunk] += common.matmul_tn(d, x_ref[:, chunk], cfg.precision)
        else:
            dw_acc[chunk, :] += common.matmul_tn(x_ref[:, chunk], d, cfg.precision)


def _dw_tail_split(cfg: BackwardConfig) -> tuple[int, int]:
    """The ragged last vocab block's entries ``(aligned, remainder)``: ``aligned`` a whole number of
    layout tiles along the vocab axis (128 lanes for ``[H, V]``, 16 sublanes for ``[V, H]``), copied
    from the staging buffer; ``remainder`` the rest, copied through a buffer of its own (0: none)."""
    tail = cfg.v - (cfg.nv - 1) * cfg.block_v
    if tail == cfg.block_v:
        return 0, 0
    unit = 16 if cfg.w_layout == "vh" else LANES
    return tail // unit * unit, tail % unit


def _dw_write(dw_hbm, dw_stage, dw_remainder, sems, block, cfg: BackwardConfig, h=0) -> _DwWrite:
    """The copies of the staged dw tile (``H``, not ``Hp``, hidden entries; hidden tile ``h``'s of a split
    one) to vocab block ``block`` of ``dw`` in HBM; a ragged last block's at static offsets (Mosaic
    expresses a ragged HBM window only where it ends at the array's end)."""
    vh = cfg.w_layout == "vh"

    def window(ref, entries: pl.Slice, hidden: slice | pl.Slice = slice(None)):
        return ref.at[entries, hidden] if vh else ref.at[hidden, entries]

    def copy(source, entries: pl.Slice):
        return pltpu.make_async_copy(source, window(dw_hbm, entries, _hidden_entries(h, cfg)), sems.at[2])

    # A single block (block_v == V, of any width) is the whole of dw: its window starts at a static 0.
    first = 0 if cfg.nv == 1 else pl.multiple_of(block * cfg.block_v, cfg.block_v)
    full = copy(dw_stage, pl.ds(first, cfg.block_v))
    aligned, remainder = _dw_tail_split(cfg)
    start = (cfg.nv - 1) * cfg.block_v
    tail = []
    if aligned:
        tail.append(copy(window(dw_stage, pl.ds(0, aligned)), pl.ds(start, aligned)))
    rest_source = None
    if remainder:
        tail.append(copy(dw_remainder, pl.ds(start + aligned, remainder)))
        rest_source = pl.ds(aligned, remainder)
    return _DwWrite(full, tuple(tail), rest_source)


#: Vocab columns of a transposed accumulator moved into the staging buffer at a time (by 128 hidden rows).
_DW_PIECE_COLUMNS = 512


def _write_dw(dw_acc, dw_stage, dw_remainder, write: _DwWrite, i, jj, block, cfg: BackwardConfig) -> None:
    """After the vocab block's last token block: the accumulator cast into the staging buffer (once the
    core's previous block has left it) and its copy to HBM started; waited for at the core's last
    block. A ragged last block is the last one of the last core, so only that final wait can be its."""

    def start_tail():
        if write.remainder_source is not None:
            entries = write.remainder_source
            dw_remainder[...] = dw_stage[entries, :] if cfg.w_layout == "vh" else dw_stage[:, entries]
        for copy in write.tail:
            copy.start()

    def wait_tail():
        for copy in write.tail:
            copy.wait()

    def either(ragged, whole):
        if not write.tail:
            whole()
            return
        last = block == cfg.nv - 1
        pl.when(last)(ragged)
        pl.when(jnp.logical_not(last))(whole)

    @pl.when(i == cfg.nb - 1)
    def _():
        @pl.when(jj > 0)
        def _():
            write.full.wait()

        _stage_dw(dw_acc, dw_stage, cfg)
        either(start_tail, write.full.start)
        pl.when((jj == cfg.nv_per_core - 1) | (block == cfg.nv - 1))(lambda: either(wait_tail, write.full.wait))


def _stage_dw(dw_acc, dw_stage, cfg: BackwardConfig) -> None:
    """The finished ``dw`` tile into the staging buffer, in ``w``'s dtype and layout; an accumulator
    kept transposed (:attr:`BackwardConfig.dw_transposed`) goes over in ``[128, 512]`` pieces (the
    piece size does not change libtpu's schedule: v6e, 128 and 512 columns alike)."""
    if not cfg.dw_transposed:
        hidden = pl.ds(0, cfg.tile_hidden)  # the accumulator's rows past H are the padding's zeros
        tile = dw_acc[:, hidden] if cfg.w_layout == "vh" else dw_acc[hidden, :]
        dw_stage[...] = tile.astype(dw_stage.dtype)
        return
    for h in range(0, cfg.hidden, LANES):
        for v in range(0, cfg.block_v, _DW_PIECE_COLUMNS):
            width = min(_DW_PIECE_COLUMNS, cfg.block_v - v)
            piece = dw_acc[pl.ds(h, LANES), pl.ds(v, width)]
            dw_stage[pl.ds(v, width), pl.ds(h, LANES)] = piece.T.astype(dw_stage.dtype)


def _dx_step(w_ref, d: jax.Array, dx_buf, dx_rows: _DxRows, t: _TokenStep, jj, cfg: BackwardConfig) -> None:
    """The core's dx partial: read-add-write in HBM, the product added straight into the slot; the
    write of one token block is waited for while the next one computes, and the last live one's at once."""

    @pl.when(jj > 0)
    def _():
        dx_rows.read.wait()

    for chunk in _hidden_chunks(cfg):
        if cfg.w_layout == "vh":
            dx_buf[dx_rows.slot, :, chunk] += common.matmul(d, w_ref[:, chunk], cfg.precision)
        else:
            dx_buf[dx_rows.slot, :, chunk] += common.matmul_nt(d, w_ref[chunk, :], cfg.precision)

    @pl.when(t.position > 0)
    def _():
        dx_rows.previous_write.wait()

    dx_rows.write.start()

    @pl.when(t.position == t.last_live)
    def _():
        dx_rows.write.wait()


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
    row_scale: jax.Array | None = None,
    kept: tuple[jax.Array, jax.Array | None] | None = None,
    live_blocks: common.LiveBlocks | None = None,
    label_rows: LabelRows | None = None,
    kept_maxima: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array, jax.Array | None]:
    """``(dx partials float32 [cores, Np, Hp], dw in w's layout and dtype, kept logits buffer)``.

    With ``live_blocks`` (of ``cfg.block_b``-row blocks) every vocab block walks the live token blocks
    only: a dead block is never read and adds nothing, and its rows of the ``dx`` partials are never
    written (garbage, for the caller to mask).

    With ``cfg.kept_logits``, ``kept`` is ``(logits, running_dw)``: the forward's kept raw logits
    (:func:`ce_pallas_tpu.forward.forward_call`) and the float32 sum of earlier chunks' ``dw`` in
    ``w``'s layout, padded to ``nv * block_v`` vocab entries (``None`` for the first chunk,
    ``cfg.dw_from_running`` False); the ``dw`` returned is that sum plus this call's (the same buffer:
    donated, aliased), or with ``cfg.dw_to_running`` False the finished ``dw`` in ``w``'s dtype and shape.
    The third value is the kept logits' buffer as the call leaves it, for the next chunk's forward to write
    into: the logits, or with :attr:`BackwardConfig.delta_over_logits` ``delta`` over them (donated,
    aliased); ``None`` without ``kept``.

    ``x`` is ``[N, H]``, ``w`` is ``[H, V]`` (``[V, H]`` for ``cfg.w_layout == "vh"``); ``labels``
    (int32), ``row_scale`` (float32, only with ``cfg.with_row_scale``), ``lse``, ``expected`` and the
    cotangents are ``[N, 1]`` (``g_sum`` only with ``cfg.with_sum``, ``expected`` and ``g_expected``
    only with ``cfg.with_expected``). ``label_rows`` exactly with ``cfg.label_rows`` (:class:`LabelRows`).
    ``kept_maxima`` exactly with ``cfg.kept_bf16``: the lane maxima of the bf16 kept logits
    (:func:`ce_pallas_tpu.forward.kept_maxima_shape`).
    """
    in_specs, operands = _inputs(x, w, labels, row_scale, lse, g_lse, g_label, g_sum, expected, g_expected,
                                 cfg)
    dw_shape, dw_dtype, aliases = w.shape, w.dtype, {}
    if cfg.hidden_split != 1 and not (cfg.kept_logits and cfg.hidden == cfg.hp
                                      and cfg.hp % (cfg.hidden_split * LANES) == 0
                                      and cfg.hidden_tile % cfg.block_h == 0):
        raise ValueError(f"backward_call: hidden_split={cfg.hidden_split} needs the kept-logits mode and "
                         f"H={cfg.hidden} a whole number of {cfg.hidden_split} tiles of 128 that "
                         f"block_h={cfg.block_h} divides")
    if cfg.delta_over_logits and not (cfg.kept_logits and cfg.hidden_split > 1):
        raise ValueError("backward_call: delta_over_logits needs the kept-logits mode in hidden tiles")
    if cfg.x_transposed and not (cfg.kept_logits and (cfg.w_layout == "hv" or cfg.kept_dw_transposed)):
        raise ValueError("backward_call: x_transposed needs the kept-logits mode and an [H, V] head, or dw held "
                         "transposed")
    if cfg.kept_dw_transposed and not (cfg.kept_logits and cfg.w_layout == "vh" and cfg.hidden == cfg.hp
                                       and cfg.hidden_split == 1 and not cfg.label_rows):
        raise ValueError("backward_call: kept_dw_transposed needs the kept-logits mode, a [V, H] head, the hidden "
                         f"size whole and a multiple of {LANES}, and no label_rows")
    if cfg.dx_transposed and not (cfg.kept_logits and cfg.hidden_split == 1
                                  and (cfg.nb == 1 or cfg.block_b % LANES == 0)):
        raise ValueError("backward_call: dx_transposed needs the kept-logits mode, the hidden size whole and token "
                         f"blocks of whole lanes ({LANES}) where there are several")
    if cfg.cotangent_in_exponent and not cfg.kept_logits:
        raise ValueError("backward_call: cotangent_in_exponent needs the kept-logits mode")
    if cfg.label_rows and not (cfg.kept_logits and cfg.w_layout == "vh"):
        raise ValueError("backward_call: label_rows needs the kept-logits mode and a [V, H] head")
    if cfg.label_rows != (label_rows is not None):
        raise ValueError("backward_call: label_rows must be given exactly when cfg.label_rows")
    if cfg.kept_bf16 and not (cfg.kept_logits and cfg.hidden_split == 1 and cfg.kept_block_v % LANES == 0
                              and cfg.block_v % LANES == 0 and max(cfg.block_v, cfg.kept_block_v)
                              % min(cfg.block_v, cfg.kept_block_v) == 0):
        raise ValueError(f"backward_call: kept_bf16 needs the kept-logits mode, the hidden size whole and "
                         f"kept_block_v={cfg.kept_block_v} a multiple or a divisor of block_v={cfg.block_v}, both "
                         f"multiples of {LANES}")
    if cfg.kept_bf16 != (kept_maxima is not None):
        raise ValueError("backward_call: kept_maxima must be given exactly when cfg.kept_bf16")
    if cfg.logits_row_block and not (cfg.kept_logits and not cfg.delta_over_logits):
        raise ValueError("backward_call: logits_row_block needs the kept-logits mode without delta_over_logits")
    if cfg.kept_logits:
        if kept is None:
            raise ValueError("backward_call: cfg.kept_logits needs kept=(logits, running_dw)")
        logits, running = kept
        padded = running_dw_shape(cfg)
        if cfg.dw_from_running != (running is not None):
            raise ValueError("backward_call: running_dw must be given exactly when cfg.dw_from_running")
        if running is not None and (running.shape != padded or running.dtype != jnp.float32):
            raise ValueError(f"backward_call: running_dw must be float32 {padded}, got {running.dtype} {running.shape}")
        nvc, first_block = cfg.nv_per_core, cfg.logits_row_block
        if (first_block + cfg.nb) * cfg.block_b > logits.shape[0]:
            raise ValueError(f"backward_call: {cfg.nb} token blocks of {cfg.block_b} rows from block {first_block} "
                             f"run past the kept logits' {logits.shape[0]} rows")
        in_specs.append(pl.BlockSpec((cfg.block_b, cfg.block_v),
                                     lambda c, j, i: (first_block + i, c * nvc + _hidden_and_vocab_step(j, cfg)[1])))
        operands.append(logits)
        logits_index = len(operands) - 1
        if kept_maxima is not None:
            in_specs.append(_maxima_spec(cfg))
            operands.append(kept_maxima)
        if running is not None:
            in_specs.append(pl.BlockSpec(memory_space=pl.ANY))
            operands.append(running)
        elif cfg.dw_zeros_by_dma:  # one zero block, read into each slot before its vocab block
            in_specs.append(pl.BlockSpec(memory_space=pl.ANY))
            operands.append(jnp.zeros(cfg.dw_acc_shape, jnp.float32))
        if cfg.dw_to_running:
            dw_shape, dw_dtype = padded, jnp.float32
            if running is not None:
                aliases = {len(operands) - 1: 0}
        if cfg.delta_over_logits:  # the kept logits come back with delta over them: a third output, in place
            aliases[logits_index] = 2
        if label_rows is not None:  # whole, in SMEM
            in_specs += [pl.BlockSpec(memory_space=pltpu.SMEM)] * len(label_rows)
            operands += list(label_rows)
    skipping = live_blocks is not None
    if live_blocks is not None:  # the scalar-prefetch operands come first
        operands = [*live_blocks, *operands]
        aliases = {index + 2: out for index, out in aliases.items()}
    axes, operands = common.per_device_operands(operands, cfg.interpret)
    out_shape = [
        common.out_type(dw_shape, dw_dtype, axes),
        common.out_type((cfg.num_cores, cfg.hp, cfg.padded_n) if cfg.dx_transposed
                        else (cfg.num_cores, cfg.padded_n, cfg.hp), jnp.float32, axes),
    ]
    if cfg.delta_over_logits:
        assert kept is not None
        out_shape.append(common.out_type(kept[0].shape, jnp.float32, axes))
    out_specs = [pl.BlockSpec(memory_space=pl.ANY)] * len(out_shape)  # dw, the dx partials: HBM, manual DMAs
    if cfg.kept_logits:
        scratch = [
            pltpu.VMEM((2, *cfg.dw_acc_shape), jnp.float32),  # dw: two slots the running sum's DMAs fill and empty
            # the chunk's dx partial, resident
            pltpu.VMEM((cfg.hidden_tile, cfg.padded_n) if cfg.dx_transposed else (cfg.padded_n, cfg.hidden_tile),
                       jnp.float32),
            pltpu.SemaphoreType.DMA((4,)),  # dw in, dx out, dw out, delta over the kept logits
        ]
        if not cfg.dw_to_running:
            scratch += _dw_staging(cfg, dw_dtype)
    else:
        stage, *remainder = _dw_staging(cfg, dw_dtype)
        scratch = [
            pltpu.VMEM(cfg.dw_acc_shape, jnp.float32),  # dw accumulator
            stage,
            pltpu.VMEM((2, cfg.block_b, cfg.hp), jnp.float32),  # dx partial rows: two slots, read-add-write
            pltpu.SemaphoreType.DMA((3,)),  # dx rows in, dx rows out, dw out
            *remainder,
        ]
    dw, dx_partials, *after = pl.pallas_call(
        common.with_prefetch(functools.partial(_backward_kernel, cfg=cfg), skipping),
        # The second axis walks the core's vocab blocks once per hidden tile (:attr:`BackwardConfig.hidden_split`).
        **common.grid_arguments((cfg.num_cores, cfg.hidden_split * cfg.nv_per_core, cfg.nb), in_specs, out_specs,
                                scratch, skipping, token_axis=2, pinned={}),
        out_shape=out_shape,
        compiler_params=pltpu.CompilerParams(
            # The core axis is "parallel": Mosaic spreads it over the TensorCores of the device the
            # call is compiled for (both on v4/v5p megacore) and loops over it on a one-core device.
            dimension_semantics=("parallel", "arbitrary", "arbitrary"),
            vmem_limit_bytes=cfg.vmem_limit_bytes,
        ),
        interpret=cfg.interpret,
        input_output_aliases=aliases,
        cost_estimate=pl.CostEstimate(
            flops=(4 if cfg.kept_logits else 6) * cfg.n * cfg.hp * cfg.v,
            transcendentals=cfg.n * cfg.v * (2 if cfg.logit_soft_cap is not None else 1),
            bytes_accessed=w.size * w.dtype.itemsize * 2
            + cfg.nv * (x.size * x.dtype.itemsize + 8 * cfg.padded_n * cfg.hp),
        ),
        name="ce_pallas_tpu_backward",
    )(*operands)
    if cfg.dx_transposed:
        dx_partials = jnp.swapaxes(dx_partials, 1, 2)
    if kept is None:
        return dx_partials, dw, None
    return dx_partials, dw, after[0] if after else kept[0]


def _maxima_spec(cfg: BackwardConfig) -> pl.BlockSpec:
    """The lane maxima of a kept block (:attr:`BackwardConfig.kept_bf16`): 128 for each forward block it spans, or
    its forward block's 128 where those are wider."""
    nvc, first_block = cfg.nv_per_core, cfg.logits_row_block

    def vocab_block(c, j):
        return c * nvc + _hidden_and_vocab_step(j, cfg)[1]

    if cfg.block_v >= cfg.kept_block_v:
        return pl.BlockSpec((cfg.block_b, cfg.block_v // cfg.kept_block_v * LANES),
                            lambda c, j, i: (first_block + i, vocab_block(c, j)))
    per_kept = cfg.kept_block_v // cfg.block_v
    return pl.BlockSpec((cfg.block_b, LANES), lambda c, j, i: (first_block + i, vocab_block(c, j) // per_kept))


def _dw_staging(cfg: BackwardConfig, dtype: Any) -> list[Any]:
    """VMEM for the finished ``dw`` tile on its way out in ``w``'s dtype: the staging block, and for a
    ragged last vocab block the buffer of its entries past the last whole layout tile (:func:`_dw_write`)."""
    buffers = [pltpu.VMEM(_block_shape(cfg, cfg.tile_hidden), dtype)]
    remainder = _dw_tail_split(cfg)[1]
    if remainder:
        buffers.append(pltpu.VMEM(_block_shape(dataclasses.replace(cfg, block_v=remainder), cfg.tile_hidden),
                                  dtype))
    return buffers


def _w_block_spec(cfg: BackwardConfig) -> pl.BlockSpec:
    """The spec of the ``w`` blocks: the core's vocab blocks (the last one repeated on a core
    a block short). They change once per vocab block (every nb steps); see BackwardConfig.w_buffers.
    (Interpret mode ignores buffer counts.)"""
    nvc, nv = cfg.nv_per_core, cfg.nv
    vh = cfg.w_layout == "vh"

    def w_block(c, j, i):
        h, jj = _hidden_and_vocab_step(j, cfg)
        block = jnp.minimum(c * nvc + jj, nv - 1)
        return (block, h) if vh else (h, block)

    return common.block_spec(_w_block_shape(cfg), w_block, pl.Buffered(cfg.w_buffers))


def _w_block_shape(cfg: BackwardConfig) -> tuple[int, int]:
    """A ``w`` block (and ``dw``'s accumulator): ``[Hp, block_v]``, or ``[block_v, Hp]`` for a ``[V, H]`` head
    (``Hp`` the hidden tile's, :attr:`BackwardConfig.hidden_split`)."""
    return _block_shape(cfg, cfg.hidden_tile)


def _block_shape(cfg: BackwardConfig, hidden: int) -> tuple[int, int]:
    """A ``[hidden, block_v]`` block of ``w``'s layout (``[block_v, hidden]`` for a ``[V, H]`` head)."""
    return (cfg.block_v, hidden) if cfg.w_layout == "vh" else (hidden, cfg.block_v)


def _inputs(x, w, labels, row_scale, lse, g_lse, g_label, g_sum, expected, g_expected,
            cfg: BackwardConfig) -> tuple[list[pl.BlockSpec], list[jax.Array]]:
    """The kernel's input specs and operands: x, w, labels, the row scale if any, then the other
    per-row columns (the optional ones last)."""

    def rows(c, j, i):
        return (i, 0)

    column = pl.BlockSpec((cfg.block_b, 1), rows)
    if cfg.x_transposed:  # x.T resident, zero-padded to [Hp, Np] here (one XLA copy a call)
        x_spec = common.block_spec((cfg.hidden_tile, cfg.padded_n),
                                   lambda c, j, i: (_hidden_and_vocab_step(j, cfg)[0], 0), pl.Buffered(1))
        x = jnp.pad(x, ((0, cfg.padded_n - cfg.n), (0, cfg.hp - cfg.hidden))).T
    elif cfg.kept_logits:  # the chunk's x resident in VMEM: fetched once per core, one buffer
        x_spec = common.block_spec((cfg.padded_n, cfg.hidden_tile),
                                   lambda c, j, i: (0, _hidden_and_vocab_step(j, cfg)[0]), pl.Buffered(1))
    else:
        x_spec = pl.BlockSpec((cfg.block_b, cfg.hp), rows)
    if cfg.kept_logits:  # the per-row columns in one resident slab (:class:`_RowSlab`), zero past N
        given = {"y": jax.lax.bitcast_convert_type(labels, jnp.float32), "scale": row_scale, "lse": lse,
                 "g_lse": g_lse, "g_label": g_label, "g_sum": g_sum, "expected": expected, "g_expected": g_expected}
        fields = _row_fields(cfg)
        missing = [name for name in fields if given[name] is None]
        assert not missing, f"the config asks for {missing}"
        columns = [jnp.pad(given[name].astype(jnp.float32), ((0, cfg.padded_n - cfg.n), (0, 0))) for name in fields]
        slab = jnp.concatenate(columns, axis=0 if _slab_by_field(cfg) else 1)
        slab_spec = common.block_spec(slab.shape, lambda c, j, i: (0, 0), pl.Buffered(1))
        return [x_spec, _w_block_spec(cfg), slab_spec], [x, w, slab]
    in_specs = [x_spec, _w_block_spec(cfg), column]
    operands = [x, w, labels]
    if cfg.with_row_scale:
        assert row_scale is not None, "cfg.with_row_scale needs row_scale"
        in_specs.append(column)
        operands.append(row_scale)
    in_specs += [column, column, column]
    operands += [lse, g_lse, g_label]
    if cfg.with_sum:
        assert g_sum is not None, "cfg.with_sum needs g_sum"
        in_specs.append(column)
        operands.append(g_sum)
    if cfg.with_expected:
        assert expected is not None and g_expected is not None, "cfg.with_expected needs expected and g_expected"
        in_specs += [column, column]
        operands += [expected, g_expected]
    return in_specs, operands
