"""examples/grpo.py: the fused GRPO loss (one linear_token_objective call) equals GRPO on materialised logits."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ce_core.testing import max_rel_error


@pytest.fixture(scope="module")
def grpo(load_example):
    return load_example("grpo.py")


def reference_objective(logp, entropy, old_logp, advantages, mask, config, ref_logp):
    """GRPO written out on ``[batch, tokens]`` arrays: per-token clipped ratio, k3 KL and entropy bonus,
    averaged over each completion's tokens (``mask``), then over completions."""
    ratio = jnp.exp(logp - old_logp)
    advantage = advantages[:, None]
    high = config.clip_epsilon if config.clip_epsilon_high is None else config.clip_epsilon_high
    clipped = jnp.clip(ratio, 1.0 - config.clip_epsilon, 1.0 + high)
    per_token = -jnp.minimum(ratio * advantage, clipped * advantage)
    log_ratio = ref_logp - logp
    per_token = per_token + config.kl_coefficient * (jnp.exp(log_ratio) - log_ratio - 1.0)
    per_token = per_token - config.entropy_coefficient * entropy
    mask = mask.astype(per_token.dtype)
    per_sequence = jnp.sum(per_token * mask, axis=1) / jnp.maximum(jnp.sum(mask, axis=1), 1.0)
    return jnp.mean(per_sequence)


def materialised_loss(hidden, head, tokens, mask, old_logp, advantages, config, ref_logp):
    """The same objective, with logp and entropy from the full [batch, tokens, V] float32 logits."""
    logits = jnp.einsum("bth,hv->btv", hidden.astype(jnp.float32), head.astype(jnp.float32)) / config.temperature
    log_p = jax.nn.log_softmax(logits, axis=-1)
    logp = jnp.take_along_axis(log_p, tokens[..., None], axis=-1)[..., 0] * mask
    entropy = -jnp.sum(jnp.exp(log_p) * log_p, axis=-1) * mask
    return reference_objective(logp, entropy, old_logp, advantages, mask, config, ref_logp)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_fused_grpo_loss_and_gradients_match_materialised_logits(grpo, backend_name, dtype):
    rng = np.random.default_rng(0)
    batch, length, hidden_size, vocab = 8, 12, 32, 203
    hidden = jnp.asarray(rng.standard_normal((batch, length, hidden_size)), dtype)
    head = jnp.asarray(rng.standard_normal((hidden_size, vocab)) / np.sqrt(hidden_size), dtype)
    tokens = jnp.asarray(rng.integers(0, vocab, (batch, length)), jnp.int32)
    mask = jnp.asarray(np.arange(length)[None, :] >= rng.integers(1, 6, (batch, 1)), jnp.float32)
    # Old and reference log-probs near the current ones, so some ratios fall outside the clip range.
    current = -np.log(vocab) + 0.3 * rng.standard_normal((batch, length))
    old_logp = jnp.asarray(current + 0.3 * rng.standard_normal((batch, length)), jnp.float32)
    ref_logp = jnp.asarray(current + 0.1 * rng.standard_normal((batch, length)), jnp.float32)
    advantages = grpo.group_advantages(jnp.asarray(rng.standard_normal(batch), jnp.float32), group_size=4)
    config = grpo.GrpoConfig(clip_epsilon_high=0.28, kl_coefficient=0.04, entropy_coefficient=0.01, temperature=0.8)
    args = (tokens, mask, old_logp, advantages, config, ref_logp)

    fused, (d_hidden, d_head) = jax.jit(jax.value_and_grad(
        lambda h, w: grpo.grpo_loss(h, w, *args, implementation=backend_name), argnums=(0, 1)))(hidden, head)
    expected, (e_hidden, e_head) = jax.value_and_grad(
        lambda h, w: materialised_loss(h, w, *args), argnums=(0, 1))(hidden.astype(jnp.float32),
                                                                          head.astype(jnp.float32))
    tol = 1e-5 if dtype == "float32" else 2e-2
    assert max_rel_error(fused, expected) < tol
    assert max_rel_error(d_hidden.astype(jnp.float32), e_hidden) < 10 * tol
    assert max_rel_error(d_head.astype(jnp.float32), e_head) < 10 * tol
    assert float(jnp.abs(e_head).max()) > 0  # the objective really depends on the head


def test_group_advantages_are_standardised_within_groups(grpo):
    advantages = np.asarray(grpo.group_advantages(jnp.asarray([1.0, 2.0, 3.0, 10.0, 10.0, 14.0]), group_size=3))
    np.testing.assert_allclose(advantages.reshape(2, 3).mean(axis=1), 0.0, atol=1e-6)
    np.testing.assert_allclose(advantages.reshape(2, 3).std(axis=1), 1.0, atol=1e-4)


def test_the_demo_runs(grpo, capsys):
    grpo.demo()
    assert "GRPO loss" in capsys.readouterr().out
