"""What the bench differentiates: a cross-entropy loss with a reduction, an RL objective, or distillation.

``--objective`` takes ``mean``, ``sum`` or ``none`` (the loss's reduction; ``none`` differentiates
the sum of per-token losses); ``rl``: per-token log-probabilities and entropies from
:func:`ce_core.linear_log_probs`, differentiated through ``mean(logp) + RL_ENTROPY_WEIGHT *
mean(entropy)``, the two quantities a GRPO/PPO step takes from the LM head; or ``distill``:
:func:`ce_core.linear_distillation_loss` against a top-``DISTILL_K`` teacher (:func:`synthetic_teacher`,
drawn from the labels so that every contender sees the same one) with ``DISTILL_HARD_WEIGHT`` of the hard
label, the mean over tokens (``reference`` is the materialised student beside the same gather); or
``distill_dense``: the forward KL against a dense teacher twice the student's width
(:func:`synthetic_dense_teacher`, built from the student's own arrays), both heads streamed (``reference``
materialises both).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

import ce_core
from ce_core.extend import distillation_oracle, log_probs_oracle, oracle

OBJECTIVES = ("mean", "sum", "none", "rl", "distill", "distill_dense")
RL_ENTROPY_WEIGHT = 0.01
DISTILL_K = 64
DISTILL_HARD_WEIGHT = 0.1


def synthetic_teacher(labels: Any, vocab: int, k: int = DISTILL_K) -> tuple[Any, Any]:
    """A teacher's top-``k`` per token for the bench: ``(ids, log-probs)``, ``[..., k]``, from the labels alone
    (ignored ones as 0): the label first, then ids spread over the vocabulary by a multiplicative hash; log-probs
    decreasing geometrically, 0.9 of the mass on the ``k`` entries. NumPy in, NumPy out; JAX in, JAX out."""
    xp = np if isinstance(labels, np.ndarray) else jnp
    base = xp.where(labels < 0, 0, labels).astype(xp.int64 if xp is np else xp.int32)
    steps = xp.arange(k, dtype=base.dtype)
    ids = (base[..., None] + steps * 7919 + steps * steps * 104729) % vocab
    ids = ids.astype(xp.int32)
    weights = 0.7 ** np.arange(k)
    log_probs = np.log(0.9 * weights / weights.sum()).astype(np.float32)
    return ids, xp.broadcast_to(xp.asarray(log_probs), ids.shape)


def synthetic_dense_teacher(x: Any, w: Any) -> tuple[Any, Any]:
    """A dense teacher of width ``2H`` for the bench, from the student's ``x [..., H]`` and ``w [H, V]``: hidden
    states ``[x, reversed x]`` and a head ``[w; w rolled by one entry] / sqrt(2)``, so its logits are of order 1
    and differ from the student's. NumPy in, NumPy out; JAX in, JAX out (not differentiated)."""
    xp = np if isinstance(x, np.ndarray) else jnp
    if xp is jnp:
        x, w = jax.lax.stop_gradient(x), jax.lax.stop_gradient(w)
    hidden = xp.concatenate([x, x[..., ::-1]], axis=-1)
    head = xp.concatenate([w, xp.roll(w, 1, axis=1)], axis=0) / np.sqrt(2.0).astype(np.float32)
    return hidden, head.astype(w.dtype)


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

    if objective == "distill":
        def distill(x: jax.Array, labels: jax.Array, w: jax.Array) -> jax.Array:
            ids, log_probs = synthetic_teacher(labels, w.shape[1])
            return ce_core.linear_distillation_loss(x, w, labels=labels, teacher_indices=ids,
                                                    teacher_log_probs=log_probs,
                                                    hard_label_weight=DISTILL_HARD_WEIGHT, implementation=name)

        return distill

    if objective == "distill_dense":
        def distill_dense(x: jax.Array, labels: jax.Array, w: jax.Array) -> jax.Array:
            teacher_x, teacher_w = synthetic_dense_teacher(x, w)
            return ce_core.linear_distillation_loss(x, w, teacher_x, teacher_w, labels, implementation=name)

        return distill_dense

    def loss(x: jax.Array, labels: jax.Array, w: jax.Array) -> jax.Array:
        return ce_core.linear_cross_entropy(x, labels, w, reduction=objective, implementation=name)

    return loss


def expected_outputs(x: np.ndarray, labels: np.ndarray, w: np.ndarray, objective: str) -> dict[str, np.ndarray]:
    """The float64 oracle's value and gradients of ``objective`` (of the sum for ``"none"``)."""
    x, w = np.asarray(x, np.float32), np.asarray(w, np.float32)
    if objective == "distill":
        ids, log_probs = synthetic_teacher(np.asarray(labels), w.shape[1])
        return distillation_oracle(x, w, labels=labels, teacher_indices=ids, teacher_log_probs=log_probs,
                                   hard_label_weight=DISTILL_HARD_WEIGHT)
    if objective == "distill_dense":
        return distillation_oracle(x, w, *synthetic_dense_teacher(x, w), labels)
    if objective != "rl":
        return oracle(x, labels, w, reduction=objective)
    n = labels.size
    result = log_probs_oracle(x, labels, w, logp_cotangent=np.full(labels.shape, 1.0 / n),
                              entropy_cotangent=np.full(labels.shape, RL_ENTROPY_WEIGHT / n))
    loss = result["logp"].mean() + RL_ENTROPY_WEIGHT * result["entropy"].mean()
    return {"loss": np.asarray(loss), "dx": result["dx"], "dw": result["dw"]}
