"""The tiles the pallas_tpu backend reports come from its tuned table for the target."""

from __future__ import annotations

import jax.numpy as jnp

import ce_core


def test_block_sizes_for_reports_the_tuned_tiles(monkeypatch):
    monkeypatch.setenv("CE_PALLAS_TPU_TARGET", "v5p")
    problem = ce_core.Problem(8192, 4096, 128256, jnp.bfloat16, jnp.bfloat16, ce_core.StatsSpec())
    tiles = ce_core.get_backend("pallas_tpu").block_sizes_for(problem)
    assert tiles.source == "table:v5p/llama3"
    assert tiles.forward.v % 128 == 0 and tiles.backward.v % 128 == 0
