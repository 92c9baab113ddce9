"""A pair of heads (contract version 5: a dense distillation teacher): both heads' logit tiles in one grid step.

The student's ``a = s cap_s(x @ w)`` and the teacher's ``b = s cap_t(u @ v)`` tiles (``u = teacher_x``, ``v =
teacher_w``, :mod:`ce_core.contract.pair`) are formed side by side in VMEM and never reach HBM. Two kernels:

- **Statistics** (:func:`pair_stats_call`), grid ``(token blocks, vocab blocks)``, the vocab axis a reduction.
  Every running statistic is kept per lane (``[rows, 128]``: a tile's 128-column groups folded in elementwise),
  so no step waits on a cross-lane reduction; the lanes are combined once, at the row's last block.
  ``online``: each lane keeps a reference per head and the sum of exps against it (an online logsumexp) and, for
  a KL, the divergence's running sum against the reference of the distribution that weighs it
  (``sum_j e^(b_j - m_b) (b_j - a_j)`` for the forward KL, ``sum_j e^(a_j - m_a) (a_j - b_j)`` for the reverse);
  at the row's last block ``KL(q||p) = sum_j q_j (b_j - a_j) - lse_b + lse_a`` (the reverse alike). A row's first
  block sets the references to the lanes' maxima; later blocks are streamed against them as they stand (no max,
  no rescale) and a step whose sums overflow is redone exactly, as the single-head forward does. ``given`` (the
  whole rows' lses known: a JSD's second pass, a vocab shard's part): each tile adds its terms of the contract's
  sums as they stand.
- **Gradient** (:func:`pair_grad_call`), one chunk of ``block_b`` token rows per call, grid ``(cores, vocab
  blocks per core)``: the chunk's ``x`` and ``u`` stay in VMEM, each step recomputes both heads' tiles for its
  vocab block, forms the student's ``delta`` from the whole rows' statistics, adds ``delta @ w.T`` into the
  core's float32 ``dx`` (resident over the core's blocks) and writes ``dw``'s block as the running float32 sum
  it read plus ``x.T @ delta`` (the sum's blocks aliased in and out: each is read and written once a call).
  The wrapper walks the chunks (a ``fori_loop``) and sums the cores' ``dx``. With an odd number of vocab blocks on
  a two-core chip the second core takes one block fewer (its last step repeats a block and does nothing).

A KL's value and gradient take two passes over both heads (statistics, gradient: ``2N(Hs + Ht)V`` and then
``2N(Hs + Ht)V + 4N Hs V`` of products); the JSD three (its mixture needs the whole rows' lses first).

Ragged edges: vocab columns past ``V`` are set to a large negative finite logit in both heads (their
probabilities are 0 and every term of theirs is 0; ``-inf`` would make ``0 * (inf - inf)``), and ``w``'s garbage
columns are zeroed in place before ``dx``'s product. Rows past ``N`` and dead rows (``live`` false) are computed
as they stand by the statistics kernel (a row's statistics are its own) and replaced by a zero hidden state's
(each lse ``log V``, every divergence term 0) in the wrapper; the gradient kernel zeroes their hidden states in
place once per chunk and gives them a zero cotangent, so their ``delta`` is exactly 0 without a select on it.
Hidden sizes need not be multiples of 128: the blocks span the round-up and the garbage past ``H`` is zeroed in
both operands, in place (:func:`ce_pallas_tpu.common.zero_hidden_tail`). Masks are written into the VMEM blocks,
never applied as a select on a loaded bf16 operand or on ``delta``: libtpu's static profiler refuses a matmul fed
by one (a type check on the packed bf16 values), and the profile is how the kernels' speed is measured.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from ce_core.extend import PairSpec, PairStats, vary_like
from ce_pallas_tpu import common, tile_stats, tiling
from ce_pallas_tpu.layout import LANES, round_up
from ce_pallas_tpu.target import active_cores, current_target, interpret_params

#: The logit given to vocab columns past ``V``: far below any real one, yet finite.
MASKED_LOGIT = -1e30
#: ``log2(e)``: the given pass takes its logits in bits, so that its exps and its mixture's log are the
#: hardware's base-2 ones (the natural ones multiply their argument or result by a constant first).
LOG2E = 1.0 / math.log(2.0)
#: The statistics kernels' modes: KLs in one pass, the lses alone, or the sums with the lses given.
MODES = ("online", "lses", "given")


@dataclasses.dataclass(frozen=True)
class PairConfig(common.GridCounts):
    """Static shape and tiling of one pair kernel call (hashable)."""

    n: int  # token rows of the call (the gradient kernel: of its chunk)
    hs: int  # the student's hidden size
    ht: int  # the teacher's hidden size
    v: int  # vocab size
    block_b: int  # token rows per block (the gradient kernel: per chunk)
    block_v: int  # vocab columns per block
    num_cores: int  # the gradient kernel's core split of the vocab blocks
    spec: PairSpec
    precision: str  # "default" (bf16 MXU passes), "high" or "highest"
    interpret: object  # False, or pltpu.InterpretParams
    vmem_limit_bytes: int | None
    streamed: bool = False  # the statistics kernel streams a row's later vocab blocks (:data:`STREAMED_STATS`)

    @property
    def hsp(self) -> int:
        return round_up(self.hs, LANES)

    @property
    def htp(self) -> int:
        return round_up(self.ht, LANES)


# ---------------------------------------------------------------------------------------------
# Traced inside the kernels.


def _zero_tails(x_ref, w_ref, hidden: int, hp: int, layout: str = "hv") -> None:
    """Zero the garbage past ``hidden`` in a token block and a head block in ``layout``, in place (either may be
    None); a ``[V, H]`` head block has it in its last columns, as ``x``. In place, not as a select on the loaded
    bf16 values: libtpu's profiler refuses a matmul fed by such a select."""
    if hidden == hp:
        return
    if x_ref is not None:
        common.zero_hidden_tail(x_ref, None, hidden, hp)
    if w_ref is not None and layout == "hv":
        common.zero_hidden_tail(None, w_ref, hidden, hp)
    elif w_ref is not None:
        common.zero_hidden_tail(w_ref, None, hidden, hp)


def _zero_head_columns(w_ref, block, cfg: PairConfig) -> None:
    """The student head block's vocab entries past ``V`` zeroed in place (along the block's own vocab axis)."""
    vocab_axis = 1 if cfg.spec.w_layout == "hv" else 0
    entries = block * cfg.block_v + jax.lax.broadcasted_iota(jnp.int32, w_ref.shape, vocab_axis)
    w_ref[...] = jnp.where(entries < cfg.v, w_ref[...], jnp.zeros((), w_ref.dtype))


def _logits(x: jax.Array, w: jax.Array, layout: str, cap: float | None, scale: jax.Array, precision: str,
            cols_valid: jax.Array | None) -> tuple[jax.Array, jax.Array | None]:
    """``s * cap(x @ w)`` (float32 ``[rows, c]``; given ``cols_valid``, the columns past ``V`` at
    :data:`MASKED_LOGIT`) and ``cap'`` there."""
    raw = common.matmul(x, w, precision) if layout == "hv" else common.matmul_nt(x, w, precision)
    capped, t = common.soft_cap(raw, cap)
    slope = None if t is None else 1.0 - t * t
    logits = scale * capped
    return (logits if cols_valid is None else jnp.where(cols_valid, logits, MASKED_LOGIT)), slope


def _per_block(block, cfg: PairConfig, step) -> None:
    """``step(masked)`` for this grid step's vocab ``block``: ``masked`` (columns past ``V`` to mask) on a ragged last
    block only, so no other block pays a select an element."""
    if cfg.v % cfg.block_v == 0:
        step(False)
        return
    last = block == cfg.nv - 1
    pl.when(last)(functools.partial(step, True))
    pl.when(jnp.logical_not(last))(functools.partial(step, False))


def _cols_valid(block, cfg: PairConfig) -> jax.Array:
    cols = block * cfg.block_v + jax.lax.broadcasted_iota(jnp.int32, (1, cfg.block_v), 1)
    return cols < cfg.v


def _rows_valid(rows: int, n: int, live: jax.Array) -> jax.Array:
    """Rows before ``n`` whose ``live`` (``[rows, 1]`` float32, 1 or 0) is set, as ``[rows, 1]`` bools."""
    return (jax.lax.broadcasted_iota(jnp.int32, (rows, 1), 0) < n) & (live > 0.5)


def _groups(tile: jax.Array) -> list[jax.Array]:
    """A ``[rows, c]`` tile's 128-wide column groups (``[rows, 128]`` each): one column per lane."""
    return [tile[:, g:g + LANES] for g in range(0, tile.shape[1], LANES)]


def _lane_sum(tile: jax.Array) -> jax.Array:
    """A tile's column groups added elementwise into ``[rows, 128]``: no cross-lane reduction (that waits for the
    tile's last column; one at the row's end suffices)."""
    return functools.reduce(jnp.add, _groups(tile))


def _rows(lanes: jax.Array) -> jax.Array:
    return jnp.sum(lanes, axis=1, keepdims=True)


#: The smallest normal float32: the mixture's floor, where both probabilities underflow (their terms are then 0).
_TINY = float(jnp.finfo(jnp.float32).tiny)


def _log_mixture(p: jax.Array, q: jax.Array, beta: float, log=jnp.log) -> jax.Array:
    """``log(beta q + (1 - beta) p)`` (the contract's mixture) from the probabilities: one transcendental where a
    ``logaddexp`` of the log-probabilities takes two and a dozen vector operations (``log``: ``jnp.log2`` in bits)."""
    return log(jnp.maximum(beta * q + (1.0 - beta) * p, _TINY))


def _given_terms(a: jax.Array, b: jax.Array, lse_a: jax.Array, lse_b: jax.Array,
                 spec: PairSpec) -> tuple[jax.Array, jax.Array | None]:
    """This tile's terms of the divergence's and the JSD's ``student_term`` sums (None for a KL), per lane
    (``[rows, 128]`` each), the lses given: :func:`ce_core.extend.pair_stats_of`'s terms, per tile. In bits: the
    logits and lses in units of ``log 2`` (times :data:`LOG2E`), so are the terms (v6e, Qwen3-0.6B taught by
    Qwen3-8B: the JSD's given pass 1.155 -> 1.120 of its MXU minimum, docs/notes/2026-11-29-pallas-pair-kernels.md)."""
    log_p, log_q = a - lse_a, b - lse_b
    p, q = jnp.exp2(log_p), jnp.exp2(log_q)
    if spec.divergence == "forward_kl":
        return _lane_sum(q * (log_q - log_p)), None
    if spec.divergence == "reverse_kl":
        return _lane_sum(p * (log_p - log_q)), None
    log_m = _log_mixture(p, q, spec.beta, jnp.log2)
    student = _lane_sum(p * (log_p - log_m))
    return spec.beta * _lane_sum(q * (log_q - log_m)) + (1.0 - spec.beta) * student, student


def _delta(a: jax.Array, b: jax.Array, slope: jax.Array | None, scale: jax.Array, lse_a: jax.Array,
           lse_b: jax.Array, divergence: jax.Array, student_term: jax.Array, g: jax.Array,
           spec: PairSpec) -> jax.Array:
    """The cotangent of the student's raw logits (:func:`ce_core.extend.pair_delta`, stats as ``[rows, 1]``)."""
    log_p, log_q = a - lse_a, b - lse_b
    p = jnp.exp(log_p)
    if spec.divergence == "forward_kl":
        d_a = p - jnp.exp(log_q)
    elif spec.divergence == "reverse_kl":
        d_a = p * ((log_p - log_q) - divergence)
    else:
        d_a = (1.0 - spec.beta) * p * ((log_p - _log_mixture(p, jnp.exp(log_q), spec.beta)) - student_term)
    delta = (g * scale) * d_a
    return delta if slope is None else delta * slope


# ---------------------------------------------------------------------------------------------
# Dead token blocks: the statistics kernel's token axis walks a permutation of the blocks.


class StatsWalk(NamedTuple):
    """Which token block each position of the statistics kernel's token axis takes (scalar prefetch, int32 ``[nb]``
    each): ``owner`` a permutation of the blocks, the live ones (holding a live row) first within each core's share
    of the positions and spread evenly over the shares; ``reads`` the block whose operands a position reads: its
    own where live, else the share's last live block, and ``vocab_floor`` the least vocab block it reads (0 where
    live, the last where dead), so that a dead position fetches nothing new; ``walk`` the body's (:func:`common.
    token_block`'s encoding: ``~reads`` where dead), which runs no matmul there. Each index map reads one scalar.
    The axis stays ``"parallel"`` (split between v5p's cores): each position writes only its own block's rows (a
    dead block's are garbage, replaced by :func:`pair_row_stats`)."""

    walk: jax.Array
    reads: jax.Array
    vocab_floor: jax.Array
    owner: jax.Array

    @classmethod
    def of(cls, block_live: jax.Array, shares: int, nv: int) -> StatsWalk:
        """The walk of the token blocks whose bool ``block_live [nb]`` holds (:func:`common.blocks_live`) over
        ``shares`` contiguous shares of the positions (one per TensorCore that splits a ``"parallel"`` axis), ``nv``
        vocab blocks a row."""
        nb = block_live.shape[0]
        share_size = pl.cdiv(nb, shares)
        positions = jnp.arange(nb, dtype=jnp.int32)
        share, slot = positions // share_size, positions % share_size
        # Positions in the order they are filled: slot by slot, across the shares.
        filling = jnp.argsort(slot * shares + share).astype(jnp.int32)
        blocks = jnp.argsort(jnp.logical_not(block_live), stable=True).astype(jnp.int32)  # live first, in order
        owner = jnp.zeros(nb, jnp.int32).at[filling].set(blocks)
        taken = jnp.zeros(nb, bool).at[filling].set(positions < jnp.sum(block_live))
        per_share = jnp.zeros(shares, jnp.int32).at[share].add(taken.astype(jnp.int32))
        last = owner[share * share_size + jnp.maximum(per_share[share] - 1, 0)]
        reads = jnp.where(taken, owner, last)
        return cls(jnp.where(taken, owner, jnp.bitwise_not(last)), reads,
                   jnp.where(taken, 0, nv - 1).astype(jnp.int32), owner)


def _walked(specs: list[pl.BlockSpec], *, reads: bool, heads: tuple[int, ...] = ()) -> list[pl.BlockSpec]:
    """``specs`` over ``(position, vocab block)`` as index maps that take the :class:`StatsWalk` refs: an operand's
    (``reads``) the token block a position reads, or for the ``heads`` (indices into ``specs``: blocks of the vocab
    axis only) a vocab block at least the position's floor (a dead one keeps the last); an output's the position's
    own block. Each map reads one scalar."""

    def mapped(index_map, head: bool):
        def index(i, j, walk_ref, reads_ref, floor_ref, owner_ref):
            del walk_ref
            if not reads:
                return index_map(owner_ref[i], j)
            if head:
                return index_map(i, jnp.maximum(j, floor_ref[i]))
            return index_map(reads_ref[i], j)

        return index

    return [dataclasses.replace(spec, index_map=mapped(spec.index_map, k in heads)) for k, spec in enumerate(specs)]


# ---------------------------------------------------------------------------------------------
# The statistics kernel.


def _stats_tiles(x_ref, w_ref, u_ref, v_ref, scale_ref, cfg: PairConfig,
                 masked: bool, in_bits: bool = False) -> tuple[jax.Array, jax.Array]:
    """Both heads' logit tiles of this grid step ``(token block, vocab block)``, the columns past ``V`` masked if
    ``masked``; ``in_bits``: times :data:`LOG2E` (folded into the row scale). Rows past ``N`` and dead rows are
    computed as they stand: each row's statistics are their own, and the wrapper replaces a dead row's."""
    spec = cfg.spec
    j = pl.program_id(1)
    cols = _cols_valid(j, cfg) if masked else None
    scale = scale_ref[...] * LOG2E if in_bits else scale_ref[...]

    @pl.when(j == 0)  # a token block's hidden states arrive with the row's first vocab block and stay
    def _():
        _zero_tails(x_ref, None, cfg.hs, cfg.hsp)
        _zero_tails(u_ref, None, cfg.ht, cfg.htp)

    _zero_tails(None, w_ref, cfg.hs, cfg.hsp, spec.w_layout)
    _zero_tails(None, v_ref, cfg.ht, cfg.htp, spec.teacher_w_layout)
    a = _logits(x_ref[...], w_ref[...], spec.w_layout, spec.logit_soft_cap, scale, cfg.precision, cols)[0]
    b = _logits(u_ref[...], v_ref[...], spec.teacher_w_layout, spec.teacher_logit_soft_cap, scale, cfg.precision,
                cols)[0]
    return a, b


def _given_kernel(x_ref, w_ref, u_ref, v_ref, scale_ref, lse_a_ref, lse_b_ref, div_ref, student_ref,
                  div_acc, student_acc, *, cfg: PairConfig, block, live):
    """The sums' parts over this call's columns, the whole rows' lses given (summed per lane, then per row).
    ``block``, ``live``: the token block this position takes and whether it holds a live row
    (:func:`_stats_body`)."""
    del block
    j = pl.program_id(1)

    @pl.when(common.both(j == 0, live))
    def _():
        div_acc[...] = jnp.zeros_like(div_acc)
        student_acc[...] = jnp.zeros_like(student_acc)

    def step(masked: bool) -> None:
        tiles = _stats_tiles(x_ref, w_ref, u_ref, v_ref, scale_ref, cfg, masked, in_bits=True)
        div, student = _given_terms(*tiles, lse_a_ref[...] * LOG2E, lse_b_ref[...] * LOG2E, cfg.spec)
        div_acc[...] += div
        if student is not None:
            student_acc[...] += student

    common.when_live(live, lambda: _per_block(j, cfg, step))

    @pl.when(common.both(j == cfg.nv - 1, live))
    def _():  # the sums in bits, back in nats
        div_ref[...] = _rows(div_acc[...]) * math.log(2.0)
        student_ref[...] = _rows(student_acc[...]) * math.log(2.0)


def _online_kernel(x_ref, w_ref, u_ref, v_ref, scale_ref, lse_a_ref, lse_b_ref, div_ref, m_a, m_b, z_a, z_b,
                   s_acc, redo_ref=None, *, cfg: PairConfig, with_divergence: bool, block, live):
    """Both lses by an online logsumexp and, ``with_divergence`` (a KL), its running sum, per lane (``[rows, 128]``,
    the lanes combined at the row's last block).

    Each lane keeps a reference ``m`` (a running max as of its last exact step) and its sums against it. A row's
    first vocab block is taken exactly (the references moved up to each lane's max, the sums rescaled); with
    ``cfg.streamed`` every later block is streamed: its exps are taken against the references as they stand, with
    no max and no rescale (the element's vector work that v6e's MXU would otherwise wait on), else taken exactly
    too. A streamed step whose sums pass
    :data:`ce_pallas_tpu.tile_stats.OVERFLOW_SUM` (a logit ~30 nats above its lane's reference) is redone exactly
    from the state before it: the sums sit in two slots, the step reading one and writing the other. The
    references are written by exact steps only; ``redo_ref`` (SMEM, streamed only) says whether a step is (re)done
    exactly. ``block``, ``live``: as for :func:`_given_kernel`."""
    j = pl.program_id(1)
    # A streamed step's redo needs the state before it: two slots, read one and write the other. Taken exactly,
    # every step reads and writes one (a fixed address: the slot's index is not computed a step).
    previous, current = ((j + 1) % 2, j % 2) if cfg.streamed else (0, 0)
    forward = cfg.spec.divergence == "forward_kl"
    sums = (z_a, z_b, s_acc)

    def divergence_terms(exps_a, exps_b, groups_a, groups_b) -> list[jax.Array]:
        """Each group's terms of the KL's running sum (a masked column has ``a == b`` and adds nothing)."""
        if forward:
            return [e * (gb - ga) for e, ga, gb in zip(exps_b, groups_a, groups_b, strict=True)]
        return [e * (ga - gb) for e, ga, gb in zip(exps_a, groups_a, groups_b, strict=True)]

    def streamed(masked: bool) -> None:
        assert redo_ref is not None
        groups_a, groups_b = map(_groups, _stats_tiles(x_ref, w_ref, u_ref, v_ref, scale_ref, cfg, masked))
        ma, mb = m_a[...], m_b[...]
        exps_a = [jnp.exp(group - ma) for group in groups_a]
        exps_b = [jnp.exp(group - mb) for group in groups_b]
        za = functools.reduce(jnp.add, exps_a, z_a[previous])
        zb = functools.reduce(jnp.add, exps_b, z_b[previous])
        z_a[current], z_b[current] = za, zb
        if with_divergence:
            s_acc[current] = functools.reduce(jnp.add, divergence_terms(exps_a, exps_b, groups_a, groups_b),
                                              s_acc[previous])
        largest = jnp.maximum(za, zb)
        if cfg.n % cfg.block_b:  # a ragged token block's garbage rows never ask for a redo
            rows_left = cfg.n - block * cfg.block_b
            largest = jnp.where(jax.lax.broadcasted_iota(jnp.int32, largest.shape, 0) < rows_left, largest, 0.0)
        redo_ref[0] = tile_stats.overflowed(largest, interpreted=bool(cfg.interpret)).astype(jnp.int32)

    def exact(masked: bool) -> None:
        """The lanes' references moved up to their max over this block, the sums rescaled; the state before the
        block read from the previous slot. A lane that has seen only masked columns sums their count at the masked
        logit, which the combine weighs by 0."""
        groups_a, groups_b = map(_groups, _stats_tiles(x_ref, w_ref, u_ref, v_ref, scale_ref, cfg, masked))
        ma, mb = m_a[...], m_b[...]
        za, zb, s = (ref[previous] for ref in sums)
        new_a = functools.reduce(jnp.maximum, groups_a, ma)
        new_b = functools.reduce(jnp.maximum, groups_b, mb)
        rescale_a, rescale_b = jnp.exp(ma - new_a), jnp.exp(mb - new_b)
        exps_a = [jnp.exp(group - new_a) for group in groups_a]
        exps_b = [jnp.exp(group - new_b) for group in groups_b]
        m_a[...], m_b[...] = new_a, new_b
        z_a[current] = functools.reduce(jnp.add, exps_a, za * rescale_a)
        z_b[current] = functools.reduce(jnp.add, exps_b, zb * rescale_b)
        if with_divergence:
            s_acc[current] = functools.reduce(jnp.add, divergence_terms(exps_a, exps_b, groups_a, groups_b),
                                              s * (rescale_b if forward else rescale_a))

    @pl.when(common.both(j == 0, live))
    def _():  # the state before a row's first block
        for ref in (m_a, m_b):
            ref[...] = jnp.full(ref.shape, MASKED_LOGIT, jnp.float32)
        for ref in sums:
            ref[previous] = jnp.zeros(ref.shape[1:], jnp.float32)

    if cfg.streamed:
        assert redo_ref is not None
        redo_ref[0] = common.both(j == 0, live).astype(jnp.int32)
        pl.when(common.both(j > 0, live))(lambda: _per_block(j, cfg, streamed))
        pl.when(redo_ref[0] != 0)(lambda: _per_block(j, cfg, exact))
    else:
        common.when_live(live, lambda: _per_block(j, cfg, exact))

    @pl.when(common.both(j == cfg.nv - 1, live))
    def _():
        def lse_and_share(m_ref, z_ref) -> tuple[jax.Array, jax.Array, jax.Array]:
            row_max = jnp.max(m_ref[...], axis=1, keepdims=True)
            share = jnp.exp(m_ref[...] - row_max)
            total = _rows(z_ref[current] * share)
            return row_max + jnp.log(total), share, total

        lse_a, share_a, total_a = lse_and_share(m_a, z_a)
        lse_b, share_b, total_b = lse_and_share(m_b, z_b)
        lse_a_ref[...] = lse_a
        lse_b_ref[...] = lse_b
        if not with_divergence:
            div_ref[...] = jnp.zeros_like(lse_a)
        elif forward:
            div_ref[...] = _rows(s_acc[current] * share_b) / total_b - lse_b + lse_a
        else:
            div_ref[...] = _rows(s_acc[current] * share_a) / total_a - lse_a + lse_b


def _head_spec(hp: int, block_v: int, layout: str, index) -> pl.BlockSpec:
    """A head's vocab block ``index(*grid) -> block`` in its layout."""
    if layout == "hv":
        return pl.BlockSpec((hp, block_v), lambda *grid: (0, index(*grid)))
    return pl.BlockSpec((block_v, hp), lambda *grid: (index(*grid), 0))


def _stats_body(kernel, walking: bool):
    """``kernel(*refs, block=, live=)`` as a Pallas body: the token block of this position and whether it is live,
    from the :class:`StatsWalk` refs that come first when ``walking`` (else the position's own block, live)."""

    def body(*refs):
        if not walking:
            return kernel(*refs, block=pl.program_id(0), live=True)
        block, live = common.token_block(pl.program_id(0), refs[0])
        return kernel(*refs[4:], block=block, live=live)

    return body


def pair_stats_call(x: jax.Array, w: jax.Array, u: jax.Array, v: jax.Array, scale: jax.Array, cfg: PairConfig,
                    mode: str, lse: tuple[jax.Array, jax.Array] | None = None,
                    walk: StatsWalk | None = None) -> tuple[jax.Array, ...]:
    """``(lse_a, lse_b, divergence)`` (``mode`` ``"online"``; ``"lses"``: the divergence 0) or ``(divergence,
    student_term)`` (``"given"``, with the whole rows' ``lse``), each float32 ``[N, 1]``. ``scale``: float32 ``[N, 1]``
    (the row scale). Every row's statistics are those of its own hidden states (a dead row's are replaced by
    :func:`pair_row_stats`). With ``walk`` the token blocks without a live row are skipped (their rows' outputs are
    garbage)."""
    if mode not in MODES:
        raise ValueError(f"pair_stats_call: mode must be one of {MODES}, got {mode!r}")
    if (mode == "given") != (lse is not None):
        raise ValueError("pair_stats_call: the lses are given in mode 'given', and only there")
    rows = lambda i, j: (i, 0)  # noqa: E731
    row_spec = pl.BlockSpec((cfg.block_b, 1), rows)
    in_specs = [pl.BlockSpec((cfg.block_b, cfg.hsp), rows), _head_spec(cfg.hsp, cfg.block_v, cfg.spec.w_layout,
                                                                         lambda i, j: j),
                pl.BlockSpec((cfg.block_b, cfg.htp), rows), _head_spec(cfg.htp, cfg.block_v,
                                                                         cfg.spec.teacher_w_layout, lambda i, j: j),
                row_spec]
    inputs = [x, w, u, v, scale]
    if mode == "given":
        assert lse is not None
        in_specs += [row_spec, row_spec]
        inputs += [lse[0].reshape(-1, 1), lse[1].reshape(-1, 1)]
    outputs = 2 if mode == "given" else 3
    lanes = pltpu.VMEM((cfg.block_b, LANES), jnp.float32)
    scratch = ([lanes] * 2 if mode == "given"  # the sums
               else [lanes] * 2  # references
               + [pltpu.VMEM((2 if cfg.streamed else 1, cfg.block_b, LANES), jnp.float32)] * 3  # sums (slots)
               + [pltpu.SMEM((1,), jnp.int32)] * int(cfg.streamed))  # whether this step is (re)done exactly
    out_specs = [row_spec] * outputs
    kernel = (functools.partial(_given_kernel, cfg=cfg) if mode == "given"
              else functools.partial(_online_kernel, cfg=cfg, with_divergence=mode == "online"))
    grid: dict[str, Any]
    if walk is None:
        grid = {"grid": (cfg.nb, cfg.nv), "in_specs": in_specs, "out_specs": out_specs, "scratch_shapes": scratch}
    else:
        inputs = [*walk, *inputs]
        grid = {"grid_spec": pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=4, grid=(cfg.nb, cfg.nv), in_specs=_walked(in_specs, reads=True, heads=(1, 3)),
            out_specs=_walked(out_specs, reads=False), scratch_shapes=scratch)}
    axes, inputs = common.per_device_operands(inputs, cfg.interpret)
    return pl.pallas_call(
        _stats_body(kernel, walk is not None),
        **grid,
        out_shape=[common.out_type((cfg.n, 1), jnp.float32, axes)] * outputs,
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary"),
                                             vmem_limit_bytes=cfg.vmem_limit_bytes),
        interpret=cfg.interpret,
        cost_estimate=pl.CostEstimate(flops=2 * cfg.n * (cfg.hsp + cfg.htp) * cfg.v,
                                      transcendentals=2 * cfg.n * cfg.v,
                                      bytes_accessed=cfg.nb * (w.size * w.dtype.itemsize + v.size * v.dtype.itemsize)),
        name=f"ce_pallas_tpu_pair_stats_{mode}",
    )(*inputs)


# ---------------------------------------------------------------------------------------------
# The gradient kernel.


def _grad_kernel(x_ref, w_ref, u_ref, v_ref, scale_ref, live_ref, lse_a_ref, lse_b_ref, div_ref, student_ref,
                 g_ref, dw_in_ref, dx_ref, dw_ref, dx_acc, *, cfg: PairConfig):
    spec = cfg.spec
    c, j = pl.program_id(0), pl.program_id(1)
    block = c * cfg.nv_per_core + j
    rows = _rows_valid(cfg.block_b, cfg.n, live_ref[...])

    @pl.when(j == 0)
    def _():
        # The chunk's hidden states stay in VMEM over the core's steps: dead rows zeroed once, in place, so that
        # their logits are finite and their delta (g = 0) exactly 0 (a NaN would reach dw and dx through it).
        x_ref[...] = jnp.where(rows, x_ref[...], jnp.zeros((), x_ref.dtype))
        u_ref[...] = jnp.where(rows, u_ref[...], jnp.zeros((), u_ref.dtype))
        _zero_tails(x_ref, None, cfg.hs, cfg.hsp)
        _zero_tails(u_ref, None, cfg.ht, cfg.htp)
        dx_acc[...] = jnp.zeros_like(dx_acc)

    def step(masked: bool) -> None:
        _zero_tails(None, w_ref, cfg.hs, cfg.hsp, spec.w_layout)
        _zero_tails(None, v_ref, cfg.ht, cfg.htp, spec.teacher_w_layout)
        if masked:  # the last block's columns past V: garbage that would reach dx through delta = 0
            _zero_head_columns(w_ref, block, cfg)
        cols = _cols_valid(block, cfg) if masked else None
        scale = scale_ref[...]
        a, slope = _logits(x_ref[...], w_ref[...], spec.w_layout, spec.logit_soft_cap, scale, cfg.precision, cols)
        b = _logits(u_ref[...], v_ref[...], spec.teacher_w_layout, spec.teacher_logit_soft_cap, scale, cfg.precision,
                    cols)[0]
        # Columns past V have probability 0 in both heads, dead rows g = 0: their delta is 0 without a select (a
        # select feeding the product becomes a masked matmul that libtpu's profiler refuses).
        g = jnp.where(rows, g_ref[...], 0.0)
        delta = _delta(a, b, slope, scale, lse_a_ref[...], lse_b_ref[...], div_ref[...], student_ref[...], g, spec)
        delta = delta.astype(common.mxu_dtype(cfg.precision))
        w = w_ref[...]
        if spec.w_layout == "hv":
            dx_acc[...] += common.matmul_nt(delta, w, cfg.precision)
            dw_ref[...] = dw_in_ref[...] + common.matmul_tn(x_ref[...], delta, cfg.precision)
        else:
            dx_acc[...] += common.matmul(delta, w, cfg.precision)
            dw_ref[...] = dw_in_ref[...] + common.matmul_tn(delta, x_ref[...], cfg.precision)

    if cfg.nv_per_core * cfg.num_cores != cfg.nv:  # the last core has a block fewer: its last step repeats a block
        pl.when(block < cfg.nv)(lambda: _per_block(block, cfg, step))
    else:
        _per_block(block, cfg, step)

    @pl.when(j == cfg.nv_per_core - 1)
    def _():
        dx_ref[...] = dx_acc[...].reshape(dx_ref.shape)


def pair_grad_call(x: jax.Array, w: jax.Array, u: jax.Array, v: jax.Array, rows: dict[str, jax.Array],
                   running_dw: jax.Array, cfg: PairConfig) -> tuple[jax.Array, jax.Array]:
    """One chunk's float32 ``dx`` (``[cores, rows, Hsp]``, summed by the caller) and the running float32 ``dw`` plus
    the chunk's share (``running_dw``: ``w``'s layout, padded to whole blocks). ``rows``: float32 ``[rows, 1]`` each of
    ``scale``, ``live``, ``lse``, ``teacher_lse``, ``divergence``, ``student_term`` and ``g``."""
    nvc, nv = cfg.nv_per_core, cfg.nv
    column = lambda c, j: jnp.minimum(c * nvc + j, nv - 1)  # noqa: E731  (a short core repeats its last block)
    whole = lambda c, j: (0, 0)  # noqa: E731
    row_spec = pl.BlockSpec((cfg.block_b, 1), whole)
    dw_spec = _head_spec(cfg.hsp, cfg.block_v, cfg.spec.w_layout, column)
    names = ("scale", "live", "lse", "teacher_lse", "divergence", "student_term", "g")
    in_specs = [pl.BlockSpec((cfg.block_b, cfg.hsp), whole),
                _head_spec(cfg.hsp, cfg.block_v, cfg.spec.w_layout, column),
                pl.BlockSpec((cfg.block_b, cfg.htp), whole),
                _head_spec(cfg.htp, cfg.block_v, cfg.spec.teacher_w_layout, column),
                *[row_spec] * len(names), dw_spec]
    inputs = [x, w, u, v, *[rows[name] for name in names], running_dw]
    axes, inputs = common.per_device_operands(inputs, cfg.interpret)
    dx, dw = pl.pallas_call(
        functools.partial(_grad_kernel, cfg=cfg),
        grid=(cfg.num_cores, nvc),
        in_specs=in_specs,
        out_specs=[pl.BlockSpec((1, cfg.block_b, cfg.hsp), lambda c, j: (c, 0, 0)), dw_spec],
        out_shape=[common.out_type((cfg.num_cores, cfg.block_b, cfg.hsp), jnp.float32, axes),
                   common.out_type(running_dw.shape, jnp.float32, axes)],
        scratch_shapes=[pltpu.VMEM((cfg.block_b, cfg.hsp), jnp.float32)],
        input_output_aliases={len(inputs) - 1: 1},
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary"),
                                             vmem_limit_bytes=cfg.vmem_limit_bytes),
        interpret=cfg.interpret,
        cost_estimate=pl.CostEstimate(flops=2 * cfg.block_b * (cfg.hsp + cfg.htp) * cfg.v
                                      + 4 * cfg.block_b * cfg.hsp * cfg.v,
                                      transcendentals=2 * cfg.block_b * cfg.v,
                                      bytes_accessed=w.size * w.dtype.itemsize + v.size * v.dtype.itemsize
                                      + 2 * running_dw.size * 4),
        name="ce_pallas_tpu_pair_grad",
    )(*inputs)
    return dx, dw



# ---------------------------------------------------------------------------------------------
# Plans and the backend's entry points.

#: Tiles ``(statistics token block, gradient chunk rows, vocab block)`` to use instead of the rule's (tests set
#: small ones so that a call takes several of each); ``None``: :func:`make_configs` decides.
BLOCKS: tuple[int, int, int] | None = None
#: The rule's largest tiles: gradient chunks and their vocab blocks.
CHUNK_ROWS, VOCAB_COLUMNS = 1024, 512
#: The statistics kernel's tiles ``(token rows, vocab columns)`` per generation (others: ``"default"``). A step's
#: vector work that waits for its last product is a fixed share of the step; v6e's MXU is four times v5e's against
#: vector units of the same width, so it hides that share only in larger tiles (libtpu's static schedule,
#: ``tools/schedule_pair.py``: a KL's pass at Qwen3-8B -> 0.6B went 1.27 -> 1.19 of its MXU minimum from 512 to
#: 1,024 square; v5e and v5p are at 1.04 with 512). v6e's 2,048 rows where they fit (:func:`_fitted_stats_tiles`):
#: Qwen3's heads' KL pass 1.087 -> 1.071, the JSD's lses pass 1.053 -> 1.032 and its given pass 1.120 -> 1.107;
#: Gemma-2's take 1,024.
STATS_TILES = {"default": (512, 512), "v6e": (2048, 1024)}
#: The generations whose statistics kernel streams a row's later vocab blocks (:func:`_online_kernel`). In libtpu's
#: static schedule it takes v6e's KL pass at Qwen3-8B -> 0.6B from 1.19 to 1.09 of its MXU minimum and the JSD's
#: lses pass from 1.13 to 1.05; on v5e and v5p, whose MXU leaves the element's vector work hidden, the step's
#: overflow check costs more than it saves (their lses pass 1.02 -> 1.03).
STREAMED_STATS = ("v6e",)
#: Rows and columns are multiples of these (a bf16 block's rows fill whole packed sublanes).
ROW_ALIGN = 16


def _operand_bytes(rows: int, block_v: int, hsp: int, htp: int, x_bytes: int, w_bytes: int, u_bytes: int,
                   v_bytes: int) -> int:
    """One buffer each of a kernel's operand blocks: both heads' ``rows`` hidden states and ``block_v`` entries."""
    return rows * (hsp * x_bytes + htp * u_bytes) + block_v * (hsp * w_bytes + htp * v_bytes)


def _grad_vmem_bytes(chunk: int, hsp: int, htp: int, block_v: int, *sizes: int) -> int:
    """The gradient kernel's VMEM: double-buffered operands and ``dw`` blocks, ``dx``, and ~6 float32 tiles."""
    operands = _operand_bytes(chunk, block_v, hsp, htp, *sizes)
    return 2 * operands + 4 * hsp * block_v * 4 + 3 * chunk * hsp * 4 + 6 * chunk * block_v * 4


#: The statistics kernel's float32 working set beside its operand blocks, in ``[rows, block_v]`` tiles: what Mosaic
#: spills of the two heads' logit tiles and their terms, fitted to libtpu's largest figure (v6e, Llama-3 70B teaching
#: 8B, ``H`` 8192 and 4096 at 1,024 x 1,024: 121.55 MiB of scoped VMEM, 96 MiB of it the double-buffered operands;
#: Qwen3's heads at 4,096 x 1,024 spill 4.2 tiles), plus :data:`STATS_FIXED_BYTES` of row columns and accumulators.
STATS_WORK_TILES = 6.4
STATS_FIXED_BYTES = 4 * 2**20
#: The statistics kernel's token block is not halved below this many rows before its vocab block is: each token block
#: reads both heads whole from HBM once, and at ``H`` 12,288 between them 512-row blocks would leave a pass bound by
#: that traffic on v6e.
STATS_MIN_HALVED_ROWS = 1024


def _stats_vmem_bytes(rows: int, block_v: int, hsp: int, htp: int, *sizes: int) -> int:
    """The statistics kernel's VMEM: double-buffered operand blocks and the float32 working set."""
    operands = _operand_bytes(rows, block_v, hsp, htp, *sizes)
    return 2 * operands + int(STATS_WORK_TILES * rows * block_v * 4) + STATS_FIXED_BYTES


def _fitted_stats_tiles(rows: int, block_v: int, hsp: int, htp: int, sizes: list[int], limit: int) -> tuple[int, int]:
    """The generation's statistics tiles, shrunk until :func:`_stats_vmem_bytes` is within ``limit``: the rows
    halved down to :data:`STATS_MIN_HALVED_ROWS`, then the vocab block down to 256 columns, then the rows down to
    128. Distilling Llama-3 70B into 8B on v6e (``H`` 8192 and 4096) needed 121.55 MiB at 1,024 x 1,024 against
    the 115.2 MiB limit and did not compile; it takes 1,024 x 512. Heads up to Qwen3-8B's and Gemma-2 9B's keep
    their tiles."""
    def fits(r: int, c: int) -> bool:
        return _stats_vmem_bytes(r, c, hsp, htp, *sizes) <= limit

    while not fits(rows, block_v) and rows > STATS_MIN_HALVED_ROWS:
        rows //= 2
    while not fits(rows, block_v) and block_v > 256:
        block_v //= 2
    while not fits(rows, block_v) and rows > 128:
        rows //= 2
    return rows, block_v


def _fitted_grad_tiles(chunk: int, block_v: int, hsp: int, htp: int, sizes: list[int], budget: int) -> tuple[int, int]:
    """The gradient's ``(chunk, block_v)``, shrunk until :func:`_grad_vmem_bytes` is within ``budget``: the chunk
    halved down to 128 rows, then the vocab block (v5p, Llama-3 70B teaching 8B: 128-row chunks still needed
    68.7 MiB of its 64)."""
    while chunk > 128 and _grad_vmem_bytes(chunk, hsp, htp, block_v, *sizes) > budget:
        chunk //= 2
    while block_v > LANES and _grad_vmem_bytes(chunk, hsp, htp, block_v, *sizes) > budget:
        block_v //= 2
    return chunk, block_v


def make_configs(n: int, hs: int, ht: int, v: int, dtypes: tuple[Any, Any, Any, Any], spec: PairSpec,
                 target) -> tuple[PairConfig, PairConfig]:
    """The statistics kernel's and the gradient kernel's configs for ``n`` rows on ``target``."""
    sizes = [jnp.dtype(d).itemsize for d in dtypes]
    precision = common.resolve_precision(dtypes[0], dtypes[1], spec.precision)
    interpret = interpret_params(target)
    limit = None if target.interpret else tiling.vmem_limit(target)
    rows_cap = round_up(n, ROW_ALIGN) if n > ROW_ALIGN else n  # a statistics block may overhang N
    if BLOCKS is not None:
        stats_rows, chunk, block_v = BLOCKS
        stats_v = block_v
    else:
        stats_rows, stats_v = STATS_TILES.get(target.generation, STATS_TILES["default"])
        chunk, block_v = CHUNK_ROWS, VOCAB_COLUMNS
        vmem = limit or tiling.vmem_limit(target)
        budget = vmem * 3 // 4
        hsp, htp = round_up(hs, LANES), round_up(ht, LANES)
        stats_rows, stats_v = _fitted_stats_tiles(stats_rows, stats_v, hsp, htp, sizes, vmem)
        chunk, block_v = _fitted_grad_tiles(chunk, block_v, hsp, htp, sizes, budget)
    # A gradient chunk is a slice of exactly ``chunk`` rows (the last one moved back to end at ``N``): at most
    # ``N``, and whole packed sublanes where ``N`` has that many.
    stats_rows = min(stats_rows, rows_cap)
    chunk = n if n <= ROW_ALIGN else min(chunk, n // ROW_ALIGN * ROW_ALIGN)
    block_v, stats_v = min(block_v, round_up(v, LANES)), min(stats_v, round_up(v, LANES))
    cores = active_cores(target.num_cores, pl.cdiv(v, block_v))
    stats = PairConfig(n=n, hs=hs, ht=ht, v=v, block_b=stats_rows, block_v=stats_v, num_cores=1, spec=spec,
                       precision=precision, interpret=interpret, vmem_limit_bytes=limit,
                       streamed=target.generation in STREAMED_STATS)
    return stats, dataclasses.replace(stats, n=chunk, block_b=chunk, block_v=block_v, num_cores=cores,
                                      streamed=False)


def _column(values: jax.Array | None, n: int, fill: float = 0.0) -> jax.Array:
    """A float32 ``[N, 1]`` column of ``values`` (``fill`` where ``None``)."""
    if values is None:
        return jnp.full((n, 1), fill, jnp.float32)
    return values.astype(jnp.float32).reshape(n, 1)


def pair_row_stats(x: jax.Array, w: jax.Array, u: jax.Array, v: jax.Array, spec: PairSpec, *,
                   row_scale: jax.Array, lse: tuple[jax.Array, jax.Array] | None = None,
                   live: jax.Array | None = None):
    """:class:`ce_core.extend.PairStats` of every row (contract version 5; dead rows' statistics are those of
    zero hidden states): one pass for a KL, two for the JSD, one with the whole rows' ``lse`` given."""
    n, vocab = x.shape[0], _vocab(w, spec.w_layout)
    target = current_target()
    cfg, _ = make_configs(n, x.shape[1], u.shape[1], vocab, (x.dtype, w.dtype, u.dtype, v.dtype), spec, target)
    scale = _column(row_scale, n, 1.0)
    alive = jnp.ones((n,), bool) if live is None else live.reshape(n).astype(bool)
    call = pair_stats_call
    if live is not None:
        # Token blocks without a live row are skipped (their rows are replaced below, whatever the kernel left
        # there), by a kernel that walks the live ones; where every block is live, the plain kernel runs instead (the
        # walk's index maps and guards cost 1-1.5% of a step in libtpu's static schedule).
        block_live = common.blocks_live(alive, cfg.block_b)
        walk = StatsWalk.of(block_live, target.num_cores, cfg.nv)
        every_block_live = jnp.all(block_live)

        def call(*args, **options):
            return jax.lax.cond(every_block_live, functools.partial(pair_stats_call, *args, **options),
                                functools.partial(pair_stats_call, *args, walk=walk, **options))
    # A dead row's statistics are those of zero hidden states: every logit 0 in both heads, so each lse is
    # log V and every divergence term 0 (computed rows are replaced, whatever their hidden states hold).
    zero_lse = jnp.float32(math.log(vocab))
    dead_lse = lambda column: jnp.where(alive, column.reshape(n), zero_lse)  # noqa: E731
    dead_zero = lambda column: jnp.where(alive, column.reshape(n), 0.0)  # noqa: E731
    jsd = spec.divergence == "jsd"
    if lse is None and not jsd:
        lse_a, lse_b, divergence = call(x, w, u, v, scale, cfg, "online")
        return PairStats(dead_lse(lse_a), dead_lse(lse_b), dead_zero(divergence))
    if lse is None:
        lse_a, lse_b, _ = call(x, w, u, v, scale, cfg, "lses")
        lse = (dead_lse(lse_a), dead_lse(lse_b))
    divergence, student = call(x, w, u, v, scale, cfg, "given", lse=lse)
    return PairStats(lse[0], lse[1], dead_zero(divergence), dead_zero(student) if jsd else None)


def pair_grads(x: jax.Array, w: jax.Array, u: jax.Array, v: jax.Array, stats, g: jax.Array, spec: PairSpec, *,
               row_scale: jax.Array, live: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
    """``dx`` and ``dw`` of ``sum(g * divergence)`` given the whole rows' statistics: the gradient kernel over
    chunks of rows (the last one moved back to end at ``N``; its rows an earlier chunk took get ``g = 0`` and
    keep that chunk's ``dx``), ``dw`` summed in float32 across them. Given ``live``, only the chunks that own a
    live row are called (a loop over their list; a dead chunk's ``dx`` rows stay 0)."""
    n, vocab = x.shape[0], _vocab(w, spec.w_layout)
    if n == 0:
        return jnp.zeros_like(x), jnp.zeros_like(w)
    _, cfg = make_configs(n, x.shape[1], u.shape[1], vocab, (x.dtype, w.dtype, u.dtype, v.dtype), spec,
                          current_target())
    chunk = cfg.block_b
    columns = {"scale": _column(row_scale, n, 1.0), "live": _column(live, n, 1.0), "lse": _column(stats.lse, n),
               "teacher_lse": _column(stats.teacher_lse, n), "divergence": _column(stats.divergence, n),
               "student_term": _column(stats.student_term, n), "g": _column(g, n)}
    chunks = pl.cdiv(n, chunk)

    def step(k, carry):
        dx, dw = carry
        start = jnp.minimum(k * chunk, n - chunk)
        owned = (start + jnp.arange(chunk) >= k * chunk).reshape(chunk, 1)
        take = lambda a: jax.lax.dynamic_slice_in_dim(a, start, chunk)  # noqa: E731
        rows = {name: take(value) for name, value in columns.items()}
        rows["g"] = jnp.where(owned, rows["g"], 0.0)
        dx_parts, dw = pair_grad_call(take(x), w, take(u), v, rows, dw, cfg)
        dx_chunk = jnp.sum(dx_parts, axis=0)[:, : x.shape[1]].astype(x.dtype)
        dx_chunk = jnp.where(owned, dx_chunk, take(dx))
        return jax.lax.dynamic_update_slice_in_dim(dx, dx_chunk, start, 0), dw

    # The running dw spans whole blocks (an aliased operand's blocks must lie inside it).
    padded = (cfg.hsp, cfg.nv * cfg.block_v)
    padded = padded if spec.w_layout == "hv" else padded[::-1]
    initial = vary_like((jnp.zeros_like(x), jnp.zeros(padded, jnp.float32)), x, w, u, v, *columns.values())
    if live is None:
        dx, dw = jax.lax.fori_loop(0, chunks, step, initial)
    else:
        walk = common.LiveBlocks.of(live.reshape(n).astype(bool), chunk)  # chunk k owns rows [k chunk, (k+1) chunk)
        dx, dw = jax.lax.fori_loop(0, walk.n_live[0], lambda k, carry: step(walk.walk[k], carry), initial)
    return dx, dw[: w.shape[0], : w.shape[1]].astype(w.dtype)


def _vocab(w: jax.Array, layout: str) -> int:
    return w.shape[1] if layout == "hv" else w.shape[0]
