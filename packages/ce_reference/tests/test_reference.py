"""The reference backend: registered by entry point, and really materialises the logits."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

import ce_core
from ce_core.extend import oracle, random_problem
from ce_reference import ReferenceBackend, make_backend


def test_entry_point_gives_a_reference_backend():
    backend = ce_core.get_backend("reference")
    assert isinstance(backend, ReferenceBackend) and isinstance(make_backend(), ReferenceBackend)
    assert backend.contract_version == ce_core.CONTRACT_VERSION


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
