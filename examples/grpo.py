"""A GRPO policy loss as one fused call, ``ce_core.linear_token_objective``: no ``[tokens, vocab]`` logits anywhere.

GRPO (group relative policy optimisation) samples a group of completions per prompt, scores them,
and uses each completion's reward relative to its group as the advantage of every one of its tokens.
The per-token objective is PPO's clipped importance ratio against the sampling policy's stored
log-probabilities, optionally with a KL penalty towards a frozen reference policy (the k3 estimator)
and an entropy bonus; GRPO averages it over each completion's tokens, then over completions.

That per-token objective (``ce_core.policy.PolicyLoss``) goes into the call with its per-token data,
so the loss is a scalar whose ``d hidden`` and ``d head`` the backend forms in its forward pass: no
second pass over the logits in the backward pass (on TPU, with ``keep_logits=True``, three matmul
passes instead of four). The rest is ``[batch, tokens]``-sized arithmetic on the mask and rewards.

Run it for a tiny demonstration step: ``uv run python examples/grpo.py``.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from ce_core import linear_log_probs, linear_token_objective
from ce_core.policy import PolicyInputs, PolicyLoss, token_weights


@dataclasses.dataclass(frozen=True)
class GrpoConfig:
    """Coefficients of the objective (defaults as in common GRPO recipes)."""

    clip_epsilon: float = 0.2  # the ratio is clipped to [1 - eps, 1 + eps_high]
    clip_epsilon_high: float | None = None  # None: clip_epsilon (DAPO's "clip higher" uses 0.28)
    kl_coefficient: float = 0.0  # weight of KL(policy || reference), k3 estimator
    entropy_coefficient: float = 0.0  # weight of the entropy bonus
    temperature: float = 1.0  # the sampling temperature the old log-probs were taken at


def group_advantages(rewards: jax.Array, group_size: int, eps: float = 1e-6) -> jax.Array:
    """Each completion's reward standardised within its group: ``[num_prompts * group_size]`` -> same."""
    grouped = rewards.reshape(-1, group_size)
    mean = grouped.mean(axis=1, keepdims=True)
    std = grouped.std(axis=1, keepdims=True)
    return ((grouped - mean) / (std + eps)).reshape(rewards.shape)


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

    ``tokens`` are the sampled completion tokens and ``mask`` marks them (prompt and padding are 0);
    ``old_logp`` and ``ref_logp`` are ``[batch, tokens]``, ``advantages`` ``[batch]``. Per token:
    ``-min(r A, clip(r, 1 - eps, 1 + eps_high) A) + beta * KL - alpha * entropy`` with the importance
    ratio ``r = exp(logp - old_logp)``; averaged over each completion's tokens, then over completions.
    """
    labels = jnp.where(mask.astype(bool), tokens, -100)
    objective = PolicyLoss(clip_low=config.clip_epsilon, clip_high=config.clip_epsilon_high,
                           kl_coefficient=config.kl_coefficient if ref_logp is not None else 0.0,
                           entropy_coefficient=config.entropy_coefficient)
    inputs = PolicyInputs(old_logp=old_logp, advantages=advantages[:, None], weights=token_weights(mask, "sequence"),
                          ref_logp=ref_logp)
    return linear_token_objective(hidden, labels, head, objective, inputs, temperature=config.temperature,
                                  implementation=implementation)


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
