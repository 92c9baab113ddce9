"""Every installed backend against the float64 oracle: every feature, reduction and dtype."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ce_core import linear_cross_entropy
from ce_core.testing import Case, compare_with_oracle, random_problem

#: Every option of the loss; each test runs the rows of a covering array over them and the backends.
FEATURES = dict(reduction=("mean", "sum", "none"), use_weights=(False, True), logsumexp_weight=(0.0, 1e-3),
                logit_soft_cap=(None, 2.0), label_smoothing=(0.0, 0.1), dtype=("float32", "bfloat16"))


@pytest.mark.covering(**FEATURES)
def test_every_feature(backend_name, reduction, use_weights, logsumexp_weight, logit_soft_cap, label_smoothing,
                       dtype):
    """Every pair of options (and of an option and a backend) meets in one of these cases."""
    case = Case(reduction, use_weights, logsumexp_weight, logit_soft_cap, label_smoothing)
    x, labels, w = random_problem(0, (37,), 48, 203) if dtype == "float32" else random_problem(1, (29,), 64, 130)
    compare_with_oracle(backend_name, case, x, labels, w, dtype=dtype)


@pytest.mark.covering(shape=[((1,), 8, 5), ((3, 5), 16, 1000), ((2, 3, 7), 24, 3001), ((127,), 129, 257),
                             ((64,), 33, 2)], reduction=("mean", "none"))
def test_awkward_shapes(backend_name, shape, reduction):
    batch_shape, hidden, vocab = shape
    x, labels, w = random_problem(2, batch_shape, hidden, vocab)
    compare_with_oracle(backend_name, Case(reduction=reduction, label_smoothing=0.05), x, labels, w)


@pytest.mark.cpu_rows_slow
def test_eager_matches_jit(backend_name):
    x, labels, w = random_problem(3, (4, 9), 32, 77)
    compare_with_oracle(backend_name, Case(logsumexp_weight=1e-4), x, labels, w, jit=False)


@pytest.mark.covering(reduction=("mean", "sum", "none"), dtype=("float32", "bfloat16"))
def test_all_ignored_gives_zero_loss_and_zero_gradients(backend_name, reduction, dtype):
    x, _, w = random_problem(4, (3, 11), 40, 99)
    labels = np.full((3, 11), -100, np.int32)

    def loss_fn(x_, w_):
        loss = linear_cross_entropy(x_, labels, w_, reduction=reduction, logsumexp_weight=1e-2,
                                    label_smoothing=0.1, implementation=backend_name)
        return jnp.sum(loss)

    loss, (dx, dw) = jax.jit(jax.value_and_grad(loss_fn, argnums=(0, 1)))(jnp.asarray(x, dtype), jnp.asarray(w, dtype))
    assert float(loss) == 0.0
    assert not np.any(np.asarray(dx, np.float32)) and not np.any(np.asarray(dw, np.float32))


def test_custom_ignore_index(backend_name):
    x, labels, w = random_problem(5, (50,), 16, 40, ignore_index=7, ignore_fraction=0.3)
    ours = linear_cross_entropy(x, labels, w, ignore_index=7, reduction="none", implementation=backend_name)
    assert np.all(np.asarray(ours)[labels == 7] == 0.0)
    assert np.all(np.asarray(ours)[labels != 7] > 0.0)


def test_return_lse(backend_name):
    x, labels, w = random_problem(6, (2, 13), 24, 301)
    loss, lse = linear_cross_entropy(x, labels, w, return_lse=True, implementation=backend_name)
    logits = np.asarray(x, np.float64) @ np.asarray(w, np.float64)
    expected = np.log(np.exp(logits).sum(-1))
    assert lse.shape == labels.shape and lse.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(lse), expected, rtol=1e-5)
    plain = linear_cross_entropy(x, labels, w, implementation=backend_name)
    np.testing.assert_allclose(float(loss), float(plain), rtol=1e-6)


def test_traced_out_of_vocab_label_gives_nan_for_that_token(backend_name):
    x, labels, w = random_problem(7, (6,), 16, 20, ignore_fraction=0.0)
    labels[2] = 20  # == V: out of range
    labels[4] = -1  # negative, and not ignore_index

    @jax.jit
    def per_token(labels_):
        return linear_cross_entropy(x, labels_, w, reduction="none", implementation=backend_name)

    losses = np.asarray(per_token(labels))
    assert np.isnan(losses[[2, 4]]).all() and np.isfinite(losses[[0, 1, 3, 5]]).all()
    mean = jax.jit(lambda labels_: linear_cross_entropy(x, labels_, w, implementation=backend_name))(labels)
    assert np.isnan(float(mean))


def test_mixed_input_dtypes(backend_name):
    x, labels, w = random_problem(8, (21,), 32, 65)
    grads = jax.grad(lambda x_, w_: linear_cross_entropy(x_, labels, w_, implementation=backend_name),
                     argnums=(0, 1))(jnp.asarray(x, jnp.bfloat16), jnp.asarray(w, jnp.float32))
    assert grads[0].dtype == jnp.bfloat16 and grads[1].dtype == jnp.float32


def test_empty_batch(backend_name):
    x = np.zeros((0, 8), np.float32)
    w = np.ones((8, 5), np.float32)
    labels = np.zeros((0,), np.int32)
    assert float(linear_cross_entropy(x, labels, w, implementation=backend_name)) == 0.0
    assert linear_cross_entropy(x, labels, w, reduction="none", implementation=backend_name).shape == (0,)


def test_single_class_vocab_has_zero_loss(backend_name):
    x, labels, w = random_problem(9, (10,), 16, 1, ignore_fraction=0.0)
    loss, (dx, dw) = jax.value_and_grad(
        lambda x_, w_: linear_cross_entropy(x_, labels, w_, label_smoothing=0.1, implementation=backend_name),
        argnums=(0, 1))(x, w)
    assert abs(float(loss)) < 1e-6
    assert np.abs(np.asarray(dx)).max() < 1e-6 and np.abs(np.asarray(dw)).max() < 1e-6
