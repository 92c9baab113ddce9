"""How a call is spread over devices: found from the caller's context and types, never guessed.

JAX code shards in three ways, and the loss follows each (see DESIGN.md, "Inside the caller's
sharded step"):

- **Explicit axes** (``jax.make_mesh``'s default, with ``jax.set_mesh`` or inputs placed on such a
  mesh): every array's type carries its sharding, so the placement is read from the types of ``x``
  and ``w`` at trace time and run with ``jax.shard_map`` (placement ``"shard_map"``).
- **Auto axes** (GSPMD/Shardy: ``NamedSharding`` inputs, ``jax.set_mesh`` of an Auto mesh): the
  shardings are only chosen by the compiler, so the call runs with ``jax.shard_map`` over a layout
  fixed at trace time: the one the caller states (``in_specs``), else the default of
  :func:`default_placement` (every token split over every mesh axis, ``w`` whole). The compiler
  reshards the inputs to it. (``jax.experimental.custom_partitioning``, which would see the
  compiler's shardings, does not compile on TPU: jax-ml/jax#38196; see docs/sharding.md.)
- **Inside the caller's ``shard_map``**, or with no mesh at all: the call is one shard, or the whole
  problem (placement ``"local"``), with ``vocab_axis_name`` naming a vocab axis of the caller's.

In the first two, tokens stay split over the mesh axes that split ``x``'s leading dimensions; ``w``
stays split on V over the axes that split its columns and not the tokens (vocab parallelism), and is
gathered over every other axis it is split on (FSDP: once per call, as for any layer).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
from jax.sharding import AbstractMesh, AxisType, Mesh, NamedSharding, PartitionSpec

#: One entry of a PartitionSpec: no axis, one axis name, or a tuple of names (major to minor).
SpecEntry = str | tuple[str, ...] | None
AnyMesh = Mesh | AbstractMesh
#: ``(x_spec, w_spec)``: how the caller's ``x`` and ``w`` are split over the mesh (the ``in_specs`` option).
InSpecs = tuple[PartitionSpec, PartitionSpec]


@dataclasses.dataclass(frozen=True)
class ShardAxes:
    """The mesh axes one shard's computation is split over.

    ``typed``: values carry their varying axes (inside ``shard_map``), so a gradient is summed over
    the axes it varies over and its primal does not. Otherwise (one device, or the caller's
    ``vocab_axis_name`` outside a typed ``shard_map``) ``dw`` is summed over ``tokens`` and ``dx`` over
    ``vocab``.
    """

    tokens: tuple[str, ...] = ()
    vocab: tuple[str, ...] = ()
    typed: bool = False


@dataclasses.dataclass(frozen=True)
class Placement:
    """Where a call runs (hashable: part of the cache key of the ops built for it).

    ``token_spec`` holds one entry per leading dimension of ``x`` (``"shard_map"`` only), and
    ``vocab_axes`` the axes splitting V (``"shard_map"``, or the caller's ``vocab_axis_name``
    under ``"local"``). ``typed``: a ``"local"`` call inside the caller's ``shard_map``.
    ``flat_tokens``: the tokens are flattened to one dimension and padded with ignored tokens to a
    multiple of the token shards before the call (:class:`ce_core.sharded.flat_tokens.FlatTokens`), and
    ``token_spec`` has one entry for that dimension. ``stated``: the caller's ``in_specs``; inputs
    are constrained to them first, so the gradients come back laid out as the caller's arrays are.
    ``w_layout``: ``"hv"`` (``w`` is ``[H, V]``) or ``"vh"`` (``[V, H]``): which dimension of ``w`` the
    vocab axes split.
    """

    kind: str = "local"
    mesh: AnyMesh | None = None
    token_spec: tuple[SpecEntry, ...] = ()
    vocab_axes: tuple[str, ...] = ()
    typed: bool = False
    flat_tokens: bool = False
    stated: InSpecs | None = None
    w_layout: str = "hv"

    @property
    def token_axes(self) -> tuple[str, ...]:
        return tuple(axis for entry in self.token_spec for axis in axes_of(entry))

    @property
    def shard_axes(self) -> ShardAxes:
        """The axes of one shard's computation under ``"local"`` and ``"shard_map"``."""
        return ShardAxes(self.token_axes, self.vocab_axes, typed=self.typed or self.kind == "shard_map")

    def token_shards(self) -> int:
        """How many ways the tokens are split (1 unless ``"shard_map"``)."""
        return _axes_size(self.mesh, self.token_axes) if self.mesh is not None else 1

    def vocab_shards(self) -> int:
        """How many ways V is split under ``"shard_map"`` (1 otherwise; the caller's axis for ``"local"``)."""
        return _axes_size(self.mesh, self.vocab_axes) if self.kind == "shard_map" and self.mesh is not None else 1

    def lay_out(self, value: jax.Array, kind: str) -> jax.Array:
        """``value`` (an array of ``kind``) laid out as this placement runs it: resharded for ``"shard_map"``."""
        if self.kind != "shard_map":
            return value
        if self.mesh is None:
            raise ValueError("a shard_map placement needs a mesh")
        if self.stated is not None:
            x_spec, w_spec = self.stated
            callers = {"x": x_spec, "w": w_spec, "tokens": PartitionSpec(*spec_entries(x_spec, value.ndim + 1)[:-1])}
            value = place(value, self.mesh, callers[kind])
        return place(value, self.mesh, self.spec(kind))

    def spec(self, kind: str) -> PartitionSpec:
        """The ``shard_map`` spec of an array of ``kind`` (``"x"``, ``"w"`` or ``"tokens"``)."""
        vocab: SpecEntry = _entry(self.vocab_axes)
        w_spec = PartitionSpec(None, vocab) if self.w_layout == "hv" else PartitionSpec(vocab, None)
        return {"x": PartitionSpec(*self.token_spec, None), "w": w_spec,
                "tokens": PartitionSpec(*self.token_spec)}[kind]


LOCAL = Placement()


def axes_of(entry: SpecEntry) -> tuple[str, ...]:
    """The axis names of one spec entry, major to minor."""
    if entry is None:
        return ()
    return (entry,) if isinstance(entry, str) else tuple(entry)


def _entry(axes: tuple[str, ...]) -> SpecEntry:
    return None if not axes else axes[0] if len(axes) == 1 else axes


def _axes_size(mesh: AnyMesh | None, axes: tuple[str, ...]) -> int:
    return math.prod(mesh.shape[a] for a in axes) if mesh is not None else 1


def spec_entries(spec: PartitionSpec, ndim: int) -> tuple[SpecEntry, ...]:
    """``spec`` as exactly ``ndim`` entries (a spec may omit trailing ``None``s)."""
    entries = tuple(spec) + (None,) * (ndim - len(spec))
    return tuple(_entry(axes_of(e)) for e in entries)  # normalise ("a",) to "a"


def typed_mesh(*values: Any) -> AnyMesh | None:
    """The context mesh, else the mesh recorded in the first input type that has one.

    A concrete input (an eager call) gives its concrete ``Mesh``: an eager call lays out the other
    arguments (host arrays, single-device arrays) on real devices, which an abstract mesh cannot.
    """
    context = jax.sharding.get_abstract_mesh()
    if not context.empty:
        return context
    for value in values:
        if value is None:
            continue
        sharding = getattr(jax.typeof(value), "sharding", None)
        mesh = getattr(sharding, "mesh", None)
        if isinstance(mesh, AbstractMesh) and not mesh.empty:
            return mesh
        if isinstance(mesh, Mesh) and not mesh.empty:
            return mesh
    return None


def find_placement(x: jax.Array, labels: jax.Array, w: jax.Array, vocab_axis_name: str | None,
                   in_specs: InSpecs | None = None, w_layout: str = "hv") -> Placement:
    """The placement of a ``linear_cross_entropy`` call, from the context, the input types and ``in_specs``.

    ``w_layout`` says which dimension of ``w`` is its vocabulary (the one vocab axes split).

    Raises:
      ValueError: ``in_specs`` that are malformed, name axes the mesh lacks, split a dimension
        unevenly, or are given where they mean nothing (no mesh, or inside the caller's ``shard_map``).
    """
    context = jax.sharding.get_abstract_mesh()
    inside_shard_map = not context.empty and bool(context.manual_axes)
    if vocab_axis_name is not None or inside_shard_map:
        if in_specs is not None:
            raise ValueError(
                "in_specs describe how x and w are split over a mesh; inside your own shard_map (or with "
                "vocab_axis_name) the call is one shard's, so pass in_specs=None there"
            )
        vocab = (vocab_axis_name,) if vocab_axis_name is not None else ()
        return Placement("local", vocab_axes=vocab, typed=inside_shard_map, w_layout=w_layout)
    mesh = typed_mesh(x, w, labels)
    if in_specs is not None:
        if mesh is None:
            raise ValueError(
                f"in_specs={in_specs!r} name mesh axes, but no mesh is visible to this call: enter one with "
                "jax.set_mesh(mesh), or place the inputs with jax.device_put(..., NamedSharding(mesh, spec))"
            )
        x_spec, w_spec = check_in_specs(in_specs, mesh, x, w, w_layout)
        return dataclasses.replace(placement_from_specs(mesh, x_spec, w_spec, x.ndim, w_layout),
                                   stated=(x_spec, w_spec))
    if mesh is None:
        return dataclasses.replace(LOCAL, w_layout=w_layout)
    if mesh.explicit_axes:  # even of size 1: explicit types reject ops that split along their axes
        return placement_from_specs(mesh, jax.typeof(x).sharding.spec, jax.typeof(w).sharding.spec, x.ndim,
                                    w_layout)
    if mesh.size == 1:
        return dataclasses.replace(LOCAL, w_layout=w_layout)
    return default_placement(mesh, w_layout)


def default_placement(mesh: AnyMesh, w_layout: str = "hv") -> Placement:
    """Auto axes, no layout stated: the flattened tokens split over every mesh axis, ``w`` whole.

    Chosen so that the caller's arrays reach it cheaply whatever their layout: tokens split over some
    of the axes (data parallelism, in mesh order) are split further by a local slice, never gathered;
    ``w`` is gathered once if it is split (FSDP, vocab or tensor parallelism), as any layer gathers its
    FSDP weights; the logits never leave a device. ``dx`` comes back split over every axis, and the
    compiler gathers it to the caller's layout over the axes that layout leaves whole.
    """
    axes = tuple(name for name in mesh.axis_names if mesh.shape[name] > 1)
    return Placement("shard_map", mesh=mesh, token_spec=(_entry(axes),), flat_tokens=True, w_layout=w_layout)


def placement_from_specs(mesh: AnyMesh, x_spec: PartitionSpec, w_spec: PartitionSpec, x_ndim: int,
                         w_layout: str = "hv") -> Placement:
    """Tokens split as ``x_spec`` says; V split over the axes of ``w_spec``'s vocab dimension (its columns for
    ``"hv"``, its rows for ``"vh"``) that do not split tokens."""
    x_entries = spec_entries(x_spec, x_ndim)
    token_spec = tuple(without_trivial_axes(entry, mesh) for entry in x_entries[:-1])
    tokens = {a for entry in token_spec for a in axes_of(entry)}
    w_entries = spec_entries(w_spec, 2)
    vocab_entry = w_entries[1] if w_layout == "hv" else w_entries[0]
    vocab = tuple(a for a in axes_of(without_trivial_axes(vocab_entry, mesh)) if a not in tokens)
    return Placement("shard_map", mesh=mesh, token_spec=token_spec, vocab_axes=vocab, w_layout=w_layout)


def check_in_specs(in_specs: object, mesh: AnyMesh, x: jax.Array, w: jax.Array,
                   w_layout: str = "hv") -> tuple[PartitionSpec, PartitionSpec]:
    """``in_specs`` as ``(x_spec, w_spec)``, checked against the mesh and the shapes (a ValueError naming them)."""
    if (not isinstance(in_specs, (tuple, list)) or len(in_specs) != 2
            or not all(isinstance(s, PartitionSpec) for s in in_specs)):
        raise ValueError(f"in_specs must be a pair (x_spec, w_spec) of jax.sharding.PartitionSpec, got {in_specs!r}")
    x_spec, w_spec = in_specs
    for name, spec, array in (("x", x_spec, x), ("w", w_spec, w)):
        if len(spec) > array.ndim:
            raise ValueError(f"in_specs: the spec of {name}, {spec}, has more entries than {name} has dimensions "
                             f"(shape {array.shape})")
        used = [a for entry in spec for a in axes_of(entry)]
        for axis in used:
            if axis not in mesh.axis_names:
                raise ValueError(f"in_specs: the spec of {name}, {spec}, names axis {axis!r}, which the mesh lacks; "
                                 f"mesh axes: {tuple(mesh.axis_names)}")
        if len(set(used)) != len(used):
            raise ValueError(f"in_specs: the spec of {name}, {spec}, uses a mesh axis twice")
    placement = placement_from_specs(mesh, x_spec, w_spec, x.ndim, w_layout)
    for dim, entry in enumerate(placement.token_spec):
        shards = _axes_size(mesh, axes_of(entry))
        if x.shape[dim] % shards:
            raise ValueError(
                f"in_specs: x's dimension {dim} (size {x.shape[dim]}, x of shape {x.shape}) does not split evenly "
                f"over its {shards} shards on mesh axes {axes_of(entry)}; pad it, or leave in_specs=None (the "
                "default layout pads the tokens itself)"
            )
    vocab = w.shape[1] if w_layout == "hv" else w.shape[0]
    if vocab % placement.vocab_shards():
        raise ValueError(
            f"in_specs: w's vocab V={vocab} (w of shape {w.shape}, w_layout={w_layout!r}) does not split evenly "
            f"over its {placement.vocab_shards()} shards on mesh axes {placement.vocab_axes}; pad w's vocab to a "
            "multiple of it"
        )
    return x_spec, w_spec


def without_trivial_axes(entry: SpecEntry, mesh: AnyMesh) -> SpecEntry:
    """``entry`` without mesh axes of size 1: splitting over one changes no data, but inside
    ``shard_map`` it types values as varying over it, which then costs a (trivial) ``psum``."""
    return _entry(tuple(a for a in axes_of(entry) if mesh.shape[a] > 1))


def place(value: jax.Array, mesh: AnyMesh, spec: PartitionSpec) -> jax.Array:
    """``value`` laid out as ``spec`` on ``mesh``: a no-op when its type already says so.

    Explicit axes are resharded (an all-gather where ``spec`` splits less, a local slice where it
    splits more); Auto axes get a sharding constraint, which the compiler meets the same way.
    """
    ndim = value.ndim
    current = getattr(jax.typeof(value), "sharding", None)
    if isinstance(current, NamedSharding) and not current.mesh.empty:
        same_axes = tuple(current.mesh.axis_names) == tuple(mesh.axis_names)
        if same_axes and spec_entries(current.spec, ndim) == spec_entries(spec, ndim):
            return value
    if any(t == AxisType.Explicit for t in mesh.axis_types):
        context = jax.sharding.get_abstract_mesh()
        target: Any = spec if not context.empty else NamedSharding(mesh, spec)
        return jax.sharding.reshard(value, target)
    return jax.lax.with_sharding_constraint(value, NamedSharding(mesh, spec))
