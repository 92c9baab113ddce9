"""The backend contract as differentiable ops over whole (possibly sharded) arrays.

``row_stats`` is a custom VJP whose forward and backward passes each run one per-shard function of
:mod:`ce_core.sharded.shard_ops` under the call's placement; ``row_stats_and_grads`` runs the fused one.
Because differentiation stops at these ops, the same per-shard code serves every placement:

- ``"local"``: called directly (one device, or one shard in the caller's ``shard_map``);
- ``"shard_map"``: inside ``jax.shard_map`` over the placement's mesh and specs (explicit axes, auto
  axes with a layout fixed at trace time, the sharded wrapper).

Arrays keep their leading token dimensions (``x: [..., H]``, labels ``[...]``); each shard flattens
its own rows, so no sharded array is ever reshaped across devices. ``max`` and ``argmax`` (when the spec
asks) come out of the same forward pass and take no cotangent; a ``row_scale`` (``StatsSpec.with_row_scale``)
is one more per-token input, never differentiated.
"""

from __future__ import annotations

import functools
from typing import Any

import jax

from ce_core.contract.backend import Backend, CotangentFn, RowStats, StatsSpec
from ce_core.sharded.batching import batched_by_kinds
from ce_core.sharded.placement import Placement
from ce_core.sharded.shard_ops import (
    RowStatsAndGradsFn,
    RowStatsFn,
    RowStatsVjpFn,
    ShardFn,
    differentiable_spec,
    stats_from,
    stats_values,
)


def run(fn: ShardFn, placement: Placement, *args: jax.Array) -> tuple[jax.Array, ...]:
    """``fn`` over whole arrays laid out as ``placement`` says."""
    if placement.kind == "local":
        return _per_shard(fn, placement)(*args)
    if placement.kind == "shard_map":
        sharded = jax.shard_map(
            _per_shard(fn, placement),
            mesh=placement.mesh,
            in_specs=tuple(placement.spec(k) for k in fn.in_kinds),
            out_specs=tuple(placement.spec(k) for k in fn.out_kinds),
        )
        return sharded(*args)
    raise ValueError(f"unknown placement kind {placement.kind!r}")


@functools.lru_cache(maxsize=256)
def _per_shard(fn: ShardFn, placement: Placement):
    """``fn`` on one shard's arrays; for a backend that JAX cannot batch, with a ``vmap`` rule of ours."""
    op = functools.partial(fn, placement.shard_axes)
    return op if fn.backend.batchable else batched_by_kinds(fn, op)


def row_stats(backend: Backend, spec: StatsSpec, placement: Placement, x: jax.Array, w: jax.Array,
              labels: jax.Array, row_scale: jax.Array | None = None, live: jax.Array | None = None) -> RowStats:
    """Row statistics of ``s * cap(x @ w)`` over the whole vocabulary, differentiable in ``x`` and ``w``.

    ``live`` (bool, the labels' shape; only for a backend that takes it): the tokens whose statistics
    are needed; the others' are 0 and take no gradient.
    """
    op = _row_stats_op(backend, spec, placement, live is not None)
    return op(x, w, labels, *_scale_args(spec, row_scale), *_live_args(live))


def row_stats_and_grads(backend: Backend, spec: StatsSpec, placement: Placement, cotangent_fn: CotangentFn,
                        x: jax.Array, w: jax.Array, labels: jax.Array,
                        coefficients: jax.Array | tuple[jax.Array, ...],
                        row_scale: jax.Array | None = None,
                        live: jax.Array | None = None) -> tuple[RowStats, jax.Array, jax.Array]:
    """Statistics with ``dx`` and ``dw`` (dtypes of ``x`` and ``w``) for ``cotangent_fn``'s cotangents.

    ``coefficients``: one per-token array, or a tuple of them (``cotangent_fn`` then gets the tuple).
    ``live`` as for :func:`row_stats` (dead tokens' cotangents must be 0).
    """
    packed = isinstance(coefficients, tuple)
    params = coefficients if isinstance(coefficients, tuple) else (coefficients,)
    fn = RowStatsAndGradsFn(backend, spec, cotangent_fn, n_params=len(params) if packed else None,
                            with_live=live is not None)
    out = run(fn, placement, x, w, labels, *_scale_args(spec, row_scale), *_live_args(live), *params)
    return stats_from(out, spec), out[-2], out[-1]


def _scale_args(spec: StatsSpec, row_scale: jax.Array | None) -> tuple[jax.Array, ...]:
    if not spec.with_row_scale:
        return ()
    if row_scale is None:
        raise ValueError("StatsSpec.with_row_scale needs a row_scale")
    return (jax.lax.stop_gradient(row_scale),)


def per_token_args(row_scale: jax.Array | None, live: jax.Array | None) -> tuple[jax.Array, ...]:
    """The optional per-token inputs of a custom VJP built on these ops, in order: the row scale, then the
    live mask, each only when given (:func:`split_per_token` reads them back)."""
    return tuple(value for value in (row_scale, live) if value is not None)


def split_per_token(spec: StatsSpec, with_live: bool,
                    per_token: tuple[jax.Array, ...]) -> tuple[jax.Array | None, jax.Array | None]:
    """``(row_scale, live)`` from :func:`per_token_args`'s tuple (``None`` for each one absent)."""
    rest = list(per_token)
    scale = rest.pop(0) if spec.with_row_scale else None
    return scale, rest.pop(0) if with_live else None


def _live_args(live: jax.Array | None) -> tuple[jax.Array, ...]:
    return () if live is None else (jax.lax.stop_gradient(live),)


@functools.lru_cache(maxsize=256)
def _row_stats_op(backend: Backend, spec: StatsSpec, placement: Placement, with_live: bool = False):
    forward_fn = RowStatsFn(backend, spec, with_live=with_live)
    smooth_spec = differentiable_spec(spec)
    backward_fn = RowStatsVjpFn(backend, smooth_spec, with_live=with_live)

    def stats(x, w, labels, *per_token):
        return stats_from(run(forward_fn, placement, x, w, labels, *per_token), spec)

    def forward(x, w, labels, *per_token):
        result = stats(x, w, labels, *per_token)
        return result, (x, w, labels, per_token, result)

    def backward(residuals: Any, cotangent: RowStats):
        x, w, labels, per_token, result = residuals
        smooth = result._replace(max=None, argmax=None)
        ct = cotangent._replace(max=None, argmax=None)
        dx, dw = run(backward_fn, placement, x, w, labels, *per_token, *stats_values(smooth), *stats_values(ct))
        return (dx, dw, None, *tuple(None for _ in per_token))

    op = jax.custom_vjp(stats)
    op.defvjp(forward, backward)
    return op
