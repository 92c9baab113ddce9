"""What one device computes: a backend's row statistics and gradients on its shard, plus collectives.

A call is split over devices along two kinds of mesh axes (:class:`ShardAxes`): *token* axes split
the rows of ``x`` (data parallelism), *vocab* axes split the columns of ``w`` (vocab parallelism).
Each function here runs on one shard, calls the backend on it, and combines shards explicitly:

- statistics: a stable logsumexp and sums over the vocab axes (:mod:`ce_core.sharded.vocab_parallel`);
- ``dx``: summed over the vocab axes (each vocab shard holds part of ``delta @ w.T``);
- ``dw``: summed over the token axes (each token shard holds part of ``x.T @ delta``).

Nothing here is differentiated through: :mod:`ce_core.sharded.ops` wraps these functions in custom VJPs, so
the same code runs whole on one device and inside ``jax.shard_map``. Each function is a frozen
dataclass (hashable, so the op built around it can be cached) taking and returning flat tuples of
arrays, with the kind of every array declared:
``"x"`` (``[..., H]``), ``"w"`` (``[H, V]``) or ``"tokens"`` (``[...]``, one value per token).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax

from ce_core.contract.backend import Backend, CotangentFn, RowStats, StatsSpec, localize_cotangent
from ce_core.contract.varying import align_varying, psum_to, vary_like
from ce_core.sharded.placement import ShardAxes
from ce_core.sharded.vocab_parallel import combine_vocab_shards, vocab_offset


def _sum_to(grad: jax.Array, primal: jax.Array, declared: tuple[str, ...], axes: ShardAxes) -> jax.Array:
    """``grad`` summed over the shards that share ``primal``: a cotangent shaped and typed like it."""
    if axes.typed:
        return psum_to(grad, primal)
    return jax.lax.psum(grad, declared) if declared else grad


def _flat_rows(x: jax.Array) -> jax.Array:
    return x.reshape(-1, x.shape[-1])


def _stats_out(stats: RowStats, shape: tuple[int, ...]) -> tuple[jax.Array, ...]:
    return tuple(s.reshape(shape) for s in stats if s is not None)


def _stats_in(values: tuple[jax.Array, ...], spec: StatsSpec) -> RowStats:
    return stats_from(tuple(v.reshape(-1) for v in values), spec)


@dataclasses.dataclass(frozen=True)
class ShardFn:
    """A per-shard computation with declared input and output kinds (see the module docstring)."""

    backend: Backend
    spec: StatsSpec

    @property
    def in_kinds(self) -> tuple[str, ...]:
        raise NotImplementedError

    @property
    def n_stats(self) -> int:
        return self.spec.n_stats

    @property
    def out_kinds(self) -> tuple[str, ...]:
        raise NotImplementedError

    def __call__(self, axes: ShardAxes, *args: jax.Array) -> tuple[jax.Array, ...]:
        raise NotImplementedError


@dataclasses.dataclass(frozen=True)
class RowStatsFn(ShardFn):
    """``(x, w, labels) -> (lse, label[, sum])`` over the whole vocabulary."""

    @property
    def in_kinds(self) -> tuple[str, ...]:
        return ("x", "w", "tokens")

    @property
    def out_kinds(self) -> tuple[str, ...]:
        return ("tokens",) * self.n_stats

    def __call__(self, axes: ShardAxes, *args: jax.Array) -> tuple[jax.Array, ...]:
        x, w, labels = args
        xf, w_, yf = align_varying(_flat_rows(x), w, labels.reshape(-1))
        local = self.backend.row_stats(xf, w_, yf - vocab_offset(axes.vocab, w.shape[1]), self.spec)
        return _stats_out(combine_vocab_shards(local, axes.vocab), labels.shape)


@dataclasses.dataclass(frozen=True)
class RowStatsVjpFn(ShardFn):
    """``(x, w, labels, *stats, *cotangents) -> (dx, dw)``, given the whole rows' statistics."""

    @property
    def in_kinds(self) -> tuple[str, ...]:
        return ("x", "w", "tokens") + ("tokens",) * (2 * self.n_stats)

    @property
    def out_kinds(self) -> tuple[str, ...]:
        return ("x", "w")

    def __call__(self, axes: ShardAxes, *args: jax.Array) -> tuple[jax.Array, ...]:
        x, w, labels = args[:3]
        stats, cotangent = args[3:3 + self.n_stats], args[3 + self.n_stats:]
        xf, w_, yf, stats_f, ct = align_varying(_flat_rows(x), w, labels.reshape(-1), _stats_in(stats, self.spec),
                                                _stats_in(cotangent, self.spec))
        dx, dw = self.backend.row_stats_vjp(xf, w_, yf - vocab_offset(axes.vocab, w.shape[1]), stats_f, ct, self.spec)
        dx = dx.astype(x.dtype).reshape(x.shape)
        return _sum_to(dx, x, axes.vocab, axes), _sum_to(dw.astype(w.dtype), w, axes.tokens, axes)


@dataclasses.dataclass(frozen=True)
class RowStatsAndGradsFn(ShardFn):
    """``(x, w, labels, coefficients) -> (lse, label[, sum], dx, dw)`` for a scalar loss.

    ``cotangent_fn(stats, coefficients)`` gives the cotangents of the statistics (see
    :meth:`ce_core.Backend.row_stats_and_grads`). Without vocab shards the backend forms ``dx`` and
    ``dw`` in its forward pass (6NHV on backends that fuse). With vocab shards a token's cotangents
    need the global lse first, so each shard keeps its forward residuals, combines, and then runs
    its backward pass (8NHV).
    """

    cotangent_fn: CotangentFn

    @property
    def in_kinds(self) -> tuple[str, ...]:
        return ("x", "w", "tokens", "tokens")

    @property
    def out_kinds(self) -> tuple[str, ...]:
        return ("tokens",) * self.n_stats + ("x", "w")

    def __call__(self, axes: ShardAxes, *args: jax.Array) -> tuple[jax.Array, ...]:
        x, w, labels, coefficients = args
        xf, w_, yf = align_varying(_flat_rows(x), w, labels.reshape(-1))
        # Not aligned: the coefficients must vary like the combined statistics, or differentiating
        # sum(coefficients * losses) would sum the statistics' cotangents over the vocab shards.
        cf = coefficients.reshape(-1)
        yf = yf - vocab_offset(axes.vocab, w.shape[1])
        if not axes.vocab:
            stats, dx, dw = self.backend.row_stats_and_grads(xf, w_, yf, self.spec, self.cotangent_fn, cf)
        else:
            local, vjp = jax.vjp(lambda a, b: self.backend.row_stats(a, b, yf, self.spec), xf, w_)
            stats = combine_vocab_shards(local, axes.vocab)
            cotangent: Any = localize_cotangent(self.cotangent_fn(stats, cf), local, stats)
            dx, dw = vjp(vary_like(cotangent, local))
        dx = dx.astype(x.dtype).reshape(x.shape)
        grads = (_sum_to(dx, x, axes.vocab, axes), _sum_to(dw.astype(w.dtype), w, axes.tokens, axes))
        return _stats_out(stats, labels.shape) + grads


def stats_from(values: tuple[jax.Array, ...], spec: StatsSpec) -> RowStats:
    """``RowStats`` from the leading values in :func:`stats_values` order, as ``spec`` has them."""
    rest = iter(values[2:])
    total = next(rest) if spec.with_sum else None
    expected = next(rest) if spec.with_expected else None
    return RowStats(values[0], values[1], total, expected)


def stats_values(stats: RowStats) -> tuple[jax.Array, ...]:
    """The arrays of ``stats`` in output order (the sum only when present)."""
    return tuple(s for s in stats if s is not None)
