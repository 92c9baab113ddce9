"""Contract version 5: statistics of a pair of heads (a student and a dense teacher) for distillation.

A backend at version 5 streams two heads over the same vocabulary, token row by token row:

    a_ij = s_i cap_s(x_i . w_j)        (the student: differentiated)
    b_ij = s_i cap_t(u_i . v_j)        (the teacher, ``u = teacher_x``, ``v = teacher_w``: data only)

with ``s_i`` the per-token ``row_scale`` (``1 / T_i``), ``log p = a - lse_a`` and ``log q = b - lse_b``. For each
row it returns :class:`PairStats`: both lses and the divergence's per-row sum ``sum_j d_ij`` where

    forward_kl:  d = q (log q - log p)                     (KL(q || p))
    reverse_kl:  d = p (log p - log q)                     (KL(p || q))
    jsd:         d = beta q (log q - log m) + (1 - beta) p (log p - log m),   m = beta q + (1 - beta) p

and, for the JSD, ``student_term = sum_j p (log p - log m)`` (what its gradient needs). Given the whole rows'
statistics and a cotangent ``g`` of the divergence (``[N]``), the student's logit cotangent is

    forward_kl:  delta = g (p - q)
    reverse_kl:  delta = g p ((log p - log q) - divergence)
    jsd:         delta = g (1 - beta) p ((log p - log m) - student_term)

times ``s_i cap_s'(x_i . w_j)``, and ``dx = delta @ w.T``, ``dw = x.T @ delta`` (``w``'s layout) as for one head.
**A vocab shard** (``w`` and ``v`` hold the same slice of the vocabulary): given the whole rows' ``lse`` pair, the
sums are the shard's part (they add over shards) and ``delta`` is the shard's columns as it stands.

The elementwise pieces (:func:`scaled_logits`, :func:`pair_stats_of`, :func:`pair_delta`) are here so that every
backend applies the same formulas to the logit tiles it forms; a backend owns only how it tiles and multiplies.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp

#: The divergences between the student's and the teacher's softmax that a pair computation takes.
PAIR_DIVERGENCES = ("forward_kl", "reverse_kl", "jsd")

#: The first contract version whose backends compute pair statistics.
PAIR_VERSION = 5


class PairStats(NamedTuple):
    """Per-token statistics of a pair of heads, each float32 ``[N]`` (``student_term`` only for the JSD)."""

    lse: jax.Array
    teacher_lse: jax.Array
    divergence: jax.Array
    student_term: jax.Array | None = None


@dataclasses.dataclass(frozen=True)
class PairSpec:
    """Static options of a pair computation (hashable). ``beta`` is strictly inside ``(0, 1)`` for the JSD (ce_core
    maps its ends to the KLs) and unused otherwise."""

    divergence: str = "forward_kl"
    beta: float = 0.5
    logit_soft_cap: float | None = None
    teacher_logit_soft_cap: float | None = None
    w_layout: str = "hv"
    teacher_w_layout: str = "hv"
    #: MXU precision of the products, as :attr:`StatsSpec.precision`.
    precision: str | None = None

    def __post_init__(self) -> None:
        if self.divergence not in PAIR_DIVERGENCES:
            raise ValueError(f"PairSpec.divergence must be one of {PAIR_DIVERGENCES}, got {self.divergence!r}")
        if self.divergence == "jsd" and not 0.0 < self.beta < 1.0:
            raise ValueError(f"PairSpec.beta must be in (0, 1) for the JSD, got {self.beta}")


_LOGITS = {"hv": (((1,), (0,)), ((), ())), "vh": (((1,), (1,)), ((), ()))}


def scaled_logits(x: jax.Array, w: jax.Array, layout: str, soft_cap: float | None, row_scale: jax.Array,
                  precision: str | None = None) -> tuple[jax.Array, jax.Array | None]:
    """``s * cap(x @ w)`` as float32 ``[rows, V]`` (``w`` in ``layout``), and ``cap'`` there (``None``: no cap)."""
    raw = jax.lax.dot_general(x, w, _LOGITS[layout], precision=precision, preferred_element_type=jnp.float32)
    slope = None
    if soft_cap is not None:
        squashed = jnp.tanh(raw / soft_cap)
        raw, slope = soft_cap * squashed, 1.0 - squashed * squashed
    return row_scale[:, None] * raw, slope



def pair_logits(x: jax.Array, w: jax.Array, teacher_x: jax.Array, teacher_w: jax.Array, spec: PairSpec,
                row_scale: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array | None]:
    """Both heads' float32 ``[rows, V]`` logits through :func:`scaled_logits`, and the student's ``cap'``."""
    a, slope = scaled_logits(x, w, spec.w_layout, spec.logit_soft_cap, row_scale, spec.precision)
    b, _ = scaled_logits(teacher_x, teacher_w, spec.teacher_w_layout, spec.teacher_logit_soft_cap, row_scale,
                         spec.precision)
    return a, b, slope


def pair_stats_of(a: jax.Array, b: jax.Array, spec: PairSpec,
                  lse: tuple[jax.Array, jax.Array] | None = None) -> PairStats:
    """The statistics of student logits ``a`` and teacher logits ``b`` (``[rows, c]``), over these columns or, with
    ``lse`` (the whole rows' pair), these columns' part of the whole rows' sums."""
    lse_a, lse_b = (jax.nn.logsumexp(a, axis=-1), jax.nn.logsumexp(b, axis=-1)) if lse is None else lse
    log_p, log_q = a - lse_a[:, None], b - lse_b[:, None]
    p, q = jnp.exp(log_p), jnp.exp(log_q)
    if spec.divergence == "forward_kl":
        return PairStats(lse_a, lse_b, jnp.sum(q * (log_q - log_p), axis=-1))
    if spec.divergence == "reverse_kl":
        return PairStats(lse_a, lse_b, jnp.sum(p * (log_p - log_q), axis=-1))
    log_m = _log_mixture(log_p, log_q, spec.beta)
    teacher_term = jnp.sum(q * (log_q - log_m), axis=-1)
    student_term = jnp.sum(p * (log_p - log_m), axis=-1)
    return PairStats(lse_a, lse_b, spec.beta * teacher_term + (1.0 - spec.beta) * student_term, student_term)


def pair_delta(a: jax.Array, b: jax.Array, slope: jax.Array | None, row_scale: jax.Array, stats: PairStats,
               g: jax.Array, spec: PairSpec) -> jax.Array:
    """The cotangent of ``x @ w`` (float32 ``[rows, c]``) for a cotangent ``g`` (``[rows]``) of the divergence,
    given the whole rows' statistics."""
    log_p, log_q = a - stats.lse[:, None], b - stats.teacher_lse[:, None]
    p = jnp.exp(log_p)
    if spec.divergence == "forward_kl":
        d_a = p - jnp.exp(log_q)
    elif spec.divergence == "reverse_kl":
        d_a = p * ((log_p - log_q) - stats.divergence[:, None])
    else:
        if stats.student_term is None:
            raise ValueError("the JSD's gradient needs PairStats.student_term")
        log_m = _log_mixture(log_p, log_q, spec.beta)
        d_a = (1.0 - spec.beta) * p * ((log_p - log_m) - stats.student_term[:, None])
    delta = (g * row_scale)[:, None] * d_a
    return delta if slope is None else delta * slope


def _log_mixture(log_p: jax.Array, log_q: jax.Array, beta: float) -> jax.Array:
    """``log(beta q + (1 - beta) p)``, from the log-probabilities (finite wherever they are)."""
    return jnp.logaddexp(jnp.log(beta) + log_q, jnp.log1p(-beta) + log_p)
