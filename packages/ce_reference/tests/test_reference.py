"""The reference backend: registered by entry point, and really materialises the logits."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import ce_core
from ce_core.extend import max_rel_error, oracle, random_problem, stats_oracle
from ce_reference import ReferenceBackend, make_backend


def test_entry_point_gives_a_reference_backend():
    backend = ce_core.get_backend("reference")
    assert isinstance(backend, ReferenceBackend) and isinstance(make_backend(), ReferenceBackend)
    # The current version (pairs of heads); it computes every row, dead ones on zeros.
    assert backend.contract_version == ce_core.CONTRACT_VERSION == 5 and backend.takes_live_rows


def test_row_stats_match_the_oracle_with_cap_and_sum():
    x, labels, w = random_problem(0, (19,), 24, 150, ignore_fraction=0.0)
    spec = ce_core.StatsSpec(logit_soft_cap=3.0, with_sum=True)
    stats = make_backend().row_stats(jnp.asarray(x), jnp.asarray(w), jnp.asarray(labels), spec)
    logits = 3.0 * np.tanh((x.astype(np.float64) @ w.astype(np.float64)) / 3.0)
    np.testing.assert_allclose(stats.lse, oracle(x, labels, w, logit_soft_cap=3.0)["lse"], rtol=1e-6)
    np.testing.assert_allclose(stats.label, logits[np.arange(19), labels], rtol=1e-5, atol=1e-6)
    assert stats.sum is not None  # asked for with with_sum=True
    np.testing.assert_allclose(stats.sum, logits.sum(-1), rtol=1e-5, atol=1e-4)


def test_temporaries_hold_the_full_logits():
    n, h, v = 512, 64, 4096

    def loss(x, w):
        return ce_core.linear_cross_entropy(x, jnp.zeros((n,), jnp.int32), w, implementation="reference")

    compiled = jax.jit(jax.value_and_grad(loss, argnums=(0, 1))).lower(
        jax.ShapeDtypeStruct((n, h), jnp.float32), jax.ShapeDtypeStruct((h, v), jnp.float32)).compile()
    memory = compiled.memory_analysis()
    assert memory is not None and memory.temp_size_in_bytes >= 4 * n * v


def test_reference_has_no_block_sizes_to_report():
    f32 = jnp.dtype(jnp.float32)
    problem = ce_core.Problem(8, 4, 16, f32, f32, ce_core.StatsSpec())
    assert make_backend().block_sizes_for(problem) is None


# Contract version 3: w_layout, max/argmax and row_scale, each and together, against stats_oracle.
def _v3_problem(seed: int, n: int, h: int, v: int, layout: str, dtype=jnp.float32):
    x, labels, w = random_problem(seed, (n,), h, v, ignore_fraction=0.0)
    labels[0] = v + 3  # a label outside this w (another vocab shard's): label logit 0
    head = w if layout == "hv" else np.ascontiguousarray(w.T)
    scale = np.random.default_rng(seed + 7).uniform(0.4, 2.5, n).astype(np.float32)
    xj, wj = jnp.asarray(x, dtype), jnp.asarray(head, dtype)
    return xj, wj, labels, scale


@pytest.mark.covering(w_layout=("hv", "vh"), logit_soft_cap=(None, 2.5), with_argmax=(False, True),
                      with_row_scale=(False, True), dtype=(jnp.float32, jnp.bfloat16))
def test_v3_row_stats_vjp_and_grads_match_stats_oracle(w_layout, logit_soft_cap, with_argmax, with_row_scale, dtype):
    spec_kw = dict(w_layout=w_layout, logit_soft_cap=logit_soft_cap, with_argmax=with_argmax,
                   with_row_scale=with_row_scale)
    spec = ce_core.StatsSpec(with_sum=True, with_expected=True, **spec_kw)
    xj, wj, labels, scale = _v3_problem(3, 13, 24, 157, spec.w_layout, dtype)
    kw = {"row_scale": jnp.asarray(scale)} if spec.with_row_scale else {}
    backend = make_backend()
    x64, w64 = np.asarray(xj.astype(jnp.float32)), np.asarray(wj.astype(jnp.float32))
    rng = np.random.default_rng(5)
    ct = {name: rng.standard_normal(13).astype(np.float32) for name in ("lse", "label", "sum", "expected")}
    want = stats_oracle(x64, w64, labels, w_layout=spec.w_layout, logit_soft_cap=spec.logit_soft_cap,
                        row_scale=scale if spec.with_row_scale else None, cotangent=ct)
    tol = 1e-5  # the oracle sees the same (rounded) inputs; the logits are float32 either way
    stats = backend.row_stats(xj, wj, jnp.asarray(labels), spec, **kw)
    for name in ("lse", "label", "sum", "expected"):
        assert max_rel_error(getattr(stats, name), want[name]) < tol, name
    if spec.with_argmax:
        assert stats.argmax is not None and stats.max is not None and stats.argmax.dtype == jnp.int32
        np.testing.assert_array_equal(stats.argmax, want["argmax"])
        assert max_rel_error(stats.max, want["max"]) < tol
    else:
        assert stats.max is None and stats.argmax is None
    cotangent = ce_core.RowStats(*(jnp.asarray(ct[k]) for k in ("lse", "label", "sum", "expected")))
    dx, dw = backend.row_stats_vjp(xj, wj, jnp.asarray(labels), stats, cotangent, spec, **kw)
    assert dw.shape == wj.shape
    gtol = 1e-4 if dtype == jnp.float32 else 2e-2
    assert max_rel_error(dx.astype(jnp.float32), want["dx"]) < gtol
    assert max_rel_error(dw.astype(jnp.float32), want["dw"]) < gtol

    def cotangent_fn(s, params):
        del s
        return ce_core.RowStats(*(params[k] for k in ("lse", "label", "sum", "expected")))

    params = {k: jnp.asarray(v) for k, v in ct.items()}
    stats2, dx2, dw2 = backend.row_stats_and_grads(xj, wj, jnp.asarray(labels), spec, cotangent_fn, params, **kw)
    assert max_rel_error(stats2.lse, want["lse"]) < tol
    if spec.with_argmax:
        np.testing.assert_array_equal(stats2.argmax, want["argmax"])
    assert max_rel_error(dx2.astype(jnp.float32), want["dx"]) < gtol
    assert max_rel_error(dw2.astype(jnp.float32), want["dw"]) < gtol


@pytest.mark.parametrize("layout", ["hv", "vh"])
def test_argmax_tie_takes_the_lowest_index(layout):
    x, labels, w = random_problem(4, (6,), 16, 300, ignore_fraction=0.0)
    w[:, 250] = w[:, 17] = 3.0 * np.abs(w).max()  # two equal maximal columns for rows with positive sum
    x = np.abs(x)
    head = w if layout == "hv" else np.ascontiguousarray(w.T)
    stats = make_backend().row_stats(jnp.asarray(x), jnp.asarray(head), jnp.asarray(labels),
                                     ce_core.StatsSpec(w_layout=layout, with_argmax=True))
    np.testing.assert_array_equal(stats.argmax, np.full(6, 17))
