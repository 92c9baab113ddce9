"""The distillation oracle (issue 42) checked against its own definitions: gradients by central finite
differences, the divergences' identities, the sparse teacher with every entry equal to the forward KL, and
a padded teacher vocabulary cut by ``vocab_size``."""

from __future__ import annotations

import numpy as np
import pytest

from ce_core.distillation_oracle import distillation_oracle

N, H, HT, V = 7, 5, 6, 11


def _problem(seed: int = 0):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((N, H))
    w = rng.standard_normal((H, V)) / np.sqrt(H)
    tx = rng.standard_normal((N, HT))
    tw = 1.5 * rng.standard_normal((HT, V)) / np.sqrt(HT)
    labels = rng.integers(0, V, N)
    labels[[1, 4]] = -100
    return x, w, tx, tw, labels


OPTIONS = {
    "plain": {},
    "everything": {"temperature": np.linspace(0.6, 1.7, N), "logit_soft_cap": 2.5, "teacher_logit_soft_cap": 3.0,
                   "hard_label_weight": 0.3, "weights": np.linspace(0.5, 2.0, N)},
    "sum": {"reduction": "sum", "temperature": 2.0},
    "none": {"reduction": "none", "cotangent": np.linspace(-1.0, 1.0, N)},
}


@pytest.mark.parametrize("divergence,beta", [("forward_kl", 0.5), ("reverse_kl", 0.5), ("jsd", 0.3), ("jsd", 0.5)])
@pytest.mark.parametrize("options", list(OPTIONS))
def test_gradients_match_finite_differences(divergence, beta, options):
    x, w, tx, tw, labels = _problem()
    kwargs = dict(divergence=divergence, beta=beta, **OPTIONS[options])
    cotangent = kwargs.pop("cotangent", None)
    result = distillation_oracle(x, w, tx, tw, labels, cotangent=cotangent, **kwargs)

    def objective(x_, w_):
        loss = distillation_oracle(x_, w_, tx, tw, labels, **kwargs)["loss"]
        return float(np.sum(loss * (1.0 if cotangent is None else cotangent)))

    step = 1e-6
    for name, array, grad in (("x", x, result["dx"]), ("w", w, result["dw"])):
        for index in np.ndindex(array.shape):
            up, down = array.copy(), array.copy()
            up[index] += step
            down[index] -= step
            numeric = (objective(up, w) - objective(down, w) if name == "x"
                       else objective(x, up) - objective(x, down)) / (2 * step)
            assert abs(numeric - grad[index]) <= 1e-6 * max(1.0, abs(numeric)), (name, index)


def test_divergences_are_zero_between_equal_heads_and_positive_otherwise():
    x, w, tx, tw, labels = _problem(1)
    for divergence in ("forward_kl", "reverse_kl", "jsd"):
        same = distillation_oracle(x, w, x, w, labels, divergence=divergence)
        assert abs(float(same["loss"])) < 1e-12 and np.abs(same["dw"]).max() < 1e-12
        apart = distillation_oracle(x, w, tx, tw, labels, divergence=divergence, reduction="none")
        counted = labels != -100
        assert np.all(apart["divergence"][counted] > 0) and np.all(apart["divergence"][~counted] == 0)


def test_jsd_ends_are_the_kls_and_its_middle_is_symmetric():
    x, w, tx, tw, labels = _problem(2)
    for beta, kl in ((0.0, "forward_kl"), (1.0, "reverse_kl")):
        jsd = distillation_oracle(x, w, tx, tw, labels, divergence="jsd", beta=beta)
        assert float(jsd["loss"]) == float(distillation_oracle(x, w, tx, tw, labels, divergence=kl)["loss"])
    # JSD_1/2(p, q) = JSD_1/2(q, p): swapping the heads changes nothing.
    one = distillation_oracle(x, w, tx, tw, labels, divergence="jsd", beta=0.5, reduction="none")["divergence"]
    other = distillation_oracle(tx, tw, x, w, labels, divergence="jsd", beta=0.5, reduction="none")["divergence"]
    np.testing.assert_allclose(one, other, rtol=1e-12)
    # Forward and reverse KL swap the same way.
    forward = distillation_oracle(x, w, tx, tw, labels, reduction="none")["divergence"]
    reverse = distillation_oracle(tx, tw, x, w, labels, divergence="reverse_kl", reduction="none")["divergence"]
    np.testing.assert_allclose(forward, reverse, rtol=1e-12)


def test_a_sparse_teacher_with_every_entry_is_the_forward_kl():
    x, w, tx, tw, labels = _problem(3)
    b = tx @ tw / 1.3
    log_q = b - np.log(np.exp(b).sum(axis=1, keepdims=True))
    order = np.argsort(-log_q, axis=1)  # any order of the entries
    sparse = distillation_oracle(x, w, labels=labels, teacher_indices=order,
                                 teacher_log_probs=np.take_along_axis(log_q, order, axis=1), temperature=1.0,
                                 hard_label_weight=0.2)
    dense = distillation_oracle(x, w, tx / 1.3, tw, labels, hard_label_weight=0.2)
    for name in ("loss", "dx", "dw"):
        np.testing.assert_allclose(sparse[name], dense[name], rtol=1e-10, atol=1e-12)


def test_a_sparse_teachers_missing_mass_counts_for_nothing():
    """Top-3 entries (not renormalised) and padding: the value is their sum alone; padding changes nothing."""
    x, w, tx, tw, labels = _problem(4)
    b = tx @ tw
    log_q = b - np.log(np.exp(b).sum(axis=1, keepdims=True))
    top = np.argsort(-log_q, axis=1)[:, :3]
    top_log_q = np.take_along_axis(log_q, top, axis=1)
    result = distillation_oracle(x, w, labels=labels, teacher_indices=top, teacher_log_probs=top_log_q,
                                 reduction="none")
    a = x @ w
    log_p = a - np.log(np.exp(a).sum(axis=1, keepdims=True))
    expected = np.sum(np.exp(top_log_q) * (top_log_q - np.take_along_axis(log_p, top, axis=1)), axis=1)
    np.testing.assert_allclose(result["divergence"], np.where(labels != -100, expected, 0.0), rtol=1e-12)
    padded = distillation_oracle(x, w, labels=labels, reduction="none",
                                 teacher_indices=np.concatenate([top, np.zeros((N, 2), int)], axis=1),
                                 teacher_log_probs=np.concatenate([top_log_q, np.full((N, 2), -np.inf)], axis=1))
    for name in ("divergence", "dx", "dw"):
        np.testing.assert_allclose(padded[name], result[name], rtol=1e-12)


def test_vocab_size_cuts_a_padded_teacher_and_a_mismatch_is_named():
    x, w, tx, tw, labels = _problem(5)
    padded = np.concatenate([tw, np.full((HT, 3), 50.0)], axis=1)  # rows a padded table would hold
    cut = distillation_oracle(x, w, tx, padded, labels, vocab_size=V)
    plain = distillation_oracle(x, w, tx, tw, labels)
    np.testing.assert_allclose(cut["dw"], plain["dw"], rtol=1e-12)
    with pytest.raises(ValueError, match=r"student's vocabulary \(11\) and the teacher's \(14\)"):
        distillation_oracle(x, w, tx, padded, labels)
