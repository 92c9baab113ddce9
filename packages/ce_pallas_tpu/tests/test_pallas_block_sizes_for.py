"""The tiles the pallas_tpu backend reports come from its tuned table for the target."""

from __future__ import annotations

import jax.numpy as jnp

import ce_core
from ce_pallas_tpu import PallasTpuBackend


def test_block_sizes_for_reports_the_tuned_tiles(monkeypatch):
    monkeypatch.setenv("CE_PALLAS_TPU_TARGET", "v5p")
    bf16 = jnp.dtype(jnp.bfloat16)
    problem = ce_core.Problem(8192, 4096, 128256, bf16, bf16, ce_core.StatsSpec())
    backend = ce_core.get_backend("pallas_tpu")
    assert isinstance(backend, PallasTpuBackend)
    tiles = backend.block_sizes_for(problem)
    assert tiles.source == "table:v5p/llama3"
    assert tiles.forward.v % 128 == 0 and tiles.backward.v % 128 == 0
