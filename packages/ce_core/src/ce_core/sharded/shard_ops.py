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
``"x"`` (``[..., H]``), ``"w"`` (``[H, V]`` or ``[V, H]``, as ``StatsSpec.w_layout`` says) or ``"tokens"``
(``[...]``, one value per token). Under ``StatsSpec.with_row_scale`` every function takes the per-token
scale as one more ``"tokens"`` input right after the labels, never differentiated; with ``with_live``
(a backend of contract version 4) the bool mask of live tokens follows: each shard hands its own
to the backend, which may skip the dead rows, and zeroes their statistics (vocab shards hold the same
tokens, so they agree on which are live).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp

from ce_core.contract.backend import Backend, CotangentFn, RowStats, StatsSpec, inert_dead_rows, localize_cotangent
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


def local_vocab(w: jax.Array, spec: StatsSpec) -> int:
    """The vocab size of this shard's ``w`` (its columns for ``"hv"``, its rows for ``"vh"``)."""
    return w.shape[1] if spec.w_layout == "hv" else w.shape[0]


def _per_token_kw(spec: StatsSpec, row_scale: jax.Array | None, live: jax.Array | None) -> dict[str, Any]:
    """The ``row_scale`` and ``live`` keywords, each passed only when there is one (older backends take neither)."""
    keywords: dict[str, Any] = {"row_scale": row_scale} if spec.with_row_scale else {}
    if live is not None:
        keywords["live"] = live
    return keywords


def _dead_rows_zeroed(stats: RowStats, live: jax.Array | None) -> RowStats:
    """``stats`` with every dead row's statistics 0 (a backend may have skipped them, or computed them)."""
    if live is None:
        return stats
    return jax.tree.map(lambda s: jnp.where(live, s, jnp.zeros((), s.dtype)), stats)


def _stats_out(stats: RowStats, shape: tuple[int, ...]) -> tuple[jax.Array, ...]:
    return tuple(s.reshape(shape) for s in stats if s is not None)


def _stats_in(values: tuple[jax.Array, ...], spec: StatsSpec) -> RowStats:
    return stats_from(tuple(v.reshape(-1) for v in values), spec)


def differentiable_spec(spec: StatsSpec) -> StatsSpec:
    """``spec`` without ``max``/``argmax``: the statistics a VJP takes and gives cotangents for."""
    return dataclasses.replace(spec, with_argmax=False) if spec.with_argmax else spec


@dataclasses.dataclass(frozen=True)
class ShardFn:
    """A per-shard computation with declared input and output kinds (see the module docstring)."""

    backend: Backend
    spec: StatsSpec
    #: A bool ``"tokens"`` input of live tokens follows the row scale (a backend of contract version 4).
    with_live: bool = dataclasses.field(default=False, kw_only=True)

    @property
    def in_kinds(self) -> tuple[str, ...]:
        raise NotImplementedError

    @property
    def n_stats(self) -> int:
        return self.spec.n_stats

    @property
    def out_kinds(self) -> tuple[str, ...]:
        raise NotImplementedError

    @property
    def head_kinds(self) -> tuple[str, ...]:
        """``x``, ``w``, the labels, (under ``with_row_scale``) the row scale and (``with_live``) the live mask."""
        return ("x", "w", "tokens") + ("tokens",) * (self.spec.with_row_scale + self.with_live)

    def split_head(self, args: tuple[jax.Array, ...]) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array | None,
                                                                jax.Array | None, tuple[jax.Array, ...]]:
        """``(x, w, labels, row_scale or None, live or None, rest)`` from the flat arguments."""
        x, w, labels, *rest = args
        scale = rest.pop(0) if self.spec.with_row_scale else None
        live = rest.pop(0) if self.with_live else None
        return x, w, labels, scale, live, tuple(rest)

    def __call__(self, axes: ShardAxes, *args: jax.Array) -> tuple[jax.Array, ...]:
        raise NotImplementedError


@dataclasses.dataclass(frozen=True)
class RowStatsFn(ShardFn):
    """``(x, w, labels[, row_scale]) -> (lse, label[, sum][, expected][, max, argmax])`` over the whole vocabulary."""

    @property
    def in_kinds(self) -> tuple[str, ...]:
        return self.head_kinds

    @property
    def out_kinds(self) -> tuple[str, ...]:
        return ("tokens",) * self.n_stats

    def __call__(self, axes: ShardAxes, *args: jax.Array) -> tuple[jax.Array, ...]:
        x, w, labels, scale, live, _ = self.split_head(args)
        xf, w_, yf, sf = align_varying(_flat_rows(x), w, labels.reshape(-1), _flat_tokens(scale))
        lf = _flat_live(live)
        v = local_vocab(w, self.spec)
        local = self.backend.row_stats(xf, w_, yf - vocab_offset(axes.vocab, v), self.spec,
                                       **_per_token_kw(self.spec, sf, lf))
        return _stats_out(_dead_rows_zeroed(combine_vocab_shards(local, axes.vocab, v), lf), labels.shape)


@dataclasses.dataclass(frozen=True)
class RowStatsVjpFn(ShardFn):
    """``(x, w, labels[, row_scale], *stats, *cotangents) -> (dx, dw)``, given the whole rows' statistics.

    Its spec has no ``max``/``argmax`` (:func:`differentiable_spec`): they take no cotangent.
    """

    @property
    def in_kinds(self) -> tuple[str, ...]:
        return self.head_kinds + ("tokens",) * (2 * self.n_stats)

    @property
    def out_kinds(self) -> tuple[str, ...]:
        return ("x", "w")

    def __call__(self, axes: ShardAxes, *args: jax.Array) -> tuple[jax.Array, ...]:
        x, w, labels, scale, live, rest = self.split_head(args)
        stats, cotangent = rest[:self.n_stats], rest[self.n_stats:]
        xf, w_, yf, sf, stats_f, ct = align_varying(_flat_rows(x), w, labels.reshape(-1), _flat_tokens(scale),
                                                    _stats_in(stats, self.spec), _stats_in(cotangent, self.spec))
        lf = _flat_live(live)
        yf = yf - vocab_offset(axes.vocab, local_vocab(w, self.spec))
        stats_f, ct = inert_dead_rows(stats_f, ct, lf)
        dx, dw = self.backend.row_stats_vjp(xf, w_, yf, stats_f, ct, self.spec, **_per_token_kw(self.spec, sf, lf))
        dx = dx.astype(x.dtype).reshape(x.shape)
        return _sum_to(dx, x, axes.vocab, axes), _sum_to(dw.astype(w.dtype), w, axes.tokens, axes)


@dataclasses.dataclass(frozen=True)
class RowStatsAndGradsFn(ShardFn):
    """``(x, w, labels[, row_scale], coefficients) -> (*stats, dx, dw)`` for a scalar loss.

    ``cotangent_fn(stats, coefficients)`` gives the cotangents of the statistics (see
    :meth:`ce_core.Backend.row_stats_and_grads`; it sees them without ``max``/``argmax``).
    ``coefficients`` is one ``"tokens"`` array, or (``n_params`` set) that many, which
    ``cotangent_fn`` then receives as a tuple (the inputs of :func:`ce_core.linear_token_objective`).
    The backend forms ``dx`` and ``dw`` in its forward pass (6NHV on backends that fuse). With vocab
    shards a token's cotangents need the global statistics first: the ``cotangent_fn`` the backend gets
    combines each chunk's local statistics over the shards (collectives of ``[chunk]``-sized rows) and
    localizes the cotangents (:func:`_vocab_sharded_cotangents`), so what a backend keeps between its
    passes (the pallas_tpu kept logits, the xla tokens-outer chunk) survives the collective.
    """

    cotangent_fn: CotangentFn
    n_params: int | None = None

    @property
    def in_kinds(self) -> tuple[str, ...]:
        return (*self.head_kinds, *("tokens",) * (1 if self.n_params is None else self.n_params))

    @property
    def out_kinds(self) -> tuple[str, ...]:
        return ("tokens",) * self.n_stats + ("x", "w")

    def __call__(self, axes: ShardAxes, *args: jax.Array) -> tuple[jax.Array, ...]:
        x, w, labels, scale, live, params = self.split_head(args)
        xf, w_, yf, sf = align_varying(_flat_rows(x), w, labels.reshape(-1), _flat_tokens(scale))
        lf = _flat_live(live)  # not aligned: the statistics it masks vary over the token axes only
        # Not aligned: the coefficients must vary like the combined statistics, or differentiating
        # sum(coefficients * losses) would sum the statistics' cotangents over the vocab shards.
        flat_params = tuple(p.reshape(-1) for p in params)
        cf: Any = flat_params[0] if self.n_params is None else flat_params
        v = local_vocab(w, self.spec)
        yf = yf - vocab_offset(axes.vocab, v)
        per_token_kw = _per_token_kw(self.spec, sf, lf)
        cotangent_fn = self.cotangent_fn
        if axes.vocab:  # each chunk's statistics combined over the shards before its cotangents
            cotangent_fn = functools.partial(_vocab_sharded_cotangents, self.cotangent_fn, axes.vocab, v)
        stats, dx, dw = self.backend.row_stats_and_grads(xf, w_, yf, self.spec, cotangent_fn, cf, **per_token_kw)
        stats = _dead_rows_zeroed(combine_vocab_shards(stats, axes.vocab, v), lf)
        dx = dx.astype(x.dtype).reshape(x.shape)
        grads = (_sum_to(dx, x, axes.vocab, axes), _sum_to(dw.astype(w.dtype), w, axes.tokens, axes))
        return _stats_out(stats, labels.shape) + grads


def _vocab_sharded_cotangents(cotangent_fn: CotangentFn, vocab_axes: tuple[str, ...], local_vocab: int,
                              local: RowStats, params: Any) -> RowStats:
    """``cotangent_fn`` on one vocab shard: the rows' statistics combined over the shards, their
    cotangents taken, and mapped back onto this shard's (:func:`ce_core.contract.backend.localize_cotangent`)."""
    whole = combine_vocab_shards(local, vocab_axes, local_vocab)
    return vary_like(localize_cotangent(cotangent_fn(whole, params), local, whole), local)


def _flat_live(live: jax.Array | None) -> jax.Array | None:
    """The shard's live mask as bool ``[n]``; varying like the labels only (not aligned with ``w``), so
    the statistics it masks stay replicated over the vocab shards."""
    return None if live is None else jax.lax.stop_gradient(live.reshape(-1).astype(bool))


def _flat_tokens(values: jax.Array | None) -> jax.Array | None:
    return None if values is None else jax.lax.stop_gradient(values.reshape(-1).astype(jnp.float32))


def stats_from(values: tuple[jax.Array, ...], spec: StatsSpec) -> RowStats:
    """``RowStats`` from the leading values in :func:`stats_values` order, as ``spec`` has them."""
    rest = iter(values[2:])
    total = next(rest) if spec.with_sum else None
    expected = next(rest) if spec.with_expected else None
    top = next(rest) if spec.with_argmax else None
    index = next(rest) if spec.with_argmax else None
    return RowStats(values[0], values[1], total, expected, top, index)


def stats_values(stats: RowStats) -> tuple[jax.Array, ...]:
    """The arrays of ``stats`` in output order (the optional ones only when present)."""
    return tuple(s for s in stats if s is not None)
