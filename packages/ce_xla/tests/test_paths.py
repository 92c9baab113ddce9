"""Both gradient paths and both gradient orders of the xla backend against float64.

- the general path: ``row_stats`` and its custom VJP (recomputes the logits: 8NHV), used by
  ``reduction="none"``, ``return_lse`` and vocab-sharded calls;
- the fused path: ``row_stats_and_grads``, used when the loss is reduced to a scalar (dx and dw in
  the forward pass, 6NHV, when the gradient order is tokens outer).

Each runs in both gradient orders (tokens outer: float32 ``dw`` accumulated over token chunks;
vocab outer: float32 ``dx`` accumulated over vocab slices), forced on both dtypes, and in three
chunkings: one chunk; full-row statistics with overlapping token chunks (and, tokens outer,
gradient slices); and vocab chunks with overlapping token and vocab chunks. N = 50 tokens and
V = 1000 or 3001 are divided by none of the chunks.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ce_core import BlockSizes, RowStats, StatsSpec, linear_cross_entropy, linear_log_probs
from ce_core.extend import (
    Case,
    compare_with_oracle,
    log_probs_oracle,
    max_rel_error,
    random_problem,
    register_backend,
    unregister_backend,
)
from ce_xla import XlaBackend

ORDERS = ("tokens_outer", "vocab_outer")
# chunking -> (backend options, block sizes); N = 50 tokens, V = 1000 or 3001 in the tests below.
CHUNKINGS = {
    "one_chunk": ({}, None),
    # 24-row token chunks (50 = 24 + 24 + overlapping 24); tokens outer, 512-column gradient slices.
    "full_rows": ({"grad_budget_bytes": 1}, BlockSizes(b_block_size=24)),
    # 384-column vocab tiles and gradient slices divide neither 1000 nor 3001 (the last overlaps).
    "vocab_chunks": ({}, BlockSizes(b_block_size=16, v_block_size=384)),
}
#: Both odd vocabularies, both dtypes, with and without the soft cap.
STATS_FACTORS = dict(vocab=(1000, 3001), dtype=("float32", "bfloat16"), cap=(None, 3.0))
TOLERANCE = {"float32": 2e-5, "bfloat16": 2e-2}
#: Each test runs every chunking in both gradient orders (pairs of a covering array); its other factors
#: meet them pairwise.
EVERY_MODE = dict(chunking=tuple(CHUNKINGS), order=ORDERS)


@pytest.fixture
def mode(chunking, order):
    """``(name, backend, block_sizes)``: the xla backend forced to ``order`` with ``chunking``, registered
    as ``name``."""
    options, block_sizes = CHUNKINGS[chunking]
    backend = XlaBackend(**options, gradient_order=order)
    name = f"xla_test_{chunking}_{order}"
    register_backend(name, lambda: backend, replace=True)
    yield name, backend, block_sizes
    unregister_backend(name)


class Float64Stats(NamedTuple):
    """The row statistics of :class:`ce_core.RowStats`, as float64 NumPy arrays."""

    lse: np.ndarray
    label: np.ndarray
    sum: np.ndarray


def float64_stats(x, w, labels, cap) -> Float64Stats:
    """Row statistics of ``cap(x @ w)`` in float64."""
    return _float64(x, w, labels, cap)[0]


def float64_grads(x, w, labels, cap, cotangent: Sequence[Any]) -> tuple[Float64Stats, np.ndarray, np.ndarray]:
    """Row statistics and ``dx, dw`` for ``cotangent`` (of the lse, label logit and sum) in float64."""
    stats, raw, z, one_hot = _float64(x, w, labels, cap)
    x, w = np.asarray(x, np.float64), np.asarray(w, np.float64)
    g = [np.asarray(c, np.float64) for c in cotangent]
    delta = g[0][:, None] * np.exp(z - stats.lse[:, None]) + g[1][:, None] * one_hot + g[2][:, None]
    if cap is not None:
        delta = delta * (1.0 - np.tanh(raw / cap) ** 2)
    return stats, delta @ w.T, x.T @ delta


def _float64(x, w, labels, cap) -> tuple[Float64Stats, np.ndarray, np.ndarray, np.ndarray]:
    x, w = np.asarray(x, np.float64), np.asarray(w, np.float64)
    raw = x @ w
    z = raw if cap is None else cap * np.tanh(raw / cap)
    peak = z.max(1)
    lse = peak + np.log(np.exp(z - peak[:, None]).sum(1))
    vocab = w.shape[1]
    in_vocab = (labels >= 0) & (labels < vocab)
    one_hot = (np.arange(vocab)[None, :] == labels[:, None]).astype(np.float64)  # all 0 outside [0, V)
    stats = Float64Stats(lse, np.where(in_vocab, (z * one_hot).sum(1), 0.0), z.sum(1))
    return stats, raw, z, one_hot


def problem(vocab, dtype, seed=0):
    x, labels, w = random_problem(seed, (50,), 40, vocab, ignore_fraction=0.0)
    labels[[3, 17, 41]] = [-7, vocab, vocab + 123]  # labels another vocab shard owns
    return jnp.asarray(x, dtype), jnp.asarray(labels), jnp.asarray(w, dtype)


def check(actual, expected, tol, what):
    error = max_rel_error(np.asarray(jnp.asarray(actual, jnp.float32)), expected)
    assert error <= tol, f"{what}: rel error {error:.3g} > {tol}"


@pytest.mark.covering(**EVERY_MODE, **STATS_FACTORS)
def test_row_stats_vjp_matches_float64(mode, vocab, dtype, cap):
    _, backend, block_sizes = mode
    x, labels, w = problem(vocab, dtype)
    spec = StatsSpec(logit_soft_cap=cap, with_sum=True, block_sizes=block_sizes)
    rng = np.random.default_rng(1)
    cotangent = RowStats(*(jnp.asarray(rng.standard_normal(50), jnp.float32) for _ in range(3)))

    @jax.jit
    def run(x_, w_, ct):
        stats, vjp = jax.vjp(lambda a, b: backend.row_stats(a, b, labels, spec), x_, w_)
        return stats, vjp(ct)

    stats, (dx, dw) = run(x, w, cotangent)
    x32, w32 = np.asarray(x.astype(jnp.float32)), np.asarray(w.astype(jnp.float32))
    expected, dx64, dw64 = float64_grads(x32, w32, np.asarray(labels), cap, cotangent)
    tol = TOLERANCE[dtype]
    for name in ("lse", "label", "sum"):
        check(getattr(stats, name), getattr(expected, name), 1e-5, name)
    assert np.all(np.asarray(stats.label)[[3, 17, 41]] == 0.0), "out-of-vocab labels give label logit 0"
    assert dx.dtype == x.dtype and dw.dtype == w.dtype
    check(dx, dx64, tol, "dx")
    check(dw, dw64, tol, "dw")


@pytest.mark.covering(**EVERY_MODE, **STATS_FACTORS)
def test_row_stats_and_grads_matches_float64(mode, vocab, dtype, cap):
    _, backend, block_sizes = mode
    x, labels, w = problem(vocab, dtype, seed=2)
    spec = StatsSpec(logit_soft_cap=cap, with_sum=True, block_sizes=block_sizes)
    rng = np.random.default_rng(3)
    params = {"a": jnp.asarray(rng.uniform(0.5, 2, 50), jnp.float32),
              "b": jnp.asarray(rng.standard_normal(50), jnp.float32)}

    def cotangent_fn(stats, p):  # depends on the chunk's own statistics, as ce_core's does
        return RowStats(p["a"] * (1.0 + 0.1 * stats.lse), p["b"] * jnp.tanh(stats.label), -0.01 * p["a"])

    stats, dx, dw = jax.jit(lambda a, b: backend.row_stats_and_grads(a, b, labels, spec, cotangent_fn, params))(x, w)
    x32, w32 = np.asarray(x.astype(jnp.float32)), np.asarray(w.astype(jnp.float32))
    expected = float64_stats(x32, w32, np.asarray(labels), cap)
    a, b = (np.asarray(params[k], np.float64) for k in "ab")
    cotangent = (a * (1.0 + 0.1 * expected.lse), b * np.tanh(expected.label), -0.01 * a)
    _, dx64, dw64 = float64_grads(x32, w32, np.asarray(labels), cap, cotangent)
    for name in ("lse", "label", "sum"):
        check(getattr(stats, name), getattr(expected, name), 1e-5, name)
    assert dx.dtype == x.dtype and dw.dtype == w.dtype
    check(dx, dx64, TOLERANCE[dtype], "dx")
    check(dw, dw64, TOLERANCE[dtype], "dw")


@pytest.mark.covering(**EVERY_MODE, dtype=("float32", "bfloat16"))
def test_row_stats_vjp_from_a_global_lse_matches_float64(mode, dtype):
    """``w`` is one vocab shard (ids [0, 1000) of 3001) and ``lse`` is over the whole vocabulary."""
    _, backend, block_sizes = mode
    x, labels, w_full = problem(3001, dtype, seed=9)
    w = w_full[:, :1000]
    spec = StatsSpec(logit_soft_cap=3.0, with_sum=True, block_sizes=block_sizes)
    x32, w32 = np.asarray(x.astype(jnp.float32)), np.asarray(w_full.astype(jnp.float32))
    lse = float64_stats(x32, w32, np.asarray(labels), 3.0).lse
    rng = np.random.default_rng(10)
    cotangent = RowStats(*(jnp.asarray(rng.standard_normal(50), jnp.float32) for _ in range(3)))
    dx, dw = jax.jit(lambda a, b, s: backend.row_stats_vjp(a, b, labels, RowStats(s, s), cotangent, spec))(
        x, w, jnp.asarray(lse, jnp.float32))
    # The shard's share: softmax against the global lse; labels >= 1000 belong to other shards.
    raw = x32.astype(np.float64) @ w32[:, :1000]
    z = 3.0 * np.tanh(raw / 3.0)
    one_hot = (np.arange(1000)[None, :] == np.asarray(labels)[:, None]).astype(np.float64)
    g = [np.asarray(c, np.float64) for c in cotangent]
    delta = ((g[0][:, None] * np.exp(z - lse[:, None]) + g[1][:, None] * one_hot + g[2][:, None])
             * (1 - np.tanh(raw / 3.0) ** 2))
    assert dx.dtype == x.dtype and dw.dtype == w.dtype
    check(dx, delta @ w32[:, :1000].T, TOLERANCE[dtype], "dx")
    check(dw, x32.T @ delta, TOLERANCE[dtype], "dw")


@pytest.mark.covering(**EVERY_MODE, reduction=("mean", "sum", "none"), dtype=("float32", "bfloat16"))
def test_all_ignored_batch_gives_zero_loss_and_zero_gradients(mode, reduction, dtype):
    name, _, block_sizes = mode
    x, labels, w = random_problem(11, (50,), 40, 3001)
    labels[:] = -100

    def objective(a, b):
        return jnp.sum(linear_cross_entropy(a, labels, b, reduction=reduction, implementation=name,
                                            block_sizes=block_sizes, logsumexp_weight=1e-3))

    loss, (dx, dw) = jax.jit(jax.value_and_grad(objective, (0, 1)))(jnp.asarray(x, dtype), jnp.asarray(w, dtype))
    assert float(loss) == 0.0
    assert not np.any(np.asarray(dx, np.float32)) and not np.any(np.asarray(dw, np.float32))


@pytest.mark.covering(**EVERY_MODE, reduction=("mean", "sum", "none"), vocab=(1000, 3001),
                      dtype=("float32", "bfloat16"))
def test_loss_matches_oracle(mode, reduction, vocab, dtype):
    name, _, block_sizes = mode
    x, labels, w = random_problem(4, (5, 10), 40, vocab)  # logits of order 1, 10% ignored
    case = Case(reduction=reduction, use_weights=True, logsumexp_weight=1e-3, logit_soft_cap=3.0, label_smoothing=0.1)
    compare_with_oracle(name, case, x, labels, w, dtype=dtype, block_sizes=block_sizes)


@pytest.mark.covering(**EVERY_MODE, dtype=("float32", "bfloat16"))
def test_log_probs_and_entropy_match_oracle(mode, dtype):
    """The expected-logit statistic streamed and differentiated in every chunking and gradient order."""
    name, _, block_sizes = mode
    x, labels, w = random_problem(5, (5, 10), 40, 3001)
    rng = np.random.default_rng(5)
    g_logp, g_ent = (rng.standard_normal(labels.shape).astype(np.float32) for _ in range(2))

    def objective(x_, w_):
        logp, entropy = linear_log_probs(x_, labels, w_, temperature=0.7, logit_soft_cap=3.0, return_entropy=True,
                                         implementation=name, block_sizes=block_sizes)
        return jnp.sum(g_logp * logp + g_ent * entropy), (logp, entropy)

    xj, wj = jnp.asarray(x, dtype), jnp.asarray(w, dtype)
    (_, (logp, entropy)), (dx, dw) = jax.jit(jax.value_and_grad(objective, argnums=(0, 1), has_aux=True))(xj, wj)
    expected = log_probs_oracle(np.asarray(xj, np.float32), labels, np.asarray(wj, np.float32), temperature=0.7,
                                logit_soft_cap=3.0, logp_cotangent=g_logp, entropy_cotangent=g_ent)
    for actual, key in ((logp, "logp"), (entropy, "entropy"), (dx, "dx"), (dw, "dw")):
        assert max_rel_error(actual, expected[key]) < TOLERANCE[dtype], key

@pytest.mark.covering(**EVERY_MODE)
def test_the_two_paths_agree(mode):
    name, _, block_sizes = mode
    x, labels, w = random_problem(5, (50,), 40, 1000)

    def loss(a, b, reduction):
        return linear_cross_entropy(a, labels, b, reduction=reduction, implementation=name, block_sizes=block_sizes,
                                    label_smoothing=0.1, logit_soft_cap=3.0)

    fused = jax.jit(jax.grad(lambda a, b: loss(a, b, "sum"), (0, 1)))(x, w)
    general = jax.jit(jax.grad(lambda a, b: jnp.sum(loss(a, b, "none")), (0, 1)))(x, w)
    for f, g in zip(fused, general, strict=True):
        assert max_rel_error(f, g) < 1e-5


@pytest.mark.parametrize("reduction,path", [("mean", "fused"), ("sum", "fused"), ("none", "general")])
def test_each_reduction_takes_its_path(monkeypatch, reduction, path):
    import ce_xla.backward
    import ce_xla.fused

    calls = []
    for module, attr, tag in ((ce_xla.fused, "row_stats_and_grads", "fused"),
                              (ce_xla.backward, "row_stats_grads", "general")):
        original = getattr(module, attr)
        monkeypatch.setattr(module, attr, lambda *a, _o=original, _t=tag, **k: calls.append(_t) or _o(*a, **k))
    x, labels, w = random_problem(6, (12,), 16, 30)
    jax.grad(lambda a: jnp.sum(linear_cross_entropy(a, labels, w, reduction=reduction, implementation="xla")))(x)
    assert calls == [path]


def count_dots(jaxpr) -> int:
    """``dot_general`` equations in a jaxpr, sub-jaxprs (loop bodies, custom rules) included, each once."""
    total = 0
    for eqn in jaxpr.eqns:
        total += eqn.primitive.name == "dot_general"
        for value in eqn.params.values():
            for sub in value if isinstance(value, (list, tuple)) else [value]:
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    total += count_dots(inner)
    return total


@pytest.fixture
def no_keep_logits_budget(monkeypatch):
    """The order rule with a keep-logits budget of 0 (the devices' default budget of every ``XlaBackend``
    made without one), so that small bf16 problems with V > N take vocab outer."""
    import ce_xla.target

    monkeypatch.setattr(ce_xla.target, "device_keep_logits_budget", lambda platform: 0)


@pytest.mark.parametrize("reduction,dtype,dots", [("mean", "float32", 3), ("none", "float32", 4),
                                                  ("mean", "bfloat16", 4), ("none", "bfloat16", 4)])
def test_fused_path_does_three_matmul_passes_the_others_four(no_keep_logits_budget, reduction, dtype, dots):
    """Full-row mode: logits, dx and dw products once per chunk (6NHV); the VJP adds a recompute,
    and so does the vocab-outer order that bf16 takes (statistics first, then 8NHV in all)."""
    x, labels, w = random_problem(7, (64,), 16, 100)
    loss = lambda a, b: jnp.sum(linear_cross_entropy(a, labels, b, reduction=reduction, implementation="xla",  # noqa: E731
                                                     block_sizes=BlockSizes(b_block_size=16)))
    args = (jnp.asarray(x, dtype), jnp.asarray(w, dtype))
    assert count_dots(jax.make_jaxpr(jax.value_and_grad(loss, (0, 1)))(*args).jaxpr) == dots


@pytest.mark.parametrize("keep_logits,dtype,budget,dots", [
    (None, "bfloat16", None, 3),  # the device's budget: 4HV = 6.4 KiB fits, tokens outer
    (True, "bfloat16", 0, 3),  # forced tokens outer, whatever the budget
    (False, "float32", None, 4),  # forced recompute, vocab outer
    (False, "bfloat16", None, 4),
])
def test_keep_logits_picks_the_path_of_a_scalar_loss(keep_logits, dtype, budget, dots):
    """``keep_logits=`` reaches the plan: True keeps the logits (3 matmul passes), False recomputes (4)."""
    register_backend("xla_keep_logits_test", lambda: XlaBackend(keep_logits_budget_bytes=budget), replace=True)
    try:
        x, labels, w = random_problem(7, (64,), 16, 100)
        loss = lambda a, b: linear_cross_entropy(a, labels, b, implementation="xla_keep_logits_test",  # noqa: E731
                                                 block_sizes=BlockSizes(b_block_size=16), keep_logits=keep_logits)
        args = (jnp.asarray(x, dtype), jnp.asarray(w, dtype))
        assert count_dots(jax.make_jaxpr(jax.value_and_grad(loss, (0, 1)))(*args).jaxpr) == dots
    finally:
        unregister_backend("xla_keep_logits_test")


@pytest.mark.parametrize("dtype,vocab,order", [("float32", 100, "tokens_outer"), ("bfloat16", 100, "vocab_outer"),
                                               ("bfloat16", 48, "tokens_outer")])
@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_every_entry_point_takes_the_planned_gradient_order(monkeypatch, no_keep_logits_budget, dtype, vocab, order,
                                                            reduction):
    """bf16 with V > N avoids the float32 [H, V] accumulator on the fused and the general path;
    with V <= N (here 48 <= 64) the dw accumulator is the smaller one, and tokens outer keeps it."""
    import ce_xla.vocab_outer as vocab_outer_module

    calls = []
    original = vocab_outer_module.row_stats_grads
    monkeypatch.setattr(vocab_outer_module, "row_stats_grads", lambda *a, **k: calls.append(1) or original(*a, **k))
    x, labels, w = random_problem(12, (64,), 16, vocab)
    args = (jnp.asarray(x, dtype), jnp.asarray(w, dtype))
    jax.grad(lambda a, b: jnp.sum(linear_cross_entropy(a, labels, b, reduction=reduction, implementation="xla")),
             (0, 1))(*args)
    assert bool(calls) == (order == "vocab_outer")
    calls.clear()
    backend = XlaBackend()
    lse = backend.row_stats(*args[:1], args[1], jnp.asarray(np.maximum(labels, 0)), StatsSpec()).lse
    zeros = jnp.zeros(64, jnp.float32)
    backend.row_stats_vjp(args[0], args[1], jnp.asarray(np.maximum(labels, 0)), RowStats(lse, zeros),
                          RowStats(zeros + 1, zeros), StatsSpec())
    assert bool(calls) == (order == "vocab_outer")


def test_float16_mean_gradients_do_not_underflow():
    """With a mean over many tokens, ``delta`` is below float16's range: its products run in float32."""
    x, labels, w = random_problem(8, (2048,), 32, 500)
    errors = compare_with_oracle("xla", Case(), x, labels, w, dtype="float16")
    assert errors["dx"] < 1e-3 and errors["dw"] < 1e-3, errors


@pytest.mark.parametrize("rows,f32_dw", [(None, False), (64, True)])
def test_one_token_chunk_holds_no_float32_dw_temporaries(rows, f32_dw):
    """Tokens outer with one token chunk writes each ``dw`` share in ``w``'s dtype (it is final): no float32
    ``[H, V]`` buffer (4HV = 64 MiB here, one logits chunk 8 MiB); two chunks accumulate in one."""
    n, h, v = 128, 1024, 16384
    backend = XlaBackend(gradient_order="tokens_outer")
    spec = StatsSpec(block_sizes=None if rows is None else BlockSizes(b_block_size=rows))
    assert backend.plan(n, h, v, spec, jnp.bfloat16, jnp.bfloat16).token_chunks == (1 if rows is None else 2)

    def fused(x, w, labels):
        coefficient = jnp.full((n,), 1.0 / n, jnp.float32)
        return backend.row_stats_and_grads(x, w, labels, spec, lambda _, c: RowStats(c, -c), coefficient)[1:]

    shapes = (jax.ShapeDtypeStruct((n, h), jnp.bfloat16), jax.ShapeDtypeStruct((h, v), jnp.bfloat16),
              jax.ShapeDtypeStruct((n,), jnp.int32))
    memory = jax.jit(fused).lower(*shapes).compile().memory_analysis()
    assert memory is not None
    assert (memory.temp_size_in_bytes >= 4 * h * v) == f32_dw, memory.temp_size_in_bytes / 2**20
