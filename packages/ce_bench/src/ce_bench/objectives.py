"""What the bench differentiates: a cross-entropy loss with a reduction, or an RL objective.

``--objective`` takes ``mean``, ``sum`` or ``none`` (the loss's reduction; ``none`` differentiates
the sum of per-token losses) or ``rl``: per-token log-probabilities and entropies from
:func:`ce_core.linear_log_probs`, differentiated through ``mean(logp) + RL_ENTROPY_WEIGHT *
mean(entropy)``, the two quantities a GRPO/PPO step takes from the LM head.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

import ce_core
from ce_core.extend import log_probs_oracle, oracle

OBJECTIVES = ("mean", "sum", "none", "rl")
RL_ENTROPY_WEIGHT = 0.01


def rl_objective(logp: jax.Array, entropy: jax.Array) -> jax.Array:
    """The scalar the ``rl`` objective differentiates."""
    return jnp.mean(logp) + RL_ENTROPY_WEIGHT * jnp.mean(entropy)


def ce_core_objective(name: str, objective: str) -> Any:
    """``f(x, labels, w)`` of backend ``name``: the loss (a reduction) or the ``rl`` scalar."""
    if objective == "rl":
        def rl(x: jax.Array, labels: jax.Array, w: jax.Array) -> jax.Array:
            logp, entropy = ce_core.linear_log_probs(x, labels, w, return_entropy=True, implementation=name)
            return rl_objective(logp, entropy)

        return rl

    def loss(x: jax.Array, labels: jax.Array, w: jax.Array) -> jax.Array:
        return ce_core.linear_cross_entropy(x, labels, w, reduction=objective, implementation=name)

    return loss


def expected_outputs(x: np.ndarray, labels: np.ndarray, w: np.ndarray, objective: str) -> dict[str, np.ndarray]:
    """The float64 oracle's value and gradients of ``objective`` (of the sum for ``"none"``)."""
    x, w = np.asarray(x, np.float32), np.asarray(w, np.float32)
    if objective != "rl":
        return oracle(x, labels, w, reduction=objective)
    n = labels.size
    result = log_probs_oracle(x, labels, w, logp_cotangent=np.full(labels.shape, 1.0 / n),
                              entropy_cotangent=np.full(labels.shape, RL_ENTROPY_WEIGHT / n))
    loss = result["logp"].mean() + RL_ENTROPY_WEIGHT * result["entropy"].mean()
    return {"loss": np.asarray(loss), "dx": result["dx"], "dw": result["dw"]}
