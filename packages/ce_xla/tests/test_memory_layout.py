"""A ``[V, H]`` head costs what an ``[H, V]`` one does (compile only, nothing is executed).

The xla backend reads vocab chunks of a ``[V, H]`` ``w`` as row slices and contracts on H inside
``dot_general``, so the compiled fwd+bwd program must need no more temporaries than the ``[H, V]``
one (within 5% or 8 MiB) and hold no copy or transpose of a ``[V, H]``-sized array (``w``, ``dw``
or ``w.T``). Both paths ce_core runs are compiled at the contract level: the fused
``row_stats_and_grads`` (a scalar loss) and ``jax.value_and_grad`` through ``row_stats`` and its
custom VJP (per-token outputs). Small on CPU in the fast tier; 4096 x 1536 x 151936 bf16 (Qwen-like)
on CPU and, ahead of time through libtpu, for TPU v5e and v5p in the slow tier. Also: the expected
logit (the entropy's statistic) adds no logits-sized tile to the forward pass.
"""

from __future__ import annotations

import contextlib
import math
import re
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ce_core import RowStats, StatsSpec
from ce_xla import XlaBackend

MiB = 2**20
FULL_SIZE = (4096, 1536, 151936)
TPU_TOPOLOGIES = {"v5e": "v5e:1x1", "v5p": "v5p:1x1x1"}
#: One HLO instruction: ``%name = dtype[dims]{layout} opcode(``.
_INSTRUCTION = re.compile(r"%\S+ = [a-z0-9]+\[(?P<dims>[\d,]*)\](?:\{[^}]*\})? (?P<op>[a-z\-]+)\(")


def compile_program(path: str, layout: str, n: int, h: int, v: int, dtype: Any = jnp.bfloat16,
                    generation: str | None = None) -> Any:
    """Compiled loss and ``(dx, dw)`` of the mean cross-entropy through ``path`` (``"fused"`` or
    ``"general"``), for a head in ``layout``; ``generation``: ahead of time for that TPU."""
    backend = XlaBackend()
    spec = StatsSpec(w_layout=layout)
    device = None
    if generation is not None:
        from jax.experimental import topologies

        device = topologies.get_topology_desc(topology_name=TPU_TOPOLOGIES[generation], platform="tpu").devices[0]
    context = contextlib.nullcontext() if device is None else jax.sharding.use_abstract_mesh(
        jax.sharding.Mesh(np.array([device]), ("aot",)).abstract_mesh)
    sharding = None if device is None else jax.sharding.SingleDeviceSharding(device)

    def fused(x, w, labels):
        coefficient = jnp.full((n,), 1.0 / n, jnp.float32)
        stats, dx, dw = backend.row_stats_and_grads(x, w, labels, spec, lambda _, c: RowStats(c, -c), coefficient)
        return jnp.mean(stats.lse - stats.label), (dx, dw)

    def general(x, w, labels):
        def loss(x_, w_):
            stats = backend.row_stats(x_, w_, labels, spec)
            return jnp.mean(stats.lse - stats.label)

        return jax.value_and_grad(loss, (0, 1))(x, w)

    w_shape = (h, v) if layout == "hv" else (v, h)
    shapes = (jax.ShapeDtypeStruct((n, h), dtype, sharding=sharding),
              jax.ShapeDtypeStruct(w_shape, dtype, sharding=sharding),
              jax.ShapeDtypeStruct((n,), jnp.int32, sharding=sharding))
    with context:
        return jax.jit({"fused": fused, "general": general}[path]).lower(*shapes).compile()


def head_sized_moves(hlo: str, h: int, v: int, layout: str) -> list[str]:
    """Instructions that copy or transpose an ``H x V``-element array, or (``"vh"``) make any ``[H, V]`` one."""
    found = []
    for line in hlo.splitlines():
        match = _INSTRUCTION.search(line)
        if match is None:
            continue
        dims = [int(d) for d in match["dims"].split(",") if d]
        moves = match["op"] in ("copy", "copy-start", "transpose") and math.prod(dims) >= h * v
        if moves or (layout == "vh" and dims == [h, v]):
            found.append(line.strip()[:200])
    return found


def temp_bytes(compiled: Any) -> int:
    memory = compiled.memory_analysis()
    assert memory is not None, "this platform reports no memory analysis"
    return memory.temp_size_in_bytes


def check_layouts(path: str, n: int, h: int, v: int, generation: str | None = None) -> None:
    temps = {}
    for layout in ("hv", "vh"):
        compiled = compile_program(path, layout, n, h, v, generation=generation)
        moves = head_sized_moves(compiled.as_text(), h, v, layout)
        assert not moves, f"{layout}: the head is copied or transposed:\n" + "\n".join(moves)
        temps[layout] = temp_bytes(compiled)
    assert temps["vh"] <= max(1.05 * temps["hv"], temps["hv"] + 8 * MiB), {k: t / MiB for k, t in temps.items()}


@pytest.mark.parametrize("path", ["fused", "general"])
def test_vh_head_needs_what_hv_needs_on_cpu_small(path):
    check_layouts(path, 512, 256, 3001)


def test_the_check_sees_a_transposed_head():
    """A program that does transpose ``w`` is caught (the check is not vacuous)."""
    h, v = 256, 3001
    copied = jax.jit(lambda w: jnp.transpose(w) + 1).lower(jax.ShapeDtypeStruct((v, h), jnp.bfloat16)).compile()
    assert head_sized_moves(copied.as_text() or "", h, v, "vh")


@pytest.mark.slow
@pytest.mark.parametrize("path", ["fused", "general"])
def test_vh_head_needs_what_hv_needs_on_cpu_full_size(path):
    check_layouts(path, *FULL_SIZE)


@pytest.mark.slow
@pytest.mark.parametrize("generation", sorted(TPU_TOPOLOGIES))
@pytest.mark.parametrize("path", ["fused", "general"])
def test_vh_head_needs_what_hv_needs_on_tpu_full_size(path, generation):
    check_layouts(path, *FULL_SIZE, generation=generation)


def test_the_expected_logit_adds_no_tile_to_the_forward():
    """``with_expected`` sums ``exp(z - max)`` and ``exp(z - max) z`` in one two-output reduction, so the
    exponentials of a full-row chunk are never written out (they were: 120.6 -> 60.9 MiB for the RL
    objective at 512 x 1536 x 151936 float32 on CPU)."""
    n, h, v = 256, 64, 32768  # one full-row chunk of 256 x 32768 float32 logits: 32 MiB
    backend = XlaBackend()
    shapes = (jax.ShapeDtypeStruct((n, h), jnp.float32), jax.ShapeDtypeStruct((h, v), jnp.float32),
              jax.ShapeDtypeStruct((n,), jnp.int32))
    temps = {}
    for with_expected in (False, True):
        spec = StatsSpec(with_expected=with_expected)
        compiled = jax.jit(lambda x, w, y, s=spec: backend.row_stats(x, w, y, s)).lower(*shapes).compile()
        temps[with_expected] = temp_bytes(compiled)
    assert temps[True] <= temps[False] + MiB, {k: t / MiB for k, t in temps.items()}
