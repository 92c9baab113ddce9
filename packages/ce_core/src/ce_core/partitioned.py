"""Per-shard functions under automatic sharding (GSPMD/Shardy), with ``custom_partitioning``.

With Auto mesh axes nothing about the input shardings is visible at trace time, and a backend's
kernels (a Mosaic custom call, a loop over token chunks) would otherwise be partitioned blindly:
gathered, or refused. ``jax.experimental.custom_partitioning`` instead hands the shardings the
compiler chose to a callback, which returns the per-device function and the operand shardings it
wants; the compiler inserts only the collectives that needs (an FSDP gather of ``w``).

The Shardy rule names the token dimensions ``n0, n1, ...`` (shared by ``x``, labels and per-token
outputs), ``h`` for the hidden size (must be replicated: it is contracted) and ``v`` for the vocab.
The callback keeps the tokens split as ``x`` is and ``w`` split on V over the axes that do not also
split tokens, when those divide V evenly (otherwise it gathers ``w``; statistics over padded vocab
columns would be wrong). Token shards that GSPMD pads (``N`` not a multiple of the shard count)
have their padding rows zeroed, so they add nothing to ``dw``.

``custom_partitioning`` has no differentiation rule; :mod:`ce_core.ops` wraps these calls in
custom VJPs. Nor has it a batching rule: :mod:`ce_core.batching` gives it one (fold the mapped axis
into the token dimensions, or map over the examples). On one device the function is inlined whole.
"""

from __future__ import annotations

import functools
import math
import warnings

import jax
import jax.numpy as jnp
from jax.experimental.custom_partitioning import custom_partitioning
from jax.sharding import NamedSharding, PartitionSpec

from ce_core.batching import batched_by_kinds
from ce_core.placement import SpecEntry, axes_of, spec_entries, without_trivial_axes
from ce_core.shard_ops import ShardAxes, ShardFn


def run_partitioned(fn: ShardFn, *args: jax.Array) -> tuple[jax.Array, ...]:
    """``fn`` over the whole arrays, each device running it on the shards the compiler chose."""
    lead_ndim = args[fn.in_kinds.index("x")].ndim - 1
    # jit, so an eager call is compiled as one partitioned program, not run op by op.
    return jax.jit(_batchable_op(fn, lead_ndim))(*args)


@functools.lru_cache(maxsize=256)
def _batchable_op(fn: ShardFn, lead_ndim: int):
    """The partitioned op with a ``vmap`` rule of its own (``custom_partitioning`` has none)."""
    return batched_by_kinds(fn, _partitioned_op(fn, lead_ndim), folded=lambda: _batchable_op(fn, lead_ndim + 1))


def _rule(kinds: tuple[str, ...], lead: str) -> str:
    factors = {"x": f"{lead} h", "w": "h v", "tokens": lead}
    return ", ".join(factors[k].strip() for k in kinds)


@functools.lru_cache(maxsize=256)
def _partitioned_op(fn: ShardFn, lead_ndim: int):
    def whole(*args):  # the unsharded meaning of the op: one shard holding everything
        return fn(ShardAxes(), *args)

    op = custom_partitioning(whole)
    in_kinds, out_kinds = fn.in_kinds, fn.out_kinds

    def partition(mesh, arg_shapes, result_shape):
        del result_shape
        x = arg_shapes[in_kinds.index("x")]
        w = arg_shapes[in_kinds.index("w")]
        token_spec = _token_spec(x.sharding, lead_ndim)
        token_axes = tuple(a for entry in token_spec for a in axes_of(entry))
        vocab_axes = _vocab_axes(w.sharding, token_axes, w.shape[1], mesh)
        specs = {
            "x": PartitionSpec(*token_spec, None),
            "w": PartitionSpec(None, vocab_axes[0] if len(vocab_axes) == 1 else (vocab_axes or None)),
            "tokens": PartitionSpec(*token_spec),
        }
        arg_shardings = tuple(NamedSharding(mesh, specs[k]) for k in in_kinds)
        out_shardings = tuple(NamedSharding(mesh, specs[k]) for k in out_kinds)
        axes = ShardAxes(token_axes, vocab_axes, typed=False)
        global_lead = tuple(x.shape[:-1])

        def per_device(*args):
            return fn(axes, *_zero_padding_rows(args, in_kinds, token_spec, global_lead, mesh))

        return mesh, per_device, out_shardings, arg_shardings

    lead = " ".join(f"n{i}" for i in range(lead_ndim))
    op.def_partition(
        partition=partition,
        sharding_rule=f"{_rule(in_kinds, lead)} -> {_rule(out_kinds, lead)}",
        need_replication_factors=("h",),
    )
    return op


def _token_spec(sharding, lead_ndim: int) -> tuple[SpecEntry, ...]:
    spec = getattr(sharding, "spec", None)
    if spec is None:  # not expressible on the mesh: keep the tokens whole
        return (None,) * lead_ndim
    return tuple(without_trivial_axes(e, sharding.mesh) for e in spec_entries(spec, lead_ndim + 1)[:lead_ndim])


def _vocab_axes(sharding, token_axes: tuple[str, ...], vocab: int, mesh) -> tuple[str, ...]:
    spec = getattr(sharding, "spec", None)
    if spec is None:
        return ()
    axes = tuple(a for a in axes_of(without_trivial_axes(spec_entries(spec, 2)[1], mesh)) if a not in token_axes)
    shards = math.prod(mesh.shape[a] for a in axes)
    if vocab % shards:
        warnings.warn(
            f"ce_core: w's vocab V={vocab} does not divide evenly over its {shards} shards on mesh axes {axes}; "
            "gathering w for this loss (pad V to a multiple of the shard count to keep it vocab-parallel)",
            stacklevel=2,
        )
        return ()
    return axes


def _zero_padding_rows(args, kinds, token_spec, global_lead, mesh):
    """Zero the rows GSPMD padded onto the last token shards (``N`` not a multiple of the shard count)."""
    valid = None
    for dim, (entry, size) in enumerate(zip(token_spec, global_lead, strict=True)):
        axes = axes_of(entry)
        shards = math.prod(mesh.shape[a] for a in axes)
        if not axes or size % shards == 0:
            continue
        local = -(-size // shards)
        rows = jax.lax.axis_index(axes) * local + jax.lax.broadcasted_iota(jnp.int32, (local,), 0)
        shape = [1] * len(global_lead)
        shape[dim] = local
        dim_valid = (rows < size).reshape(shape)
        valid = dim_valid if valid is None else valid & dim_valid
    if valid is None:
        return args

    def zero(value, kind):
        if kind == "w":
            return value
        mask = valid[..., None] if kind == "x" else valid
        return jnp.where(mask, value, jnp.zeros((), value.dtype))

    return tuple(zero(v, k) for v, k in zip(args, kinds, strict=True))
