"""Row statistics of fully materialised logits, differentiated by JAX's autodiff."""

from __future__ import annotations

from types import MappingProxyType

import jax
import jax.numpy as jnp

from ce_core import Backend, RowStats, StatsSpec


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
    #: Version 3: the oracle computes every row, so ce_core hands it no live rows (version 4) to skip.
    contract_version = 3
    #: The last resort everywhere: it materialises the logits.
    default_priority = MappingProxyType({"*": 0})

    def row_stats(self, x: jax.Array, w: jax.Array, labels: jax.Array, spec: StatsSpec, *,
                  row_scale: jax.Array | None = None, live: jax.Array | None = None) -> RowStats:
        del live  # in the signature only (never passed at version 3)
        return row_stats(x, w, labels, spec, row_scale)


def make_backend() -> ReferenceBackend:
    """Entry-point factory (group ``ce_core.backends``, name ``reference``)."""
    return ReferenceBackend()
