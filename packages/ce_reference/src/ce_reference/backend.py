"""Row statistics of fully materialised logits, differentiated by JAX's autodiff."""

from __future__ import annotations

from types import MappingProxyType

import jax
import jax.numpy as jnp

from ce_core import Backend, RowStats, StatsSpec


def row_stats(x: jax.Array, w: jax.Array, labels: jax.Array, spec: StatsSpec) -> RowStats:
    """lse, label logit and (optionally) logit sum and expected logit of ``cap(x @ w)``, in float32."""
    logits = jnp.dot(x, w, preferred_element_type=jnp.float32)
    if spec.logit_soft_cap is not None:
        logits = spec.logit_soft_cap * jnp.tanh(logits / spec.logit_soft_cap)
    lse = jax.nn.logsumexp(logits, axis=-1)
    vocab = w.shape[1]
    in_vocab = (labels >= 0) & (labels < vocab)
    picked = jnp.take_along_axis(logits, jnp.where(in_vocab, labels, 0)[:, None], axis=-1)[:, 0]
    label = jnp.where(in_vocab, picked, 0.0)
    logit_sum = jnp.sum(logits, axis=-1) if spec.with_sum else None
    expected = jnp.sum(jnp.exp(logits - lse[:, None]) * logits, axis=-1) if spec.with_expected else None
    return RowStats(lse, label, logit_sum, expected)


class ReferenceBackend(Backend):
    """Materialises ``[N, V]`` logits; runs wherever XLA runs."""

    name = "reference"
    contract_version = 2
    #: The last resort everywhere: it materialises the logits.
    default_priority = MappingProxyType({"*": 0})

    def row_stats(self, x: jax.Array, w: jax.Array, labels: jax.Array, spec: StatsSpec, *,
                  row_scale: jax.Array | None = None) -> RowStats:
        return row_stats(x, w, labels, spec)


def make_backend() -> ReferenceBackend:
    """Entry-point factory (group ``ce_core.backends``, name ``reference``)."""
    return ReferenceBackend()
