"""Data- and vocab-parallel loss over a mesh the caller names, whatever the inputs' layout.

:func:`ce_core.linear_cross_entropy` already follows the shardings its inputs carry. This wrapper is
for the other case: the caller says how to split (``batch_axes``, ``vocab_axis``) and the inputs
are laid out that way first (resharded: a slice, or a gather where they were split differently),
then run under ``jax.shard_map`` like an explicitly sharded call (:mod:`ce_core.sharded.placement`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal, Unpack, overload

import jax
from jax.sharding import AbstractMesh, AxisType, Mesh
from jax.typing import ArrayLike

from ce_core.api import validation
from ce_core.api.loss import loss_with_placement, packed
from ce_core.api.options import Options, ShardedLossOptions
from ce_core.sharded.placement import Placement, axes_of, typed_mesh, without_trivial_axes


@overload
def sharded_linear_cross_entropy(x: ArrayLike, labels: ArrayLike, w: ArrayLike, *, mesh: Mesh | AbstractMesh,
                                 batch_axes: str | Sequence[str] = ..., vocab_axis: str | None = ...,
                                 return_lse: Literal[False] = ..., return_argmax: Literal[False] = ...,
                                 **options: Unpack[ShardedLossOptions]) -> jax.Array: ...


@overload
def sharded_linear_cross_entropy(x: ArrayLike, labels: ArrayLike, w: ArrayLike, *, mesh: Mesh | AbstractMesh,
                                 batch_axes: str | Sequence[str] = ..., vocab_axis: str | None = ...,
                                 return_lse: Literal[True], return_argmax: Literal[False] = ...,
                                 **options: Unpack[ShardedLossOptions]) -> tuple[jax.Array, jax.Array]: ...


@overload
def sharded_linear_cross_entropy(x: ArrayLike, labels: ArrayLike, w: ArrayLike, *, mesh: Mesh | AbstractMesh,
                                 batch_axes: str | Sequence[str] = ..., vocab_axis: str | None = ...,
                                 return_lse: Literal[False] = ..., return_argmax: Literal[True],
                                 **options: Unpack[ShardedLossOptions]) -> tuple[jax.Array, jax.Array]: ...


@overload
def sharded_linear_cross_entropy(x: ArrayLike, labels: ArrayLike, w: ArrayLike, *, mesh: Mesh | AbstractMesh,
                                 batch_axes: str | Sequence[str] = ..., vocab_axis: str | None = ...,
                                 return_lse: Literal[True], return_argmax: Literal[True],
                                 **options: Unpack[ShardedLossOptions]) -> tuple[jax.Array, jax.Array, jax.Array]: ...


@overload
def sharded_linear_cross_entropy(x: ArrayLike, labels: ArrayLike, w: ArrayLike, *, mesh: Mesh | AbstractMesh,
                                 batch_axes: str | Sequence[str] = ..., vocab_axis: str | None = ...,
                                 return_lse: bool = ..., return_argmax: bool = ...,
                                 **options: Unpack[ShardedLossOptions]) -> jax.Array | tuple[jax.Array, ...]: ...


def sharded_linear_cross_entropy(x: ArrayLike, labels: ArrayLike, w: ArrayLike, *, mesh: Mesh | AbstractMesh,
                                 batch_axes: str | Sequence[str] = ("data",), vocab_axis: str | None = None,
                                 return_lse: bool = False, return_argmax: bool = False,
                                 **options: Unpack[ShardedLossOptions]) -> jax.Array | tuple[jax.Array, ...]:
    """:func:`ce_core.linear_cross_entropy` with tokens split over ``batch_axes`` and ``w`` over ``vocab_axis``.

    The value and gradients equal the unsharded call. The flattened token dimension is split over
    the product of ``batch_axes`` (padded with ignored tokens when it does not divide evenly);
    ``w`` is split over ``vocab_axis`` on its vocab dimension (V: its columns, or its rows with
    ``w_layout="vh"``), which the axis must divide. ``"mean"`` is the global weighted
    sum over the global weight sum (0 when that is 0). ``mesh`` may have any axis types, and the
    inputs any sharding: they are resharded to this layout. ``dx`` comes back split over the tokens
    and ``dw`` over ``vocab_axis``. ``return_lse`` and ``return_argmax`` are as for
    :func:`ce_core.linear_cross_entropy` (the argmax is exact across vocab shards: the lowest global
    index of the maximum). The other keyword options are the loss's
    (:class:`ce_core.ShardedLossOptions`: those of :func:`ce_core.linear_cross_entropy` but its
    layout options, ``vocab_axis_name`` and ``in_specs``, which this function's arguments replace).
    Works on one host or many (after ``jax.distributed.initialize()``), with any backend.
    """
    batch_axes = (batch_axes,) if isinstance(batch_axes, str) else tuple(batch_axes)
    _check_mesh(mesh, batch_axes, vocab_axis)
    settings, weights, temperature = Options.of("sharded_linear_cross_entropy", ShardedLossOptions, options)
    x, labels, w, weights = validation.input_arrays(x, labels, w, weights, settings.w_layout)
    temperature_tokens = None if temperature is None else validation.temperature_tokens(temperature, labels.shape)
    vocab = w.shape[validation.vocab_dim(settings.w_layout)]
    if vocab_axis is not None and vocab % mesh.shape[vocab_axis]:
        raise ValueError(
            f"vocab size V={vocab} (w of shape {w.shape}, w_layout={settings.w_layout!r}) is not divisible by the "
            f"{mesh.shape[vocab_axis]} shards of vocab_axis={vocab_axis!r}; pad w's vocab to a multiple of it"
        )

    run_mesh = _mesh_for(mesh, x, w)
    token_entry = without_trivial_axes(batch_axes, run_mesh)
    vocab_axes = axes_of(without_trivial_axes(vocab_axis, run_mesh))
    placement = Placement("shard_map", mesh=run_mesh, token_spec=(token_entry,), vocab_axes=vocab_axes,
                          flat_tokens=True, w_layout=settings.w_layout)
    return packed(loss_with_placement(x, labels, w, placement, weights=weights, options=settings,
                                      return_lse=bool(return_lse), temperature_tokens=temperature_tokens,
                                      return_argmax=bool(return_argmax)))


def _mesh_for(mesh: Mesh | AbstractMesh, *values: jax.Array) -> Mesh | AbstractMesh:
    """``mesh`` as the inputs can meet it: Explicit when their types carry explicit shardings, else Auto.

    Inputs typed on an explicit mesh must be resharded on it; plain inputs (uncommitted, or placed
    without explicit types) are laid out with sharding constraints, which need Auto axes.
    """
    typed = typed_mesh(*values)
    if typed is not None and typed.explicit_axes:
        return mesh
    auto = {name: AxisType.Auto for name in mesh.axis_names}
    if isinstance(mesh, AbstractMesh):
        return mesh.update_axis_types(auto)
    return Mesh(mesh.devices, mesh.axis_names, axis_types=tuple(auto.values()))


def _check_mesh(mesh: Mesh | AbstractMesh, batch_axes: tuple[str, ...], vocab_axis: str | None) -> None:
    if not isinstance(mesh, (Mesh, AbstractMesh)):
        raise ValueError(f"mesh must be a jax.sharding.Mesh, got {type(mesh).__name__}")
    names = tuple(mesh.axis_names)
    for axis in batch_axes:
        if axis not in names:
            raise ValueError(f"batch axis {axis!r} is not an axis of the mesh; mesh axes: {names}")
    if vocab_axis is not None:
        if vocab_axis not in names:
            raise ValueError(f"vocab_axis {vocab_axis!r} is not an axis of the mesh; mesh axes: {names}")
        if vocab_axis in batch_axes:
            raise ValueError(f"vocab_axis {vocab_axis!r} is also one of batch_axes {batch_axes}")
    if len(set(batch_axes)) != len(batch_axes):
        raise ValueError(f"batch_axes has a repeated axis: {batch_axes}")
