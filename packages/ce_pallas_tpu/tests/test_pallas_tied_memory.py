"""The memory bound of a tied ``[V, H]`` head (issue 23 item 1): compile only, for v5e, v5p and v6e.

A head stored ``[V, H]`` must cost what the same head stored ``[H, V]`` costs: the kernels contract
on H in place, so the compiled program's temporaries match within 5% (or 8 MiB, whichever is
larger) and no ``[V, H]``-sized array is transposed or copied. Checked on one device of each
generation's deviceless topology, at one of two real shapes each (both shapes used) in bf16, for
``value_and_grad`` of the statistics through the backend (forward and backward kernels). ``ce-bench tied``
measures the same through the public API, with the table also used as the input embedding.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import pytest

import ce_core
from ce_core import StatsSpec
from ce_core.extend import CompileResult, compile_program
from ce_pallas_tpu.tooling import aot

pytestmark = pytest.mark.slow

GENERATIONS = ("v5e", "v5p", "v6e")
#: Qwen-like (4k tokens) and Llama-3 (8k tokens), bf16.
SHAPES = [(4096, 1536, 151936), (8192, 4096, 128256)]
SHAPE_IDS = ["qwen-4k", "llama3-8k"]


def _w_shape(layout: str, h: int, v: int) -> tuple[int, int]:
    return (h, v) if layout == "hv" else (v, h)


def _compile(generation: str, build: Callable[[Callable[..., Any]], Any]) -> tuple[CompileResult, str]:
    """``(result, compiled HLO text)`` of ``build(struct)``, a lowered program for ``generation``."""

    def compile_fn() -> Any:
        with aot.compiling_for(generation) as device:
            sharding = jax.sharding.SingleDeviceSharding(device)

            def struct(shape, dtype):
                return jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)

            return build(struct).compile()

    compiled, result = compile_program(compile_fn)
    assert result.ok and result.temp_bytes is not None, result
    hlo = compiled.as_text()
    assert hlo is not None
    return result, hlo


def _value_and_grad(generation: str, layout: str, n: int, h: int, v: int) -> tuple[CompileResult, str]:
    """``value_and_grad`` w.r.t. ``x`` and ``w`` of a scalar of the statistics, through the backend."""
    spec = StatsSpec(w_layout=layout)
    backend = ce_core.get_backend("pallas_tpu")

    def objective(x, w, labels):
        stats = backend.row_stats(x, w, labels, spec)
        return jnp.sum(stats.lse - stats.label)

    def build(struct):
        return jax.jit(jax.value_and_grad(objective, argnums=(0, 1))).lower(
            struct((n, h), jnp.bfloat16), struct(_w_shape(layout, h, v), jnp.bfloat16), struct((n,), jnp.int32))

    return _compile(generation, build)


#: An HLO instruction that transposes or copies, with its result shape (the op names in metadata,
#: such as ``transpose(jvp(...))``, are not instructions).
_MOVING = re.compile(r"^\s*(?:ROOT\s+)?%?[\w.\-]+\s*=\s*(?P<shape>\([^=]*?\)|\S+)\s+(?:transpose|copy|copy-start)\(")


def head_copies(hlo: str, h: int, v: int) -> list[str]:
    """Instructions of the compiled HLO that transpose or copy a ``[V, H]``-sized array."""
    sized = re.compile(rf"\[({v},{h}|{h},{v})\]")
    return [line.strip()[:200] for line in hlo.splitlines()
            if (match := _MOVING.match(line)) and sized.search(match["shape"])]


def _assert_tied_head_costs_the_same(compile_layout: Callable[[str], tuple[CompileResult, str]],
                                     h: int, v: int) -> None:
    untied, untied_hlo = compile_layout("hv")
    tied, tied_hlo = compile_layout("vh")
    assert untied.temp_bytes is not None and tied.temp_bytes is not None
    slack = max(0.05 * untied.temp_bytes, 8 * 2**20)
    assert abs(tied.temp_bytes - untied.temp_bytes) <= slack, (tied.temp_bytes, untied.temp_bytes)
    assert head_copies(tied_hlo, h, v) == []
    assert head_copies(untied_hlo, h, v) == []


@pytest.mark.rotating(shares=3)  # one row in three a CI run, a new share each run (conftest.rotate)
@pytest.mark.parametrize("generation,shape", [("v5e", "llama3-8k"), ("v5p", "qwen-4k"), ("v6e", "qwen-4k")])
def test_value_and_grad_of_a_tied_head_needs_no_more_memory(generation, shape):
    """Forward and backward kernels together, the way a training step differentiates the head: each
    generation once, each shape at least once."""
    n, h, v = SHAPES[SHAPE_IDS.index(shape)]
    _assert_tied_head_costs_the_same(lambda layout: _value_and_grad(generation, layout, n, h, v), h, v)


def test_head_copies_finds_a_transposed_head():
    """The HLO check itself: a program that does transpose the head is caught."""
    h, v = 256, 1024
    hlo = jax.jit(lambda w: w.T * 2).lower(jax.ShapeDtypeStruct((v, h), jnp.float32)).compile().as_text()
    assert hlo is not None and head_copies(hlo, h, v)
