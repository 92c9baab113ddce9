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
    report = backend.block_sizes_for(problem)
    assert report.source == "table:v5p/llama3"
    forward, backward = report["forward"], report["backward"]
    f, b = forward.block_sizes, backward.block_sizes
    assert f.b_block_size and f.v_block_size and b.b_block_size and b.v_block_size
    assert f.v_block_size % 128 == 0 and b.v_block_size % 128 == 0
    # The grids cover the problem: (cores, token blocks, vocab blocks per core, hidden blocks) forward,
    # (cores, vocab blocks per core, token blocks) backward; v5p splits the vocab over two TensorCores.
    assert forward.grid is not None and backward.grid is not None
    cores, token_blocks, vocab_blocks, _ = forward.grid
    assert cores == 2 and token_blocks * f.b_block_size >= 8192 and cores * vocab_blocks * f.v_block_size >= 128256
    cores, vocab_blocks, token_blocks = backward.grid
    assert cores == 2 and token_blocks * b.b_block_size >= 8192 and cores * vocab_blocks * b.v_block_size >= 128256
    assert report.details["precision"] == "default" and report.details["backward_w_buffers"] in ("1", "2")
    assert "forward b=" in report.describe() and "source=table:v5p/llama3" in report.describe()
