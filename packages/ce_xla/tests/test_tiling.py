"""The chunk rule and the checks on explicit block sizes."""

from __future__ import annotations

import os

import jax.numpy as jnp
import numpy as np
import pytest

from ce_core import BlockSizes, Problem, StatsSpec, linear_cross_entropy
from ce_xla import LOGITS_BUDGET_BYTES, XlaBackend, gradient_order, plan_chunks
from ce_xla.target import KEEP_LOGITS_BUDGET_CAP_BYTES, keep_logits_budget
from ce_xla.tiling import MIN_GRAD_CHUNK, MIN_GRAD_TOKEN_CHUNK, keep_logits_extra_bytes


def test_default_rule_full_rows_within_the_budget():
    plan = plan_chunks(4096, 512, 32768)
    assert plan.full_rows and plan.token_chunk == 512 and plan.vocab_chunk == 32768
    assert plan.token_chunk * plan.vocab_chunk * 4 <= LOGITS_BUDGET_BYTES
    assert plan.grad_chunk == 4096 and 512 * plan.grad_chunk * 4 <= 8 * 2**20  # CPU gradient slices
    big = plan_chunks(16384, 1024, 65536)
    assert big.full_rows and big.token_chunk == 256 and big.token_chunks == 64


def test_small_problems_are_one_chunk():
    plan = plan_chunks(37, 48, 203)
    assert (plan.token_chunk, plan.vocab_chunk, plan.grad_chunk) == (37, 203, 203)
    assert plan.token_chunks == plan.vocab_chunks == plan.grad_chunks == 1


def test_huge_vocab_switches_to_vocab_chunks():
    plan = plan_chunks(4096, 1024, 1_000_000)
    assert not plan.full_rows
    assert plan.vocab_chunk % 128 == 0 and plan.token_chunk * plan.vocab_chunk * 4 <= LOGITS_BUDGET_BYTES
    assert plan.grad_chunk == plan.vocab_chunk


def test_accelerators_take_one_wide_gradient_update():
    assert plan_chunks(4096, 512, 32768, platform="gpu").grad_chunk == 32768
    assert plan_chunks(4096, 8192, 256000).grad_chunk == MIN_GRAD_CHUNK


def test_explicit_sizes_are_used_as_given():
    plan = plan_chunks(100, 64, 3001, BlockSizes(b_block_size=24, v_block_size=700))
    assert (plan.token_chunk, plan.vocab_chunk, plan.grad_chunk) == (24, 700, 700)
    assert plan.token_chunks == 5 and plan.vocab_chunks == 5
    only_tokens = plan_chunks(100, 64, 3001, BlockSizes(b_block_size=24))
    assert only_tokens.token_chunk == 24 and only_tokens.full_rows


def test_sizes_above_the_dimension_mean_one_chunk():
    plan = plan_chunks(10, 8, 50, BlockSizes(b_block_size=4096, h_block_size=8, v_block_size=1 << 20))
    assert (plan.token_chunk, plan.vocab_chunk) == (10, 50) and plan.full_rows


def test_statistics_rows_are_spread_evenly_over_their_chunks():
    """The last token chunk starts early and overlaps the one before: evened-out chunks recompute few rows."""
    full = plan_chunks(4096, 1536, 151936, order="vocab_outer", budget_bytes=2**30, platform="gpu")
    assert full.full_rows and full.token_chunks == 3  # 1 GiB holds 1760 rows: three chunks
    assert full.token_chunk == 1368 and 3 * 1368 - 4096 == 8  # not 3 x 1760 (1184 rows done twice)
    tiled = plan_chunks(5000, 4096, 128256, x_dtype=jnp.bfloat16, w_dtype=jnp.bfloat16, platform="tpu",
                        order="vocab_outer")
    assert not tiled.full_rows and (tiled.token_chunk, tiled.token_chunks) == (1000, 5)  # not 1024-row chunks
    for n in (1, 7, 1023, 1025, 4097, 16381):
        plan = plan_chunks(n, 512, 32768)
        assert plan.token_chunk % 8 == 0 or plan.token_chunk == n
        assert plan.token_chunks * plan.token_chunk - n < 8 * plan.token_chunks, n  # overlap under 8 rows a chunk
        assert plan.token_chunk * plan.vocab_chunk * 4 <= LOGITS_BUDGET_BYTES


def test_budget_scales_the_token_chunk():
    assert plan_chunks(4096, 512, 32768, budget_bytes=16 * 2**20).token_chunk == 128


@pytest.mark.parametrize("bad", [BlockSizes(h_block_size=16), BlockSizes(b_block_size=8, h_block_size=31)])
def test_splitting_the_hidden_dimension_is_a_value_error_naming_it(bad):
    with pytest.raises(ValueError, match="h_block_size"):
        plan_chunks(10, 32, 50, bad)
    x = np.ones((4, 32), np.float32)
    with pytest.raises(ValueError, match=r"h_block_size=\d+ is below H=32"):
        linear_cross_entropy(x, np.zeros(4, np.int32), jnp.ones((32, 50)), implementation="xla", block_sizes=bad)


def test_bad_budgets_are_value_errors():
    with pytest.raises(ValueError, match="budget_bytes"):
        XlaBackend(budget_bytes=0)
    with pytest.raises(ValueError, match="grad_budget_bytes"):
        XlaBackend(grad_budget_bytes=-1)


GiB = 2**30


@pytest.mark.parametrize("x_dtype,w_dtype,n,h,v,budget,order", [
    (jnp.float32, jnp.float32, 8192, 4096, 128256, 0, "tokens_outer"),  # dw accumulator is the f32 gradient
    (jnp.bfloat16, jnp.bfloat16, 8192, 4096, 128256, 2 * GiB, "tokens_outer"),  # 4HV - 4NH = 1.83 GiB fits
    (jnp.bfloat16, jnp.bfloat16, 8192, 4096, 128256, GiB, "vocab_outer"),  # ...but not 1 GiB
    (jnp.bfloat16, jnp.bfloat16, 8192, 8192, 128256, 4 * GiB, "tokens_outer"),  # 3.66 GiB within the cap
    (jnp.bfloat16, jnp.bfloat16, 16384, 8192, 262144, 4 * GiB, "vocab_outer"),  # 8 GiB - 0.5 GiB: over it
    (jnp.bfloat16, jnp.bfloat16, 65536, 4096, 32000, 0, "tokens_outer"),  # V <= N: 4HV <= 4NH, and 6NHV
    (jnp.float16, jnp.float16, 8192, 4096, 128256, 2 * GiB, "tokens_outer"),
    (jnp.float16, jnp.float16, 8192, 4096, 128256, 0, "vocab_outer"),
    (jnp.float32, jnp.bfloat16, 8192, 4096, 128256, 4 * 4096 * 128256 - 1, "vocab_outer"),  # dx: the f32 gradient
    (jnp.float32, jnp.bfloat16, 8192, 4096, 128256, 4 * 4096 * 128256, "tokens_outer"),  # 4HV = 1.96 GiB
    (jnp.bfloat16, jnp.float32, 8192, 4096, 128256, 0, "tokens_outer"),
])
def test_gradient_order_keeps_the_logits_within_the_budget(x_dtype, w_dtype, n, h, v, budget, order):
    assert gradient_order(n, h, v, x_dtype, w_dtype, budget) == order
    plan = plan_chunks(n, h, v, x_dtype=x_dtype, w_dtype=w_dtype, keep_logits_budget_bytes=budget)
    assert plan.gradient_order == order and plan.fused == (order == "tokens_outer")


@pytest.mark.parametrize("x_dtype,w_dtype", [(jnp.bfloat16, jnp.bfloat16), (jnp.float16, jnp.bfloat16),
                                             (jnp.float32, jnp.bfloat16)])
def test_the_budget_boundary_is_inclusive(x_dtype, w_dtype):
    """Tokens outer exactly when ``4HV - 4NH`` (each only for a dtype narrower than float32) fits the budget."""
    n, h, v = 256, 512, 4480
    extra = keep_logits_extra_bytes(n, h, v, x_dtype, w_dtype)
    assert extra == 4 * h * v - (4 * n * h if np.dtype(x_dtype).itemsize < 4 else 0)
    assert gradient_order(n, h, v, x_dtype, w_dtype, extra) == "tokens_outer"
    assert gradient_order(n, h, v, x_dtype, w_dtype, extra - 1) == "vocab_outer"
    backend = XlaBackend(keep_logits_budget_bytes=extra - 1)
    assert backend.plan(n, h, v, StatsSpec(), x_dtype, w_dtype).gradient_order == "vocab_outer"
    assert backend.block_sizes_for(Problem(n, h, v, jnp.dtype(x_dtype), jnp.dtype(w_dtype), StatsSpec())).details == {
        "gradient_order": "vocab_outer"}
    assert XlaBackend(keep_logits_budget_bytes=extra).plan(n, h, v, StatsSpec(), x_dtype,
                                                           w_dtype).gradient_order == "tokens_outer"


def test_the_budget_is_the_smaller_of_4_gib_and_an_eighth_of_the_memory():
    assert keep_logits_budget("tpu", 16 * GiB) == 2 * GiB  # TPU v5e
    assert keep_logits_budget("gpu", 80 * GiB) == 4 * GiB == KEEP_LOGITS_BUDGET_CAP_BYTES
    assert keep_logits_budget("tpu") == keep_logits_budget("gpu") == 2 * GiB  # 16 GiB assumed
    assert keep_logits_budget("cpu") == 4 * GiB  # 32 GiB of host memory assumed
    assert plan_chunks(8192, 8192, 128256, x_dtype=jnp.bfloat16, w_dtype=jnp.bfloat16).gradient_order == "tokens_outer"
    assert plan_chunks(8192, 8192, 128256, x_dtype=jnp.bfloat16, w_dtype=jnp.bfloat16,
                       platform="tpu").gradient_order == "vocab_outer"  # 3.66 GiB over 2 GiB


def test_the_backend_resolves_the_budget_from_the_device(monkeypatch):
    """On CPU: an eighth of the host's physical memory, at most 4 GiB; an explicit budget wins."""
    import ce_xla.target

    ce_xla.target.device_memory_bytes.cache_clear()
    host = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    assert ce_xla.target.device_memory_bytes("cpu") == host
    assert ce_xla.target.device_memory_bytes("tpu") is None  # not this process's platform: 16 GiB assumed
    assert XlaBackend().keep_logits_budget("cpu") == min(4 * GiB, host // 8)
    assert XlaBackend().keep_logits_budget("tpu") == 2 * GiB
    assert XlaBackend(keep_logits_budget_bytes=0).keep_logits_budget("cpu") == 0
    monkeypatch.setattr(ce_xla.target, "device_memory_bytes", lambda platform: 8 * GiB)
    assert XlaBackend().keep_logits_budget() == GiB
    llama = (8192, 4096, 128256, StatsSpec(), jnp.bfloat16, jnp.bfloat16)
    assert XlaBackend().plan(*llama).gradient_order == "vocab_outer"  # 1.83 GiB over 1 GiB
    monkeypatch.setattr(ce_xla.target, "device_memory_bytes", lambda platform: 16 * GiB)
    assert XlaBackend().plan(*llama).gradient_order == "tokens_outer"


def test_float32_plans_are_unchanged_by_the_dtype_rule():
    assert plan_chunks(4096, 512, 32768) == plan_chunks(4096, 512, 32768, x_dtype=jnp.float32, w_dtype=jnp.float32)
    plan = plan_chunks(16384, 1024, 65536, platform="tpu")
    assert (plan.token_chunk, plan.vocab_chunk, plan.gradient_order) == (256, 65536, "tokens_outer")


def test_vocab_outer_tiles_on_accelerators_are_large_enough_for_the_mxu():
    """Statistics tiles of 1024 rows (every row chunk streams w); 2048 x 1024 gradient tiles at H = 4096."""
    plan = plan_chunks(8192, 4096, 128256, x_dtype=jnp.bfloat16, w_dtype=jnp.bfloat16, platform="tpu",
                       order="vocab_outer")
    assert (plan.token_chunk, plan.vocab_chunk) == (1024, 16384)
    assert (plan.grad_token_chunk, plan.grad_chunk) == (1024, 2048)
    assert 4 * plan.h * plan.grad_chunk == 32 * 2**20 and 4 * plan.grad_token_chunk * plan.grad_chunk == 8 * 2**20
    assert plan.grad_chunks == 63 and plan.grad_token_chunks == 8
    wide = plan_chunks(8192, 8192, 128256, x_dtype=jnp.bfloat16, w_dtype=jnp.bfloat16, platform="tpu")
    assert wide.gradient_order == "vocab_outer"  # 4HV - 4NH = 3.66 GiB: over TPU's 2 GiB budget
    assert (wide.grad_token_chunk, wide.grad_chunk) == (2048, 1024)
    small_vocab = plan_chunks(8192, 1024, 8192, x_dtype=jnp.bfloat16, w_dtype=jnp.bfloat16, platform="tpu",
                              order="vocab_outer")
    assert small_vocab.full_rows and small_vocab.token_chunk == 2048  # full rows once 1024 of them fit


def test_gpu_tiles_are_four_times_larger():
    """Fewer loop steps on GPU: 64 gradient tiles of [2048, 8192] at Llama-3 8B instead of 504 of [1024, 2048]
    (1.80x instead of 2.34x the three-matmul floor on an H200, ce_xla.target)."""
    plan = plan_chunks(8192, 4096, 128256, x_dtype=jnp.bfloat16, w_dtype=jnp.bfloat16, platform="gpu",
                       order="vocab_outer")
    assert (plan.token_chunk, plan.vocab_chunk) == (1024, 128256)  # whole rows: no column slice of w to copy
    assert (plan.grad_token_chunk, plan.grad_chunk) == (2048, 8192)
    assert 4 * plan.h * plan.grad_chunk == 128 * 2**20 and 4 * plan.grad_token_chunk * plan.grad_chunk == 64 * 2**20
    assert plan.grad_chunks * plan.grad_token_chunks == 16 * 4
    rl = plan_chunks(4096, 1536, 151936, x_dtype=jnp.bfloat16, w_dtype=jnp.bfloat16, platform="gpu",
                     order="vocab_outer")
    assert (rl.grad_token_chunk, rl.grad_chunk) == (768, 21760)  # the x4 row of the measured table
    assert (rl.token_chunk, rl.vocab_chunk) == (824, 151936)  # 5 chunks of whole rows, evened out
    gemma = plan_chunks(8192, 2560, 262144, x_dtype=jnp.bfloat16, w_dtype=jnp.bfloat16, platform="gpu")
    assert gemma.gradient_order == "vocab_outer"  # 4HV - 4NH = 2.42 GiB: over the assumed 2 GiB budget
    assert (gemma.token_chunk, gemma.vocab_chunk) == (512, 262144)  # 512 MiB: whole rows from 512 of them
    assert 4 * gemma.token_chunk * gemma.vocab_chunk == 512 * 2**20


def test_vocab_outer_tiles_on_cpu():
    plan = plan_chunks(8192, 4096, 128256, x_dtype=jnp.bfloat16, w_dtype=jnp.bfloat16, keep_logits_budget_bytes=0)
    assert (plan.token_chunk, plan.vocab_chunk) == (128, 128256)  # the full-row statistics rule
    assert (plan.grad_token_chunk, plan.grad_chunk) == (1024, 512)
    narrow = plan_chunks(4096, 1024, 32768, x_dtype=jnp.bfloat16, w_dtype=jnp.bfloat16, order="vocab_outer")
    assert narrow.gradient_order == "vocab_outer" and (narrow.grad_token_chunk, narrow.grad_chunk) == (256, 2048)
    assert narrow.grad_token_chunk == MIN_GRAD_TOKEN_CHUNK  # 2 MiB / (4 x 2048) = 64 rows, raised


def test_fused_path_kept_for_a_bf16_w_within_the_budget():
    """4HV = 64 MiB: the fused path measured 0.68x the reference's CPU time, vocab outer 0.85x; and at
    Llama-3 8B (4HV = 1.96 GiB) the fused path on CPU is 128-row chunks of whole rows, 512-column dw updates."""
    plan = plan_chunks(4096, 512, 32768, x_dtype=jnp.bfloat16, w_dtype=jnp.bfloat16)
    assert plan.gradient_order == "tokens_outer" and plan.fused
    llama = plan_chunks(8192, 4096, 128256, x_dtype=jnp.bfloat16, w_dtype=jnp.bfloat16)
    assert llama.fused and (llama.token_chunk, llama.vocab_chunk, llama.grad_chunk) == (128, 128256, 512)


def test_explicit_sizes_set_both_tiles_vocab_outer():
    sizes = BlockSizes(b_block_size=24, v_block_size=700)
    plan = plan_chunks(100, 64, 3001, sizes, order="vocab_outer")
    assert (plan.token_chunk, plan.vocab_chunk, plan.grad_token_chunk, plan.grad_chunk) == (24, 700, 24, 700)
    assert plan.grad_token_chunks == 5 and plan.grad_chunks == 5


def test_forced_order_and_bad_orders():
    assert XlaBackend(gradient_order="vocab_outer").plan(10, 8, 50, StatsSpec()).gradient_order == "vocab_outer"
    huge = (8192, 16384, 262144, StatsSpec(), jnp.bfloat16, jnp.bfloat16)  # 4HV = 16 GiB: over any budget
    assert XlaBackend(gradient_order="tokens_outer").plan(*huge).gradient_order == "tokens_outer"
    with pytest.raises(ValueError, match="keep_logits_budget_bytes"):
        XlaBackend(keep_logits_budget_bytes=-1)
    with pytest.raises(ValueError, match="keep_logits_budget_bytes"):
        plan_chunks(10, 8, 50, keep_logits_budget_bytes=-1)
    with pytest.raises(ValueError, match="gradient_order"):
        XlaBackend(gradient_order="columns_first")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="gradient_order"):
        plan_chunks(10, 8, 50, order="columns_first")  # type: ignore[arg-type]


def test_the_old_module_names_still_work_with_a_deprecation_warning():
    import ce_xla.chunking
    import ce_xla.platforms
    import ce_xla.target
    import ce_xla.tiling

    with pytest.warns(DeprecationWarning, match=r"ce_xla.chunking is now ce_xla.tiling"):
        assert ce_xla.chunking.plan_chunks is ce_xla.tiling.plan_chunks
    with pytest.warns(DeprecationWarning, match=r"ce_xla.platforms is now ce_xla.target"):
        assert ce_xla.platforms.target_platform is ce_xla.target.target_platform


@pytest.mark.parametrize("keep_logits,order", [(True, "tokens_outer"), (False, "vocab_outer"), (None, None)])
def test_keep_logits_forces_the_order_per_call(keep_logits, order):
    """``StatsSpec.keep_logits``: True tokens outer, False vocab outer, None the budget rule."""
    spec = StatsSpec(keep_logits=keep_logits)
    for shape, rule in (((8192, 16384, 262144), "vocab_outer"), ((64, 16, 48), "tokens_outer"),
                        ((4096, 512, 32768), "tokens_outer")):
        assert XlaBackend().plan(*shape, spec, jnp.bfloat16, jnp.bfloat16).gradient_order == (order or rule), shape
    assert XlaBackend(keep_logits_budget_bytes=0).plan(4096, 512, 32768, spec, jnp.bfloat16,
                                                        jnp.bfloat16).gradient_order == (order or "vocab_outer")
    assert plan_chunks(10, 8, 50, keep_logits=keep_logits).gradient_order == (order or "tokens_outer")


def test_a_backend_order_and_a_contradicting_keep_logits_are_a_value_error():
    """The backend's ``gradient_order`` agrees with ``keep_logits`` or the call fails, naming both."""
    backend = XlaBackend(gradient_order="vocab_outer")
    assert backend.plan(10, 8, 50, StatsSpec(keep_logits=False)).gradient_order == "vocab_outer"
    with pytest.raises(ValueError, match=r"keep_logits=True .* gradient_order='vocab_outer'"):
        backend.plan(10, 8, 50, StatsSpec(keep_logits=True))
    with pytest.raises(ValueError, match=r"keep_logits=False .* gradient_order='tokens_outer'"):
        f32 = jnp.dtype(jnp.float32)
        XlaBackend(gradient_order="tokens_outer").check(Problem(10, 8, 50, f32, f32, StatsSpec(keep_logits=False)))
    with pytest.raises(ValueError, match="keep_logits=True"):
        plan_chunks(10, 8, 50, order="vocab_outer", keep_logits=True)
