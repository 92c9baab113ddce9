"""Argument checks for :func:`ce_core.linear_cross_entropy`: clear errors that name the argument."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.core import Tracer

REDUCTIONS = ("mean", "sum", "none")


def as_array(value: object, name: str) -> jax.Array:
    """``jnp.asarray(value)``, with an error that names the argument when that fails."""
    if isinstance(value, jax.Array):
        return value
    try:
        return jnp.asarray(value)
    except (TypeError, ValueError) as error:
        raise ValueError(f"{name} must be an array, got {type(value).__name__}: {error}") from None


def as_labels(value: object) -> jax.Array:
    """``labels`` as an array; concrete values that the int32 JAX would convert them to cannot hold are an error.

    With 64-bit mode off (JAX's default), ``jnp.asarray`` wraps an int64 label such as ``2**32 + 3``
    to 3: a silently wrong token. Such values are refused here instead.
    """
    if not isinstance(value, jax.Array) and not jax.config.read("jax_enable_x64"):
        try:
            values = np.asarray(value)
        except (TypeError, ValueError):
            values = None
        if values is not None and values.dtype.kind in "iu" and values.size:
            info = np.iinfo(np.int32)
            outside = (values < info.min) | (values > info.max)
            if outside.any():
                position = np.unravel_index(int(np.argmax(outside)), values.shape)
                raise ValueError(
                    f"labels{list(map(int, position))} = {int(values[position])} does not fit in int32, which JAX "
                    "uses for labels while 64-bit mode is off; it would be wrapped silently"
                )
    return as_array(value, "labels")


W_LAYOUTS = ("hv", "vh")


def input_arrays(
    x: object, labels: object, w: object, weights: object | None = None, w_layout: str = "hv"
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array | None]:
    """The array arguments of every entry point as arrays, after :func:`check_arrays`."""
    x_array, label_array, w_array = as_array(x, "x"), as_labels(labels), as_array(w, "w")
    weight_array = None if weights is None else as_array(weights, "weights")
    check_arrays(x_array, label_array, w_array, weight_array, w_layout)
    return x_array, label_array, w_array, weight_array


def check_w_layout(w_layout: object, name: str = "w_layout") -> str:
    """``w_layout`` must be ``"hv"`` (``w`` is ``[H, V]``) or ``"vh"`` (``[V, H]``, a tied embedding table);
    ``name``: the argument's name in the error (``teacher_w_layout``, the teacher's head)."""
    if not isinstance(w_layout, str) or w_layout not in W_LAYOUTS:
        head = name.removesuffix("_layout")
        raise ValueError(f"{name} must be one of {W_LAYOUTS} ('hv': {head} is [H, V]; 'vh': {head} is [V, H]), "
                         f"got {w_layout!r}")
    return w_layout


def vocab_dim(w_layout: str) -> int:
    """The dimension of ``w`` that holds the vocabulary."""
    return 1 if w_layout == "hv" else 0


def check_arrays(x: jax.Array, labels: jax.Array, w: jax.Array, weights: jax.Array | None,
                 w_layout: str = "hv") -> None:
    """Ranks, matching shapes and dtypes of the array arguments."""
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise ValueError(f"x must be a floating array (bf16, f16 or f32), got dtype {x.dtype}")
    if not jnp.issubdtype(w.dtype, jnp.floating):
        raise ValueError(f"w must be a floating array (bf16, f16 or f32), got dtype {w.dtype}")
    if not jnp.issubdtype(labels.dtype, jnp.integer):
        raise ValueError(f"labels must be an integer array of class ids, got dtype {labels.dtype}")
    shape_name = "[H, V]" if w_layout == "hv" else "[V, H] (w_layout='vh')"
    if w.ndim != 2:
        raise ValueError(f"w must have shape {shape_name}, got shape {w.shape}")
    if x.ndim < 1:
        raise ValueError("x must have shape [..., H], got a scalar")
    hidden = w.shape[1 - vocab_dim(w_layout)]
    if x.shape[-1] != hidden:
        raise ValueError(
            f"hidden sizes differ: x has shape {x.shape} (H={x.shape[-1]}) but w has shape {w.shape} (H={hidden}"
            + (")" if w_layout == "hv" else ", w_layout='vh': w is [V, H])")
        )
    if labels.shape != x.shape[:-1]:
        raise ValueError(
            f"labels must have shape x.shape[:-1] = {x.shape[:-1]}, got labels of shape {labels.shape} "
            f"for x of shape {x.shape}"
        )
    if w.shape[vocab_dim(w_layout)] == 0:
        where = "column" if w_layout == "hv" else "row (w_layout='vh')"
        raise ValueError(f"w must have at least one vocab {where}, got shape {w.shape}")
    if weights is not None:
        if not jnp.issubdtype(weights.dtype, jnp.floating):
            raise ValueError(f"weights must be a floating array, got dtype {weights.dtype}")
        if weights.shape != labels.shape:
            raise ValueError(f"weights must have the shape of labels {labels.shape}, got {weights.shape}")


def check_options(
    reduction: str,
    ignore_index: int,
    logsumexp_weight: float,
    logit_soft_cap: float | None,
    label_smoothing: float,
) -> None:
    """The scalar options of the loss; each must be a concrete Python number."""
    if reduction not in REDUCTIONS:
        raise ValueError(f"reduction must be one of {REDUCTIONS}, got {reduction!r}")
    check_ignore_index(ignore_index)
    if check_number("logsumexp_weight", logsumexp_weight) < 0:
        raise ValueError(f"logsumexp_weight must be >= 0, got {logsumexp_weight}")
    if not 0 <= check_number("label_smoothing", label_smoothing) < 1:
        raise ValueError(f"label_smoothing must be in [0, 1), got {label_smoothing}")
    check_soft_cap(logit_soft_cap)


def check_keep_logits(keep_logits: object, reduction: str) -> None:
    """``keep_logits`` is ``None`` or a bool, and ``True`` only where the loss is a scalar."""
    if keep_logits is not None and not isinstance(keep_logits, bool):
        raise ValueError(f"keep_logits must be None, True or False, got {keep_logits!r}")
    if keep_logits and reduction == "none":
        raise ValueError('keep_logits=True needs reduction="mean" or "sum": per-token losses get their '
                         "cotangents only in the backward pass, where the logits are recomputed")


def check_ignore_index(ignore_index: object) -> None:
    if isinstance(ignore_index, bool) or not isinstance(ignore_index, (int, np.integer)):
        raise ValueError(f"ignore_index must be an int, got {ignore_index!r}")


def check_soft_cap(logit_soft_cap: object, name: str = "logit_soft_cap") -> None:
    """A soft cap is None or a finite Python number above 0 (``name``: the argument it came in)."""
    if logit_soft_cap is not None and check_number(name, logit_soft_cap) <= 0:
        raise ValueError(f"{name} must be None or > 0, got {logit_soft_cap}")


def check_temperature(temperature: object) -> None:
    """A static ``temperature`` must be a finite Python number above 0."""
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float, np.integer, np.floating)):
        raise ValueError(f"temperature must be a number > 0 or an array of them (broadcastable to labels), "
                         f"got {temperature!r}")
    if check_number("temperature", temperature) <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")


def is_static_number(value: object) -> bool:
    """Whether ``value`` is a Python (or NumPy scalar) number: a static temperature, as before arrays."""
    return isinstance(value, (int, float, np.integer, np.floating)) and not isinstance(value, bool)


def temperature_tokens(temperature: object, labels_shape: tuple[int, ...]) -> jax.Array:
    """A per-token temperature array as float32 in the labels' shape; concrete values checked by name.

    Concrete values must be finite and above 0 (a ``ValueError``); traced ones cannot be checked, and
    a bad one makes that token's loss NaN instead (:mod:`ce_core.api.prepare`).
    """
    if isinstance(temperature, bool) or isinstance(temperature, str):
        raise ValueError(f"temperature must be a number > 0 or an array of them, got {temperature!r}")
    values = as_array(temperature, "temperature")
    if not (jnp.issubdtype(values.dtype, jnp.floating) or jnp.issubdtype(values.dtype, jnp.integer)):
        raise ValueError(f"temperature must be a real number or array, got dtype {values.dtype}")
    try:
        shape = jnp.broadcast_shapes(values.shape, labels_shape)
    except ValueError:
        shape = None
    if shape != tuple(labels_shape):
        raise ValueError(f"temperature of shape {values.shape} does not broadcast to the labels' shape "
                         f"{tuple(labels_shape)} (give one per token, or per sequence as [B, 1])")
    if not isinstance(values, Tracer) and values.is_fully_addressable:
        host = np.asarray(values, np.float64)
        bad = ~(np.isfinite(host) & (host > 0))
        if bad.any():
            position = np.unravel_index(int(np.argmax(bad)), host.shape)
            raise ValueError(f"temperature must be finite and > 0 everywhere; temperature{list(map(int, position))} "
                             f"= {host[position]} ({int(bad.sum())} bad values in all)")
    return jnp.broadcast_to(values.astype(jnp.float32), labels_shape)


def check_vocab_axis_name(vocab_axis_name: object) -> None:
    if vocab_axis_name is not None and not isinstance(vocab_axis_name, str):
        raise ValueError(f"vocab_axis_name must be None or a mesh axis name (str), got {vocab_axis_name!r}")


#: ``precision`` spellings jax accepts, by the name ce_core passes to backends.
_PRECISIONS = {
    "default": "default", "bfloat16": "default", "fastest": "default",
    "high": "high", "tensorfloat32": "high", "bfloat16_3x": "high",
    "highest": "highest", "float32": "highest",
}


def check_precision(precision: object) -> str | None:
    """``None``, or the name (``"default"``, ``"high"``, ``"highest"``) of a jax matmul precision."""
    if precision is None:
        return None
    if isinstance(precision, jax.lax.Precision):
        return _PRECISIONS[precision.name.lower()]
    if isinstance(precision, str) and precision.lower() in _PRECISIONS:
        return _PRECISIONS[precision.lower()]
    raise ValueError(
        f"precision must be None, a jax.lax.Precision or one of {sorted(_PRECISIONS)}, got {precision!r}"
    )


def check_number(name: str, value: object) -> float:
    """``value`` as a float, when it is a finite Python (or NumPy) number; else a ValueError naming it."""
    if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise ValueError(f"{name} must be a Python number (static, not traced), got {value!r}")
    if not math.isfinite(value):
        raise ValueError(f"{name} must be finite, got {value}")
    return float(value)


def check_concrete_labels(labels: jax.Array, vocab_size: int, ignore_index: int) -> None:
    """When the labels are concrete, a label outside [0, V) other than ``ignore_index`` is an error.

    Traced labels cannot be inspected; there such a token's loss is NaN instead (see the loss).
    Labels spread over several processes (multi-host, after ``jax.distributed.initialize()``) are
    never fetched whole: each process checks the label shards it holds and names a bad label by its
    global position, so the process that holds a bad label raises.
    """
    if isinstance(labels, Tracer):
        return
    if not labels.is_fully_addressable:
        _check_held_labels(labels, vocab_size, ignore_index)
        return
    values = np.asarray(labels)
    bad = _bad(values, vocab_size, ignore_index)
    if bad.any():
        position = np.unravel_index(int(np.argmax(bad)), values.shape)
        raise ValueError(
            f"labels must be in [0, {vocab_size}) or equal ignore_index={ignore_index}; "
            f"labels{list(map(int, position))} = {int(values[position])} ({int(bad.sum())} bad labels in all)"
        )


def _bad(values: np.ndarray, vocab_size: int, ignore_index: int) -> np.ndarray:
    return (values != ignore_index) & ((values < 0) | (values >= vocab_size))


def _check_held_labels(labels: jax.Array, vocab_size: int, ignore_index: int) -> None:
    """:func:`check_concrete_labels` on the shards of ``labels`` this process holds (each once)."""
    first: tuple[int, tuple[int, ...], int] | None = None  # (global flat position, global position, value)
    count = 0
    seen: set[tuple[tuple[int, int], ...]] = set()
    for shard in labels.addressable_shards:
        values = np.asarray(shard.data)
        offsets = tuple(0 if index.start is None else int(index.start) for index in shard.index)
        key = tuple(zip(offsets, values.shape, strict=True))
        if key in seen:  # a replica of a shard already checked
            continue
        seen.add(key)
        bad = _bad(values, vocab_size, ignore_index)
        if not bad.any():
            continue
        count += int(bad.sum())
        local = np.unravel_index(int(np.argmax(bad)), values.shape)
        position = tuple(int(offset + i) for offset, i in zip(offsets, local, strict=True))
        flat = int(np.ravel_multi_index(position, labels.shape)) if labels.ndim else 0
        if first is None or flat < first[0]:
            first = (flat, position, int(values[local]))
    if first is not None:
        _, position, value = first
        raise ValueError(
            f"labels must be in [0, {vocab_size}) or equal ignore_index={ignore_index}; "
            f"labels{list(position)} = {value} ({count} bad labels in the shards process {jax.process_index()} "
            "holds; each process checks only its own)"
        )
