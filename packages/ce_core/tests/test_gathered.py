"""ce_core.api.gathered: a few logits per token and their gradients, chunked, against the materialised logits."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ce_core.api.gathered import gathered_logits
from ce_core.testing import max_rel_error


@pytest.mark.parametrize(("w_layout", "cap", "chunk_bytes", "dtype"), [
    ("hv", None, 2**20, "float32"),      # one chunk
    ("vh", 1.5, 200, "float32"),         # a few tokens and pairs per chunk: runs span several chunks
    ("hv", 1.5, 96, "bfloat16"),         # one row of w and one pair a chunk
])
def test_gathered_logits_and_gradients_equal_the_materialised_ones(w_layout, cap, chunk_bytes, dtype):
    rng = np.random.default_rng(0)
    n, h, v, m = 13, 8, 11, 4
    x = rng.standard_normal((n, h)).astype(np.float32)
    w = (rng.standard_normal((h, v)) / np.sqrt(h)).astype(np.float32)
    entries = rng.integers(0, 4, (n, m)).astype(np.int32)  # few distinct entries: long runs of pairs
    entries[3] = 10
    scale = rng.uniform(0.5, 1.5, n).astype(np.float32)
    cotangent = rng.standard_normal((n, m)).astype(np.float32)
    xj, wj = jnp.asarray(x, dtype), jnp.asarray(w if w_layout == "hv" else w.T, dtype)

    def fused(a, b):
        return jnp.sum(cotangent * gathered_logits(a, b, jnp.asarray(entries), jnp.asarray(scale), cap, w_layout,
                                                   chunk_bytes=chunk_bytes))

    def materialised(a, b):
        z = a.astype(jnp.float32) @ (b if w_layout == "hv" else b.T).astype(jnp.float32)
        z = z if cap is None else cap * jnp.tanh(z / cap)
        return jnp.sum(cotangent * jnp.take_along_axis(z * scale[:, None], jnp.asarray(entries), axis=1))

    value, (dx, dw) = jax.value_and_grad(fused, argnums=(0, 1))(xj, wj)
    expected, (e_dx, e_dw) = jax.value_and_grad(materialised, argnums=(0, 1))(xj.astype(jnp.float32),
                                                                             wj.astype(jnp.float32))
    assert dx.dtype == xj.dtype and dw.dtype == wj.dtype and dw.shape == wj.shape
    tolerance = 1e-5 if dtype == "float32" else 1e-2
    assert max_rel_error(value, expected) <= tolerance
    assert max_rel_error(dx.astype(jnp.float32), e_dx) <= tolerance
    # Each entry of dw is its float32 sum rounded once, so bf16 is within half an ulp of the float32 result.
    assert max_rel_error(dw.astype(jnp.float32), e_dw) <= (1e-5 if dtype == "float32" else 2**-8)
    unused = np.setdiff1d(np.arange(v), entries)
    assert not np.asarray(dw.astype(jnp.float32))[(slice(None), unused) if w_layout == "hv" else unused].any()
