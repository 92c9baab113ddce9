"""The chunk plan the xla backend reports is the one it uses, for the dtypes and platform compiled for."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import ce_core
from ce_xla import XlaBackend

F32 = jnp.dtype(jnp.float32)


def xla_backend() -> XlaBackend:
    """The backend the registry gives for "xla" (the one calls use)."""
    backend = ce_core.get_backend("xla")
    assert isinstance(backend, XlaBackend)
    return backend


def test_block_sizes_for_reports_the_chunk_plan():
    backend = xla_backend()
    spec = ce_core.StatsSpec(block_sizes=ce_core.BlockSizes(b_block_size=64, v_block_size=256))
    report = backend.block_sizes_for(ce_core.Problem(1000, 32, 3001, F32, F32, spec))
    plan = backend.plan(1000, 32, 3001, spec)
    assert (plan.token_chunk, plan.vocab_chunk) == (64, 256)
    assert report["statistics"].block_sizes == ce_core.BlockSizes(64, None, 256)
    assert report["statistics"].grid == (16, 12)  # ceil(1000 / 64), ceil(3001 / 256)
    assert report["gradients"].block_sizes == ce_core.BlockSizes(plan.grad_token_chunk, None, plan.grad_chunk)
    assert report.details["gradient_order"] == plan.gradient_order
    assert report.source.startswith("explicit")


@pytest.mark.parametrize("dtype,shape,order", [
    (jnp.float32, (8192, 8192, 262144), "tokens_outer"),  # the dw accumulator is the float32 gradient
    (jnp.bfloat16, (8192, 8192, 262144), "vocab_outer"),  # 4HV - 4NH = 7.75 GiB: over the 4 GiB cap
    (jnp.bfloat16, (4096, 512, 32768), "tokens_outer"),  # 4HV - 4NH = 56 MiB
])
def test_block_sizes_for_reports_the_gradient_order_of_the_dtypes(dtype, shape, order):
    backend = xla_backend()
    n, h, v = shape
    problem = ce_core.Problem(n, h, v, jnp.dtype(dtype), jnp.dtype(dtype), ce_core.StatsSpec())
    assert backend.block_sizes_for(problem).details["gradient_order"] == order


def test_block_sizes_for_plans_for_the_tpu_being_compiled_for():
    """Under a deviceless TPU topology's mesh (ahead-of-time compiles) the plan is the TPU one."""
    from jax.experimental import topologies

    device = topologies.get_topology_desc(topology_name="v5e:1x1", platform="tpu").devices[0]
    problem = ce_core.Problem(8192, 4096, 128256, jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.bfloat16), ce_core.StatsSpec())
    backend = XlaBackend(keep_logits_budget_bytes=0)  # vocab outer on both
    on_cpu = backend.block_sizes_for(problem)
    mesh = jax.sharding.Mesh(np.array([device]), ("aot",)).abstract_mesh
    with jax.sharding.use_abstract_mesh(mesh):
        on_tpu = backend.block_sizes_for(problem)
    assert on_cpu.source == "rule for cpu" and on_tpu.source == "rule for tpu"
    assert (on_cpu["statistics"].block_sizes.b_block_size, on_cpu["gradients"].block_sizes.v_block_size) == (128, 512)
    assert (on_tpu["statistics"].block_sizes.b_block_size, on_tpu["gradients"].block_sizes.v_block_size) == (1024, 2048)
    # The default budget: a deviceless TPU reports no memory, so 16 GiB is assumed (2 GiB budget), which the
    # 1.83 GiB float32 dw (beyond vocab outer's dx) fits: tokens outer, 64 MiB dw updates on TPU.
    with jax.sharding.use_abstract_mesh(mesh):
        default_tpu = xla_backend().block_sizes_for(problem)
    assert default_tpu.details["gradient_order"] == "tokens_outer"
    assert (default_tpu["statistics"].block_sizes.b_block_size,
            default_tpu["gradients"].block_sizes.v_block_size) == (128, 4096)
