"""A few logits per token, ``cap(x_n . w[:, i_nm]) / T_n``, differentiable, without ``[N, V]`` or a float32 ``[V, H]``.

The sparse teacher of :func:`ce_core.linear_distillation_loss` needs the student's logits at its ``k``
entries per token. Forward and ``dx`` gather ``w``'s entries token chunk by token chunk (``[rows, m, H]``
at a time, :data:`CHUNK_BYTES`). ``dw`` is the scatter of ``d_nm x_n`` into the rows ``i_nm``: the
``(entry, token)`` pairs are sorted by entry, so each entry's pairs are contiguous, and summed in float32
chunk by chunk (a segment sum); the sum of an entry that spans two chunks is carried over, so every entry
of ``dw`` is written once, in ``w``'s dtype, from its whole float32 sum (no float32 ``[V, H]`` accumulator,
no repeated rounding). Under a ``shard_map`` placement the same runs per shard: each vocab shard takes the
entries its slice holds (the products and ``dx`` summed over the vocab shards), each token shard its tokens
(``dw`` summed over the token shards, in ``w``'s dtype).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from ce_core.contract.varying import vary_like
from ce_core.sharded.placement import Placement, place

#: Bytes of ``w``'s gathered entries (or ``x``'s float32 rows) one chunk holds.
CHUNK_BYTES = 32 * 2**20


def gathered_logits(x: jax.Array, w: jax.Array, entries: jax.Array, scale: jax.Array, soft_cap: float | None,
                    w_layout: str, placement: Placement | None = None, chunk_bytes: int = CHUNK_BYTES) -> jax.Array:
    """``cap(x_n . w_e) * scale_n`` for the vocabulary entries ``e = entries[n, m]``, float32 ``[..., m]``.

    ``x`` is ``[..., H]``; ``w`` is ``[H, V]`` (``w_layout="hv"``) or ``[V, H]``; ``entries`` int ``[..., m]``
    in ``[0, V)`` (ids outside are clipped: the caller masks them); ``scale`` float32 ``[...]`` (``1 / T``,
    not differentiated); ``cap(z) = c tanh(z / c)`` with ``c = soft_cap``, the identity when None.
    Differentiable in ``x`` and ``w`` (gradients in their dtypes, ``dw`` in ``w``'s layout). Under a
    ``"shard_map"`` ``placement`` (:func:`ce_core.sharded.placement.find_placement`) each shard takes its
    tokens and the entries its slice of the vocabulary holds, and the products are summed over the vocab
    shards.
    """
    raw = gathered_products(x, w, entries, w_layout, placement, chunk_bytes)
    capped = raw if soft_cap is None else soft_cap * jnp.tanh(raw / soft_cap)
    return capped * scale[..., None].astype(jnp.float32)


def gathered_products(x: jax.Array, w: jax.Array, entries: jax.Array, w_layout: str,
                      placement: Placement | None = None, chunk_bytes: int = CHUNK_BYTES) -> jax.Array:
    """``x_n . w_e`` (float32 ``[..., m]``) for the entries ``e = entries[n, m]``, as :func:`gathered_logits`."""
    entries = entries.astype(jnp.int32)
    if placement is None or placement.kind != "shard_map":
        return _products_fn(w_layout, (), chunk_bytes, None)(x, w, entries)
    # Under Auto axes an eager call (jax.grad of one) sees only the abstract mesh of its traced inputs, on
    # which arrays cannot be laid out op by op: compiled as one program, as ce_core.api.prepare.run_placed does.
    return _sharded_products(x, w, entries, w_layout=w_layout, placement=placement, chunk_bytes=chunk_bytes)


@functools.partial(jax.jit, static_argnames=("w_layout", "placement", "chunk_bytes"))
def _sharded_products(x: jax.Array, w: jax.Array, entries: jax.Array, *, w_layout: str, placement: Placement,
                      chunk_bytes: int) -> jax.Array:
    """:func:`gathered_products` under a ``"shard_map"`` placement."""
    tokens, hidden, m = x.shape[:-1], x.shape[-1], entries.shape[-1]
    mesh = placement.mesh
    assert mesh is not None  # a shard_map placement has one
    if placement.flat_tokens:  # the tokens in one dimension, padded to a multiple of their shards
        n = math.prod(tokens)
        padded = -(-n // placement.token_shards()) * placement.token_shards()
        x = jnp.pad(x.reshape(n, hidden), ((0, padded - n), (0, 0)))
        entries = jnp.pad(entries.reshape(n, m), ((0, padded - n), (0, 0)))
    token_spec = placement.token_spec
    specs = (PartitionSpec(*token_spec, None), placement.spec("w"), PartitionSpec(*token_spec, None))
    x, w, entries = (place(a, mesh, spec) for a, spec in zip((x, w, entries), specs, strict=True))
    fn = _products_fn(w_layout, placement.vocab_axes, chunk_bytes, (mesh, specs, placement.token_axes))
    out = fn(x, w, entries)
    return out[:math.prod(tokens)].reshape((*tokens, m)) if placement.flat_tokens else out


@functools.lru_cache(maxsize=64)
def _products_fn(w_layout: str, vocab_axes: tuple[str, ...], chunk_bytes: int, sharded: tuple | None):
    """The products as a ``custom_vjp`` of ``(x, w, entries)``, run per shard under ``sharded`` =
    ``(mesh, (x_spec, w_spec, entries_spec), token_axes)``, or whole when None."""

    def local_forward(x, w, entries):
        hidden, m = x.shape[-1], entries.shape[-1]
        n = math.prod(x.shape[:-1])
        own, local = _owned(w, entries.reshape(n, m), w_layout, vocab_axes)
        rows, _ = _chunks(n, m, hidden, w.dtype.itemsize, chunk_bytes)
        raw = _raw(_padded(x.reshape(n, hidden), rows), _entry_rows(w, w_layout), _padded(local, rows), rows)[:n]
        raw = jnp.where(own, raw, 0.0)
        if vocab_axes:
            raw = jax.lax.psum(raw, vocab_axes)
        return raw.reshape((*x.shape[:-1], m))

    def local_backward(x, w, entries, g):
        hidden, m = x.shape[-1], entries.shape[-1]
        n = math.prod(x.shape[:-1])
        own, local = _owned(w, entries.reshape(n, m), w_layout, vocab_axes)
        d = jnp.where(own, g.reshape(n, m).astype(jnp.float32), 0.0)
        rows, pairs = _chunks(n, m, hidden, w.dtype.itemsize, chunk_bytes)
        dx = _dx(_entry_rows(w, w_layout), _padded(local, rows), _padded(d, rows), rows)[:n]
        vocab = w.shape[1] if w_layout == "hv" else w.shape[0]
        dw = _dw(x.reshape(n, hidden), local, d, (vocab, hidden), w.dtype, pairs)
        if vocab_axes:
            dx = jax.lax.psum(dx, vocab_axes)
        if sharded is not None and sharded[2]:
            dw = jax.lax.psum(dw, sharded[2])  # each token shard's share
        return dx.astype(x.dtype).reshape(x.shape), dw.T if w_layout == "hv" else dw

    if sharded is not None:
        mesh, (x_spec, w_spec, e_spec), _ = sharded
        forward_op = jax.shard_map(local_forward, mesh=mesh, in_specs=(x_spec, w_spec, e_spec), out_specs=e_spec)
        backward_op = jax.shard_map(local_backward, mesh=mesh, in_specs=(x_spec, w_spec, e_spec, e_spec),
                                    out_specs=(x_spec, w_spec))
    else:
        forward_op, backward_op = local_forward, local_backward

    @jax.custom_vjp
    def products(x, w, entries):
        return forward_op(x, w, entries)

    def fwd(x, w, entries):
        return forward_op(x, w, entries), (x, w, entries)

    def bwd(residuals, g):
        x, w, entries = residuals
        dx, dw = backward_op(x, w, entries, g)
        return dx, dw, None

    products.defvjp(fwd, bwd)
    return products


def _owned(w: jax.Array, entries: jax.Array, w_layout: str, vocab_axes: tuple[str, ...]):
    """``(owned, local ids)``: which entries this shard's slice of the vocabulary holds, and their rows in it
    (0 where not owned)."""
    vocab = w.shape[1] if w_layout == "hv" else w.shape[0]
    offset = 0
    if vocab_axes:
        offset = jax.lax.axis_index(vocab_axes) * vocab
    local = entries - offset
    own = (local >= 0) & (local < vocab)
    return own, jnp.where(own, local, 0)


def _chunks(n: int, m: int, hidden: int, itemsize: int, chunk_bytes: int) -> tuple[int, int]:
    """Tokens per chunk of the gathers (``[rows, m, H]`` of ``w``) and pairs per chunk of ``dw``'s sums."""
    rows = max(1, min(n, chunk_bytes // max(1, m * hidden * itemsize)))
    pairs = max(1, min(n * m, chunk_bytes // (4 * hidden)))
    return rows, pairs


def _padded(a: jax.Array, rows: int) -> jax.Array:
    """``a`` with its first dimension padded with zeros to a multiple of ``rows``."""
    extra = -a.shape[0] % rows
    return jnp.pad(a, [(0, extra)] + [(0, 0)] * (a.ndim - 1)) if extra else a


def _entry_rows(w: jax.Array, w_layout: str) -> jax.Array:
    """``w`` as ``[V, H]``, one vocabulary entry a row: gathering rows reads each entry contiguously, where
    gathering columns of an ``[H, V]`` reads ``H`` strided values (about 8x slower on CPU), so an ``"hv"`` head
    is transposed once per call (a copy of ``w``)."""
    return w.T if w_layout == "hv" else w


def _raw(x, w_rows, entries, rows):
    """``x_n . w_{e_nm}`` (``w_rows`` ``[V, H]``), float32 ``[N, m]``, token chunk by token chunk (``N`` a
    multiple of ``rows``)."""
    m = entries.shape[1]

    def chunk(i):
        x_c = jax.lax.dynamic_slice_in_dim(x, i * rows, rows)
        e_c = jax.lax.dynamic_slice_in_dim(entries, i * rows, rows)
        picked = jnp.take(w_rows, e_c, axis=0, mode="clip")  # ids out of range: the caller masks them
        return jnp.einsum("nh,nmh->nm", x_c, picked, preferred_element_type=jnp.float32)

    return jax.lax.map(chunk, jnp.arange(x.shape[0] // rows)).reshape(-1, m)


def _dx(w_rows, entries, d_raw, rows):
    """``dx_n = sum_m d_nm w_{e_nm}`` (``w_rows`` ``[V, H]``), token chunk by token chunk (float32)."""

    def chunk(i):
        e_c = jax.lax.dynamic_slice_in_dim(entries, i * rows, rows)
        d_c = jax.lax.dynamic_slice_in_dim(d_raw, i * rows, rows)
        picked = jnp.take(w_rows, e_c, axis=0, mode="clip")
        return jnp.einsum("nm,nmh->nh", d_c, picked, preferred_element_type=jnp.float32)

    dx = jax.lax.map(chunk, jnp.arange(entries.shape[0] // rows))
    return dx.reshape(entries.shape[0], -1)


def _dw(x, entries, d_raw, shape, dtype, pairs):
    """``dw[e] = sum over the pairs (n, m) with e_nm = e of d_nm x_n``, ``[V, H]`` in ``dtype``.

    The pairs sorted by entry are summed in float32 ``pairs`` at a time (``segment_sum`` over their runs); a
    chunk's last run may go on in the next chunk, so its sum is carried, and written when its entry ends:
    each entry of ``dw`` is its whole sum rounded once (what else lands on it is an exact 0).
    """
    hidden = x.shape[1]
    flat_entries = entries.reshape(-1)
    order = jnp.argsort(flat_entries, stable=True)
    sorted_entries = flat_entries[order]
    tokens = order // entries.shape[1]
    values = d_raw.reshape(-1)[order]
    total = -(-sorted_entries.shape[0] // pairs) * pairs
    extra = total - sorted_entries.shape[0]  # padding: the last entry again, with 0 (its run goes on)
    sorted_entries = jnp.pad(sorted_entries, (0, extra), mode="edge")
    tokens = jnp.pad(tokens, (0, extra))
    values = jnp.pad(values, (0, extra))

    def chunk(carry, i):
        dw, open_entry, open_sum = carry
        e = jax.lax.dynamic_slice_in_dim(sorted_entries, i * pairs, pairs)
        t = jax.lax.dynamic_slice_in_dim(tokens, i * pairs, pairs)
        d = jax.lax.dynamic_slice_in_dim(values, i * pairs, pairs)
        run = jnp.concatenate([jnp.zeros((1,), jnp.int32), jnp.cumsum(e[1:] != e[:-1], dtype=jnp.int32)])
        sums = jax.ops.segment_sum(d[:, None] * x[t].astype(jnp.float32), run, num_segments=pairs,
                                   indices_are_sorted=True)
        run_entry = jnp.zeros((pairs,), jnp.int32).at[run].set(e)
        continues = run_entry[0] == open_entry
        sums = sums.at[0].add(jnp.where(continues, open_sum, 0.0))
        dw = dw.at[open_entry].add(jnp.where(continues, 0.0, open_sum).astype(dtype))  # it ended before
        last = run[-1]
        next_sum = sums[last]
        sums = sums.at[last].set(0.0)
        dw = dw.at[run_entry].add(sums.astype(dtype))  # the unused runs: entry 0 plus 0
        return (dw, e[-1], next_sum), None

    start = vary_like((jnp.zeros(shape, dtype), sorted_entries[0], jnp.zeros((hidden,), jnp.float32)), x, entries,
                      d_raw)  # inside a shard_map the carry varies as the values summed into it do
    (dw, open_entry, open_sum), _ = jax.lax.scan(chunk, start, jnp.arange(total // pairs))
    return dw.at[open_entry].add(open_sum.astype(dtype))
