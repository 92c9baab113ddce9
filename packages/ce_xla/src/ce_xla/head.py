"""The head ``w`` in either layout: vocab slices and the three products, contracting on H directly.

``"hv"``: ``w`` is ``[H, V]``, vocab entry ``j`` is column ``j``; ``"vh"``: ``w`` is ``[V, H]``, it is
row ``j`` (a head tied to the input embedding). Every pass reads a vocab chunk as a slice along the
vocab axis and hands it to ``lax.dot_general`` with the dimension numbers of its layout, so ``w`` is
never transposed or copied whole; ``dw`` tiles come out in ``w``'s layout.
"""

from __future__ import annotations

import contextlib

import jax
import jax.numpy as jnp

#: ``dot_general`` dimension numbers, by layout: logits ``x [rows, H] . w_tile -> [rows, c]``;
#: ``dx`` ``delta [rows, c] . w_tile -> [rows, H]``; ``dw`` tile from ``x`` and ``delta`` in w's layout.
_LOGITS = {"hv": (((1,), (0,)), ((), ())), "vh": (((1,), (1,)), ((), ()))}
_DX = {"hv": (((1,), (1,)), ((), ())), "vh": (((1,), (0,)), ((), ()))}
_CONTRACT_ROWS = (((0,), (0,)), ((), ()))  # x.T @ delta -> [H, c] ("hv"), delta.T @ x -> [c, H] ("vh")


def vocab_axis(layout: str) -> int:
    """The axis of ``w`` that indexes the vocabulary."""
    return 0 if layout == "vh" else 1


def dims(w: jax.Array, layout: str) -> tuple[int, int]:
    """``(H, V)`` of a head ``w`` in ``layout``."""
    return (w.shape[1], w.shape[0]) if layout == "vh" else (w.shape[0], w.shape[1])


def vocab_slice(w: jax.Array, start: jax.Array | int, width: int, layout: str) -> jax.Array:
    """Vocab entries ``[start, start + width)`` of ``w`` (``w`` itself when that is all of them)."""
    if width == w.shape[vocab_axis(layout)]:
        return w
    return jax.lax.dynamic_slice_in_dim(w, start, width, axis=vocab_axis(layout))


def update_slice(w: jax.Array, tile: jax.Array, start: jax.Array | int, layout: str) -> jax.Array:
    """``w`` with vocab entries ``[start, start + tile's width)`` replaced by ``tile``."""
    return jax.lax.dynamic_update_slice_in_dim(w, tile, start, axis=vocab_axis(layout))


def precision_scope(precision: str | None) -> contextlib.AbstractContextManager[object]:
    """The products traced inside run at ``precision`` (``StatsSpec.precision``; ``None``: JAX's default).

    Every product here leaves ``precision`` to the enclosing ``jax.default_matmul_precision``, so each
    entry point of the backend (and the custom VJP's backward, traced later) opens this scope.
    """
    return jax.default_matmul_precision(precision) if precision is not None else contextlib.nullcontext()


def logits_product(x_chunk: jax.Array, w_tile: jax.Array, layout: str) -> jax.Array:
    """``x_chunk @ w_tile`` as float32 ``[rows, c]`` (operands as given)."""
    return jax.lax.dot_general(x_chunk, w_tile, _LOGITS[layout], preferred_element_type=jnp.float32)


def dx_product(delta: jax.Array, w_tile: jax.Array, layout: str) -> jax.Array:
    """``delta @ w_tile.T`` (``"hv"``) or ``delta @ w_tile`` (``"vh"``): float32 ``[rows, H]``."""
    return jax.lax.dot_general(delta, w_tile, _DX[layout], preferred_element_type=jnp.float32)


def dw_product(x_chunk: jax.Array, delta: jax.Array, layout: str) -> jax.Array:
    """A float32 ``dw`` tile in ``w``'s layout: ``x.T @ delta`` ``[H, c]`` or ``delta.T @ x`` ``[c, H]``."""
    if layout == "vh":
        return jax.lax.dot_general(delta, x_chunk, _CONTRACT_ROWS, preferred_element_type=jnp.float32)
    return jax.lax.dot_general(x_chunk, delta, _CONTRACT_ROWS, preferred_element_type=jnp.float32)


def zeros_tile(h: int, width: int, layout: str) -> jax.Array:
    """A float32 ``dw`` tile of ``width`` vocab entries in ``layout``, zeros."""
    return jnp.zeros((width, h) if layout == "vh" else (h, width), jnp.float32)


def column_mask_for(cols_owned: jax.Array, layout: str) -> jax.Array:
    """A ``[1, c]`` column mask of a logits tile, shaped to select vocab entries of a ``dw`` tile."""
    return cols_owned.reshape(-1, 1) if layout == "vh" else cols_owned
