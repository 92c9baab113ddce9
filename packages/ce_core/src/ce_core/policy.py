"""Ready-made token functions of the common RL policy losses, for :func:`ce_core.linear_token_objective`.

:class:`PolicyLoss` is the per-token objective of PPO, GRPO and DAPO: the clipped importance ratio
against the sampling policy's log-probabilities, with an optional k3 KL penalty towards a reference
policy and an entropy bonus, times an aggregation weight::

    r = exp(logp - old_logp)
    loss = weight * (-min(r A, clip(r, 1 - clip_low, 1 + clip_high) A) + beta * k3 - alpha * entropy)
    k3 = exp(ref_logp - logp) - (ref_logp - logp) - 1

The aggregation over tokens is the weight, from the mask (:func:`token_weights`): ``"sequence"``
(GRPO: each sequence's mean over its tokens, then the mean over sequences) or ``"token"`` (DAPO:
the mean over all counted tokens of the batch). Other schemes are other weights (Dr. GRPO's constant
normaliser: ``mask / mask.size``).
"""

from __future__ import annotations

import dataclasses
from typing import Literal, NamedTuple

import jax
import jax.numpy as jnp
from jax.typing import ArrayLike


class PolicyInputs(NamedTuple):
    """The per-token data of :class:`PolicyLoss` (each broadcastable to the labels' shape; not differentiated).

    Attributes:
      old_logp: log-probabilities of the tokens under the sampling policy (at the same temperature).
      advantages: each token's advantage; per sequence as ``[B, 1]``.
      weights: the aggregation weights, :func:`token_weights` of the mask.
      ref_logp: log-probabilities under the reference policy, for the KL penalty; ``None`` without one.
    """

    old_logp: ArrayLike
    advantages: ArrayLike
    weights: ArrayLike
    ref_logp: ArrayLike | None = None


def clipped_surrogate(logp: jax.Array, old_logp: jax.Array, advantages: jax.Array, clip_low: float = 0.2,
                      clip_high: float | None = None) -> jax.Array:
    """PPO's clipped objective, negated to a loss: ``-min(r A, clip(r, 1 - clip_low, 1 + clip_high) A)``.

    ``r = exp(logp - old_logp)``; ``clip_high`` defaults to ``clip_low`` (PPO, GRPO); DAPO's "clip higher"
    takes a larger one (``clip_low=0.2, clip_high=0.28``). Elementwise.
    """
    high = clip_low if clip_high is None else clip_high
    ratio = jnp.exp(logp - old_logp)
    clipped = jnp.clip(ratio, 1.0 - clip_low, 1.0 + high)
    return -jnp.minimum(ratio * advantages, clipped * advantages)


def k3_kl(logp: jax.Array, ref_logp: jax.Array) -> jax.Array:
    """The k3 estimator of ``KL(policy || reference)`` at a sampled token: ``exp(d) - d - 1``, ``d = ref_logp - logp``.

    Non-negative and unbiased for samples of the policy. Elementwise.
    """
    log_ratio = ref_logp - logp
    return jnp.exp(log_ratio) - log_ratio - 1.0


@dataclasses.dataclass(frozen=True)
class PolicyLoss:
    """A token function (``token_fn``) for :func:`ce_core.linear_token_objective` taking :class:`PolicyInputs`.

    Frozen, so hashable: the call treats it as static, like its options. The entropy statistic is
    computed only when ``entropy_coefficient`` is not 0.

    Attributes:
      clip_low: the ratio is clipped below at ``1 - clip_low``.
      clip_high: ... and above at ``1 + clip_high`` (``None``: ``clip_low``; DAPO uses 0.28).
      kl_coefficient: ``beta``, the weight of the k3 KL penalty (needs ``ref_logp``).
      entropy_coefficient: ``alpha``, the weight of the entropy bonus (subtracted from the loss).
    """

    clip_low: float = 0.2
    clip_high: float | None = None
    kl_coefficient: float = 0.0
    entropy_coefficient: float = 0.0

    def __call__(self, logp: jax.Array, entropy: jax.Array, inputs: PolicyInputs) -> jax.Array:
        """The weighted loss of one token (or of each token of arrays: it is elementwise)."""
        loss = clipped_surrogate(logp, jnp.asarray(inputs.old_logp), jnp.asarray(inputs.advantages), self.clip_low,
                                 self.clip_high)
        if self.kl_coefficient:
            if inputs.ref_logp is None:
                raise ValueError("PolicyLoss with kl_coefficient != 0 needs PolicyInputs.ref_logp")
            loss = loss + self.kl_coefficient * k3_kl(logp, jnp.asarray(inputs.ref_logp))
        if self.entropy_coefficient:
            loss = loss - self.entropy_coefficient * entropy
        return jnp.asarray(inputs.weights) * loss


def token_weights(mask: ArrayLike, level: Literal["token", "sequence"]) -> jax.Array:
    """Per-token weights that turn a sum over tokens into the mean ``level`` asks for (float32, ``mask``'s shape).

    ``mask`` is ``[..., T]``, true (or nonzero) at the counted tokens, the last axis a sequence's tokens.

    - ``"token"`` (DAPO): ``mask / count``, the mean over every counted token of the batch;
    - ``"sequence"`` (GRPO): ``mask / (len_s * S)``, each sequence's mean over its tokens, then the mean over
      the ``S`` sequences (those without a counted token count as 0, as ``jnp.mean`` of their 0 losses).

    Where nothing is counted the weights are 0, never NaN. Compute them from the whole batch's mask.
    """
    m = (jnp.asarray(mask) != 0).astype(jnp.float32)
    if level == "token":
        return m / jnp.maximum(jnp.sum(m), 1.0)
    if level == "sequence":
        if m.ndim == 0:
            raise ValueError("token_weights(level='sequence') needs a mask with a tokens axis, got a scalar")
        sequences = max(m.size // m.shape[-1], 1) if m.shape[-1] else 1
        return m / jnp.maximum(jnp.sum(m, axis=-1, keepdims=True), 1.0) / sequences
    raise ValueError(f"level must be 'token' or 'sequence', got {level!r}")
