"""The per-token divergence between a student head and a dense teacher head, on a contract-version-5 backend.

Both heads stream through the backend's pair statistics (:mod:`ce_core.contract.pair`); differentiation stops
at the two custom VJPs here. A scalar loss knows each token's cotangent of the divergence in advance (its
weight over the normaliser), so :func:`weighted_divergence` asks the backend for the gradient in the same pass
(:meth:`Backend.pair_row_stats_and_grads`); :func:`per_token_divergence` keeps the statistics and recomputes
in the backward (:meth:`Backend.pair_row_stats_vjp`). The teacher is data: its cotangents are zeros, never a
pass over its head.

**Placements** are those of the student's loss (:func:`ce_core.sharded.placement.find_placement`): one shard's
computation (:class:`PairRun`'s methods) runs whole, or on each device inside ``jax.shard_map``. The teacher's
hidden states are laid out like ``x`` (tokens split the same way) and its head like ``w`` (the same vocab
shards, in its own layout). Token shards are independent (``dw`` summed over them). Vocab shards need the
whole rows' lses before any sum. A KL is combined from each shard's own statistics by the chain rule
(:func:`_combined_kl`): a pass for the statistics and one for the gradient. The JSD's mixture needs the whole
rows' lses inside its logarithm: each shard's lses are combined, the sums taken over the shard's columns with
them and added over the shards, then the gradient (three passes). One device or token shards alone take one.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from ce_core.contract.backend import Backend, Problem, StatsSpec
from ce_core.contract.pair import PairSpec, PairStats
from ce_core.contract.registry import select_backend
from ce_core.contract.varying import align_varying, psum_to
from ce_core.sharded.flat_tokens import FlatTokens
from ce_core.sharded.placement import Placement, ShardAxes


def pair_backend(implementation: object, placement: Placement, x: jax.Array, w: jax.Array, spec: PairSpec) -> Backend:
    """The backend that runs the pair (a version-5 one: older backends are refused by name)."""
    hidden, vocab = (w.shape[1], w.shape[0]) if spec.w_layout == "vh" else w.shape
    tokens = x.size // hidden
    student = StatsSpec(logit_soft_cap=spec.logit_soft_cap, precision=spec.precision, w_layout=spec.w_layout)
    problem = Problem(tokens // placement.token_shards(), hidden, vocab // placement.vocab_shards(), x.dtype,
                      w.dtype, student, placement.kind, pair=spec)
    return select_backend(implementation, problem)  # type: ignore[arg-type]


@dataclasses.dataclass(frozen=True)
class PairRun:
    """One pair computation: the backend, its options and the placement (hashable: the ops are cached on it)."""

    backend: Backend
    spec: PairSpec
    placement: Placement

    def lay_out(self, x: jax.Array, w: jax.Array, teacher_x: jax.Array, teacher_w: jax.Array,
                *tokens: jax.Array) -> tuple[jax.Array, ...]:
        """The arrays as the placement runs them (tokens flattened and padded where it says so)."""
        placement = self.placement
        if placement.flat_tokens:
            flat = FlatTokens.over(tokens[0].shape, placement.token_shards())
            x, teacher_x = flat.rows(x), flat.rows(teacher_x)
            tokens = tuple(flat.tokens(values, 0) for values in tokens)  # padded rows: zero weight, any scale
        teacher = dataclasses.replace(placement, w_layout=self.spec.teacher_w_layout)
        return (placement.lay_out(x, "x"), placement.lay_out(w, "w"), placement.lay_out(teacher_x, "x"),
                teacher.lay_out(teacher_w, "w"), *(placement.lay_out(values, "tokens") for values in tokens))

    def restore(self, per_token: jax.Array, shape: tuple[int, ...]) -> jax.Array:
        """A per-token result in the tokens' own shape."""
        return FlatTokens.over(shape, self.placement.token_shards()).restore(per_token) \
            if self.placement.flat_tokens else per_token

    def run(self, fn: Callable[..., tuple[jax.Array, ...]], in_kinds: tuple[str, ...], out_kinds: tuple[str, ...],
            *args: jax.Array) -> tuple[jax.Array, ...]:
        """``fn(axes, *args)`` on every shard (or whole), each array laid out as its kind says."""
        axes = self.placement.shard_axes
        if self.placement.kind == "local":
            return fn(axes, *args)
        return jax.shard_map(functools.partial(fn, axes), mesh=self.placement.mesh,
                             in_specs=tuple(self._spec(kind) for kind in in_kinds),
                             out_specs=tuple(self._spec(kind) for kind in out_kinds))(*args)

    def _spec(self, kind: str) -> jax.sharding.PartitionSpec:
        if kind == "teacher_w":
            return dataclasses.replace(self.placement, w_layout=self.spec.teacher_w_layout).spec("w")
        return self.placement.spec({"teacher_x": "x"}.get(kind, kind))

    # One shard's computations: x, w, teacher_x, teacher_w, row_scale, live (float32 1/0, so that it takes a
    # zero cotangent like the rest)[, statistics][, g] in; nothing differentiated. Every shard of a token runs
    # the same chunks (the live rows are the same on its vocab shards), so their collectives line up.

    def shard_stats(self, axes: ShardAxes, x, w, teacher_x, teacher_w, row_scale, live) -> tuple[jax.Array, ...]:
        """The whole rows' statistics of this shard's tokens, token-shaped."""
        rows = self._rows(x, w, teacher_x, teacher_w, row_scale)
        stats = self._whole_stats(axes, *rows, _live_mask(live))
        return tuple(value.reshape(row_scale.shape) for value in stats if value is not None)

    def shard_vjp(self, axes: ShardAxes, x, w, teacher_x, teacher_w, row_scale, live,
                  *stats_and_g) -> tuple[jax.Array, ...]:
        """``dx, dw`` of ``sum(g * divergence)`` from the whole rows' statistics."""
        *stats, g = stats_and_g
        xf, w_, txf, tw_, sf, gf, *flat_stats = align_varying(*self._rows(x, w, teacher_x, teacher_w, row_scale),
                                                               g.reshape(-1), *(s.reshape(-1) for s in stats))
        dx, dw = self.backend.pair_row_stats_vjp(xf, w_, txf, tw_, PairStats(*flat_stats), gf, self.spec,
                                                 row_scale=sf, live=_live_mask(live))
        return self._summed(axes, x, w, dx, dw)

    def shard_fused(self, axes: ShardAxes, x, w, teacher_x, teacher_w, row_scale, live, g) -> tuple[jax.Array, ...]:
        """The divergence per token and the ``dx, dw`` of ``sum(g * divergence)``: one pass without vocab shards."""
        rows = self._rows(x, w, teacher_x, teacher_w, row_scale)
        mask = _live_mask(live)
        if axes.vocab:
            stats = self._whole_stats(axes, *rows, mask)
            xf, w_, txf, tw_, sf, gf, *flat_stats = align_varying(*rows, g.reshape(-1), *stats)
            dx, dw = self.backend.pair_row_stats_vjp(xf, w_, txf, tw_, PairStats(*flat_stats), gf, self.spec,
                                                     row_scale=sf, live=mask)
        else:
            xf, w_, txf, tw_, sf, gf = align_varying(*rows, g.reshape(-1))
            stats, dx, dw = self.backend.pair_row_stats_and_grads(xf, w_, txf, tw_, self.spec, gf, row_scale=sf,
                                                                  live=mask)
        return (stats.divergence.reshape(row_scale.shape), *self._summed(axes, x, w, dx, dw))

    def _rows(self, x, w, teacher_x, teacher_w, row_scale) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array,
                                                                     jax.Array]:
        return (x.reshape(-1, x.shape[-1]), w, teacher_x.reshape(-1, teacher_x.shape[-1]), teacher_w,
                row_scale.reshape(-1))

    def _whole_stats(self, axes: ShardAxes, x, w, teacher_x, teacher_w, row_scale, live) -> PairStats:
        """This shard's tokens' statistics over the whole vocabulary (combined over the vocab shards)."""
        xf, w_, txf, tw_, sf = align_varying(x, w, teacher_x, teacher_w, row_scale)
        local = self.backend.pair_row_stats(xf, w_, txf, tw_, self.spec, row_scale=sf, live=live)
        if not axes.vocab:
            return local
        lse = (_combined_lse(local.lse, axes.vocab), _combined_lse(local.teacher_lse, axes.vocab))
        if self.spec.divergence != "jsd":
            return PairStats(*lse, _combined_kl(local, lse, axes.vocab, self.spec.divergence))
        part = self.backend.pair_row_stats(xf, w_, txf, tw_, self.spec, row_scale=sf, lse=lse, live=live)
        summed = None if part.student_term is None else jax.lax.psum(part.student_term, axes.vocab)
        return PairStats(*lse, jax.lax.psum(part.divergence, axes.vocab), summed)

    def _summed(self, axes: ShardAxes, x, w, dx, dw) -> tuple[jax.Array, jax.Array]:
        dx = dx.astype(x.dtype).reshape(x.shape)
        dw = dw.astype(w.dtype)
        if axes.typed:
            return psum_to(dx, x), psum_to(dw, w)
        return dx, dw


def _live_mask(live: jax.Array) -> jax.Array:
    """The bool ``[rows]`` mask of live rows from the float32 1/0 the shard functions take."""
    return live.reshape(-1) > 0


def _combined_lse(lse: jax.Array, axes: tuple[str, ...]) -> jax.Array:
    peak = jax.lax.pmax(lse, axes)
    return peak + jnp.log(jax.lax.psum(jnp.exp(lse - peak), axes))


def _combined_kl(local: PairStats, lse: tuple[jax.Array, jax.Array], axes: tuple[str, ...],
                 divergence: str) -> jax.Array:
    """The whole rows' KL from each vocab shard's own (over its columns, with its own lses), by the chain rule:
    ``KL(u || v) = sum_s U_s (KL(u_s || v_s) + log U_s - log V_s)``, ``U_s``, ``V_s`` the shard's share of each
    distribution's mass (``u`` the teacher's for the forward KL, the student's for the reverse). Every term is
    taken as it stands (no difference of lses), so a small KL keeps its precision."""
    log_share_p, log_share_q = local.lse - lse[0], local.teacher_lse - lse[1]
    log_u, log_v = (log_share_q, log_share_p) if divergence == "forward_kl" else (log_share_p, log_share_q)
    return jax.lax.psum(jnp.exp(log_u) * (local.divergence + (log_u - log_v)), axes)


def per_token_divergence(run: PairRun, x: jax.Array, w: jax.Array, teacher_x: jax.Array, teacher_w: jax.Array,
                         row_scale: jax.Array, live: jax.Array) -> jax.Array:
    """The divergence of each token (float32, ``row_scale``'s shape; 0 where ``live`` is false), differentiable in
    ``x`` and ``w``. Dead tokens' rows must be zeros and their cotangents 0 (a backend may skip them)."""
    return _compiled_if_sharded(run, _per_token)(run, x, w, teacher_x, teacher_w, row_scale, live)


def weighted_divergence(run: PairRun, x: jax.Array, w: jax.Array, teacher_x: jax.Array, teacher_w: jax.Array,
                        row_scale: jax.Array, live: jax.Array, coefficient: jax.Array) -> jax.Array:
    """``sum(coefficient * divergence)`` (a float32 scalar), its gradient formed with the statistics; dead tokens
    (``live`` false, zero rows, coefficient 0) may be skipped."""
    return _compiled_if_sharded(run, _weighted)(run, x, w, teacher_x, teacher_w, row_scale, live, coefficient)


def _per_token(run: PairRun, x, w, teacher_x, teacher_w, row_scale, live) -> jax.Array:
    divergence = _per_token_op(run)(*run.lay_out(x, w, teacher_x, teacher_w, row_scale, live.astype(jnp.float32)))
    return jnp.where(live, run.restore(divergence, row_scale.shape), 0.0)


def _weighted(run: PairRun, x, w, teacher_x, teacher_w, row_scale, live, coefficient) -> jax.Array:
    return _weighted_op(run)(*run.lay_out(x, w, teacher_x, teacher_w, row_scale, live.astype(jnp.float32),
                                          coefficient))


def _compiled_if_sharded(run: PairRun, fn: Callable[..., jax.Array]) -> Callable[..., jax.Array]:
    """``fn`` itself, or jitted under a ``shard_map`` placement: an eager call under Auto axes sees only the
    abstract mesh of its inputs, where they cannot be laid out op by op (as :func:`ce_core.api.prepare.run_placed`)."""
    return _jitted(fn) if run.placement.kind == "shard_map" else fn


@functools.lru_cache(maxsize=8)
def _jitted(fn: Callable[..., jax.Array]) -> Callable[..., jax.Array]:
    return jax.jit(fn, static_argnums=0)


def _teacher_zeros(*arrays: jax.Array) -> tuple[jax.Array, ...]:
    return tuple(jnp.zeros_like(array) for array in arrays)


_HEADS = ("x", "w", "teacher_x", "teacher_w", "tokens", "tokens")  # ..., row_scale, live


@functools.lru_cache(maxsize=64)
def _per_token_op(run: PairRun) -> Any:
    n_stats = 4 if run.spec.divergence == "jsd" else 3

    def stats(*args):
        return run.run(run.shard_stats, _HEADS, ("tokens",) * n_stats, *args)

    @jax.custom_vjp
    def divergence(x, w, teacher_x, teacher_w, row_scale, live):
        return stats(x, w, teacher_x, teacher_w, row_scale, live)[2]

    def forward(x, w, teacher_x, teacher_w, row_scale, live):
        values = stats(x, w, teacher_x, teacher_w, row_scale, live)
        return values[2], (x, w, teacher_x, teacher_w, row_scale, live, values)

    def backward(residuals, g):
        x, w, teacher_x, teacher_w, row_scale, live, values = residuals
        dx, dw = run.run(run.shard_vjp, (*_HEADS, *("tokens",) * (n_stats + 1)), ("x", "w"),
                         x, w, teacher_x, teacher_w, row_scale, live, *values, g.astype(jnp.float32) * live)
        return (dx, dw, *_teacher_zeros(teacher_x, teacher_w, row_scale, live))

    divergence.defvjp(forward, backward)
    return divergence


@functools.lru_cache(maxsize=64)
def _weighted_op(run: PairRun) -> Any:
    n_stats = 4 if run.spec.divergence == "jsd" else 3

    @jax.custom_vjp
    def total(x, w, teacher_x, teacher_w, row_scale, live, coefficient):  # not differentiated: no gradient formed
        values = run.run(run.shard_stats, _HEADS, ("tokens",) * n_stats, x, w, teacher_x, teacher_w, row_scale, live)
        return jnp.sum(coefficient * live * values[2])

    def forward(x, w, teacher_x, teacher_w, row_scale, live, coefficient):
        divergence, dx, dw = run.run(run.shard_fused, (*_HEADS, "tokens"), ("tokens", "x", "w"),
                                     x, w, teacher_x, teacher_w, row_scale, live, coefficient * live)
        return (jnp.sum(coefficient * live * divergence),
                (dx, dw, teacher_x, teacher_w, row_scale, live, coefficient))

    def backward(residuals, g):
        dx, dw, teacher_x, teacher_w, row_scale, live, coefficient = residuals
        return ((g * dx).astype(dx.dtype), (g * dw).astype(dw.dtype),
                *_teacher_zeros(teacher_x, teacher_w, row_scale, live, coefficient))

    total.defvjp(forward, backward)
    return total
