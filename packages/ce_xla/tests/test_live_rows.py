"""Ignored tokens cost nothing on the xla backend (contract version 4's live rows), and change no result.

ce_core hands the backend the mask of tokens whose outputs count; every token loop then gathers the live
rows to the front and runs only the chunks that hold them. Checked here: values and gradients against
the float64 oracle for every ignored pattern (none, all, prompts, padding, random, one live token), in
both gradient orders and chunkings, through the loss, the log-probabilities and the token objective;
that chunks of dead rows run no matmul (a counter in the loop body); that garbage in dead rows of
``x`` (NaN padding) reaches no output; and data- and vocab-parallel shards with different live counts.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import ce_core
from ce_core import BlockSizes, linear_cross_entropy, linear_log_probs, linear_token_objective
from ce_core.extend import (
    IGNORED_PATTERNS,
    Case,
    compare_with_oracle,
    log_probs_oracle,
    max_rel_error,
    oracle,
    random_problem,
    register_backend,
    unregister_backend,
)
from ce_core.extend import ignored_labels as ignored_labels_of
from ce_xla import XlaBackend

BATCH, SEQ, HIDDEN, VOCAB = 2, 61, 32, 1000
PATTERNS = IGNORED_PATTERNS
#: chunking -> (backend options, block sizes): several 24-row token chunks with full rows, or vocab tiles.
CHUNKINGS = {
    "full_rows": ({"grad_budget_bytes": 1}, BlockSizes(b_block_size=24)),
    "vocab_chunks": ({}, BlockSizes(b_block_size=16, v_block_size=384)),
}
ORDERS = ("tokens_outer", "vocab_outer")


def ignored_labels(pattern: str, seed: int = 0, shape: tuple[int, ...] = (BATCH, SEQ)) -> np.ndarray:
    """Labels of ``shape`` with the tokens ``pattern`` names ignored (:func:`ce_core.extend.ignored_labels`)."""
    return ignored_labels_of(pattern, shape, VOCAB, seed=seed)


@pytest.fixture
def backend_name(chunking, order):
    """The xla backend forced to ``order`` and ``chunking``, registered under a name of its own."""
    options, _ = CHUNKINGS[chunking]
    name = f"xla_live_{chunking}_{order}"
    register_backend(name, lambda: XlaBackend(**options, gradient_order=order), replace=True)
    yield name
    unregister_backend(name)


@pytest.mark.covering(pattern=PATTERNS, chunking=tuple(CHUNKINGS), order=ORDERS, dtype=("float32", "bfloat16"),
                      case=(Case(), Case(reduction="sum", use_weights=True, logit_soft_cap=4.0),
                            Case(reduction="none", label_smoothing=0.1, logsumexp_weight=1e-3),
                            Case(use_weights=True, temperature=0.7, label_smoothing=0.2)))
def test_loss_with_ignored_tokens_matches_float64(backend_name, chunking, pattern, dtype, case):
    x, _, w = random_problem(3, (BATCH, SEQ), HIDDEN, VOCAB)
    labels = ignored_labels(pattern)
    compare_with_oracle(backend_name, case, x, labels, w, dtype=dtype, block_sizes=CHUNKINGS[chunking][1])


@pytest.mark.covering(pattern=PATTERNS, chunking=tuple(CHUNKINGS), order=ORDERS, per_token_temperature=(False, True))
def test_log_probs_and_entropy_with_ignored_tokens_match_float64(backend_name, chunking, pattern,
                                                                 per_token_temperature):
    x, _, w = random_problem(4, (BATCH, SEQ), HIDDEN, VOCAB)
    labels = ignored_labels(pattern, seed=1)
    rng = np.random.default_rng(5)
    temperature = rng.uniform(0.5, 1.5, (BATCH, 1)).astype(np.float32) if per_token_temperature else 1.0
    g_logp, g_ent = (rng.standard_normal(labels.shape).astype(np.float32) for _ in range(2))
    def objective(x_, w_):
        logp, entropy = linear_log_probs(x_, labels, w_, return_entropy=True, implementation=backend_name,
                                         block_sizes=CHUNKINGS[chunking][1], temperature=temperature,
                                         logit_soft_cap=5.0)
        return jnp.sum(g_logp * logp + g_ent * entropy), (logp, entropy)

    (_, (logp, entropy)), (dx, dw) = jax.jit(jax.value_and_grad(objective, (0, 1), has_aux=True))(x, w)
    expected = log_probs_oracle(x, labels, w, temperature=temperature, logit_soft_cap=5.0, logp_cotangent=g_logp,
                                entropy_cotangent=g_ent)
    for name, actual in (("logp", logp), ("entropy", entropy), ("dx", dx), ("dw", dw)):
        assert max_rel_error(actual, expected[name]) <= 1e-4, name


@pytest.mark.parametrize("pattern", ["prompts", "random", "all"])
def test_token_objective_with_ignored_tokens_matches_the_loss(pattern):
    """The fused token objective over ignored tokens: a weighted log-likelihood is the weighted loss's negative."""
    x, _, w = random_problem(5, (BATCH, SEQ), HIDDEN, VOCAB)
    labels = ignored_labels(pattern, seed=2)
    weights = np.random.default_rng(6).uniform(0.5, 2.0, labels.shape).astype(np.float32)
    name = "xla_live_objective"
    register_backend(name, lambda: XlaBackend(**CHUNKINGS["full_rows"][0]), replace=True)
    try:
        sizes = CHUNKINGS["full_rows"][1]
        objective = jax.value_and_grad(lambda a, b: linear_token_objective(
            a, labels, b, lambda logp, entropy, c: -c * logp, weights, implementation=name, block_sizes=sizes), (0, 1))
        loss = jax.value_and_grad(lambda a, b: linear_cross_entropy(
            a, labels, b, weights=weights, reduction="sum", implementation="reference"), (0, 1))
        (value, grads), (expected, expected_grads) = objective(x, w), loss(x, w)
    finally:
        unregister_backend(name)
    assert abs(float(value) - float(expected)) <= 1e-5 * max(1.0, abs(float(expected)))
    for actual, wanted in zip(grads, expected_grads, strict=True):
        assert max_rel_error(actual, wanted) <= 1e-4


def _counting(monkeypatch: pytest.MonkeyPatch, module, attr: str, counter: list[int]) -> None:
    """Count every run of ``module.attr`` inside compiled loops (a host callback per call)."""
    original = getattr(module, attr)

    def counted(*args, **kwargs):
        jax.debug.callback(lambda: counter.append(1))
        return original(*args, **kwargs)

    monkeypatch.setattr(module, attr, counted)


@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("pattern", ["none", "prompts", "one", "all"])
def test_chunks_of_dead_rows_run_no_matmul(monkeypatch, order, pattern):
    """Each pass runs ``ceil(live / rows)`` token chunks: none of them only dead rows (and, all dead, none)."""
    import ce_xla.backward
    import ce_xla.forward
    import ce_xla.fused
    import ce_xla.head

    backend = XlaBackend(gradient_order=order, grad_budget_bytes=1)
    x, _, w = random_problem(6, (BATCH, SEQ), HIDDEN, VOCAB)
    labels = ignored_labels(pattern, seed=3)
    live = int(np.sum(labels != -100))
    sizes = BlockSizes(b_block_size=24)
    plan = backend.plan(BATCH * SEQ, HIDDEN, VOCAB, ce_core.StatsSpec(block_sizes=sizes))
    assert plan.token_chunks > 2  # several chunks, so skipping shows
    register_backend("xla_live_counted", lambda: backend, replace=True)
    try:
        statistics, gradients = [], []
        _counting(monkeypatch, ce_xla.forward, "chunk_row_stats", statistics)  # every statistics chunk
        _counting(monkeypatch, ce_xla.fused, "chunk_row_stats", statistics)
        # Gradient token chunks: tokens outer, one chunk_grads call each; vocab outer, one dx product per
        # token chunk and vocab slice.
        if order == "tokens_outer":
            _counting(monkeypatch, ce_xla.backward, "chunk_grads", gradients)
            _counting(monkeypatch, ce_xla.fused, "chunk_grads", gradients)
        else:
            _counting(monkeypatch, ce_xla.head, "dx_product", gradients)
        fn = jax.jit(jax.grad(lambda a: linear_cross_entropy(a, labels, w, implementation="xla_live_counted",
                                                             block_sizes=sizes)))
        jax.block_until_ready(fn(x))
    finally:
        unregister_backend("xla_live_counted")
    expected = math.ceil(live / plan.token_chunk)
    assert len(statistics) == expected
    gradient_chunks = math.ceil(live / plan.grad_token_chunk) if order == "vocab_outer" else expected
    assert len(gradients) == gradient_chunks * (plan.grad_chunks if order == "vocab_outer" else 1)


# rows: several token chunks (24), or one (None: the rows kept in place, masked)
@pytest.mark.covering(order=ORDERS, reduction=("mean", "none"), rows=(24, None))
def test_garbage_in_dead_rows_reaches_no_output(order, reduction, rows):
    """NaN rows of ``x`` at ignored tokens (uninitialised padding) leave every output and gradient finite."""
    x, _, w = random_problem(7, (BATCH, SEQ), HIDDEN, VOCAB)
    labels = ignored_labels("padding", seed=4)
    garbage = np.where((labels == -100)[..., None], np.nan, x).astype(np.float32)
    name = "xla_live_garbage"
    register_backend(name, lambda: XlaBackend(gradient_order=order, grad_budget_bytes=1), replace=True)
    try:
        def loss(a, b, implementation):
            values = linear_cross_entropy(a, labels, b, implementation=implementation, reduction=reduction,
                                          block_sizes=BlockSizes(b_block_size=rows))
            return jnp.sum(values)

        value, (dx, dw) = jax.jit(jax.value_and_grad(functools.partial(loss, implementation=name), (0, 1)))(garbage, w)
    finally:
        unregister_backend(name)
    expected, (dx_ref, dw_ref) = jax.value_and_grad(functools.partial(loss, implementation="reference"), (0, 1))(x, w)
    assert abs(float(value) - float(expected)) <= 1e-5 * abs(float(expected))
    assert max_rel_error(dw, dw_ref) <= 1e-4
    assert max_rel_error(dx, dx_ref) <= 1e-4  # 0 at the dead rows, as the reference's


@pytest.mark.covering(axis_type=("Explicit", "Auto"), mesh_shape=((2, 1), (2, 2)), pattern=("uneven", "one_per_shard"),
                      fast=2)
def test_shards_with_different_live_counts_match_float64(mesh_shape, axis_type, pattern):
    """Data shards skip their own dead tokens (different counts, or one live token each); vocab shards agree."""
    axis = getattr(jax.sharding.AxisType, axis_type)
    mesh = jax.make_mesh(mesh_shape, ("data", "vocab"), axis_types=(axis,) * 2)
    x, _, w = random_problem(8, (4, 32), HIDDEN, VOCAB)
    labels = ignored_labels("random", seed=5, shape=(4, 32))
    if pattern == "uneven":
        labels[:2, 1:] = -100  # the first data shard: two live tokens; the second: about half
    else:
        labels[:2, :], labels[2:, :] = -100, -100
        labels[0, 5], labels[3, 30] = 7, 901  # one live token on each data shard
    loss_fn = functools.partial(ce_core.sharded_linear_cross_entropy, mesh=mesh, vocab_axis="vocab")
    for case in (Case(), Case(reduction="none", logit_soft_cap=4.0)):
        compare_with_oracle("xla", case, x, labels, w, loss_fn=loss_fn, block_sizes=BlockSizes(b_block_size=16))


@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_a_zero_weight_on_a_valid_label_is_not_skipped(reduction):
    """Such a token still has a gradient in its weight (its loss), so it stays live; only ignored labels skip."""
    x, _, w = random_problem(9, (BATCH, SEQ), HIDDEN, VOCAB)
    labels = ignored_labels("prompts", seed=6)
    weights = np.random.default_rng(7).uniform(0.5, 2.0, labels.shape).astype(np.float32)
    weights[np.random.default_rng(8).random(labels.shape) < 0.3] = 0.0
    cotangent = np.random.default_rng(9).standard_normal(labels.shape).astype(np.float32)

    def objective(weights_):
        loss = linear_cross_entropy(x, labels, w, weights=weights_, reduction=reduction, implementation="xla")
        return jnp.sum(loss * cotangent) if reduction == "none" else loss

    dweights = jax.grad(objective)(jnp.asarray(weights))
    expected = oracle(x, labels, w, weights=weights, reduction=reduction,
                      cotangent=cotangent if reduction == "none" else None)["dweights"]
    valid_zero = (weights == 0) & (labels != -100)
    assert np.abs(expected[valid_zero]).min() > 0  # the gradient the skip would lose
    assert max_rel_error(dweights, expected) <= 1e-4
