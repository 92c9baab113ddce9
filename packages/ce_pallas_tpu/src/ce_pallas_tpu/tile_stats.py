"""The online statistics of one logit tile, per row or per lane of a row (traced inside the forward).

A row's statistics are ``(max, sum of exp, label logit, logit sum, weighted sum, top, top index)``:
the lse is ``max + log(sum)``, and the weighted sum ``sum_j exp(z_j - max) z_j`` over the sum of exp
is the expected logit (for the entropy); the logit sum and weighted sum are ``None`` unless asked
for, and so are the largest logit and its lowest index (``with_argmax``), and the label logit when
the wrapper takes it (no labels given). The logits are
``s_i * cap(raw)`` (:func:`logits`; ``s`` the row scale when ``with_row_scale``).

Per row (``[b, 1]``, :func:`row_update`) each tile's maximum is reduced across lanes before its exps.
Per lane (``[b, 128]``) each lane keeps its own reference in place of the maximum, and a tile's
columns are folded in 128 at a time without crossing lanes; :func:`streamed_lane_update` takes the
exps against the reference as it stands, so they need nothing from the rest of the tile and can
follow the MXU's output, and :func:`exact_lane_update` first moves the reference up to the tile's
maximum. Per lane, the top logit is exact (not the reference) and its index is kept as the global
column of the lane's 0th position in the group that set it (the lane is added once, at the end), so
a column costs a compare and two selects; a tie keeps the earlier column, since a lane sees its
columns in increasing order. :func:`lanes_to_rows` reduces the lanes at the end (on a tie across
lanes, the lowest index).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from ce_pallas_tpu import common
from ce_pallas_tpu.common import KernelConfig
from ce_pallas_tpu.layout import LANES

#: ``(max or reference, sum of exp, label logit or None, logit sum or None, weighted sum or None, top
#: logit or None, top index or None)``; the top index is int32, per lane the global column of the
#: lane's 0th position in the group that holds the top (:func:`lanes_to_rows` adds the lane).
State = tuple[jax.Array, jax.Array, jax.Array | None, jax.Array | None, jax.Array | None, jax.Array | None,
              jax.Array | None]

#: An index above any column, for taking the lowest index of a maximum with ``min``.
NO_INDEX = jnp.iinfo(jnp.int32).max

#: How far (in nats) a logit may rise above its lane's reference in a streamed step: a lane's sum of
#: exp then stays below ``exp(OVERFLOW_MARGIN)``, far inside float32 even times the logits (the
#: weighted sum). A step whose sums pass :data:`OVERFLOW_SUM` is redone with :func:`exact_lane_update`.
OVERFLOW_MARGIN = 30.0
OVERFLOW_SUM = math.exp(OVERFLOW_MARGIN)


def overflowed(sums: jax.Array, *, interpreted: bool = False) -> jax.Array:
    """Whether a streamed step must be redone: some lane sum is above :data:`OVERFLOW_SUM` (or NaN).

    The largest sum, then one compare: the check is a streamed step's tail (it waits for the step's
    last product), so it costs one ``vmax`` per vector register. The max propagates NaN (Mosaic lowers
    it as ``arith.maximumf``, whose result is NaN when an operand is), and NaN fails the compare, so a
    NaN row asks for a redo (which changes nothing for it) and cannot hide an overflowing one.
    XLA:CPU's max under the interpreter may skip NaN depending on operand order, and so drop an
    ``inf`` seen before it: there (``interpreted``) the max is taken over the sums' bits as int32,
    which order non-negative floats as floats do, put ``inf`` above every finite sum and NaN with a
    clear sign bit above ``inf``, with no NaN rules at all.
    """
    if interpreted:
        bits = jax.lax.bitcast_convert_type(sums, jnp.int32)
        return jnp.max(bits) > jax.lax.bitcast_convert_type(jnp.float32(OVERFLOW_SUM), jnp.int32)
    return jnp.logical_not(jnp.max(sums) <= OVERFLOW_SUM)


def logits(z_raw: jax.Array, cfg: KernelConfig, scale: jax.Array | None) -> jax.Array:
    """The final logits ``s * cap(raw)`` of a tile of raw products; ``scale`` is ``[b, 1]`` or None (1).

    Under a soft cap the cap and the scale multiply the tanh together (one product per logit).
    """
    if scale is None:
        return common.soft_cap(z_raw, cfg.logit_soft_cap)[0]
    if cfg.logit_soft_cap is None:
        return z_raw * scale
    return jnp.tanh(z_raw * (1.0 / cfg.logit_soft_cap)) * (cfg.logit_soft_cap * scale)


def row_update(z_raw: jax.Array, start, y: jax.Array | None, state: State, cfg: KernelConfig,
               scale: jax.Array | None = None) -> State:
    """The per-row statistics ``[b, 1]`` after one tile ``[b, c]`` of raw logits.

    ``start`` is the global id of the tile's first column; columns at or past ``V`` (garbage in a
    ragged last block) count for nothing, and labels ``y`` ``[b, 1]`` outside ``[0, V)`` never hit
    (``y`` None: no label logit, the state's is None).
    The top logit is the running max itself; its index moves only on a strictly larger tile maximum,
    so a tie keeps the earlier tile (and, in a tile, the lowest column).
    """
    m, sum_exp, label, total, weighted, top, top_index = state
    z = logits(z_raw, cfg, scale)
    local = jax.lax.broadcasted_iota(jnp.int32, z.shape, 1)
    if cfg.v % cfg.block_v:
        valid = local < cfg.v - start
        z_lse = jnp.where(valid, z, -jnp.inf)
        z_owned = jnp.where(valid, z, 0.0)
    else:
        valid, z_lse, z_owned = None, z, z
    tile_max = jnp.max(z_lse, axis=1, keepdims=True)
    m_new = jnp.maximum(m, tile_max)
    if top_index is not None:
        first = jnp.min(jnp.where(z_lse == tile_max, local, NO_INDEX), axis=1, keepdims=True)
        top_index = jnp.where(tile_max > m, start + first, top_index)
        top = m_new
    rescale = jnp.exp(m - m_new)
    exps = jnp.exp(z_lse - m_new)
    sum_exp = sum_exp * rescale + jnp.sum(exps, axis=1, keepdims=True)
    if y is not None and label is not None:
        hit = local == y - start
        if valid is not None:
            hit = hit & valid
        label = label + jnp.sum(jnp.where(hit, z, 0.0), axis=1, keepdims=True)
    if total is not None:
        total = total + jnp.sum(z_owned, axis=1, keepdims=True)
    if weighted is not None:
        weighted = weighted * rescale + jnp.sum(exps * z_owned, axis=1, keepdims=True)
    return m_new, sum_exp, label, total, weighted, top, top_index


def _lane_groups(z: jax.Array):
    """The tile's 128-wide column groups ``(offset, [b, 128] slice)``: each adds one column per lane."""
    for g in range(0, z.shape[1], LANES):
        yield g, z[:, g:g + LANES]


def _top_update(zg: jax.Array, column, top: jax.Array | None, top_index: jax.Array | None):
    """A lane's top logit and its index after one column group whose 0th lane is global ``column``
    (a strictly larger logit only: on a tie the earlier column stays)."""
    if top is None or top_index is None:
        return top, top_index
    better = zg > top
    return jnp.where(better, zg, top), jnp.where(better, column, top_index)


def streamed_lane_update(z_raw: jax.Array, gap: jax.Array | None, state: State, cfg: KernelConfig, first: int,
                         start: jax.Array | int, scale: jax.Array | None = None) -> State:
    """The per-lane statistics ``[b, 128]`` after one tile that is not a ragged last one, its exps
    taken against each lane's reference as it stands (the reference is returned unchanged).

    The tile starts at column ``first`` of its vocab block (global column ``start``, needed for the
    top index), and ``gap`` is ``label - (the block's first global column) - lane``: a column group
    at offset ``g`` of the block holds a row's label in the lane where ``gap == g`` (None, with the
    state's label: no label logit). The caller checks the sums against :data:`OVERFLOW_SUM` afterwards.
    """
    r, sum_exp, label, total, weighted, top, top_index = state
    z = logits(z_raw, cfg, scale)
    for g, zg in _lane_groups(z):
        top, top_index = _top_update(zg, start + g, top, top_index)
        e = jnp.exp(zg - r)
        sum_exp = sum_exp + e
        if gap is not None and label is not None:
            label = jnp.where(gap == first + g, zg, label)
        if total is not None:
            total = total + zg
        if weighted is not None:
            weighted = weighted + e * zg
    return r, sum_exp, label, total, weighted, top, top_index


def exact_lane_update(z_raw: jax.Array, start, y: jax.Array | None, gap: jax.Array | None, state: State,
                      cfg: KernelConfig, first: int, scale: jax.Array | None = None) -> State:
    """The per-lane statistics after one tile, each lane's reference first moved up to its maximum
    (the sums rescaled to it), so no exp exceeds 1. ``start`` is the tile's first global column:
    columns at or past ``V`` count for nothing. ``y``: the labels ``[b, 1]`` (None with ``gap``: no
    label logit); the rest as in :func:`streamed_lane_update`.
    """
    lane = jax.lax.broadcasted_iota(jnp.int32, (z_raw.shape[0], LANES), 1)
    if z_raw.shape[1] % LANES:
        # A block not a multiple of 128 wide is the row's only one (block_v == V), so the state is the
        # initial one: take the row's statistics whole and put them in lane 0.
        return select(lane == 0, row_update(z_raw, start, y, _lane_zero(state), cfg, scale), state)
    r, sum_exp, label, total, weighted, top, top_index = state
    z = logits(z_raw, cfg, scale)
    groups = []
    for g, zg in _lane_groups(z):
        valid = lane < cfg.v - start - g if cfg.v % cfg.block_v else None
        groups.append((g, zg, valid, zg if valid is None else jnp.where(valid, zg, -jnp.inf)))
    r_new = r
    for g, _, _, z_lse in groups:
        r_new = jnp.maximum(r_new, z_lse)
        top, top_index = _top_update(z_lse, start + g, top, top_index)  # garbage columns are -inf here
    # A lane without a column so far stays at -inf with sums of 0 (exp(-inf - -inf) would be NaN).
    rescale = jnp.exp(jnp.where(r == r_new, 0.0, r - r_new))
    sum_exp = sum_exp * rescale
    if weighted is not None:
        weighted = weighted * rescale
    for g, zg, valid, z_lse in groups:
        e = jnp.exp(z_lse - r_new)
        hit = None if gap is None else gap == first + g
        if valid is not None:
            e, zg_owned = jnp.where(valid, e, 0.0), jnp.where(valid, zg, 0.0)
            hit = None if hit is None else hit & valid
        else:
            zg_owned = zg
        sum_exp = sum_exp + e
        if hit is not None and label is not None:
            label = jnp.where(hit, zg, label)
        if total is not None:
            total = total + zg_owned
        if weighted is not None:
            weighted = weighted + e * zg_owned
    return r_new, sum_exp, label, total, weighted, top, top_index


def _lane_zero(state: State) -> State:
    return tuple(None if value is None else value[:, :1] for value in state)  # pyright: ignore[reportReturnType]


def select(condition, if_true: State, if_false: State) -> State:
    """``jnp.where(condition, ...)`` statistic by statistic (absent ones stay None); broadcasts."""

    def pick(a: jax.Array, b: jax.Array) -> jax.Array:
        return jnp.where(condition, a, b)

    def pick_optional(a: jax.Array | None, b: jax.Array | None) -> jax.Array | None:
        return None if a is None or b is None else pick(a, b)

    return (pick(if_true[0], if_false[0]), pick(if_true[1], if_false[1]), pick_optional(if_true[2], if_false[2]),
            pick_optional(if_true[3], if_false[3]), pick_optional(if_true[4], if_false[4]),
            pick_optional(if_true[5], if_false[5]), pick_optional(if_true[6], if_false[6]))


def lanes_to_rows(state: State) -> State:
    """Per-lane statistics ``[b, 128]`` as per-row ones ``[b, 1]``: the reference becomes the row max;
    the top index becomes the lowest global column among the lanes holding the row's top logit."""
    r, sum_exp, label, total, weighted, top, top_index = state
    m = jnp.max(r, axis=1, keepdims=True)
    share = jnp.where(r == -jnp.inf, 0.0, jnp.exp(r - m))  # a lane that never saw a column has sums of 0

    def rows(value: jax.Array) -> jax.Array:
        return jnp.sum(value, axis=1, keepdims=True)

    row_top = row_index = None
    if top is not None and top_index is not None:
        row_top = jnp.max(top, axis=1, keepdims=True)
        lane = jax.lax.broadcasted_iota(jnp.int32, top.shape, 1)
        row_index = jnp.min(jnp.where(top == row_top, top_index + lane, NO_INDEX), axis=1, keepdims=True)
    return (m, rows(sum_exp * share), None if label is None else rows(label), None if total is None else rows(total),
            None if weighted is None else rows(weighted * share), row_top, row_index)
