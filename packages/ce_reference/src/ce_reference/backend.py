"""Row statistics of fully materialised logits, differentiated by JAX's autodiff; a pair of heads (a dense
distillation teacher) materialised both, with the contract's own elementwise formulas."""

from __future__ import annotations

from types import MappingProxyType

import jax
import jax.numpy as jnp

from ce_core import Backend, RowStats, StatsSpec
from ce_core.extend import PairSpec, PairStats, pair_delta, pair_logits, pair_stats_of


def logits_of(x: jax.Array, w: jax.Array, spec: StatsSpec, row_scale: jax.Array | None = None) -> jax.Array:
    """``s_i * cap(x_i . w_j)`` in float32, ``[N, V]``, contracting on H whichever layout ``w`` has, at
    ``spec.precision`` (its transposes in the gradient too)."""
    contract = ((1,), (0,)) if spec.w_layout == "hv" else ((1,), (1,))
    logits = jax.lax.dot_general(x, w, (contract, ((), ())), precision=spec.precision,
                                 preferred_element_type=jnp.float32)
    if spec.logit_soft_cap is not None:
        logits = spec.logit_soft_cap * jnp.tanh(logits / spec.logit_soft_cap)
    if spec.with_row_scale:
        if row_scale is None:
            raise ValueError("StatsSpec.with_row_scale needs the row_scale argument")
        logits = jax.lax.stop_gradient(row_scale.astype(jnp.float32))[:, None] * logits
    return logits


def row_stats(x: jax.Array, w: jax.Array, labels: jax.Array, spec: StatsSpec,
              row_scale: jax.Array | None = None) -> RowStats:
    """Every statistic of the contract that ``spec`` asks for, from the materialised logits, in float32."""
    logits = logits_of(x, w, spec, row_scale)
    lse = jax.nn.logsumexp(logits, axis=-1)
    vocab = logits.shape[1]
    in_vocab = (labels >= 0) & (labels < vocab)
    picked = jnp.take_along_axis(logits, jnp.where(in_vocab, labels, 0)[:, None], axis=-1)[:, 0]
    label = jnp.where(in_vocab, picked, 0.0)
    logit_sum = jnp.sum(logits, axis=-1) if spec.with_sum else None
    expected = jnp.sum(jnp.exp(logits - lse[:, None]) * logits, axis=-1) if spec.with_expected else None
    top = index = None
    if spec.with_argmax:  # not differentiated (the contract)
        frozen = jax.lax.stop_gradient(logits)
        top, index = jnp.max(frozen, axis=-1), jnp.argmax(frozen, axis=-1).astype(jnp.int32)
    return RowStats(lse, label, logit_sum, expected, top, index)


class ReferenceBackend(Backend):
    """Materialises ``[N, V]`` logits; runs wherever XLA runs."""

    name = "reference"
    #: Version 5: pair statistics. It computes every row, the dead ones (version 4's ``live``) on zeros.
    contract_version = 5
    #: The last resort everywhere: it materialises the logits.
    default_priority = MappingProxyType({"*": 0})

    def row_stats(self, x: jax.Array, w: jax.Array, labels: jax.Array, spec: StatsSpec, *,
                  row_scale: jax.Array | None = None, live: jax.Array | None = None) -> RowStats:
        if live is not None:  # dead rows' x may be garbage (padding): computed on zeros, they add nothing
            x = jnp.where(live[:, None], x, jnp.zeros((), x.dtype))
        return row_stats(x, w, labels, spec, row_scale)

    def pair_row_stats(self, x: jax.Array, w: jax.Array, teacher_x: jax.Array, teacher_w: jax.Array,
                       spec: PairSpec, *, row_scale: jax.Array, lse: tuple[jax.Array, jax.Array] | None = None,
                       live: jax.Array | None = None) -> PairStats:
        del live  # every row computed: ce_core hands dead rows in as zeros, with g = 0
        a, b, _ = pair_logits(x, w, teacher_x, teacher_w, spec, row_scale)
        return pair_stats_of(a, b, spec, lse)

    def pair_row_stats_vjp(self, x: jax.Array, w: jax.Array, teacher_x: jax.Array, teacher_w: jax.Array,
                           stats: PairStats, g: jax.Array, spec: PairSpec, *, row_scale: jax.Array,
                           live: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
        del live
        a, b, slope = pair_logits(x, w, teacher_x, teacher_w, spec, row_scale)
        delta = pair_delta(a, b, slope, row_scale, stats, g, spec)
        operand = delta.astype(jnp.promote_types(x.dtype, w.dtype))
        hv = spec.w_layout == "hv"
        dx = jnp.dot(operand, w.T if hv else w, precision=spec.precision, preferred_element_type=jnp.float32)
        dw = jnp.dot(x.T, operand, precision=spec.precision, preferred_element_type=jnp.float32)
        return dx.astype(x.dtype), (dw if hv else dw.T).astype(w.dtype)



def make_backend() -> ReferenceBackend:
    """Entry-point factory (group ``ce_core.backends``, name ``reference``)."""
    return ReferenceBackend()
