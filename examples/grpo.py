"""A GRPO policy loss on top of ``ce_core.linear_log_probs``: no ``[tokens, vocab]`` logits anywhere.

GRPO (group relative policy optimisation) samples a group of completions per prompt, scores them,
and uses each completion's reward relative to its group as the advantage of every one of its tokens.
The per-token objective is PPO's clipped importance ratio against the sampling policy's stored
log-probabilities, optionally with a KL penalty towards a frozen reference policy (the k3 estimator)
and an entropy bonus. Everything the LM head contributes (``logp`` and ``entropy`` per token)
comes from one fused call; the rest is ``[batch, tokens]``-sized arithmetic.

Run it for a tiny demonstration step: ``uv run python examples/grpo.py``.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from ce_core import linear_log_probs


@dataclasses.dataclass(frozen=True)
class GrpoConfig:
    """Coefficients of the objective (defaults as in common GRPO recipes)."""

    clip_epsilon: float = 0.2  # the ratio is clipped to [1 - eps, 1 + eps]
    kl_coefficient: float = 0.0  # weight of KL(policy || reference), k3 estimator
    entropy_coefficient: float = 0.0  # weight of the entropy bonus
    temperature: float = 1.0  # the sampling temperature the old log-probs were taken at


def group_advantages(rewards: jax.Array, group_size: int, eps: float = 1e-6) -> jax.Array:
    """Each completion's reward standardised within its group: ``[num_prompts * group_size]`` -> same."""
    grouped = rewards.reshape(-1, group_size)
    mean = grouped.mean(axis=1, keepdims=True)
    std = grouped.std(axis=1, keepdims=True)
    return ((grouped - mean) / (std + eps)).reshape(rewards.shape)


def grpo_objective(
    logp: jax.Array,
    entropy: jax.Array,
    old_logp: jax.Array,
    advantages: jax.Array,
    mask: jax.Array,
    config: GrpoConfig,
    ref_logp: jax.Array | None = None,
) -> jax.Array:
    """The scalar GRPO loss from per-token quantities, all ``[batch, tokens]`` but ``advantages`` ``[batch]``.

    Per token: ``-min(r A, clip(r, 1 - eps, 1 + eps) A) + beta * KL - alpha * entropy`` with the
    importance ratio ``r = exp(logp - old_logp)``; averaged over each completion's tokens (``mask``),
    then over completions.
    """
    ratio = jnp.exp(logp - old_logp)
    advantage = advantages[:, None]
    clipped = jnp.clip(ratio, 1.0 - config.clip_epsilon, 1.0 + config.clip_epsilon)
    per_token = -jnp.minimum(ratio * advantage, clipped * advantage)
    if ref_logp is not None and config.kl_coefficient:
        log_ratio = ref_logp - logp
        per_token = per_token + config.kl_coefficient * (jnp.exp(log_ratio) - log_ratio - 1.0)
    if config.entropy_coefficient:
        per_token = per_token - config.entropy_coefficient * entropy
    mask = mask.astype(per_token.dtype)
    per_sequence = jnp.sum(per_token * mask, axis=1) / jnp.maximum(jnp.sum(mask, axis=1), 1.0)
    return jnp.mean(per_sequence)


def grpo_loss(
    hidden: jax.Array,
    head: jax.Array,
    tokens: jax.Array,
    mask: jax.Array,
    old_logp: jax.Array,
    advantages: jax.Array,
    config: GrpoConfig = GrpoConfig(),
    ref_logp: jax.Array | None = None,
    implementation: str | None = None,
) -> jax.Array:
    """GRPO loss of a policy whose final hidden states are ``hidden [batch, tokens, H]`` and LM head ``head [H, V]``.

    ``tokens`` are the sampled completion tokens and ``mask`` marks them (prompt and padding are 0).
    """
    labels = jnp.where(mask.astype(bool), tokens, -100)
    logp, entropy = linear_log_probs(hidden, labels, head, temperature=config.temperature, return_entropy=True,
                                     implementation=implementation)
    return grpo_objective(logp, entropy, old_logp, advantages, mask, config, ref_logp)


def demo() -> None:
    """One gradient step on random data: the loss, and the size of the head's gradient."""
    batch, length, hidden_size, vocab = 8, 64, 128, 4096
    keys = jax.random.split(jax.random.key(0), 6)
    hidden = jax.random.normal(keys[0], (batch, length, hidden_size))
    head = jax.random.normal(keys[1], (hidden_size, vocab)) / hidden_size**0.5
    tokens = jax.random.randint(keys[2], (batch, length), 0, vocab)
    mask = jnp.arange(length)[None, :] >= 16  # the first 16 positions are the prompt
    config = GrpoConfig(kl_coefficient=0.04, entropy_coefficient=1e-3, temperature=0.9)
    old_logp = linear_log_probs(hidden, jnp.where(mask, tokens, -100), head, temperature=config.temperature)
    ref_logp = old_logp + 0.01 * jax.random.normal(keys[3], old_logp.shape)
    advantages = group_advantages(jax.random.normal(keys[4], (batch,)), group_size=4)
    loss, grad = jax.jit(jax.value_and_grad(grpo_loss, argnums=1), static_argnums=6)(
        hidden, head, tokens, mask, old_logp, advantages, config, ref_logp)
    print(f"GRPO loss {float(loss):.4f}; |d loss / d head| = {float(jnp.linalg.norm(grad)):.4f}")


if __name__ == "__main__":
    demo()
