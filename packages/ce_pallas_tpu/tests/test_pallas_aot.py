"""Ahead-of-time compilation for v4, v5e, v5p, v6e and TPU7x through libtpu's deviceless topologies.

Compile only, nothing runs: the real TPU compiler lowers both kernels (Mosaic, VMEM limits) inside
``value_and_grad`` of the loss, and ``memory_analysis()`` gives the HBM temporaries. libtpu comes with
the workspace's dev group; without it these tests fail (they never skip).
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import pytest

import ce_core
from ce_core.extend import CompileResult, compile_program, register_backend, unregister_backend
from ce_pallas_tpu import kept_logits, ops, target, tiling
from ce_pallas_tpu.tooling import aot

#: The slow tier: real TPU compiles for every generation (uv run pytest -m slow).
pytestmark = pytest.mark.slow

GENERATIONS = ("v4", "v5e", "v5p", "v6e", "tpu7x")
#: The real shapes of the issue: Llama-3 (8k tokens) and Qwen (32k tokens), bf16.
REAL_SHAPES = [(8192, 4096, 128256), (32768, 2048, 151936)]
#: The generations whose every tuned entry is compiled with the RL objective (log-probs and the entropy).
RL_GENERATIONS = ("v5e", "v5p", "v6e", "tpu7x")


def hbm_bound(n: int, h: int, v: int) -> int:
    """One float32 dw (4HV bytes) plus two float32 dx (8NH bytes): the recompute path's bound."""
    return 4 * h * v + 8 * n * h


def default_bound(generation: str, n: int, h: int, v: int) -> int:
    """The default path's bound: the recompute's plus the keep-logits budget of ``generation``, which a
    scalar loss's gradient may spend on kept logits (``ce_pallas_tpu.kept_logits``)."""
    return hbm_bound(n, h, v) + kept_logits.keep_logits_budget(target.Target(generation, 1, None))


def tile_report(n: int, h: int, v: int) -> ce_core.TileReport:
    """What the backend reports for a bf16 problem on the current target."""
    bf16 = jnp.dtype(jnp.bfloat16)
    problem = ce_core.Problem(n, h, v, bf16, bf16, ce_core.StatsSpec())
    report = ce_core.get_backend("pallas_tpu").block_sizes_for(problem)
    assert report is not None
    return report


def compile_value_and_grad(generation: str, fn: Callable[..., Any], x_shape: tuple[int, int],
                           w_shape: tuple[int, int], *, has_aux: bool = False) -> CompileResult:
    """Compile ``value_and_grad(fn(x, w, labels))`` w.r.t. ``x`` and ``w`` (bf16) for one chip of ``generation``."""

    def compile_fn():
        with aot.compiling_for(generation) as device:
            sharding = jax.sharding.SingleDeviceSharding(device)
            args = (jax.ShapeDtypeStruct(x_shape, jnp.bfloat16, sharding=sharding),
                    jax.ShapeDtypeStruct(w_shape, jnp.bfloat16, sharding=sharding),
                    jax.ShapeDtypeStruct(x_shape[:1], jnp.int32, sharding=sharding))
            return jax.jit(jax.value_and_grad(fn, argnums=(0, 1), has_aux=has_aux)).lower(*args).compile()

    return compile_program(compile_fn)[1]


def test_libtpu_is_installed():
    assert importlib.util.find_spec("libtpu") is not None, "libtpu is missing: run `uv sync` (dev group)"


# One worker for these and test_pallas_kept_logits's default-path compiles at Llama-3's head: the recompute programs
# they share are compiled once (the session's compile cache is per process).
@pytest.mark.xdist_group("llama3_8k_recompute")
@pytest.mark.parametrize("generation", GENERATIONS)
@pytest.mark.parametrize("n,h,v", REAL_SHAPES, ids=["llama3-8k", "qwen-32k"])
def test_real_shapes_compile_with_default_tiles_within_the_hbm_bound(generation, n, h, v):
    with aot.compiling_for(generation):
        plan = tile_report(n, h, v)
    assert plan.source.startswith(f"table:{generation}/")
    result = aot.compile_loss_and_grads(generation, n, h, v, keep_logits=False)  # the tuned recompute kernels
    assert result.ok and result.temp_bytes is not None
    assert result.temp_bytes <= hbm_bound(n, h, v), (result.temp_bytes, hbm_bound(n, h, v))
    # The dx partials are the only large temporaries: cores * 4NH, plus [N]-sized vectors.
    backward_grid = plan["backward"].grid
    assert backward_grid is not None
    assert result.temp_bytes <= backward_grid[0] * 4 * n * h + 64 * n * 128 * 4


# The llama3 and huge_batch entries are compiled at the real shapes above. On the generations the RL objective's
# test below covers, its compile of each entry is the loss's too: the same tiles (it asserts the entry's, not
# inferred ones) in the same kernels with more state (the entropy's expected logit, one more backward tile), so a
# tile that fits it fits the loss; the loss alone is compiled where the RL test does not go (v4). Until 2026-11-29
# both were compiled everywhere (12 compiles, ~220 s of the slow tier).
@pytest.mark.parametrize("generation", GENERATIONS)
@pytest.mark.parametrize("bucket", ["small", "large_vocab", "wide"])
def test_every_tuned_entry_compiles_on_its_generation(generation, bucket):
    n, h, v = tiling.BUCKET_EXAMPLES[bucket]
    with aot.compiling_for(generation):
        assert tile_report(n, h, v).source == f"table:{generation}/{bucket}"
    if generation in RL_GENERATIONS:
        return  # compiled by test_every_tuned_forward_serves_the_rl_objective
    result = aot.compile_loss_and_grads(generation, n, h, v, keep_logits=False)  # the tuned recompute kernels
    assert result.ok and result.temp_bytes is not None and result.temp_bytes <= hbm_bound(n, h, v)


@pytest.mark.rotating(shares=3)  # one row in three a CI run, a new share each run (conftest.rotate)
@pytest.mark.parametrize("generation,dtype", [(generation, (jnp.bfloat16, jnp.float32)[k % 2])
                                              for k, generation in enumerate(GENERATIONS)])
def test_ragged_shapes_and_every_option_compile(generation, dtype):
    """Odd N, V and H (the in-kernel masking paths) with cap, smoothing and z-loss; each generation in one
    dtype, the two dtypes taking turns; the default path (the kept logits where the plan keeps them)."""
    result = aot.compile_loss_and_grads(generation, 1000, 1000, 32001, dtype=dtype, logit_soft_cap=30.0,
                                        label_smoothing=0.1, logsumexp_weight=1e-4)
    assert result.ok and result.temp_bytes is not None
    assert result.temp_bytes <= default_bound(generation, 1000, 1000, 32001)


@pytest.mark.parametrize("generation", ["v4", "v5p"])
def test_tiny_shapes_compile(generation):
    """Blocks that are the whole (sub-tile) dimension, and one vocab block on a two-core chip."""
    assert aot.compile_loss_and_grads(generation, 37, 64, 5, label_smoothing=0.1).ok


def test_reference_does_not_fit_v5e_where_pallas_does():
    n, h, v = REAL_SHAPES[1]
    reference = aot.compile_loss_and_grads("v5e", n, h, v, implementation="reference", raise_errors=False)
    assert not reference.ok and "HBM" in (reference.error or "")
    assert aot.compile_loss_and_grads("v5e", n, h, v).ok


def test_loading_a_topology_prints_no_libtpu_complaints_on_a_machine_without_tpu():
    import os
    import subprocess
    import sys

    from ce_core.extend import host_has_tpu

    assert not host_has_tpu()  # this suite runs on machines without a TPU
    env = {k: v for k, v in os.environ.items() if not k.startswith("TPU_")}
    env.update(ALLOW_MULTIPLE_LIBTPU_LOAD="1", JAX_PLATFORMS="cpu")
    result = subprocess.run([sys.executable, "-c", "from ce_pallas_tpu.tooling.aot import topology_device; "
                             "print(topology_device('v5e').device_kind)"],
                            capture_output=True, text=True, env=env, timeout=300, check=True)
    assert "v5" in result.stdout.lower()
    assert "host bounds" not in result.stderr and "E0000" not in result.stderr, result.stderr


def test_v4_without_megacore_compiles_for_the_device_it_is_lowered_for(monkeypatch):
    """A v4 topology made without ``chip_config_name="megacore"`` has one core per device; the kernels'
    core axis must then run as a loop on that core (the target still says v4, two cores)."""
    import jax
    from jax.experimental import topologies

    import ce_core

    monkeypatch.setenv("CE_PALLAS_TPU_TARGET", "v4")
    device = topologies.get_topology_desc(topology_name="v4:1x1x1", platform="tpu").devices[0]
    assert device.num_cores == 1
    sharding = jax.sharding.SingleDeviceSharding(device)

    def loss(x, w, labels):
        return ce_core.linear_cross_entropy(x, labels, w, implementation="pallas_tpu")

    args = (jax.ShapeDtypeStruct((1024, 512), jnp.bfloat16, sharding=sharding),
            jax.ShapeDtypeStruct((512, 32000), jnp.bfloat16, sharding=sharding),
            jax.ShapeDtypeStruct((1024,), jnp.int32, sharding=sharding))
    jax.jit(jax.value_and_grad(loss, argnums=(0, 1))).lower(*args).compile()


def test_interpret_mode_is_refused_when_compiling_for_a_deviceless_tpu(monkeypatch):
    monkeypatch.setenv("CE_PALLAS_TPU_INTERPRET", "1")
    result = aot.compile_loss_and_grads("v5p", 256, 128, 1024, raise_errors=False)
    assert not result.ok and result.error is not None
    assert "CE_PALLAS_TPU_INTERPRET" in result.error and "not attached" in result.error


# v6e's case (the kept path's chunks, ~140 s of libtpu at slowdown 1) was dropped on 2026-12-02 when the slow tier
# outgrew CI's limit: v6e's kept default at Llama-3 8B is compiled by test_pallas_kept_logits, these features on the
# kept path run in the race-checked interpreter, and the entry's tiles for them are asserted on v6e below.
@pytest.mark.rotating(shares=3)  # one row in three a CI run, a new share each run (conftest.rotate)
@pytest.mark.parametrize("generation", ["v5e", "v5p", "tpu7x"])
def test_llama3_with_argmax_a_tied_head_and_row_scales_keeps_the_tuned_tiles(generation):
    """The v3 features add only per-row state: the tuned entry stays (no slower inferred tiles); with a
    soft cap and per-token temperatures (the row scale) on top, the call compiles within the bound."""
    n, h, v = REAL_SHAPES[0]
    bf16 = jnp.dtype(jnp.bfloat16)
    spec = ce_core.StatsSpec(w_layout="vh", with_argmax=True, with_row_scale=True)
    with aot.compiling_for(generation):
        report = ce_core.get_backend("pallas_tpu").block_sizes_for(ce_core.Problem(n, h, v, bf16, bf16, spec))
        assert report is not None and report.source == f"table:{generation}/llama3"
    temperature = jnp.linspace(0.5, 1.5, n, dtype=jnp.float32)

    def loss(x, w, labels):
        return ce_core.linear_cross_entropy(x, labels, w, implementation="pallas_tpu", w_layout="vh",
                                            logit_soft_cap=30.0, temperature=temperature, return_argmax=True)

    result = compile_value_and_grad(generation, loss, (n, h), (v, h), has_aux=True)
    assert result.ok and result.temp_bytes is not None and result.temp_bytes <= default_bound(generation, n, h, v)


def test_llama3_with_argmax_a_tied_head_and_row_scales_keeps_v6es_tuned_tiles():
    """v6e's half of the test above without its compile: the v3 features keep the tuned entry."""
    n, h, v = REAL_SHAPES[0]
    bf16 = jnp.dtype(jnp.bfloat16)
    spec = ce_core.StatsSpec(w_layout="vh", with_argmax=True, with_row_scale=True)
    with aot.compiling_for("v6e"):
        report = ce_core.get_backend("pallas_tpu").block_sizes_for(ce_core.Problem(n, h, v, bf16, bf16, spec))
    assert report is not None and report.source == "table:v6e/llama3"


@pytest.mark.rotating(shares=3)  # one row in three a CI run, a new share each run (conftest.rotate)
@pytest.mark.parametrize("generation", RL_GENERATIONS)
@pytest.mark.parametrize("bucket", list(tiling.BUCKET_EXAMPLES))
def test_every_tuned_forward_serves_the_rl_objective(generation, bucket):
    """The entropy's expected logit adds per-row state to the forward and one float32 tile to the
    backward: both kernels keep the entry's tiles (the RL objective used to fall to inferred tiles
    wherever the backward's extra tile crossed the VMEM budget by the model, and before that for both
    kernels), and log-probs with the entropy compile at the bucket's example within the bound: this
    compile is what lets the backward's judgment count the extra tile as the example's own."""
    n, h, v = tiling.BUCKET_EXAMPLES[bucket]
    bf16 = jnp.dtype(jnp.bfloat16)
    spec = ce_core.StatsSpec(with_expected=True)
    with aot.compiling_for(generation):
        report = ce_core.get_backend("pallas_tpu").block_sizes_for(ce_core.Problem(n, h, v, bf16, bf16, spec))
    assert report is not None and report.source.startswith(f"table:{generation}/{bucket}")
    assert "inferred" not in report.source

    def objective(x, w, labels):
        logp, entropy = ce_core.linear_log_probs(x, labels, w, return_entropy=True, implementation="pallas_tpu")
        return jnp.mean(logp) + 0.01 * jnp.mean(entropy)

    result = compile_value_and_grad(generation, objective, (n, h), (h, v))
    assert result.ok and result.temp_bytes is not None, result.error
    assert result.temp_bytes <= hbm_bound(n, h, v)


@pytest.mark.rotating(shares=3)  # one row in three a CI run, a new share each run (conftest.rotate)
@pytest.mark.parametrize("generation,n,h,v", [("v6e", 4096, 896, 151936), ("tpu7x", 4095, 1152, 262145),
                                              ("v6e", 2047, 640, 262144)])
def test_tied_heads_that_half_fill_a_256_wide_mxu_compile_with_dw_transposed(generation, n, h, v):
    """Qwen2.5-0.5B's, Gemma-3 1B's and 270M's tied heads (H 3.5, 4.5 and 2.5 of the MXU's width), some
    ragged: the backward accumulates their ``dw`` as ``[Hp, block_v]`` and transposes it on its way out
    (``BackwardConfig.dw_transposed``); log-probs with the entropy compile within the bound."""
    bf16 = jnp.dtype(jnp.bfloat16)
    spec = ce_core.StatsSpec(w_layout="vh", with_expected=True)
    with aot.compiling_for(generation):
        plan = ops.make_plan(n, h, v, bf16, bf16, spec)
    assert plan.backward.dw_transposed

    def objective(x, w, labels):
        logp, entropy = ce_core.linear_log_probs(x, labels, w, return_entropy=True, implementation="pallas_tpu",
                                                 w_layout="vh")
        return jnp.mean(logp) + 0.01 * jnp.mean(entropy)

    result = compile_value_and_grad(generation, objective, (n, h), (v, h))
    assert result.ok and result.temp_bytes is not None, result.error
    assert result.temp_bytes <= hbm_bound(n, h, v)


# v5p, whose two cores' dx partials and buffer assignment gave the walk its one regression; v6e's kept path with the
# walk is bounded by test_pallas_kept_logits's default-path compile (its labels make ce_core hand the live tokens).
# v6e's case here (156 s) was dropped on 2026-11-29, when the slow tier reached its budget.
@pytest.mark.rotating(shares=2)  # one of the two a CI run, the other the next (conftest.rotate)
@pytest.mark.parametrize(("generation", "keep"), [("v5p", False), ("v5p", True)])
def test_walking_the_live_blocks_costs_no_temporaries_beyond_token_sized_vectors(generation, keep):
    """Both gradient paths' kernels handed the live tokens (contract version 4) against the same backend told
    none (version 3, every block): the block ids, counts and masks are ``[N]``-sized, and nothing ``[N, H]``
    is added (the dead ``dx`` rows are masked inside the one reduction over v5p's two cores' partials). The
    kept path's four chunks carry one logits buffer (the forward writes into it): before, v5p's buffer
    assignment put a second chunk's logits above the float32 ``dw`` here, 50 MB more with the walk."""
    from ce_pallas_tpu.backend import PallasTpuBackend

    class EveryBlock(PallasTpuBackend):
        contract_version = 3

    register_backend("pallas_tpu_every_block", EveryBlock, replace=True)
    try:
        n, h, v = 2048, 4096, 32000
        walking, every = (aot.compile_loss_and_grads(generation, n, h, v, implementation=name, keep_logits=keep)
                          for name in ("pallas_tpu", "pallas_tpu_every_block"))
    finally:
        unregister_backend("pallas_tpu_every_block")
    assert walking.ok and every.ok and walking.temp_bytes is not None and every.temp_bytes is not None
    # [N]-sized: 64 bytes a token, and one [rows, 1] float32 column, which TPU's (8, 128) tiles store 128
    # lanes wide (512 bytes a row; v6e's kept path held one more [chunk, 1] column). A [chunk, H] float32
    # dx partial would be 8 MB.
    assert walking.temp_bytes <= every.temp_bytes + (64 + 512) * n, (walking.temp_bytes, every.temp_bytes)
