"""The gradient of a scalar loss without recomputing the logits: 6NHV of matmul work instead of 8NHV.

For a loss reduced to a scalar, every token's cotangents are known as soon as its statistics are
(``cotangent_fn``, :meth:`ce_core.Backend.row_stats_and_grads`). So the tokens go in chunks of
``chunk`` rows, one after another (unrolled up to :data:`UNROLLED_MIDDLE_CHUNKS`, a ``lax.fori_loop``
beyond), and for each chunk:

1. the forward kernel computes the chunk's statistics and also writes its raw logits ``x @ w``
   (float32, before the cap and the row scale) to an HBM buffer of that chunk only
   (``ForwardConfig.keep_logits``);
2. XLA merges the cores' statistics and forms their cotangents (``cotangent_fn``, ``[chunk]``-sized; under
   a vocab-split placement it combines the chunk's statistics over the shards first, see
   :mod:`ce_core.sharded.shard_ops`);
3. the backward kernel reads the kept logits instead of recomputing them (``BackwardConfig.kept_logits``),
   forms ``delta``, holds the chunk's ``x`` and float32 ``dx`` in VMEM, and adds its ``dw`` onto a float32
   running sum, whose blocks DMAs bring into two VMEM slots and write back in place. A wide head's backward
   takes the hidden size in tiles, each a walk over the vocabulary; on v5p and v6e the first writes
   ``delta`` over the kept logits and the others read it back (``BackwardConfig.delta_over_logits``). An
   ``[H, V]`` head's chunk ``x`` is held transposed on v5p and v6e (``BackwardConfig.x_transposed``), and on v6e
   a hidden size that is not a whole number of its MXU's 256 holds ``dx`` transposed too
   (``BackwardConfig.dx_transposed``), and a ``[V, H]`` head's ``dw`` and ``x`` as well
   (``BackwardConfig.kept_dw_transposed``). Where the
   whole hidden size fits VMEM only for fewer rows than the forward's chunk, the backward may instead run over
   pieces of the chunk, a call per piece reading its rows of the kept logits (``KeptPlan.pieces``). The first
   backward call starts that sum (its slots start at zero: on v6e read from a zero block by the same DMAs,
   ``BackwardConfig.dw_zeros_by_dma``) and the last one writes the finished ``dw`` in ``w``'s dtype and shape,
   as the recompute kernel does; one call does both, with no running sum.

So the MXU runs ``x @ w`` once per token (forward) and the two gradient products (backward), and the
extra memory is one chunk's logits and, over several backward calls, the float32 ``dw`` (padded to whole vocab
blocks). ``N`` is split into chunks of equal size, a whole number of both kernels' token blocks where
``N`` allows; the last chunk ends at ``N`` and may overlap the one before, its overlapped rows given
zero cotangents (they add nothing) and their statistics rewritten with the same values.

With ``keep_logits=None`` the backend keeps the logits where :func:`choose` says so: the extra memory
fits :func:`keep_logits_budget` (``min(4 GiB, HBM / 8)``) and a roofline estimate of both paths
(:func:`estimated_seconds`) has the kept one faster.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import jax
import jax.numpy as jnp

from ce_core import CotangentFn, RowStats, StatsSpec, UnsupportedError
from ce_core.extend import vary_like
from ce_pallas_tpu import common, cost_model, tiling
from ce_pallas_tpu.backward import BackwardConfig, backward_call, running_dw_shape
from ce_pallas_tpu.forward import ForwardConfig, forward_call, kept_maxima_shape
from ce_pallas_tpu.label_rows import label_rows
from ce_pallas_tpu.layout import LANES, cdiv, round_up
from ce_pallas_tpu.ops import (
    Plan,
    dead_rows_zeroed,
    inert_rows,
    live_blocks,
    make_plan,
    merge_partials,
    merged_dx,
    problem_shape,
    vocab_size,
)
from ce_pallas_tpu.target import Target, current_target

#: The most tokens per chunk (``None``: :func:`default_chunk` decides; tests set a small number): the
#: chunk's kept logits are ``4 * chunk * V`` bytes (2 GiB at 4096 tokens and V=128256).
CHUNK_TOKENS: int | None = None
#: The hidden tiles of the kept backward (``None``: :func:`plan_chunks` decides; tests force a split).
HIDDEN_SPLIT: int | None = None
#: The most rows of a backward piece (``None``: :func:`plan_chunks` decides, :attr:`KeptPlan.pieces`; tests
#: set a small number to run the backward of each chunk in pieces).
PIECE_TOKENS: int | None = None
#: The most middle chunks (neither the first nor the last) called one after another in the program; more go
#: in a ``lax.fori_loop``, which keeps the program's size bounded. Around v6e's large Llama-3 8B kernels a loop
#: doubles libtpu's compile (16384 tokens, 11 chunks: 225 s against 91 s unrolled; 65536 tokens: 215 s against
#: 128 s), where unrolled calls of identical kernels compile once; elsewhere unrolling costs a little (v5p's
#: 30 middle chunks at 16384 tokens: 15 -> 23-27 s, 31 MB more temporaries, XLA overlapping two chunks' XLA
#: work). Measured on this 2-core machine, 2026-12-02: docs/notes/2026-12-02-kept-chunks-unrolled.md.
UNROLLED_MIDDLE_CHUNKS = 64
#: Bounds of the rule's chunk: fewer rows make each step's matmuls short; more hold more logits.
MIN_CHUNK_TOKENS, MAX_CHUNK_TOKENS = 1024, 4096
#: The fewest tokens per chunk the default shrinks a chunk to, to fit its budget (the roofline then says
#: whether such chunks still pay: their float32 ``dw`` traffic is a larger share of their work).
MIN_BUDGET_CHUNK_TOKENS = 512
#: The most extra HBM the default (``keep_logits=None``) lets the path hold, whatever the chip...
KEEP_LOGITS_BUDGET_CAP_BYTES = 4 * 2**30
#: ...and at most this fraction of the chip's HBM (an eighth: 2 GiB on a v5e, 4 GiB from 32 GiB up).
KEEP_LOGITS_HBM_DIVISOR = 8


def keep_logits_budget(target: Target) -> int:
    """The extra HBM the default may spend on kept logits and the float32 ``dw`` on ``target``:
    ``min(4 GiB, HBM / 8)`` (the same rule as ``xla``'s, with the chip's HBM from its facts)."""
    return min(KEEP_LOGITS_BUDGET_CAP_BYTES, target.facts.hbm_bytes // KEEP_LOGITS_HBM_DIVISOR)


def hiding_chunk(h: int, w_bytes: int, target: Target) -> float:
    """The fewest tokens per chunk whose HBM traffic hides under their matmuls on ``target`` (infinite
    where none does): see :func:`default_chunk`."""
    ridge = target.facts.flops_per_byte
    denominator = 6 * h - 8 * ridge
    return math.inf if denominator <= 0 else (2 * w_bytes + 8) * ridge * h / denominator


def default_chunk(h: int, w_bytes: int, target: Target) -> int:
    """Tokens per chunk on ``target``: twice the fewest whose HBM traffic hides under their matmuls,
    in whole 512s within [:data:`MIN_CHUNK_TOKENS`, :data:`MAX_CHUNK_TOKENS`].

    A chunk of ``C`` tokens does ``6 C H V`` flops and moves ``2 w_bytes H V`` (``w`` read by both
    kernels), ``8 H V`` (the float32 ``dw`` read and written) and ``8 C V`` bytes (the logits written
    and read): with ``R`` the core's flops per byte, the traffic hides from ``C = (2 w_bytes + 8) R H /
    (6 H - 8 R)`` (``x``, ``dx`` and the ``[C]`` columns move once per chunk, a fraction ``H / V`` of that).
    v5p at H=4096, bf16: about 350 tokens; v6e: about 1,400; where ``6 H <= 8 R`` (narrow heads on v6e) no
    chunk hides it and the largest is taken.
    """
    fewest = hiding_chunk(h, w_bytes, target)
    if math.isinf(fewest):
        return MAX_CHUNK_TOKENS
    return int(min(MAX_CHUNK_TOKENS, max(MIN_CHUNK_TOKENS, round_up(math.ceil(2 * fewest), 512))))


@dataclasses.dataclass(frozen=True)
class KeptPlan:
    """The chunking and both kernels' configurations of one kept-logits call (hashable)."""

    n: int
    h: int
    v: int
    chunk: int
    forward: ForwardConfig
    backward: BackwardConfig  # the backward of a chunk, or of its longest piece (``pieces``)
    logits_shape: tuple[int, int]  # the kept logits buffer of one chunk (both kernels' blocks)
    #: float32 dw in w's layout (or held transposed: ``BackwardConfig.kept_dw_transposed``), padded to whole
    #: backward vocab blocks and Hp
    running_dw_shape: tuple[int, int]
    #: The backward's pieces of a chunk, in rows (summing to ``chunk``; ``()``: one piece, the chunk). Each is
    #: a backward call over its rows of the chunk's kept logits, the float32 running ``dw`` passing between
    #: them as between chunks: the forward takes a chunk too long for the backward's resident ``x`` and
    #: ``dx`` to fit VMEM with the whole hidden size, and the backward needs no hidden tiles
    #: (:func:`_pieces_plan`). All but the last are whole token blocks, so each starts on a block of the
    #: buffer.
    pieces: tuple[int, ...] = ()

    @property
    def chunks(self) -> int:
        return cdiv(self.n, self.chunk)

    @property
    def maxima_shape(self) -> tuple[int, int] | None:
        """The lane maxima of bf16 kept logits (:attr:`ForwardConfig.kept_bf16`), or None: float32 logits."""
        return kept_maxima_shape(self.logits_shape, self.forward.maxima_columns) if self.forward.kept_bf16 else None

    @property
    def kept_row_bytes(self) -> int:
        """HBM bytes a token's kept logits take: float32, or bf16 and their float32 lane maxima."""
        if self.maxima_shape is None:
            return 4 * self.logits_shape[1]
        return 2 * self.logits_shape[1] + 4 * self.maxima_shape[1]

    @property
    def piece_rows(self) -> tuple[int, ...]:
        """The rows of each backward call of a chunk (:attr:`pieces`, or the chunk whole)."""
        return self.pieces or (self.chunk,)

    @property
    def backward_calls(self) -> int:
        """The backward calls of the whole call: one per piece of each chunk."""
        return self.chunks * len(self.piece_rows)

    def piece_configs(self, chunk_role: str) -> tuple[BackwardConfig, ...]:
        """The backward of each piece of a chunk in ``chunk_role`` (``only``, ``first``, ``middle``,
        ``last``: where the chunk sits in the call): the call's first backward starts the float32 running
        ``dw`` (no running sum read), the ones between add onto it in place, the last ends it in ``w``'s dtype
        and shape; a call of one backward does both."""
        rows = self.piece_rows
        starts = chunk_role in ("only", "first")
        ends = chunk_role in ("only", "last")
        return tuple(dataclasses.replace(self.backward, n=size, dw_from_running=not (starts and j == 0),
                                         dw_to_running=not (ends and j == len(rows) - 1))
                     for j, size in enumerate(rows))

    @property
    def extra_bytes(self) -> int:
        """HBM this path holds beyond the recompute path's: one chunk's kept logits (every chunk's forward
        writes into the same buffer, :func:`row_stats_and_grads`; bf16 ones with their lane maxima), (over
        several backward calls) the float32 running dw, and where the backward takes them the chunk's ``x``
        transposed and padded (counted as float32: a bf16 ``x`` holds half), the float32 zero block its first
        call's ``dw`` slots are read from, and with :attr:`BackwardConfig.label_rows` a chunk's sorted rows and
        float32 share of ``dx``."""
        b = self.backward
        running = math.prod(self.running_dw_shape) if self.backward_calls > 1 else 0
        x_transposed = b.padded_n * b.hp if b.x_transposed else 0
        zeros = math.prod(b.dw_acc_shape) if b.dw_zeros_by_dma else 0
        label_rows = self.chunk * (b.hidden + 3) + b.nv + 1 if b.label_rows else 0
        kept = self.logits_shape[0] * self.kept_row_bytes
        return kept + 4 * (running + x_transposed + zeros + label_rows)


def plan_chunks(n: int, h: int, v: int, x_dtype: Any, w_dtype: Any, spec: StatsSpec,
                target: Target | None = None, chunk_tokens: int | None = None,
                hidden_split: int | None = None) -> KeptPlan:
    """The chunk and the kernels' tiles for ``x: [n, h]``, ``w`` with ``v`` entries on ``target``;
    ``chunk_tokens`` (default :data:`CHUNK_TOKENS`, read now, or :func:`default_chunk`) bounds the chunk,
    ``hidden_split`` (default :data:`HIDDEN_SPLIT`, read now) fixes the backward's hidden tiles.

    The tiles are the recompute path's for a chunk, adjusted to the VMEM budget: the forward's halved to the largest
    step that fits with its kept-logits blocks (:func:`_fit_forward`); the backward, which holds the chunk's ``x``
    and ``dx`` in VMEM (:mod:`ce_pallas_tpu.backward`, kept-logits mode), its vocab block halved down to
    :data:`PREFERRED_BLOCK_V_WIDTHS` MXU widths, then the chunk, its hidden size whole or in tiles (:func:`_fits`).
    Of those fits and (where the chunk is the default's) of up to twice their fewest chunks over ``n``, holding at
    most :data:`PLAN_MEMORY_GROWTH` times the preferred plan's extra HBM, the plan is the first, in that order of
    preference, whose :func:`estimated_seconds` is within :data:`PLAN_TOLERANCE` of the fastest's: 4096 tokens of
    Llama-3 8B's head on v6e would go in one chunk in two hidden tiles rather than three whole 1536-token chunks (an
    eighth more rows than tokens, each chunk's float32 ``dw`` traffic barely hidden), 16384 of Llama-3 70B's in
    eight 2048-token chunks rather than six of 3072. A plan in hidden tiles then gives way to the backward in
    pieces of its chunk (:func:`_pieces_plan`: v6e's 4096 tokens of Llama-3 8B's head in pieces of 1536, 1536 and
    1024 rows). Raises ``UnsupportedError`` where no chunk of
    :data:`MIN_FITTED_CHUNK` tokens or more fits (:func:`choose` then recomputes).
    """
    target = current_target() if target is None else target
    searching = chunk_tokens is None and CHUNK_TOKENS is None
    if chunk_tokens is None:
        chunk_tokens = CHUNK_TOKENS or _whole_chunks(n, default_chunk(h, jnp.dtype(w_dtype).itemsize, target))
    budget = tiling.vmem_budget(target)
    plans: list[KeptPlan] = []
    split, explicit = HIDDEN_SPLIT if hidden_split is None else hidden_split, _explicit_tiles(spec)
    fits = _fits(min(n, chunk_tokens), h, v, x_dtype, w_dtype, spec, target, budget, split)
    if not fits:
        raise UnsupportedError(
            f"pallas_tpu: keep_logits=True, but no kept-logits chunk of {MIN_FITTED_CHUNK} or more tokens of a "
            f"head with h={h}, v={v} fits {target.generation}'s VMEM budget of {budget} bytes"
            + (" with the block_sizes given" if explicit else "")
            + "; keep_logits=None or False recomputes the logits instead")
    if PIECE_TOKENS is not None:  # the longest fit's chunk, its backward in pieces
        longest = _plan(n, h, v, spec, *_chunked(n, *max(fits, key=lambda fit: fit[2])))
        forced = _pieces_plan(n, h, v, spec, longest, fits, PIECE_TOKENS)
        return _plan(n, h, v, spec, *_chunked(n, *fits[0])) if forced is None else forced
    for forward, backward, chunk in fits:
        plans.append(_plan(n, h, v, spec, *_chunked(n, forward, backward, chunk)))
        fewest = cdiv(n, chunk)
        for count in range(fewest + 1, 2 * fewest + 1) if searching else ():  # more, shorter chunks
            shorter = round_up(cdiv(n, count), 256)
            refit = _fit_split(shorter, h, v, x_dtype, w_dtype, spec, target, budget, backward.hidden_split, explicit)
            if refit is not None:
                plans.append(_plan(n, h, v, spec, *_chunked(n, *refit)))
    preferred = plans[0]  # the search trades speed, not memory: no alternative holds much more than it
    plans = [plan for plan in dict.fromkeys(plans) if plan.extra_bytes <= PLAN_MEMORY_GROWTH * preferred.extra_bytes]
    seconds = {plan: estimated_seconds(plan, w_dtype, target)[0] for plan in plans}
    chosen = next(plan for plan in plans if seconds[plan] <= (1 + PLAN_TOLERANCE) * min(seconds.values()))
    pieces = _pieces_plan(n, h, v, spec, chosen, fits) if searching and chosen.backward.hidden_split > 1 else None
    # Pieces whose float32 dw traffic does not hide lose to the tiles in libtpu's schedule, though the roofline
    # has them level: v6e, Llama-3 8B, a 1024-row piece runs 1.24-1.29 of its MXU minimum (2048 tokens: two).
    hides = pieces is not None and max(pieces.pieces) >= hiding_chunk(h, jnp.dtype(w_dtype).itemsize, target)
    if (pieces is not None and hides and pieces.extra_bytes <= keep_logits_budget(target)
            and estimated_seconds(pieces, w_dtype, target)[0] <= (1 + PLAN_TOLERANCE) * seconds[chosen]):
        return pieces
    return chosen


def _pieces_plan(n: int, h: int, v: int, spec: StatsSpec, base: KeptPlan,
                 fits: list[tuple[ForwardConfig, BackwardConfig, int]], longest: int | None = None) -> KeptPlan | None:
    """``base``'s chunks and forward with the backward of the fit that takes the hidden size whole (:func:`_fits`;
    else the preferred one) over pieces of each chunk (:attr:`KeptPlan.pieces`) of at most that fit's chunk (and
    ``longest``, :data:`PIECE_TOKENS`) rows; ``None`` where one piece would take the chunk. :func:`plan_chunks`
    takes it instead of its plan where that plan's backward takes the hidden size in tiles, the roofline
    (:func:`estimated_seconds`) has the pieces no slower beyond :data:`PLAN_TOLERANCE` and their extra HBM (the
    pieces add the float32 running ``dw`` to a call of one chunk) fits :func:`keep_logits_budget`: v6e, Llama-3
    8B's head, 4096 tokens in one chunk, the backward in two hidden tiles runs 1.171 of its MXU minimum in
    libtpu's schedule (10.98 ms), in pieces of 1536, 1536 and 1024 rows whole 10.43 ms (1.11), a gain the
    roofline puts within its tolerance. The chunks stay the plan's (at 8192 tokens four 2048-token chunks, not two
    of 4096 holding a third more), and :func:`plan_chunks` also asks the longest piece to hide its float32 ``dw``
    traffic (:func:`hiding_chunk`: at 2048 tokens two 1024-row pieces would lose to the tiles)."""
    forward, chunk = base.forward, base.chunk
    _, backward, fitted = next((fit for fit in fits if fit[1].hidden_split == 1), fits[0])
    limit = fitted if longest is None else min(longest, fitted)
    if limit >= chunk:
        return None
    if limit < backward.block_b:
        raise ValueError(f"PIECE_TOKENS={longest} is shorter than the backward's token block of {backward.block_b}")
    pieces = _piece_rows(chunk, limit, backward.block_b)
    backward = dataclasses.replace(backward, n=pieces[0], delta_over_logits=False)
    return _plan(n, h, v, spec, forward, backward, chunk, pieces)


#: How much slower (by :func:`estimated_seconds`) a preferred plan may be and still be taken over a faster
#: one: the roofline leaves out what libtpu's schedule shows per plan (steps outside the MXU, a second
#: hidden tile's ``delta``), so only a clear gain moves a plan from the preferred fit and chunk count.
PLAN_TOLERANCE = 0.03
#: How much more extra HBM (:attr:`KeptPlan.extra_bytes`) than the preferred plan another may hold (v5e, Llama-3
#: 70B: 1024-token chunks in two tiles, 7% more than 512 whole; v6e, Llama-3 8B at 8192 tokens: two
#: 4096-token chunks would hold 44% more than six of 1536, more than the float32 logits a materialised step holds).
PLAN_MEMORY_GROWTH = 1.1


def _chunked(n: int, forward: ForwardConfig, backward: BackwardConfig,
             chunk: int) -> tuple[ForwardConfig, BackwardConfig, int]:
    """A fit's chunk made a whole number of both kernels' token blocks where that leaves one, then as few
    tokens as the same number of chunks over ``n`` needs (less overlap at the end)."""
    if n <= chunk:
        return forward, backward, chunk
    unit = math.lcm(forward.block_b, backward.block_b)
    if chunk >= unit:
        whole = chunk // unit * unit
        chunk = min(whole, round_up(cdiv(n, cdiv(n, whole)), unit))
    return dataclasses.replace(forward, n=chunk), dataclasses.replace(backward, n=chunk), chunk


def _plan(n: int, h: int, v: int, spec: StatsSpec, forward: ForwardConfig, backward: BackwardConfig,
          chunk: int, pieces: tuple[int, ...] = ()) -> KeptPlan:
    """The plan of ``n`` tokens in chunks of ``chunk`` with these kernels' configs (the backward's over
    ``pieces`` of each chunk, if given), and its buffers' shapes."""
    # The kept logits are an array of their own, whose token blocks must be whole sublane tiles (a block
    # equal to the array's rows would do, but both kernels' blocks cannot always be): rows past N are masked.
    # The buffer's rows span the longer of the kernels' padded extents, each kernel's blocks then within it; they
    # need not be a whole number of both blocks (their lcm: v6e, Qwen3-0.6B's head, a chunk of 3000 tokens in the
    # forward's blocks of 1504 rows and the backward's of 1008 would have asked for 94,752 rows, 31 GB).
    if forward.block_b % 16:
        forward = dataclasses.replace(forward, block_b=round_up(forward.block_b, 16))
    if backward.block_b % 16:
        backward = dataclasses.replace(backward, block_b=round_up(backward.block_b, 16))
    backward_rows = backward.padded_n
    if pieces:  # the last piece's blocks start after the others' rows (whole blocks)
        last = dataclasses.replace(backward, n=pieces[-1])
        backward_rows = sum(pieces[:-1]) + last.padded_n
    rows = max(forward.padded_n, backward_rows)
    columns = max(forward.num_cores * forward.nv_per_core * forward.block_v,
                  backward.num_cores * backward.nv_per_core * backward.block_v)
    columns = round_up(columns, math.lcm(forward.block_v, backward.block_v))  # a few blocks at most
    return KeptPlan(n, h, v, chunk, forward, backward, (rows, columns), running_dw_shape(backward), pieces)


def _piece_rows(chunk: int, longest: int, block_b: int) -> tuple[int, ...]:
    """``chunk`` rows in as few backward pieces of at most ``longest`` rows as will do, all but the last the
    same whole number of ``block_b`` rows (each piece then starts on a token block of the kept logits), the
    last the rest: 4096 rows of at most 1536 in 256-row blocks go as (1536, 1536, 1024)."""
    longest = max(block_b, longest // block_b * block_b)
    size = min(longest, round_up(cdiv(chunk, cdiv(chunk, longest)), block_b))
    count = cdiv(chunk, size)
    return (size,) * (count - 1) + (chunk - (count - 1) * size,)


def estimated_seconds(plan: KeptPlan, w_dtype: Any, target: Target) -> tuple[float, float]:
    """Roofline estimates ``(kept, recompute)`` of the whole gradient step, each kernel the longer of its
    MXU work at the bf16 peak and its HBM traffic at the chip's bandwidth (all cores together).

    Recompute: the forward (``2NHV`` flops; ``w`` read) and the backward (``6NHV``; ``w`` read, ``dw``
    written). Kept, per chunk of ``C`` tokens: the forward (``2CHV``; ``w`` read, ``4CV`` bytes of logits
    written; about half that in bf16, :attr:`KeptPlan.kept_row_bytes`) and the backward over each of its pieces
    (:attr:`KeptPlan.pieces`; ``4PHV`` for ``P`` rows; ``w`` and the piece's logits read, the float32 running
    ``dw`` read and written: the call's first backward only writes it, the last reads it and writes ``dw`` in
    ``w``'s dtype). Each
    backward also forms ``delta`` from every logit, once per hidden tile, at the cost of
    ``ChipFacts.delta_columns`` MXU columns (v6e: what makes two tiles of Llama-3 8B's head 1.18 of their
    MXU minimum against 1.06 whole; formed once and read back by later tiles, ``delta_over_logits``, they
    still run 1.17: the per-tile charge stands for what a tile costs beyond its products, not ``delta``
    alone). The statistics, ``x`` and ``dx`` move ``[N]``- and ``[N, H]``-sized bytes on both paths, left out.
    This is what decides ``keep_logits=None`` and the plan (:func:`plan_chunks`); libtpu's static schedule
    checks it (``docs/benchmarks.md``).
    """
    cores = target.num_cores
    flops, bandwidth = target.facts.bf16_flops * cores, target.facts.hbm_bytes_per_s * cores
    n, h, v, c = plan.n, plan.h, plan.v, plan.chunk
    head = h * v * jnp.dtype(w_dtype).itemsize
    logits, running = c * plan.kept_row_bytes, 4 * math.prod(plan.running_dw_shape)
    delta = 4 * v * target.facts.delta_columns / flops  # per token and hidden tile, beside the products
    recompute = (max(2 * n * h * v / flops, head / bandwidth)
                 + max(6 * n * h * v / flops + n * delta, 2 * head / bandwidth))

    tiles = plan.backward.hidden_split  # the backward reads the logits and forms delta once per tile

    def forward_chunk() -> float:
        return max(2 * c * h * v / flops, (head + logits) / bandwidth)

    def backward_piece(rows: int, dw_bytes: float) -> float:
        kept_rows = rows * plan.kept_row_bytes
        return max(4 * rows * h * v / flops + tiles * rows * delta, (head + tiles * kept_rows + dw_bytes) / bandwidth)

    # Each backward call's float32 running dw: written by the call's first, read and written by the ones between,
    # read by the last (which writes dw in w's dtype); one call writes dw in w's dtype only.
    calls = [rows for _ in range(plan.chunks) for rows in plan.piece_rows]
    kept = plan.chunks * forward_chunk()
    if len(calls) == 1:
        return kept + backward_piece(calls[0], head), recompute
    kept += backward_piece(calls[0], running) + backward_piece(calls[-1], running + head)
    kept += sum(backward_piece(rows, 2 * running) for rows in calls[1:-1])
    return kept, recompute


def budgeted_plan(n: int, h: int, v: int, x_dtype: Any, w_dtype: Any, spec: StatsSpec, target: Target,
                  budget_bytes: int) -> KeptPlan:
    """:func:`plan_chunks`'s plan, its chunk shrunk (towards :data:`MIN_BUDGET_CHUNK_TOKENS`) where its
    :attr:`KeptPlan.extra_bytes` exceed ``budget_bytes`` and fewer tokens per chunk would fit."""
    plan = plan_chunks(n, h, v, x_dtype, w_dtype, spec, target)
    if plan.extra_bytes > budget_bytes:
        logits_room = budget_bytes - 4 * math.prod(plan.running_dw_shape)
        fitting = logits_room // plan.kept_row_bytes // 512 * 512
        if MIN_BUDGET_CHUNK_TOKENS <= fitting < plan.chunk:
            plan = plan_chunks(n, h, v, x_dtype, w_dtype, spec, target, chunk_tokens=fitting)
    return plan


def choose(n: int, h: int, v: int, x_dtype: Any, w_dtype: Any, spec: StatsSpec,
           target: Target | None = None, budget_bytes: int | None = None) -> KeptPlan | None:
    """The kept-logits plan for a scalar loss's gradient under ``keep_logits=None``, or ``None`` for the
    recompute: kept where its :attr:`KeptPlan.extra_bytes` fit ``budget_bytes`` (default
    :func:`keep_logits_budget`; the chunk shrinks to fit, :func:`budgeted_plan`) and
    :func:`estimated_seconds` has it faster. Where ``H`` is below twice the chip's flops per HBM byte (v6e:
    1120) the forward's float32 logits cannot hide under its matmuls, yet keeping still pays there: in
    libtpu's static schedule v6e's Qwen2.5-0.5B and Qwen3-0.6B heads (4096 tokens) take 5.51 ms kept against
    5.93 and 6.06 recomputing (until 2026-11-30 they recomputed, by a comparison that put the recompute
    kernels' ratios over the padded ``Hp`` beside the kept step's over ``H``)."""
    target = current_target() if target is None else target
    if n == 0:
        return None
    budget = keep_logits_budget(target) if budget_bytes is None else budget_bytes
    try:
        plan = budgeted_plan(n, h, v, x_dtype, w_dtype, spec, target, budget)
    except UnsupportedError:  # no chunk's kernels fit VMEM: the recompute path's tile in the hidden size
        return None
    if plan.extra_bytes > budget:
        return None
    kept, recompute = estimated_seconds(plan, w_dtype, target)
    return plan if kept < recompute else None


def _whole_chunks(n: int, preferred: int) -> int:
    """The chunk for ``n`` tokens near ``preferred``: ``n`` split into as many equal chunks as whole
    ``preferred`` ones fit, in whole 512s (about ``preferred`` to twice that, at most :data:`MAX_CHUNK_TOKENS`):
    4096 tokens at 1536 go in two 2048-token chunks, not three with the last overlapping the one before."""
    return min(MAX_CHUNK_TOKENS, max(preferred, round_up(cdiv(n, max(1, n // preferred)), 512)))


#: The chunk is not halved below this many tokens to fit the backward's VMEM.
MIN_FITTED_CHUNK = 256
#: The backward's vocab block is first not narrowed below this many MXU widths (a step of fewer columns
#: spends more of itself outside the MXU: v6e, Llama-3's head, 1536-token chunks: 1.063 of the step's MXU
#: minimum at 1024 columns; 3072-token chunks at 256: 1.71), then down to 256 if no chunk fits otherwise.
PREFERRED_BLOCK_V_WIDTHS = 4


#: The hidden tiles the kept backward may take a wide head's hidden size in (:attr:`BackwardConfig.hidden_split`).
HIDDEN_SPLITS = (1, 2, 4)


def _fits(chunk: int, h: int, v: int, x_dtype: Any, w_dtype: Any, spec: StatsSpec, target: Target,
          budget: int, split: int | None) -> list[tuple[ForwardConfig, BackwardConfig, int]]:
    """Both kernels' configs and the chunk (:func:`_fit_split`) of each way the backward may take the hidden
    size (in ``split`` tiles only, if given): whole, and (``H`` a whole number of 128-wide tiles, tiles not
    explicit) in each number of tiles of :data:`HIDDEN_SPLITS`. The preferred first: whole unless that
    starves the backward (:func:`_starved`), else the fit of the longest chunk (the fewest tiles on a tie);
    then the others that do not starve it.

    A wide head (Llama-3 70B's H=8192) holds so much per token and per vocab entry in VMEM (the chunk's
    ``x`` and float32 ``dx``, the ``[Hp, block_v]`` ``w`` block and ``dw`` slots) that its chunk or its vocab
    block shrinks until the float32 ``dw``'s traffic no longer hides (v5p: 256-token chunks, 1.10 of the
    8NHV minimum in libtpu's static schedule; v6e: 256-column vocab blocks, 1.11); in hidden tiles each
    holds a tile's worth, at the price of reading the kept logits and forming ``delta`` once per tile.
    The longest chunk preferred over the first unstarved one: v6e, Llama-3 70B, two tiles fit 1536-token
    chunks (backward 1.36 of its MXU minimum, HBM level with the MXU), four 3072 (1.18)."""
    explicit = _explicit_tiles(spec)
    if split is not None or explicit:
        fitted = _fit_split(chunk, h, v, x_dtype, w_dtype, spec, target, budget, split or 1, explicit)
        return [] if fitted is None else [fitted]
    tried = [_fit_split(chunk, h, v, x_dtype, w_dtype, spec, target, budget, tiles, explicit)
             for tiles in HIDDEN_SPLITS if tiles == 1 or (round_up(h, 128) == h and h % (128 * tiles) == 0)]
    fits = [fit for fit in tried if fit is not None]
    if not fits:
        return []
    whole = fits[0]
    preferred = max(fits, key=lambda fit: fit[2]) if _starved(whole, h, w_dtype, target) else whole
    return [preferred, *(fit for fit in fits if fit is not preferred and not _starved(fit, h, w_dtype, target))]


def _explicit_tiles(spec: StatsSpec) -> bool:
    """Whether the caller set the token or vocab block (then the backward's hidden size stays whole)."""
    sizes = spec.block_sizes
    return sizes is not None and (sizes.b_block_size is not None or sizes.v_block_size is not None)


def _starved(fitted: tuple[ForwardConfig, BackwardConfig, int], h: int, w_dtype: Any, target: Target) -> bool:
    """Whether a fit's backward runs below its MXU's pace for want of VMEM: a chunk too short to hide the
    float32 ``dw``'s traffic (:func:`hiding_chunk`) or vocab blocks narrower than
    :data:`PREFERRED_BLOCK_V_WIDTHS` MXU widths (where the vocabulary has that many)."""
    _, backward, chunk = fitted
    preferred = min(backward.v, PREFERRED_BLOCK_V_WIDTHS * target.facts.mxu_side)
    return chunk < hiding_chunk(h, jnp.dtype(w_dtype).itemsize, target) or backward.block_v < preferred


def _fit_split(chunk: int, h: int, v: int, x_dtype: Any, w_dtype: Any, spec: StatsSpec, target: Target,
               budget: int, split: int, explicit: bool) -> tuple[ForwardConfig, BackwardConfig, int] | None:
    """Both kernels' configs and the chunk, the backward's hidden size in ``split`` tiles: the largest chunk
    (from ``chunk`` down, by 512 tokens to 1024, then halving to :data:`MIN_FITTED_CHUNK`, in whole 256s) whose
    kernels fit VMEM with vocab blocks of at least :data:`PREFERRED_BLOCK_V_WIDTHS` MXU widths, else with
    narrower ones; ``None`` where none fits (the chunk's resident ``x`` and float32 ``dx`` alone can fill VMEM: tpu7x, a
    head with ``H = 4904`` of ``V = 1185`` entries, went to libtpu at 1792 tokens, 67 MB of its 64)."""
    for floor in (PREFERRED_BLOCK_V_WIDTHS * target.facts.mxu_side, 256):
        size = chunk
        while True:
            base = make_plan(size, h, v, x_dtype, w_dtype, spec, target)
            shape = problem_shape(size, h, v, x_dtype, w_dtype, spec)
            in_bf16 = split == 1 and _kept_in_bf16(base, shape, target)
            backward = _fit_backward(base, shape, budget, floor, explicit, split, target, in_bf16)
            if _backward_need(backward, shape) <= budget:
                forward = _fit_forward(base, shape, target, budget, explicit, in_bf16)
                group = forward.maxima_columns
                if in_bf16 and max(group, backward.block_v) % min(group, backward.block_v):
                    forward = dataclasses.replace(forward, kept_bf16=False)  # no lane maxima's block in common
                backward = dataclasses.replace(backward, kept_bf16=forward.kept_bf16,
                                               kept_block_v=forward.maxima_columns if forward.kept_bf16 else 0)
                if max(_backward_need(backward, shape), _forward_need(forward, shape, target)) <= budget:
                    return forward, backward, size
            if size <= MIN_FITTED_CHUNK:
                break
            size = max(MIN_FITTED_CHUNK, (size - 512 if size > 1024 else size // 2) // 256 * 256)
    return None


def _kept_in_bf16(base: Plan, shape: cost_model.Shape, target: Target) -> bool:
    """Whether the kept logits go in bf16 below their lanes' maxima (:attr:`ForwardConfig.kept_bf16`): where the
    chip's schedule gains by it (:attr:`ce_pallas_tpu.target.ChipFacts.kept_logits_bf16`), for bf16 inputs whose
    products run in bf16 (their ``delta`` is rounded to bf16 anyway), the forward's hidden size whole and too
    narrow for float32 writes to hide under its matmuls (``Hp < 2 flops_per_byte``), without a soft cap: a capped
    head's saturated logits carry large probabilities far below their lane's raw maximum (v6e's interpreter, logits
    of standard deviation 4 capped at 10: ``dw`` 36% farther from the oracle than with float32 logits)."""
    forward = base.forward
    return (target.facts.kept_logits_bf16 and shape.x_bytes == 2 and shape.w_bytes == 2 and not shape.capped
            and common.mxu_dtype(forward.precision) == jnp.bfloat16 and forward.nh == 1
            and forward.block_v % LANES == 0 and shape.hp < 2 * target.facts.flops_per_byte)


def _fit_forward(base: Plan, shape: cost_model.Shape, target: Target, budget: int, explicit: bool,
                 in_bf16: bool = False) -> ForwardConfig:
    """The kept forward's tiles: the recompute forward's (the hidden size whole where that fits,
    :func:`_with_the_hidden_size_whole`) where they and the kept logits' blocks fit VMEM, else
    :func:`_largest_fitting_forward`'s. Unless the caller set the tiles, the token block then grows
    where the kept logits' writes would not hide (:func:`_grown_for_kept_writes`). ``in_bf16``: the logits
    kept in bf16 (:func:`_kept_in_bf16`)."""
    cfg = dataclasses.replace(base.forward, keep_logits=True, kept_bf16=in_bf16)
    if not explicit:
        cfg = _with_the_hidden_size_whole(cfg, shape, target, budget)
    if _forward_need(cfg, shape, target) > budget:
        cfg = _largest_fitting_forward(cfg, shape, target, budget)
    if not explicit:
        cfg = _widened_for_bf16_groups(_grown_for_kept_writes(cfg, shape, target, budget), shape, target, budget)
    return dataclasses.replace(cfg, kept_maxima_columns=lane_maxima_columns(cfg))


def _with_the_hidden_size_whole(cfg: ForwardConfig, shape: cost_model.Shape, target: Target,
                                budget: int) -> ForwardConfig:
    """The kept forward with the hidden size whole where the recompute forward's tiles split it and the whole
    fits VMEM: a chunk of a wide head is short, and the recompute plan for so few tokens takes hidden tiles, whose
    partial logits a step adds up in VMEM before its statistics (Llama-3 70B's 1024-token chunks in 512 x 2048 x
    1024 tiles: v5e 1.108 and v5p 1.112 of the MXU minimum; the hidden size whole: v5e 1.014 at 512 x 8192 x 1024,
    v5p 1.024 at 512 x 8192 x 512, the vocab block halved where the whole does not fit at the first)."""
    if cfg.nh == 1:
        return cfg
    whole = dataclasses.replace(cfg, block_h=cfg.hp)
    trials = [whole]
    if _halvable_forward_width(cfg.block_v, target):  # v5p's VMEM holds 70B's whole at half the vocab block
        trials.append(dataclasses.replace(whole, block_v=cfg.block_v // 2))
    return next((trial for trial in trials if _forward_need(trial, shape, target) <= budget), cfg)


#: The vocab block of a kept forward with bf16 logits (:func:`_widened_for_bf16_groups`).
KEPT_BF16_BLOCK_V = 2048


def _widened_for_bf16_groups(cfg: ForwardConfig, shape: cost_model.Shape, target: Target,
                             budget: int) -> ForwardConfig:
    """A kept forward with bf16 logits (:attr:`ForwardConfig.kept_bf16`) in blocks of :data:`KEPT_BF16_BLOCK_V`
    columns and the most rows (up to the chunk's, down to its own) that fit VMEM with them: a step's first
    lane-maxima group (:func:`lane_maxima_columns`) stores its logits while the second group's products run, so
    less of the step is left after its last product, and a block of the chunk's every row reads ``w`` once
    (v6e, Qwen2.5-0.5B's head, 4096-token chunks: 4096 x 1024 tiles 1.172 of the MXU minimum, 2048 x 4096
    1.162, 4096 x 2048 1.153). Unchanged where no such block fits (Qwen3-0.6B's 4096 x 1024 at 1.170, against
    2048 x 2048's 1.182) or the vocabulary is narrower. With the entropy's statistic (more vector work a logit, its
    weighted sum) the wider block pays for half the rows too: Qwen3-0.6B 4096 x 1024 1.302, 2048 x 2048 1.286,
    Qwen2.5-0.5B 1.288 and 1.262."""
    if not cfg.kept_bf16 or cfg.column_chunk is None or KEPT_BF16_BLOCK_V > round_up(shape.v, LANES):
        return cfg
    rows = cfg.block_b
    while cfg.padded_n % (2 * rows) == 0:
        rows *= 2
    fewest = cfg.block_b // 2 if cfg.with_expected and cfg.block_b % 16 == 0 else cfg.block_b
    while rows >= fewest:
        trial = dataclasses.replace(cfg, block_b=rows, block_v=KEPT_BF16_BLOCK_V)
        trial = dataclasses.replace(trial, kept_maxima_columns=lane_maxima_columns(trial))
        if _forward_need(trial, shape, target) <= budget:
            return trial
        rows //= 2
    return cfg


#: Column chunks to a lane-maxima group of the kept forward (:attr:`ForwardConfig.kept_maxima_columns`).
KEPT_MAXIMA_CHUNKS = 4


def lane_maxima_columns(cfg: ForwardConfig) -> int:
    """The kept forward's lane-maxima group: :data:`KEPT_MAXIMA_CHUNKS` column chunks (v6e: 1024 columns) where
    the block holds several such groups; the whole block otherwise (0), and without bf16 logits. (Groups of 512
    columns took v6e's forward at Qwen2.5-0.5B's head to 1.145 of its MXU minimum, 256 to 1.065 but past its
    HBM floor, and the backward, whose block then spans four groups' maxima, from 1.073 to 1.151.)"""
    chunk = cfg.column_chunk
    if not cfg.kept_bf16 or chunk is None or cfg.block_v % (2 * KEPT_MAXIMA_CHUNKS * chunk):
        return 0
    return KEPT_MAXIMA_CHUNKS * chunk


def _largest_fitting_forward(cfg: ForwardConfig, shape: cost_model.Shape, target: Target,
                             budget: int) -> ForwardConfig:
    """Of ``cfg``'s token block halved any number of times and its vocab block halved down to
    :data:`PREFERRED_BLOCK_V_WIDTHS` MXU widths, the tiles that fit VMEM with the most logits a step, the
    most rows on a tie (the smallest, if none fits: the compile will say so). A step's work outside the
    MXU and its ``w`` block's read shrink per row as the token block grows: in libtpu's schedule a
    512 x 1024 tile of Llama-3 8B's head on v5p runs at 1.032 of its MXU minimum against 1.054 for
    256 x 2048, 1024 x 1024 of Qwen2.5-1.5B's at 1.040 against 1.058 for 512 x 2048 (Llama-3 70B's head
    on v6e, 1536-token chunks: 384 x 2048 ran at 1.54, every ``w`` block read for 384 rows)."""
    widths = [cfg.block_v]
    while _halvable_forward_width(widths[-1], target):
        widths.append(widths[-1] // 2)
    rows = [cfg.block_b]
    while rows[-1] > 8 and rows[-1] % 16 == 0:
        rows.append(rows[-1] // 2)
    trials = [dataclasses.replace(cfg, block_b=b, block_v=v) for b in rows for v in widths]
    fitting = [trial for trial in trials if _forward_need(trial, shape, target) <= budget]
    if not fitting:
        return trials[-1]
    return max(fitting, key=lambda trial: (trial.block_b * trial.block_v, trial.block_b))


def _halvable_forward_width(block_v: int, target: Target) -> bool:
    """Whether the kept forward's vocab block may be halved: whole 128-lane halves of at least
    :data:`PREFERRED_BLOCK_V_WIDTHS` MXU widths."""
    return block_v // 2 >= PREFERRED_BLOCK_V_WIDTHS * target.facts.mxu_side and block_v % 256 == 0


def _forward_need(cfg: ForwardConfig, shape: cost_model.Shape, target: Target) -> int:
    """VMEM of the kept forward: the forward's model plus two float32 blocks of the logits it writes. With
    :attr:`ForwardConfig.kept_bf16`: two bf16 blocks and two of lane maxima, and the float32 values of one
    lane-maxima group, formed before its maxima are known (:attr:`ForwardConfig.maxima_columns`); the
    forward's model then counts no label statistic where the kernel takes none (a ``[V, H]`` head's label
    logit is taken beside it). Fitted to libtpu's figures at 22 tiles on v6e (``H`` 384-1024, 2048-4096
    rows, 1024-2048 columns, both layouts), every one bounded from above by 3.7-17.5 MiB
    (docs/notes/2026-12-04-kept-store-whole-block.md)."""
    model = cost_model.forward_bytes(shape, cfg.block_b, cfg.block_h, cfg.block_v, chip=target.facts)
    if not cfg.kept_bf16:
        return model + 2 * 4 * cfg.block_b * cfg.block_v
    rows = round_up(cfg.block_b, 8)
    label = 0 if cfg.label_in_kernel else 4 * 4 * rows * LANES  # its output's and its state's two slots
    groups = cfg.block_v // cfg.maxima_columns
    kept = 2 * 2 * cfg.block_b * cfg.block_v + 2 * 4 * rows * LANES * groups
    return model - label + kept + 4 * cfg.block_b * cfg.maxima_columns


def _kept_forward_hides(block_b: int, shape: cost_model.Shape, target: Target, logit_bytes: int = 4) -> bool:
    """Whether the kept forward's HBM traffic hides under its matmuls: per flop it reads ``w_bytes /
    (2 block_b)`` bytes of ``w`` (a ``w`` block per step, for ``block_b`` rows) and writes ``logit_bytes /
    (2 Hp)`` of logits, against the chip's ``1 / flops_per_byte``."""
    return shape.w_bytes / (2 * block_b) + logit_bytes / (2 * shape.hp) <= 1 / target.facts.flops_per_byte


def _grown_for_kept_writes(cfg: ForwardConfig, shape: cost_model.Shape, target: Target,
                           budget: int) -> ForwardConfig:
    """The kept forward's token block doubled, within the chunk's rows, while its traffic does not hide
    (:func:`_kept_forward_hides`), its vocab block halved (down to :data:`PREFERRED_BLOCK_V_WIDTHS` MXU
    widths) where the doubled blocks would not fit VMEM. The recompute forward's token block hides ``w``
    alone; the float32 logits written add ``2 / Hp`` bytes per flop, which on v6e (560 flops per byte)
    leaves a narrow head's forward HBM-bound at that block: Qwen2.5-1.5B's, 1024 x 4096 tiles of a
    4096-token chunk, moves 1.31 times what its MXU time hides; 4096 x 1024 tiles run at 1.04 of the MXU
    minimum. Where ``Hp <= 2 flops_per_byte`` nothing hides; fewer ``w`` reads still cut the traffic."""
    logit_bytes = 2 if cfg.kept_bf16 else 4
    while not _kept_forward_hides(cfg.block_b, shape, target, logit_bytes) and cfg.padded_n % (2 * cfg.block_b) == 0:
        trial = dataclasses.replace(cfg, block_b=2 * cfg.block_b)
        while _forward_need(trial, shape, target) > budget and _halvable_forward_width(trial.block_v, target):
            trial = dataclasses.replace(trial, block_v=trial.block_v // 2)
        if _forward_need(trial, shape, target) > budget:
            break
        cfg = trial
    return cfg


def _backward_need(cfg: BackwardConfig, shape: cost_model.Shape) -> int:
    """VMEM of the kept-logits backward: the recompute backward's model with its ``x`` blocks and ``dx``
    slots replaced by the chunk-resident ``x`` and float32 ``dx``, plus the kept logits' blocks, and its
    float32 accumulator replaced by two float32 ``dw`` slots (the ``w``-typed staging block stays: the
    last chunk writes through it); every hidden extent the tile's (:attr:`BackwardConfig.hidden_split`).
    The per-row columns are still counted as the recompute kernel's two buffers of each, though the kept
    backward holds them in one resident slab (``backward._RowSlab``: as much where a call has at most two token
    blocks and the slab holds each field at lane 0, else 512 bytes a row for all fields, up to 6 MiB less at
    1024-row blocks): an overestimate kept so the plans stay the ones measured; counted exactly, 15 of the 96
    matrix plans take larger tiles, not all faster (v6e Llama-3 8B at 16384 tokens: 384-row blocks, its backward
    1.06 -> 0.98-1.03 of its MXU minimum; at 4096 one chunk in two hidden tiles, 1.142, against 1.12 in pieces;
    docs/notes/2026-12-04-kept-row-slab.md)."""
    rows, hp = round_up(cfg.padded_n, 16), cfg.hidden_tile
    blocks = hp * cfg.block_v
    shape = dataclasses.replace(shape, hp=hp)
    recompute = cost_model.backward_bytes(shape, cfg.block_b, cfg.block_h, cfg.block_v, single_w=cfg.w_buffers == 1)
    blocked = 2 * cfg.block_b * hp * (shape.x_bytes + 4)
    resident = rows * hp * (shape.x_bytes + 4)
    # A block's float32 lane maxima: 128 a forward lane-maxima group (before the forward is fitted, the
    # narrowest group it takes, :func:`lane_maxima_columns`: 1024 columns on v6e, the one chip keeping bf16 logits).
    group = cfg.kept_block_v or KEPT_MAXIMA_CHUNKS * 256
    maxima = 4 * LANES * max(1, cfg.block_v // group)
    logits = 2 * cfg.block_b * (2 * cfg.block_v + maxima if cfg.kept_bf16 else 4 * cfg.block_v)
    return recompute - blocked + resident + logits + 4 * blocks


#: The kept backward's largest default tiles: its ``x`` and ``dx`` stay in VMEM, so a step's token block
#: can be large, and a larger step leaves less of itself outside the MXU (v5p, Qwen2.5-0.5B's tied head,
#: 1024-token chunks: the recompute kernel's tiles, 256 x 512 in 128-row hidden chunks, 1.485 of the
#: step's MXU minimum; 1024 x 1024 over the whole hidden size 1.098, 1024 x 2048 1.062; Llama-3's head,
#: 512-token chunks: 256 x 512 1.084, 512 x 512 1.059).
KEPT_MAX_BLOCK_B, KEPT_MAX_BLOCK_V = 1024, 2048


def _fit_backward(base: Plan, shape: cost_model.Shape, budget: int, floor: int = 256,
                  explicit: bool = False, split: int = 1, target: Target | None = None,
                  in_bf16: bool = False) -> BackwardConfig:
    """The kept backward's tiles: explicit ones as given (vocab block halved to fit); by default the
    products over the whole hidden size, the largest token block that divides the chunk (at most
    :data:`KEPT_MAX_BLOCK_B`) and the widest vocab block (at most :data:`KEPT_MAX_BLOCK_V`) whose VMEM fits:
    the vocab block narrowed first, down to ``floor``, then the token block, down to 256."""
    facts = None if target is None else target.facts  # the chip's choices of the kernel's forms
    cfg = dataclasses.replace(base.backward, kept_logits=True, hidden_split=split,
                              delta_over_logits=facts is not None and facts.delta_over_logits and split > 1,
                              x_transposed=facts is not None and facts.kept_x_transposed
                              and base.backward.w_layout == "hv",
                              dw_zeros_by_dma=facts is not None and facts.kept_dw_zeros_by_dma,
                              cotangent_in_exponent=not base.backward.with_expected
                              or (facts is not None and facts.kept_entropy_in_exponent),
                              label_rows=facts is not None and facts.kept_label_rows
                              and base.backward.w_layout == "vh", kept_bf16=in_bf16)
    if cfg.hidden_tile % cfg.block_h:
        cfg = dataclasses.replace(cfg, block_h=cfg.hidden_tile)
    # Whether token blocks of whole 128-lane runs let v6e hold dx (and a tied head's dw) transposed below.
    lanes_pay = facts is not None and facts.kept_dx_transposed and split == 1 and cfg.hp % facts.mxu_side != 0
    if not explicit:
        cfg = _widest_fitting(cfg, shape, budget, floor, lanes_pay)
    while _backward_need(cfg, shape) > budget and cfg.block_v > floor and cfg.block_v % 256 == 0:
        cfg = dataclasses.replace(cfg, block_v=cfg.block_v // 2)
    if cfg.x_transposed and cfg.nb > 1 and cfg.block_b % LANES:  # a token block of x.T is a run of its lanes
        cfg = dataclasses.replace(cfg, x_transposed=False)
    # dx held transposed where Hp would pad the dx product's output columns to the MXU's side (and, as x.T's,
    # a token block of dx.T is a run of its lanes).
    whole_lanes = cfg.nb == 1 or cfg.block_b % LANES == 0
    if lanes_pay and whole_lanes:
        cfg = dataclasses.replace(cfg, dx_transposed=True)
    # A [V, H] head's dw held [Hp, V] where Hp would pad that product's output columns too, formed from x.T
    # (a run of its lanes a token block, as above), the label's term then in delta.
    if (facts is not None and facts.kept_dw_transposed and cfg.w_layout == "vh" and split == 1
            and cfg.hidden == cfg.hp and cfg.hp % facts.mxu_side and whole_lanes):
        cfg = dataclasses.replace(cfg, kept_dw_transposed=True, x_transposed=True, label_rows=False)
    return cfg


#: How many more padded token rows a chunk may take in whole 128-lane token blocks than in the recompute
#: plan's block, where such blocks let v6e hold the backward's products transposed (Qwen2.5-0.5B's tied head at
#: 3,000 and 2,900 tokens: docs/notes/2026-12-03-kept-whole-lane-token-blocks.md).
KEPT_LANE_PADDING_ALLOWANCE = 1.05


def _widest_fitting(cfg: BackwardConfig, shape: cost_model.Shape, budget: int, floor: int,
                    lanes_pay: bool = False) -> BackwardConfig:
    lane = max(cfg.mxu_side, 128)
    # A vocabulary of one block takes exactly V columns (a block may equal the array's extent, not exceed it).
    widest = cfg.v if cfg.v <= KEPT_MAX_BLOCK_V else KEPT_MAX_BLOCK_V
    # Whole 128-row multiples that divide the chunk, largest first (an 896-token chunk in one block, not in the
    # recompute plan's: 16 rows for TPU7x's [4904, 1185] head); else the recompute plan's, or where whole-lane
    # blocks pay (lanes_pay) and pad the chunk little more than it, those first.
    token_blocks = [b for b in range(KEPT_MAX_BLOCK_B // 128 * 128, 255, -128) if cfg.n % b == 0] or [cfg.block_b]
    if lanes_pay and cfg.n > token_blocks[0] and token_blocks[0] % LANES:
        token_blocks = [*_whole_lane_token_blocks(cfg.n, cfg.block_b), *token_blocks]
    for block_b in token_blocks:
        block_v = widest
        while True:
            trial = dataclasses.replace(cfg, block_b=block_b, block_h=cfg.hidden_tile, block_v=block_v,
                                        num_cores=min(cfg.num_cores, cdiv(cfg.v, block_v)))
            if _backward_need(trial, shape) <= budget:
                return trial
            if block_v <= max(floor, lane):
                break
            block_v = _narrower_width(block_v, lane)
    return cfg


def _whole_lane_token_blocks(n: int, block_b: int) -> list[int]:
    """Token blocks of whole 128-row runs, largest first, that pad ``n`` rows to at most
    :data:`KEPT_LANE_PADDING_ALLOWANCE` times the rows that blocks of ``block_b`` pad it to."""
    allowed = KEPT_LANE_PADDING_ALLOWANCE * round_up(n, block_b)
    return [b for b in range(KEPT_MAX_BLOCK_B // LANES * LANES, 255, -LANES) if round_up(n, b) <= allowed]


def _narrower_width(block_v: int, lane: int) -> int:
    """The next vocab block to try below ``block_v``: half of it where that is whole MXU widths, else the
    widest power-of-two number of MXU widths below it (a one-block vocabulary of 1185 entries narrows to
    1024, then halves)."""
    if block_v % (2 * lane) == 0:
        return block_v // 2
    return lane * 2 ** ((block_v - 1) // lane).bit_length() // 2


def row_stats_and_grads(
    x: jax.Array,
    w: jax.Array,
    labels: jax.Array,
    spec: StatsSpec,
    cotangent_fn: CotangentFn,
    token_params: Any,
    *,
    row_scale: jax.Array | None = None,
    live: jax.Array | None = None,
    plan: KeptPlan | None = None,
) -> tuple[RowStats, jax.Array, jax.Array]:
    """Statistics, ``dx`` (``x``'s dtype) and ``dw`` (``w``'s dtype and layout) of ``cotangent_fn``'s
    cotangents, chunk by chunk with the logits kept (module docs). With ``live`` (bool ``[N]``) both
    kernels skip each chunk's token blocks that hold no live row (:class:`ce_pallas_tpu.common.LiveBlocks`);
    dead rows' statistics are 0 (``cotangent_fn`` sees them so), their ``dx`` rows 0."""
    n, h = x.shape
    v = vocab_size(w, spec)
    plan = plan_chunks(n, h, v, x.dtype, w.dtype, spec) if plan is None else plan
    rows = plan.chunk
    y = labels.astype(jnp.int32)
    scale = None if row_scale is None else row_scale.astype(jnp.float32)
    live = None if live is None else live.reshape(-1).astype(bool)

    def chunk(index, carry, configs: tuple[BackwardConfig, ...]):
        stats, dx, dw, kept = carry
        first_new = index * rows
        start = jnp.minimum(first_new, n - rows) if n % rows else first_new
        piece = lambda a: jax.lax.dynamic_slice_in_dim(a, start, rows)  # noqa: E731
        x_all = x
        if kept is not None:  # this chunk's x read once the chunk before is done (not every chunk's at once)
            x_all, kept = jax.lax.optimization_barrier((x, kept))
        x_c, y_c = piece(x_all), piece(y).reshape(-1, 1)
        s_c = None if scale is None else piece(scale).reshape(-1, 1)
        live_c = None if live is None else piece(live)
        partials = forward_call(x_c, w, y_c, plan.forward, s_c, plan.logits_shape,
                                live_blocks=live_blocks(live_c, plan.forward.block_b), logits_into=kept)
        kept_outputs = 2 if plan.forward.kept_bf16 else 1
        logits, maxima = partials[-kept_outputs], partials[-1] if plan.forward.kept_bf16 else None
        stats_c = dead_rows_zeroed(merge_partials(list(partials[:-kept_outputs]), x_c, w, y_c, plan.forward, s_c),
                                   live_c)
        smooth = stats_c._replace(max=None, argmax=None)
        cotangent = cotangent_fn(smooth, jax.tree.map(piece, token_params))
        if n % rows:  # rows an earlier chunk owned add nothing now
            owned = jnp.arange(rows, dtype=jnp.int32) + start >= first_new
            cotangent = jax.tree.map(lambda g: jnp.where(owned, g, 0.0), cotangent)
        dx_pieces, offset = [], 0
        for cfg in configs:  # the backward over each piece's rows of the chunk's kept logits (one, unless pieces)
            assert offset % cfg.block_b == 0, (offset, cfg.block_b)
            cfg = dataclasses.replace(cfg, logits_row_block=offset // cfg.block_b)
            part = functools.partial(jax.lax.slice_in_dim, start_index=offset, limit_index=offset + cfg.n)
            x_p, y_p, s_p, live_p = (None if a is None else part(a) for a in (x_c, y_c, s_c, live_c))
            stats_p, cotangent_p = jax.tree.map(part, stats_c), jax.tree.map(part, cotangent)
            dx_partials, dw, logits, sign, dx_share = _backward(x_p, w, y_p, s_p, stats_p, cotangent_p, logits, dw,
                                                                cfg, live_p, maxima)
            dx_p = merged_dx(dx_partials, cfg.n, h, live_p)
            if dx_share is not None:
                dx_p = dx_p + dx_share
            dx_pieces.append(dx_p if sign is None else sign * dx_p)
            offset += cfg.n
        # The next chunk's forward writes into this buffer: only once this backward has read it (without
        # the barrier XLA may run that forward first, on a copy: a second logits buffer).
        logits, dw = jax.lax.optimization_barrier((logits, dw))
        dx_c = dx_pieces[0] if len(dx_pieces) == 1 else jnp.concatenate(dx_pieces)
        # Each row's dx comes from one chunk (an overlapped row's second is 0), so x's dtype holds it exactly.
        dx_c = (piece(dx).astype(jnp.float32) + dx_c).astype(dx.dtype)
        dx = jax.lax.dynamic_update_slice_in_dim(dx, dx_c, start, 0)
        put = lambda full, part: jax.lax.dynamic_update_slice_in_dim(full, part, start, 0)  # noqa: E731
        stats = jax.tree.map(put, stats, stats_c)
        return stats, dx, dw, logits

    # The first chunk starts the float32 running dw (no zeroed buffer read); the chunks between add onto
    # it in place; the last one writes the finished dw in w's dtype (no slice and cast after the loop).
    # The first chunk's forward makes the logits buffer; every later one writes into it (one buffer).
    carry = vary_like((_empty_stats(n, spec), jnp.zeros((n, h), x.dtype), None, None), x, w, labels,
                      token_params, row_scale)
    if plan.chunks == 1:
        carry = chunk(0, carry, plan.piece_configs("only"))
    else:
        carry = chunk(0, carry, plan.piece_configs("first"))
        if plan.chunks > 2:
            middle = plan.piece_configs("middle")
            if plan.chunks - 2 <= UNROLLED_MIDDLE_CHUNKS:
                for index in range(1, plan.chunks - 1):
                    carry = chunk(index, carry, middle)
            else:
                carry = jax.lax.fori_loop(1, plan.chunks - 1, functools.partial(chunk, configs=middle), carry)
        carry = chunk(plan.chunks - 1, carry, plan.piece_configs("last"))
    stats, dx, dw, _ = carry
    return stats, dx, dw


def _backward(x_c, w, y_c, s_c, stats: RowStats, cotangent: RowStats, logits, running_dw, cfg: BackwardConfig,
              live: jax.Array | None, maxima: jax.Array | None = None):
    """The backward kernel on one chunk's kept logits: ``(dx partials, running dw plus the chunk's, the
    logits' buffer as the kernel leaves it, the rows' sign that dx takes or None, the label term's share of dx
    with :attr:`BackwardConfig.label_rows` or None)``; ``maxima`` the lane maxima of bf16 kept logits; dead rows
    (``live`` false) made inert, dead token blocks skipped."""

    def column(g: jax.Array | None) -> jax.Array | None:
        return None if g is None else g.astype(jnp.float32).reshape(-1, 1)

    lse, expected_rows, cotangent = inert_rows(stats.lse, stats.expected, cotangent, live)
    g_sum = column(cotangent.sum) if cfg.with_sum else None
    expected = g_expected = None
    if cfg.with_expected:
        expected, g_expected = column(expected_rows), column(cotangent.expected)
    lse, g_lse, g_label = column(lse), column(cotangent.lse), column(cotangent.label)
    assert lse is not None and g_lse is not None and g_label is not None
    sign = rows = dx_share = None
    if cfg.cotangent_in_exponent:
        if cfg.with_expected:  # the kernel reads the row's ratio a / b where it reads g_lse otherwise
            assert expected is not None and g_expected is not None
            lse, sign, g_lse = fold_entropy_cotangent(lse, g_lse, expected, g_expected)
        else:
            lse, sign = fold_cotangent(lse, g_lse)
        g_label, g_sum = sign * g_label, None if g_sum is None else sign * g_sum
        x_c = sign.astype(x_c.dtype) * x_c
    if cfg.label_rows:
        rows, dx_share = label_rows(logits, w, y_c, lse, g_label, g_sum, s_c, cfg, maxima, g_lse, expected, g_expected)
    dx_partials, dw, logits = backward_call(x_c, w, y_c, lse, g_lse, g_label, g_sum, expected, g_expected, cfg,
                                            s_c, kept=(logits, running_dw), live_blocks=live_blocks(live, cfg.block_b),
                                            label_rows=rows, kept_maxima=maxima)
    return dx_partials, dw, logits, sign, dx_share


def fold_cotangent(lse: jax.Array, g_lse: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``(lse - log|g_lse|, sign)`` of float32 ``[rows, 1]`` columns, for a backward with
    :attr:`BackwardConfig.cotangent_in_exponent`: ``exp(z - lse')`` is ``|g_lse| p``, and ``sign`` (+-1, +1 where
    ``g_lse`` is 0) goes onto ``x``'s rows before the kernel (``dw = x.T delta`` sums ``sign |g_lse| p x``) and onto
    ``dx``'s after it; both are exact. A row with ``g_lse`` 0 gets ``lse' = +inf``: ``p`` is 0, as a dead row's."""
    sign = jnp.where(g_lse < 0, -1.0, 1.0).astype(jnp.float32)
    return lse - jnp.log(jnp.abs(g_lse)), sign


#: The smallest ``|b| / |a|`` :func:`fold_entropy_cotangent` folds as it is; a smaller ``b`` is taken as that share of
#: ``|a|`` (a change to ``delta`` of at most ``2^-24 |z|`` of its ``a`` term: below float32's rounding of a logit's
#: ``a + b z`` where ``|z| < 2``, and far below the bf16 rounding of ``delta`` the products take).
ENTROPY_FOLD_FLOOR = 2.0**-24


def fold_entropy_cotangent(lse: jax.Array, g_lse: jax.Array, expected: jax.Array,
                           g_expected: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """``(lse', sign, ratio)`` of float32 ``[rows, 1]`` columns for a backward with the entropy's terms and
    :attr:`BackwardConfig.cotangent_in_exponent`. A row's softmax term is ``p (a + b z)``, ``a = g_lse + g_expected
    (1 - expected)``, ``b = g_expected``; with ``lse' = lse - log|b|`` it is ``sign exp(z - lse') (ratio + z)``,
    ``ratio = a / b``: one product a logit fewer. ``sign`` goes onto ``x`` and ``dx`` as :func:`fold_cotangent`'s.
    Where ``|b|`` is below :data:`ENTROPY_FOLD_FLOOR` ``|a|`` (no entropy bonus on that token, say) ``b`` is taken
    as that share of ``|a|``, so that ``exp(z - lse')`` cannot underflow where ``p |a|`` would not. A row with
    ``a = b = 0`` gets ``lse' = +inf`` and ``ratio`` 0: its ``delta`` is 0, as a dead row's."""
    a = g_lse + g_expected * (1.0 - expected)
    floor = ENTROPY_FOLD_FLOOR * jnp.abs(a)
    b = jnp.where(jnp.abs(g_expected) >= floor, g_expected, jnp.where(g_expected < 0, -floor, floor))
    sign = jnp.where(b < 0, -1.0, 1.0).astype(jnp.float32)
    ratio = jnp.where(b == 0, 0.0, a / jnp.where(b == 0, 1.0, b))
    return lse - jnp.log(jnp.abs(b)), sign, ratio


def _empty_stats(n: int, spec: StatsSpec) -> RowStats:
    zeros = jnp.zeros((n,), jnp.float32)
    return RowStats(
        lse=zeros,
        label=zeros,
        sum=zeros if spec.with_sum else None,
        expected=zeros if spec.with_expected else None,
        max=zeros if spec.with_argmax else None,
        argmax=jnp.zeros((n,), jnp.int32) if spec.with_argmax else None,
    )
