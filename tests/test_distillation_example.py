"""examples/on_policy_distillation.py: a student decoder sampling, a larger teacher scoring, a reverse-KL step
whose loss and gradients are those of both heads' materialised logits."""

from __future__ import annotations

import functools

import jax
import pytest

from ce_core.testing import max_rel_error

pytestmark = pytest.mark.xdist_group("distillation_example")


@pytest.fixture(scope="module")
def example(load_example):
    return load_example("on_policy_distillation.py")


@pytest.mark.slow  # 18 s of compiles: the slow tier (since 2026-12-03, when the fast tier neared its 5 minutes)
def test_the_fused_step_matches_materialised_logits(example, implementation="xla"):
    """One on-policy batch: the student's loss and every parameter's gradient, fused against materialised."""
    config = example.DistillConfig(num_prompts=4)
    teacher_graph, teacher_params = example.decoder.init_model(example.TEACHER, 5)
    graphdef, params = example.decoder.init_model(example.STUDENT, 6)
    tokens, targets = example.on_policy_batch(graphdef, params, config, 0)
    teacher_hidden, teacher_table = example.teacher_scores(teacher_graph, teacher_params, tokens)
    fused = functools.partial(example.fused_reverse_kl, implementation=implementation)
    results = [jax.jit(jax.value_and_grad(example.distillation_loss), static_argnums=(1, 6))(
        params, graphdef, tokens, targets, teacher_hidden, teacher_table, loss)
        for loss in (fused, example.materialised_reverse_kl)]
    (value, grads), (expected, expected_grads) = results
    assert float(expected) > 0.01  # two different models: a divergence to learn from
    assert max_rel_error(value, expected) <= 1e-5
    for got, want in zip(jax.tree.leaves(grads), jax.tree.leaves(expected_grads), strict=True):
        assert max_rel_error(got, want, floor=1e-6) <= 1e-4


@pytest.mark.slow
def test_on_policy_steps_bring_the_student_towards_the_teacher(example):
    """The demo's loop, shortened: a teacher pretrained 20 steps, 8 on-policy steps of the student (slow tier: 11 s)."""
    log, _, _ = example.distill(example.DistillConfig(teacher_steps=20, steps=8))
    assert log[-1] < 0.8 * log[0], log
