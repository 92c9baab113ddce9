"""How a call is spread over devices: found from the caller's context and types, never guessed.

JAX code shards in three ways, and the loss follows each (see DESIGN.md, "Inside the caller's
sharded step"):

- **Explicit axes** (``jax.make_mesh``'s default, with ``jax.set_mesh`` or inputs placed on such a
  mesh): every array's type carries its sharding, so the placement is read from the types of ``x``
  and ``w`` at trace time and run with ``jax.shard_map`` (placement ``"shard_map"``).
- **Auto axes** (GSPMD/Shardy: ``NamedSharding`` inputs, ``jax.set_mesh`` of an Auto mesh): the
  shardings are only chosen by the compiler, so the backend runs under
  ``jax.experimental.custom_partitioning``, whose callback sees them (placement ``"partitioned"``).
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

from ce_core.errors import UnsupportedError
from ce_core.shard_ops import ShardAxes

#: One entry of a PartitionSpec: no axis, one axis name, or a tuple of names (major to minor).
SpecEntry = str | tuple[str, ...] | None
AnyMesh = Mesh | AbstractMesh


@dataclasses.dataclass(frozen=True)
class Placement:
    """Where a call runs (hashable: part of the cache key of the ops built for it).

    ``token_spec`` holds one entry per leading dimension of ``x`` (``"shard_map"`` only), and
    ``vocab_axes`` the axes splitting V (``"shard_map"``, or the caller's ``vocab_axis_name``
    under ``"local"``). ``typed``: a ``"local"`` call inside the caller's ``shard_map``.
    """

    kind: str = "local"
    mesh: AnyMesh | None = None
    token_spec: tuple[SpecEntry, ...] = ()
    vocab_axes: tuple[str, ...] = ()
    typed: bool = False

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
        return place(value, self.mesh, self.spec(kind))

    def spec(self, kind: str) -> PartitionSpec:
        """The ``shard_map`` spec of an array of ``kind`` (``"x"``, ``"w"`` or ``"tokens"``)."""
        vocab: SpecEntry = _entry(self.vocab_axes)
        return {"x": PartitionSpec(*self.token_spec, None), "w": PartitionSpec(None, vocab),
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


def typed_mesh(*values: Any) -> AbstractMesh | None:
    """The context mesh, else the mesh recorded in the first input type that has one."""
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
            return mesh.abstract_mesh
    return None


def find_placement(x: jax.Array, labels: jax.Array, w: jax.Array, vocab_axis_name: str | None) -> Placement:
    """The placement of a ``linear_cross_entropy`` call, from the context and the input types.

    Raises:
      UnsupportedError: automatic sharding over devices this process can only compile for (libtpu's
        deviceless topologies), where ``custom_partitioning`` cannot run; use explicit axes there.
    """
    context = jax.sharding.get_abstract_mesh()
    inside_shard_map = not context.empty and bool(context.manual_axes)
    if vocab_axis_name is not None or inside_shard_map:
        vocab = (vocab_axis_name,) if vocab_axis_name is not None else ()
        return Placement("local", vocab_axes=vocab, typed=inside_shard_map)
    mesh = typed_mesh(x, w, labels)
    if mesh is None:
        return LOCAL
    if mesh.explicit_axes:  # even of size 1: explicit types reject ops that split along their axes
        return explicit_placement(mesh, x, w)
    if mesh.size == 1:
        return LOCAL
    _check_compilable_here(mesh)
    return Placement("partitioned", mesh=mesh)


def explicit_placement(mesh: AbstractMesh, x: jax.Array, w: jax.Array) -> Placement:
    """Tokens split as ``x``'s type says; V split over ``w``'s column axes that do not split tokens."""
    x_entries = spec_entries(jax.typeof(x).sharding.spec, x.ndim)
    token_spec = tuple(without_trivial_axes(entry, mesh) for entry in x_entries[:-1])
    tokens = {a for entry in token_spec for a in axes_of(entry)}
    w_entries = spec_entries(jax.typeof(w).sharding.spec, 2)
    vocab = tuple(a for a in axes_of(without_trivial_axes(w_entries[1], mesh)) if a not in tokens)
    return Placement("shard_map", mesh=mesh, token_spec=token_spec, vocab_axes=vocab)


def without_trivial_axes(entry: SpecEntry, mesh: AnyMesh) -> SpecEntry:
    """``entry`` without mesh axes of size 1: splitting over one changes no data, but inside
    ``shard_map`` it types values as varying over it, which then costs a (trivial) ``psum``."""
    return _entry(tuple(a for a in axes_of(entry) if mesh.shape[a] > 1))


def _check_compilable_here(mesh: AbstractMesh) -> None:
    platform = mesh.abstract_device.platform if mesh.abstract_device is not None else None
    if platform is not None and platform != jax.default_backend():
        raise UnsupportedError(
            f"linear_cross_entropy: the inputs are sharded automatically (Auto mesh axes {mesh.axis_names}) "
            f"over {platform} devices while this process runs on {jax.default_backend()!r}: compiling "
            "ahead of time for devices that are not here. Automatic sharding needs "
            "jax.experimental.custom_partitioning, whose partitioner the compile-only client of such "
            "devices lacks; use explicit axes there (jax.make_mesh's default, with jax.set_mesh)"
        )


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
