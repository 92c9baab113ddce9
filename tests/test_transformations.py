"""What JAX transformations do with the loss: each claim of the README's table, checked.

The reference for second derivatives is plain JAX on materialised float32 logits (autodiff
through ``jax.nn.log_softmax``), independent of ce_core's custom VJPs.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ce_core import linear_cross_entropy, linear_log_probs
from ce_core.testing import max_rel_error, random_problem

X, LABELS, W = random_problem(0, (16,), 8, 32, ignore_fraction=0.0)
#: Backends whose every step is differentiable JAX: second derivatives go through them. (The Pallas
#: kernels have no derivatives of their own; pallas_tpu is first-order only, see the README.)
SECOND_ORDER = pytest.mark.parametrize("backend", ["reference", "xla"])


def plain_jax_loss(x, w, reduction):
    log_p = jax.nn.log_softmax(x @ w, axis=-1)
    losses = -jnp.take_along_axis(log_p, LABELS[:, None], axis=-1)[:, 0]
    return jnp.mean(losses) if reduction == "mean" else jnp.sum(losses)


def ours(backend, reduction):
    return lambda x, w: jnp.sum(linear_cross_entropy(x, LABELS, w, reduction=reduction, implementation=backend))


@pytest.mark.slow  # the reference's second-order compiles (10 s): the slow tier since 2026-12-03
@SECOND_ORDER
@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_grad_of_grad_matches_plain_jax(backend, reduction):
    def second(loss):
        return jax.grad(lambda x: jnp.sum(jax.grad(loss, argnums=1)(x, W) ** 2))(X)

    expected = second(lambda x, w: plain_jax_loss(x, w, "mean" if reduction == "mean" else "sum"))
    assert max_rel_error(second(ours(backend, reduction)), expected) < 1e-4


@SECOND_ORDER
def test_hessian_vector_product_of_the_mean_loss(backend):
    direction = np.random.default_rng(1).standard_normal(X.shape).astype(np.float32)

    def hvp(loss):
        return jax.jvp(lambda x: jax.grad(loss)(x, W), (X,), (direction,))[1]

    expected = hvp(lambda x, w: plain_jax_loss(x, w, "mean"))
    assert max_rel_error(hvp(ours(backend, "mean")), expected) < 1e-4


@pytest.mark.cpu_rows_slow
def test_vmap_matches_a_python_loop(backend_name):
    """Per-example values and gradients under ``vmap``, against the reference backend one example at a
    time. pallas_tpu's kernels cannot be batched by Pallas; ce_core folds the mapped axis into the
    tokens (per-token outputs) or runs the examples one by one (each with its own ``dw``)."""
    xs, labels, w = random_problem(2, (3, 10), 8, 32)
    ws = np.stack([w, 0.5 * w, -w])

    def loss(backend, **options):
        return lambda x, y, w_: linear_cross_entropy(x, y, w_, implementation=backend, **options)

    def check(batched, one, *, in_axes=(0, 0, None)):
        per_example = jax.vmap(batched, in_axes=in_axes)(xs, labels, ws if in_axes[2] == 0 else w)
        one = jax.jit(one)  # one compile for the three examples
        for k in range(3):
            expected = one(xs[k], labels[k], ws[k] if in_axes[2] == 0 else w)
            for got, want in zip(jax.tree.leaves(per_example), jax.tree.leaves(expected), strict=True):
                assert max_rel_error(got[k], want) < 1e-5

    grads = functools.partial(jax.value_and_grad, argnums=(0, 2))
    check(grads(loss(backend_name)), grads(loss("reference")))  # each example its own dx and dw
    check(grads(loss(backend_name)), grads(loss("reference")), in_axes=(0, 0, 0))  # and its own w
    check(loss(backend_name, reduction="none", return_lse=True), loss("reference", reduction="none", return_lse=True))
    log_probs = functools.partial(linear_log_probs, return_entropy=True, temperature=0.7)
    check(lambda x, y, w_: log_probs(x, y, w_, implementation=backend_name),
          lambda x, y, w_: log_probs(x, y, w_, implementation="reference"))

    # vmap inside grad: the examples' dw summed by JAX.
    def total(backend):
        return lambda x, w_: jnp.sum(jax.vmap(loss(backend), in_axes=(0, 0, None))(x, labels, w_))

    for got, want in zip(jax.grad(total(backend_name), argnums=(0, 1))(xs, w),
                         jax.grad(total("reference"), argnums=(0, 1))(xs, w), strict=True):
        assert max_rel_error(got, want) < 1e-5


@SECOND_ORDER
def test_checkpoint_and_donation(backend):
    loss = ours(backend, "mean")
    expected = jax.grad(loss)(X, W)
    assert max_rel_error(jax.jit(jax.grad(jax.checkpoint(loss)))(X, W), expected) < 1e-6
    donated = jax.jit(jax.grad(loss), donate_argnums=0)(jnp.array(X), W)
    assert max_rel_error(donated, expected) < 1e-6


def test_forward_mode_is_not_supported_and_says_so(backend_name):
    """Documented in the README: the loss is a custom VJP, so jvp/linearize/jacfwd of it raise."""
    with pytest.raises(TypeError, match="can't apply forward-mode autodiff"):
        jax.jvp(lambda x: ours(backend_name, "mean")(x, W), (X,), (jnp.ones_like(X),))
