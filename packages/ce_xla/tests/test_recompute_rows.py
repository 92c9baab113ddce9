"""The recompute gradient pass takes its own rows (``grad_token_chunk``), not the statistics rows.

Tokens outer, the VJP of the statistics (per-token outputs: ``linear_log_probs``, the RL objective)
recomputes each logits tile, so its token chunks need not be the forward's full-row chunks: the
rule makes them as large as an 8 MiB float32 tile allows (one chunk instead of five at N=512,
H=1536, V=151936). Checked here: the rule, and the gradients against the float64 contract oracle
when the recompute rows differ from the statistics rows and overlap at both ends.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ce_core import BlockSizes, StatsSpec
from ce_core.extend import max_rel_error, stats_oracle
from ce_xla import backward, forward, plan_chunks
from ce_xla.target import CPU

MiB = 2**20


def test_the_rl_preset_takes_one_recompute_chunk_on_cpu():
    plan = plan_chunks(512, 1536, 151936)
    assert plan.gradient_order == "tokens_outer" and plan.full_rows
    assert (plan.token_chunk, plan.token_chunks) == (104, 5)  # the statistics rows: 64 MiB of logits
    assert (plan.grad_token_chunk, plan.grad_token_chunks, plan.grad_chunk) == (512, 1, 1280)
    assert 4 * plan.grad_token_chunk * plan.grad_chunk <= CPU.recompute_tile_bytes


def test_recompute_rows_are_within_the_tile_budget_and_spread_evenly():
    plan = plan_chunks(4096, 1536, 151936)
    assert plan.grad_chunk == 1280 and plan.grad_token_chunks == 3  # 8 MiB / (4 x 1280) = 1638 rows at most
    assert plan.grad_token_chunk == 1368 and 3 * 1368 - 4096 == 8  # 4096 / 3 rounded up to 8: 8 rows done twice
    assert 4 * plan.grad_token_chunk * plan.grad_chunk <= 8 * MiB


def test_recompute_rows_never_below_the_statistics_rows_and_explicit_rows_kept():
    tiled = plan_chunks(4096, 1024, 1_000_000)  # vocab-chunked: 256-row statistics tiles
    assert not tiled.full_rows and tiled.grad_token_chunk == tiled.token_chunk == 256
    explicit = plan_chunks(4096, 1536, 151936, BlockSizes(b_block_size=64))
    assert explicit.token_chunk == explicit.grad_token_chunk == 64


@pytest.mark.parametrize("cap", [None, 3.0])
def test_recompute_pass_with_its_own_overlapping_rows_matches_float64(cap):
    n, h, v = 50, 32, 1000
    rng = np.random.default_rng(7)
    x = rng.standard_normal((n, h)).astype(np.float32)
    w = (rng.standard_normal((h, v)) * 0.3).astype(np.float32)
    labels = rng.integers(0, v, n).astype(np.int32)
    cotangent = {name: rng.standard_normal(n).astype(np.float32) for name in ("lse", "label", "expected")}
    spec = StatsSpec(logit_soft_cap=cap, with_expected=True)
    stats_plan = plan_chunks(n, h, v, BlockSizes(b_block_size=8))
    # 50 rows = 24 + 24 + an overlapping 24 (the statistics took 8-row chunks); 384-column slices overlap too.
    plan = dataclasses.replace(stats_plan, grad_token_chunk=24, grad_chunk=384)
    assert plan.grad_token_chunks == 3 and plan.grad_chunks == 3 and plan.token_chunk == 8

    stats = forward.row_stats(jnp.asarray(x), jnp.asarray(w), jnp.asarray(labels), spec, plan)
    row_cotangent = stats._replace(lse=jnp.asarray(cotangent["lse"]), label=jnp.asarray(cotangent["label"]),
                                   expected=jnp.asarray(cotangent["expected"]))
    dx, dw = jax.jit(backward.row_stats_grads, static_argnums=(5, 6))(
        jnp.asarray(x), jnp.asarray(w), jnp.asarray(labels), stats, row_cotangent, spec, plan)

    expected = stats_oracle(x, w, labels, logit_soft_cap=cap, cotangent=cotangent)
    assert max_rel_error(stats.lse, expected["lse"]) < 1e-5
    assert stats.expected is not None and max_rel_error(stats.expected, expected["expected"]) < 1e-5
    assert max_rel_error(dx, expected["dx"]) < 2e-5
    assert max_rel_error(dw, expected["dw"]) < 2e-5
