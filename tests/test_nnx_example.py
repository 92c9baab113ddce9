"""examples/nnx_decoder.py: a Flax NNX decoder with a tied head trains and runs its RL path through ce_core
exactly as it does on materialised logits."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from ce_core.testing import max_rel_error

#: One worker runs the module, so its pretraining and rollout fixtures are computed once.
pytestmark = pytest.mark.xdist_group("nnx_example")


@pytest.fixture(scope="module")
def example(load_example):
    return load_example("nnx_decoder.py")


@pytest.fixture(scope="module")
def reference_run(example):
    """Five AdamW steps on materialised logits: the per-step losses to match, and a model for the RL path."""
    return example.pretrain(example.DecoderConfig(), example.TrainConfig(steps=5), example.materialised_head_loss)


def test_fused_training_matches_materialised_logits_step_by_step(example, reference_run, backend_name):
    fused_head = functools.partial(example.tied_head_loss, implementation=backend_name)
    _, fused_params, fused = example.pretrain(example.DecoderConfig(), example.TrainConfig(steps=5), fused_head)
    _, reference_params, reference = reference_run
    np.testing.assert_allclose([loss for loss, _ in fused], [loss for loss, _ in reference], rtol=1e-4)
    assert reference[-1][0] < reference[0][0]  # it learns
    assert all(0.0 <= accuracy <= 1.0 for _, accuracy in reference)
    # The fused argmax (return_argmax) gives the accuracy the materialised logits give (a near-tie
    # may flip a token).
    np.testing.assert_allclose([a for _, a in fused], [a for _, a in reference], atol=0.03)
    # The tied table, trained as input embedding and head at once, ends up alike in both runs.
    table, expected_table = fused_params["embed"]["embedding"][...], reference_params["embed"]["embedding"][...]
    assert max_rel_error(table, expected_table) < 1e-4


def float64_log_probs(hidden, targets, table, temperatures, ignore):
    """logp and entropy of the sampled tokens from float64 logits (0 where ``targets == ignore``)."""
    hidden, table = np.asarray(hidden, np.float64), np.asarray(table, np.float64)
    logits = hidden @ table.T / np.broadcast_to(np.asarray(temperatures, np.float64), hidden.shape[:1])[:, None, None]
    log_p = logits - logits.max(-1, keepdims=True)
    log_p -= np.log(np.exp(log_p).sum(-1, keepdims=True))
    targets = np.asarray(targets)
    counted = targets != ignore
    logp = np.take_along_axis(log_p, np.where(counted, targets, 0)[..., None], axis=-1)[..., 0]
    entropy = -(np.exp(log_p) * log_p).sum(-1)
    return np.where(counted, logp, 0.0), np.where(counted, entropy, 0.0)


@pytest.fixture(scope="module")
def rl_setup(example, reference_run):
    """A scored rollout of the briefly pretrained model, and old log-probs off the current ones (so some
    ratios fall outside the clip range)."""
    graphdef, params, _ = reference_run
    rl = example.RlConfig()
    batch = example.rollout(graphdef, params, rl)
    old_logp = example.token_log_probs(params, graphdef, batch, rl, example.materialised_log_probs)[0]
    old_logp = old_logp + 0.3 * jax.random.normal(jax.random.key(1), old_logp.shape)
    return graphdef, params, rl, batch, old_logp


def policy_loss_and_grads(example, rl_setup, log_probs):
    graphdef, params, rl, batch, old_logp = rl_setup
    grad_fn = jax.value_and_grad(example.policy_loss, has_aux=True)
    return jax.jit(grad_fn, static_argnums=(1, 4, 5))(params, graphdef, batch, old_logp, rl, log_probs)


@pytest.fixture(scope="module")
def expected_policy_gradient(example, rl_setup):
    return policy_loss_and_grads(example, rl_setup, example.materialised_log_probs)


@pytest.mark.cpu_rows_slow  # the RL rows' rollouts and compiles (30 s) in the slow tier since 2026-12-03
@pytest.mark.covering(temperatures=("per_sequence", 0.8), backends="turns")
def test_rl_log_probs_and_entropy_match_float64(example, rl_setup, backend_name, temperatures):
    graphdef, params, rl, batch, _ = rl_setup
    if temperatures == "per_sequence":
        temperatures = rl.sequence_temperatures()
    model = nnx.merge(graphdef, params)
    hidden = model(batch["tokens"][:, :-1])
    log_probs = functools.partial(example.sequence_log_probs, implementation=backend_name)
    logp, entropy = jax.jit(log_probs, static_argnums=3)(hidden, batch["targets"], model.table, temperatures)
    expected_logp, expected_entropy = float64_log_probs(hidden, batch["targets"], model.table, temperatures,
                                                        example.IGNORE)
    assert max_rel_error(logp, expected_logp) < 1e-5
    assert max_rel_error(entropy, expected_entropy) < 1e-5
    assert np.all(np.asarray(logp)[np.asarray(batch["targets"]) == example.IGNORE] == 0)
    # The materialised jnp reference the example and the gradient test compare with agrees too.
    reference_logp, reference_entropy = example.materialised_log_probs(hidden, batch["targets"], model.table,
                                                                       temperatures)
    assert max_rel_error(reference_logp, expected_logp) < 1e-5
    assert max_rel_error(reference_entropy, expected_entropy) < 1e-5


@pytest.mark.cpu_rows_slow
def test_rl_policy_gradient_matches_materialised_logits(example, rl_setup, expected_policy_gradient, backend_name):
    batch = rl_setup[3]
    assert float(jnp.std(batch["rewards"])) > 0  # the advantages are not all zero
    fused_log_probs = functools.partial(example.sequence_log_probs, implementation=backend_name)
    (loss, entropy), grads = policy_loss_and_grads(example, rl_setup, fused_log_probs)
    (expected_loss, expected_entropy), expected_grads = expected_policy_gradient
    assert max_rel_error(loss, expected_loss) < 1e-4
    assert max_rel_error(entropy, expected_entropy) < 1e-5
    for leaf, expected_leaf in zip(jax.tree.leaves(grads), jax.tree.leaves(expected_grads), strict=True):
        assert max_rel_error(leaf, expected_leaf, floor=1e-6) < 1e-3
    assert float(jnp.abs(expected_grads["embed"]["embedding"][...]).max()) > 0


@pytest.mark.slow
def test_the_demo_runs(example, capsys):
    """The script end to end (pretraining both ways, rollout, GRPO steps through make_rl_step)."""
    example.demo(train=example.TrainConfig(steps=2), rl_steps=1)
    out = capsys.readouterr().out
    assert "largest relative loss difference" in out and "GRPO step 0" in out
