"""The float64 oracle's gradients agree with finite differences of its own loss.

The oracle's loss is the definition written out; its gradients are derived by hand, so they are
checked here by central differences along random directions, independently of any JAX code.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from ce_core.testing import log_probs_oracle, max_rel_error, oracle, random_problem

OPTIONS = [
    dict(reduction=r, logsumexp_weight=lam, logit_soft_cap=cap, label_smoothing=eps, temperature=t)
    for r, lam, cap, eps, t in itertools.product(
        ("mean", "sum", "none"), (0.0, 0.01), (None, 1.5), (0.0, 0.2), (1.0, 0.7)
    )
]


@pytest.mark.parametrize("options", OPTIONS, ids=str)
def test_gradients_match_finite_differences(options):
    rng = np.random.default_rng(0)
    x, labels, w = random_problem(1, (3, 4), 5, 7, ignore_fraction=0.25)
    x, w = x.astype(np.float64), w.astype(np.float64)
    weights = rng.uniform(0.5, 2.0, labels.shape)
    cotangent = rng.standard_normal(labels.shape) if options["reduction"] == "none" else None

    def objective(x_, w_, weights_):
        loss = oracle(x_, labels, w_, weights=weights_, cotangent=cotangent, **options)["loss"]
        return float(np.sum(loss * cotangent) if cotangent is not None else loss)

    result = oracle(x, labels, w, weights=weights, cotangent=cotangent, **options)
    step = 1e-6
    gradients = (("x", x, result["dx"]), ("w", w, result["dw"]), ("weights", weights, result["dweights"]))
    for name, value, gradient in gradients:
        direction = rng.standard_normal(value.shape)
        args = {"x": x, "w": w, "weights": weights}
        plus = dict(args, **{name: value + step * direction})
        minus = dict(args, **{name: value - step * direction})
        numeric = (objective(plus["x"], plus["w"], plus["weights"])
                   - objective(minus["x"], minus["w"], minus["weights"])) / (2 * step)
        analytic = float(np.sum(gradient * direction))
        assert abs(numeric - analytic) <= 1e-6 * max(1.0, abs(analytic)), (name, numeric, analytic)


def _directional_check(objective, values: dict, gradients: dict, rng) -> None:
    """Central differences of ``objective`` along a random direction in each argument vs the analytic gradient."""
    step = 1e-6
    for name, gradient in gradients.items():
        direction = rng.standard_normal(values[name].shape)
        plus = dict(values, **{name: values[name] + step * direction})
        minus = dict(values, **{name: values[name] - step * direction})
        numeric = (objective(**plus) - objective(**minus)) / (2 * step)
        analytic = float(np.sum(gradient * direction))
        assert abs(numeric - analytic) <= 1e-6 * max(1.0, abs(analytic)), (name, numeric, analytic)


@pytest.mark.parametrize("temperature", [0.7, 1.0, 1.3])
@pytest.mark.parametrize("cap", [None, 1.5])
def test_log_probs_oracle_gradients_match_finite_differences(temperature, cap):
    rng = np.random.default_rng(5)
    x, labels, w = random_problem(6, (3, 4), 5, 7, ignore_fraction=0.25)
    x, w = x.astype(np.float64), w.astype(np.float64)
    g_logp, g_ent = rng.standard_normal(labels.shape), rng.standard_normal(labels.shape)
    options = dict(temperature=temperature, logit_soft_cap=cap)

    def objective(x, w):
        out = log_probs_oracle(x, labels, w, **options)
        return float(np.sum(g_logp * out["logp"] + g_ent * out["entropy"]))

    result = log_probs_oracle(x, labels, w, logp_cotangent=g_logp, entropy_cotangent=g_ent, **options)
    _directional_check(objective, {"x": x, "w": w}, {"x": result["dx"], "w": result["dw"]}, rng)


def test_log_probs_oracle_from_the_textbook():
    x, labels, w = random_problem(7, (9,), 6, 11, ignore_fraction=0.3)
    logits = (x.astype(np.float64) @ w.astype(np.float64)) / 0.8
    p = np.exp(logits) / np.exp(logits).sum(-1, keepdims=True)
    counted = labels != -100
    result = log_probs_oracle(x, labels, w, temperature=0.8)
    label_p = p[np.arange(9), np.where(counted, labels, 0)]
    np.testing.assert_allclose(result["logp"][counted], np.log(label_p[counted]), rtol=1e-12)
    np.testing.assert_allclose(result["entropy"][counted], -(p * np.log(p)).sum(-1)[counted], rtol=1e-12)
    assert not result["logp"][~counted].any() and not result["entropy"][~counted].any()


def test_plain_loss_is_the_textbook_cross_entropy():
    x, labels, w = random_problem(2, (9,), 6, 11, ignore_fraction=0.0)
    logits = x.astype(np.float64) @ w.astype(np.float64)
    log_probs = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    expected = -log_probs[np.arange(9), labels].mean()
    assert abs(float(oracle(x, labels, w)["loss"]) - expected) < 1e-12


def test_all_ignored_mean_is_zero():
    x, _, w = random_problem(3, (4,), 6, 11)
    result = oracle(x, np.full(4, -100), w)
    assert float(result["loss"]) == 0.0 and not result["dx"].any() and not result["dw"].any()


def test_random_problem_has_logits_of_order_one():
    x, _, w = random_problem(4, (512,), 256, 1000)
    std = (x.astype(np.float64) @ w).std()
    assert 0.7 < std < 1.3


def test_max_rel_error():
    assert max_rel_error([1.0, 2.0], [1.0, 4.0]) == 0.5
    assert max_rel_error([0.0], [0.0]) == 0.0
    assert max_rel_error([1e-8], [0.0]) == 1e-8
    assert max_rel_error([1e-8], [1e-16], floor=1e-2) < 1e-5
    with pytest.raises(ValueError, match="shapes differ"):
        max_rel_error([1.0], [1.0, 2.0])


def test_ignored_labels_ignore_what_each_pattern_names():
    """The ignored-token patterns the live-rows tests share: a prompt is a prefix and padding a suffix of each
    sequence, ``one`` leaves exactly one token, and the live labels are in range."""
    from ce_core.testing import IGNORED_PATTERNS, ignored_labels

    shape, vocab = (3, 40), 7
    ignored = {p: ignored_labels(p, shape, vocab, seed=1) == -100 for p in IGNORED_PATTERNS}
    assert not ignored["none"].any() and ignored["all"].all() and (~ignored["one"]).sum() == 1
    for row in ignored["prompts"]:
        assert 0 < row.sum() < shape[1] and row[: row.sum()].all()  # a prefix, a completion after it
    for row in ignored["padding"]:
        assert row.sum() < shape[1] and row[shape[1] - row.sum():].all()  # a suffix, at least one token kept
    assert 0.3 < ignored["random"].mean() < 0.7
    live = ignored_labels("random", shape, vocab, seed=1)
    assert ((live == -100) | ((live >= 0) & (live < vocab))).all()
    with pytest.raises(ValueError, match="pattern"):
        ignored_labels("prefix", shape, vocab)
