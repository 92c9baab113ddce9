"""Each kernel alone, as a jit-able function of abstract operands (what the schedule compiles)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from ce_pallas_tpu.backward import backward_call
from ce_pallas_tpu.common import KernelConfig
from ce_pallas_tpu.forward import forward_call


def kernel_program(kernel: str, cfg: KernelConfig, x_dtype: str, w_dtype: str,
                   sharding: jax.sharding.Sharding) -> tuple[Callable[..., Any], tuple[jax.ShapeDtypeStruct, ...]]:
    """``(fn, operands)``: ``jax.jit(fn).lower(*operands)`` compiles just that kernel for ``cfg``."""

    def operand(shape: tuple[int, ...], dtype: Any) -> jax.ShapeDtypeStruct:
        return jax.ShapeDtypeStruct(shape, jnp.dtype(dtype), sharding=sharding)

    x = operand((cfg.n, cfg.hidden), x_dtype)
    w = operand((cfg.hidden, cfg.v), w_dtype)
    labels = operand((cfg.n, 1), jnp.int32)
    if kernel == "forward":
        return (lambda x_, w_, y_: forward_call(x_, w_, y_, cfg)), (x, w, labels)
    column = operand((cfg.n, 1), jnp.float32)
    columns = (column, column, column) + ((column,) if cfg.with_sum else ())

    def backward(x_, w_, y_, lse, g_lse, g_label, *g_sum):
        return backward_call(x_, w_, y_, lse, g_lse, g_label, g_sum[0] if g_sum else None, cfg)

    return backward, (x, w, labels, *columns)
