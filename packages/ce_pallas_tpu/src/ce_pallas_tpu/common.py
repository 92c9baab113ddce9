"""Small pieces shared by the forward and backward kernels (traced inside the kernels)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import NamedTuple, TypedDict

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from ce_core import BlockSizes, UnsupportedError
from ce_core.extend import vary, varying_axes_of
from ce_pallas_tpu.layout import LANES


class GridCounts:
    """The block counts of a kernel's grid, from the fields a config dataclass declares."""

    n: int  # token rows
    v: int  # vocab size
    block_b: int  # token block
    block_v: int  # vocab block
    num_cores: int  # cores the vocab blocks are split over

    @property
    def nb(self) -> int:
        return pl.cdiv(self.n, self.block_b)

    @property
    def nv(self) -> int:
        return pl.cdiv(self.v, self.block_v)

    @property
    def nv_per_core(self) -> int:
        """Vocab blocks per core (the last core may have one fewer)."""
        return pl.cdiv(self.nv, self.num_cores)


@dataclasses.dataclass(frozen=True)
class KernelConfig(GridCounts):
    """Static shape and tiling of one kernel call (hashable: a static argument of the custom VJP)."""

    n: int  # tokens
    hidden: int  # hidden size H of the arrays
    hp: int  # H rounded up to a multiple of 128: the blocks' extent
    v: int  # vocab size
    block_b: int  # token block
    block_h: int  # hidden block (forward: == hp, not blocked) or hidden chunk of the dx/dw updates (backward)
    block_v: int  # vocab block
    num_cores: int
    logit_soft_cap: float | None
    with_sum: bool
    interpret: object  # False, or pltpu.InterpretParams
    vmem_limit_bytes: int | None
    precision: str = "default"  # of the products: "default" (bf16 MXU passes) or "high"/"highest" (f32)
    with_expected: bool = False  # also the expected logit sum_j p_j z_j (for the entropy)
    w_layout: str = "hv"  # "hv": w is [H, V]; "vh": w is [V, H], blocks [block_v, hp], products contract on H
    with_argmax: bool = False  # the forward also gives each row's max logit and its lowest index
    with_row_scale: bool = False  # the logits are s_i * cap(x_i . w_j), s a per-token input
    mxu_side: int = 128  # the width of the generation's MXUs (the forward's column chunks, the backward's dw form)

    @property
    def block_sizes(self) -> BlockSizes:
        """The tiles as the public ``ce_core.BlockSizes`` (for reports)."""
        return BlockSizes(self.block_b, self.block_h, self.block_v)

    @property
    def nh(self) -> int:
        return self.hp // self.block_h

    @property
    def padded_n(self) -> int:
        return self.nb * self.block_b


def soft_cap(raw: jax.Array, cap: float | None) -> tuple[jax.Array, jax.Array | None]:
    """``(cap * tanh(raw / cap), tanh(raw / cap))``, or ``(raw, None)`` without a cap."""
    if cap is None:
        return raw, None
    t = jnp.tanh(raw * (1.0 / cap))
    return cap * t, t


def logit_probability(raw: jax.Array, lse: jax.Array, scale: jax.Array | None, cap: float | None,
                      maximum: jax.Array | None = None, spread: Callable[[jax.Array], jax.Array] = lambda a: a,
                      keep_z: bool = False) -> tuple[jax.Array, jax.Array | None, jax.Array | None]:
    """``(p, z, t)`` of the backward's logits: ``z = scale * cap(raw)``, ``p = exp(z - lse)`` and the cap's ``t``
    (:func:`soft_cap`; None uncapped). ``raw`` may be bf16 kept logits below their lanes' maxima ``maximum``,
    which ``spread`` lays over ``raw``'s columns (the kernel's per-lane maxima over a block; the identity for
    values gathered per logit): uncapped and without ``keep_z`` (the entropy's terms need ``z``), ``maximum`` joins
    the per-lane term that takes the lse's place, ``exp(s raw + spread(s m - lse))``, and ``z`` is None. The
    kernel (:func:`ce_pallas_tpu.backward._logit_cotangent`) and the label's term by rows
    (:func:`ce_pallas_tpu.label_rows.label_rows`) both form ``p`` here, so that their roundings agree."""
    if maximum is not None and cap is None and not keep_z:
        if scale is not None:
            raw, maximum = scale * raw, scale * maximum
        return jnp.exp(raw + spread(maximum - lse)), None, None
    z, t = soft_cap(raw if maximum is None else raw + spread(maximum), cap)
    if scale is not None:
        z = scale * z
    return jnp.exp(z - lse), z, t


def softmax_cotangent(raw: jax.Array, lse: jax.Array, scale: jax.Array | None, cap: float | None,
                      maximum: jax.Array | None = None, spread: Callable[[jax.Array], jax.Array] = lambda a: a, *,
                      g_lse: jax.Array | None = None, expected: jax.Array | None = None,
                      g_expected: jax.Array | None = None,
                      ratio: jax.Array | None = None) -> tuple[jax.Array, jax.Array | None]:
    """``(delta's softmax term, the cap's t or None)`` of the backward's logits (:func:`logit_probability`'s
    arguments): ``p`` itself where ``g_lse`` was folded into the lse (``g_lse`` None), ``g_lse p``, or with the
    entropy's terms (``expected`` and ``g_expected``) ``p (g_lse + g_expected (1 + z - expected))``, its row terms
    gathered (two vector ops per logit fewer). With bf16 logits below lane maxima, uncapped, the entropy's form
    takes ``z``'s maximum into its per-lane terms, ``p (spread(g_lse + g_expected (1 - expected + s m))
    + g_expected s raw)``, ``p`` as the plain loss's (one vector op a logit fewer than forming ``z``). With the
    entropy's cotangent folded into the lse (``ratio``, the row's ``a / b``: ``ce_pallas_tpu.kept_logits.
    fold_entropy_cotangent``) it is ``p' (ratio + z)``, below lane maxima ``p' (spread(ratio + s m) + s raw)``. The
    kernel and the label's term by rows both form it here, so that their roundings agree."""
    if ratio is not None:
        if maximum is not None and cap is None:
            if scale is not None:
                raw, maximum = scale * raw, scale * maximum
            return jnp.exp(raw + spread(maximum - lse)) * (spread(ratio + maximum) + raw), None
        p, z, t = logit_probability(raw, lse, scale, cap, maximum, spread, keep_z=True)
        assert z is not None  # formed with keep_z
        return p * (ratio + z), t
    entropy = expected is not None and g_expected is not None
    if entropy and maximum is not None and cap is None:
        assert g_lse is not None and expected is not None and g_expected is not None
        if scale is not None:
            raw, maximum = scale * raw, scale * maximum
        p = jnp.exp(raw + spread(maximum - lse))
        lane = spread((g_lse + g_expected * (1.0 - expected)) + g_expected * maximum)
        return p * (lane + g_expected * raw), None
    p, z, t = logit_probability(raw, lse, scale, cap, maximum, spread, keep_z=entropy)
    if g_lse is None:
        return p, t
    if not entropy:
        return g_lse * p, t
    assert z is not None and expected is not None and g_expected is not None  # formed above with keep_z
    return p * ((g_lse + g_expected * (1.0 - expected)) + g_expected * z), t


class SoftmaxRows(TypedDict):
    """:func:`softmax_cotangent`'s row arguments (:func:`softmax_cotangent_rows`)."""

    g_lse: jax.Array | None
    expected: jax.Array | None
    g_expected: jax.Array | None
    ratio: jax.Array | None


def softmax_cotangent_rows(in_exponent: bool, g_lse: jax.Array | None, expected: jax.Array | None,
                           g_expected: jax.Array | None) -> SoftmaxRows:
    """:func:`softmax_cotangent`'s row arguments from a backward's columns: with the row's cotangent in the exponent
    (``BackwardConfig.cotangent_in_exponent``) none, or with the entropy's terms the ``ratio`` the ``g_lse`` column
    then holds; otherwise ``g_lse``, ``expected`` and ``g_expected`` as they are."""
    if not in_exponent:
        return SoftmaxRows(g_lse=g_lse, expected=expected, g_expected=g_expected, ratio=None)
    return SoftmaxRows(g_lse=None, expected=None, g_expected=None, ratio=g_lse if expected is not None else None)


def delta_row_terms(delta: jax.Array, g_sum: jax.Array | None, t: jax.Array | None,
                    scale: jax.Array | None) -> jax.Array:
    """``delta`` past its probability and label terms: plus the smoothing's ``g_sum``, times the cap's slope
    ``1 - t^2`` and the row's ``scale`` (``1 / T``), in the kernel's order."""
    if g_sum is not None:
        delta = delta + g_sum
    if t is not None:
        delta = delta * (1.0 - t * t)
    if scale is not None:
        delta = delta * scale
    return delta


def resolve_precision(x_dtype, w_dtype, requested: str | None) -> str:
    """The precision the products run at: bf16 inputs need one bf16 pass whatever is asked; otherwise
    ``requested``, or by default that of the lower-precision input ("default" when either is bf16)."""
    bf16 = jnp.dtype(jnp.bfloat16)
    if jnp.dtype(x_dtype) == bf16 and jnp.dtype(w_dtype) == bf16:
        return "default"
    if requested is not None:
        return requested
    return "default" if bf16 in (jnp.dtype(x_dtype), jnp.dtype(w_dtype)) else "highest"


def mxu_dtype(precision: str) -> jnp.dtype:
    """The dtype both operands of a product are cast to."""
    return jnp.dtype(jnp.bfloat16) if precision == "default" else jnp.dtype(jnp.float32)


_LAX_PRECISION = {"default": None, "high": jax.lax.Precision.HIGH, "highest": jax.lax.Precision.HIGHEST}


def _dot(a: jax.Array, b: jax.Array, dims, precision: str) -> jax.Array:
    dtype = mxu_dtype(precision)
    return jax.lax.dot_general(a.astype(dtype), b.astype(dtype), (dims, ((), ())),
                               precision=_LAX_PRECISION[precision], preferred_element_type=jnp.float32)


def matmul(a: jax.Array, b: jax.Array, precision: str) -> jax.Array:
    """``a @ b`` accumulated in float32."""
    return _dot(a, b, ((1,), (0,)), precision)


def matmul_tn(a: jax.Array, b: jax.Array, precision: str) -> jax.Array:
    """``a.T @ b`` accumulated in float32 (contracts the leading dims)."""
    return _dot(a, b, ((0,), (0,)), precision)


def matmul_nt(a: jax.Array, b: jax.Array, precision: str) -> jax.Array:
    """``a @ b.T`` accumulated in float32 (contracts the trailing dims)."""
    return _dot(a, b, ((1,), (1,)), precision)


def matmul_tt(a: jax.Array, b: jax.Array, precision: str) -> jax.Array:
    """``a.T @ b.T`` accumulated in float32 (contracts ``a``'s leading dim with ``b``'s trailing one)."""
    return _dot(a, b, ((0,), (1,)), precision)


def zero_hidden_tail(x_ref, w_ref, hidden: int, hp: int) -> None:
    """Zero the hidden columns of an ``x`` block and rows of a ``w`` block at or past ``hidden``.

    When ``H`` is not a multiple of 128 the kernels use blocks of ``Hp`` (its round-up) over the
    unpadded arrays, so the last block's final 128-wide group holds garbage past ``H`` in both
    operands; garbage times garbage would poison every logit. ``x_ref`` / ``w_ref`` may be None.
    """
    valid = hidden - (hp - LANES)  # columns of the last 128-group that are real
    if x_ref is not None:
        tail = pl.ds(x_ref.shape[1] - LANES, LANES)
        cols = jax.lax.broadcasted_iota(jnp.int32, (x_ref.shape[0], LANES), 1)
        x_ref[:, tail] = jnp.where(cols < valid, x_ref[:, tail], jnp.zeros((), x_ref.dtype))
    if w_ref is not None:
        tail = pl.ds(w_ref.shape[0] - LANES, LANES)
        rows = jax.lax.broadcasted_iota(jnp.int32, (LANES, w_ref.shape[1]), 0)
        w_ref[tail, :] = jnp.where(rows < valid, w_ref[tail, :], jnp.zeros((), w_ref.dtype))


#: Why the generic interpreter cannot run on a shard, for the errors that refuse it.
PLAIN_INTERPRETER_UNDER_SHARD_MAP = (
    "pallas_tpu: CE_PALLAS_TPU_INTERPRET=plain cannot run inside shard_map (Pallas' generic interpreter "
    "indexes per-device blocks with replicated values, which shard_map's varying-axes check refuses); "
    "use CE_PALLAS_TPU_INTERPRET=1 (the TPU interpreter) for sharded calls"
)


def per_device_operands(operands: list, interpret) -> tuple[frozenset, list]:
    """The operands made to vary over the manual axes any of them varies over, and those axes.

    Raises:
      UnsupportedError: the generic interpreter (``interpret is True``) inside a ``shard_map``.
    """
    axes = varying_axes_of(*operands)
    if axes and interpret is True:
        raise UnsupportedError(PLAIN_INTERPRETER_UNDER_SHARD_MAP)
    return axes, [vary(value, axes) for value in operands]


def out_type(shape: tuple[int, ...], dtype, axes: frozenset) -> jax.ShapeDtypeStruct:
    """A pallas_call output type that varies over ``axes`` (required under ``check_vma``)."""
    return jax.ShapeDtypeStruct(shape, dtype, manual_axis_type=jax.sharding.ManualAxisType(varying=axes))


def block_spec(block_shape: tuple[int, ...], index_map, buffering: pl.Buffered | None) -> pl.BlockSpec:
    """A BlockSpec, with a pipeline mode (buffer count) only when one is given."""
    if buffering is None:
        return pl.BlockSpec(block_shape, index_map)
    return pl.BlockSpec(block_shape, index_map, pipeline_mode=buffering)


# ---------------------------------------------------------------------------------------------
# Dead token blocks (contract version 4): blocks holding no live token do no DMA and no matmul.


class LiveBlocks(NamedTuple):
    """The token blocks that hold a live token, handed to a kernel by scalar prefetch: ``walk`` (int32
    ``[nb]``) what each grid position along the token axis takes, the live blocks first, in order, then,
    for every dead step, ``~last`` (``-1 - last``, negative) with ``last`` the last live block (0 when none
    is live); ``n_live`` (int32 ``[1]``) how many are live.

    The kernel's token axis then walks positions, not blocks: position ``p < n_live`` is live block
    ``walk[p]``; later positions are dead steps, which keep the last live block's indices in every
    ``BlockSpec`` (and, where the token axis is not innermost, the last indices of the axes inside it), so
    the pipeline fetches and writes back nothing new, and their bodies run no matmul. A position's block
    and liveness come from one scalar: the interpreter evaluates every index map at every step, and each
    scalar it reads there is a call out to its simulated memory.
    """

    walk: jax.Array
    n_live: jax.Array

    @classmethod
    def of(cls, live: jax.Array, block_b: int) -> LiveBlocks:
        """The live blocks of ``block_b`` rows of the bool mask ``live [N]`` (rows past ``N`` are dead)."""
        block_live = blocks_live(live, block_b)
        blocks = block_live.shape[0]
        ids = jnp.argsort(jnp.logical_not(block_live), stable=True).astype(jnp.int32)
        count = jnp.sum(block_live, dtype=jnp.int32)
        positions = jnp.arange(blocks, dtype=jnp.int32)
        last = ids[jnp.maximum(count, 1) - 1]
        return cls(jnp.where(positions < count, ids, jnp.bitwise_not(last)), count.reshape(1))


def blocks_live(live: jax.Array, block_b: int) -> jax.Array:
    """Whether each block of ``block_b`` rows holds a row of the bool mask ``live [N]`` (rows past ``N`` are
    dead): bool ``[cdiv(N, block_b)]``."""
    n = live.shape[0]
    blocks = pl.cdiv(n, block_b)
    padded = jnp.pad(live.astype(bool), (0, blocks * block_b - n))
    return jnp.any(padded.reshape(blocks, block_b), axis=1)


def token_block(position, walk_ref) -> tuple[jax.Array, jax.Array]:
    """``(block, live)`` of a grid position along the token axis: the block it takes (on a dead step the
    last live one) and whether the step is live, from :attr:`LiveBlocks.walk`."""
    taken = walk_ref[position]
    live = taken >= 0
    return jnp.where(live, taken, jnp.bitwise_not(taken)), live


def skipping_specs(specs: list[pl.BlockSpec], token_axis: int, pinned: dict[int, int]) -> list[pl.BlockSpec]:
    """``specs`` (index maps over the grid's indices) for a grid that walks :class:`LiveBlocks`: each
    index map takes the scalar-prefetch refs too, maps the token position to its block, and on a dead step
    pins each axis in ``pinned`` to the index given (the last one it takes), so that no block changes and
    nothing is fetched or written back. Specs without an index map (``pl.ANY``) are left as they are."""

    def skipping(index_map):
        def mapped(*args):
            *grid, walk_ref, _ = args
            block, live = token_block(grid[token_axis], walk_ref)
            grid[token_axis] = block
            for axis, last in pinned.items():
                grid[axis] = jnp.where(live, grid[axis], last)
            return index_map(*grid)

        return mapped

    return [spec if spec.index_map is None else dataclasses.replace(spec, index_map=skipping(spec.index_map))
            for spec in specs]


def when_live(live, body) -> None:
    """Run ``body`` on a step with work: under ``pl.when(live)``, or unconditionally where every step is live."""
    if live is True:
        body()
    else:
        pl.when(live)(body)


def both(condition, live):
    """``condition & live``, or ``condition`` where every step is live (``live is True``)."""
    return condition if live is True else condition & live


def grid_arguments(grid: tuple, in_specs: list, out_specs: list, scratch: list, skipping: bool, *,
                   token_axis: int, pinned: dict[int, int]) -> dict:
    """The grid keywords of a ``pallas_call``: plain, or (``skipping``) a grid spec whose first two
    operands are a :class:`LiveBlocks`' walk and count, prefetched into SMEM, and whose index maps walk
    the live token blocks (:func:`skipping_specs`)."""
    if not skipping:
        return {"grid": grid, "in_specs": in_specs, "out_specs": out_specs, "scratch_shapes": scratch}
    spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=2, grid=grid, in_specs=skipping_specs(in_specs, token_axis, pinned),
        out_specs=skipping_specs(out_specs, token_axis, pinned), scratch_shapes=scratch)
    return {"grid_spec": spec}


def with_prefetch(kernel, skipping: bool):
    """``kernel(*refs, prefetch=...)`` as a Pallas kernel body: ``prefetch`` is the ``(walk, count)``
    scalar refs that come first when ``skipping``, else None."""

    def body(*refs):
        if skipping:
            return kernel(*refs[2:], prefetch=refs[:2])
        return kernel(*refs, prefetch=None)

    return body


def without_ref(kernel, index: int):
    """``kernel`` as a body that takes one more ref, at ``index``, and ignores it (an operand passed
    only for its buffer: an output aliased to it)."""

    def body(*refs, **keywords):
        return kernel(*refs[:index], *refs[index + 1:], **keywords)

    return body


def step_block(position, prefetch) -> tuple[jax.Array, jax.Array | bool]:
    """``(block, live)`` of a token position: :func:`token_block`, or ``(position, True)`` without prefetch."""
    if prefetch is None:
        return position, True
    return token_block(position, prefetch[0])
