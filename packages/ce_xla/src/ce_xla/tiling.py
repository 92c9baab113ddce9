"""How the ``xla`` backend cuts a problem into chunks: the gradient order, the chunk rule, checks.

**Statistics.** The forward pass streams over token chunks of ``token_chunk`` rows. When a whole
row chunk ``[token_chunk, V]`` of float32 logits fits the budget (full-row mode) it is held once;
otherwise the pass also streams over vocab chunks of ``vocab_chunk`` columns with an online
logsumexp (vocab-chunked mode).

**Gradients: two loop orders.** ``dx = delta @ w.T`` sums over the vocabulary and
``dw = x.T @ delta`` over the tokens, so whichever loop is outer, one of them must be accumulated
in float32 across it (accuracy: float32 accumulation everywhere):

- ``"tokens_outer"``: token chunks outer; ``dw`` ``[H, V]`` accumulates in float32 across them
  (extra ``4HV`` bytes unless ``w`` is float32, when the accumulator is the gradient itself).
  Every per-token cotangent of a scalar loss is known once that chunk's statistics are, so the
  fused path forms ``dx`` and ``dw`` from the same full-row logits: 6NHV flops.
- ``"vocab_outer"``: vocab slices of ``grad_chunk`` columns outer; for each, all token chunks of
  ``grad_token_chunk`` rows are streamed, that ``[H, grad_chunk]`` slice of ``dw`` accumulates in
  float32 and is written once in ``w``'s dtype; ``dx`` ``[N, H]`` accumulates in float32 (extra
  ``4NH`` bytes unless ``x`` is float32). The statistics must be known first: 8NHV flops.

**The rule** (:func:`gradient_order`): tokens outer whenever the extra memory it holds beyond
vocab outer fits the **keep-logits budget**: ``dw_extra - dx_extra <= budget``, where ``dw_extra``
is ``4HV`` when ``w`` is narrower than float32 (else 0) and ``dx_extra`` is ``4NH`` when ``x`` is
(else 0). The budget is ``min(4 GiB, device memory / 8)`` (:func:`ce_xla.target.keep_logits_budget`):
the device's HBM on TPU and GPU (``memory_stats()["bytes_limit"]``; 16 GiB assumed where the device
reports none, as in an ahead-of-time compile for TPU from a CPU host: 2 GiB), the host's physical
memory on CPU (32 GiB assumed where unreadable). So float32 ``w`` always takes the fused 6NHV
path (``dw_extra`` is 0), and so does bf16/f16 ``w`` up to ``4HV`` of about 4 GiB: Llama-3 8B's head
(H=4096, V=128256, ``4HV`` = 1.96 GiB) at 8192 tokens needs 1.83 GiB more than vocab outer, which
a 16 GiB device (2 GiB budget) affords; H=8192 (``4HV`` = 3.9 GiB) takes vocab outer below 32 GiB.
On a shared 2-core CPU the fused path ran bf16 fwd+bwd at 0.57-1.0x vocab outer's time at the bench's
presets (noisy: ``docs/notes/2026-11-28-xla-bf16-tokens-outer.md``); it is a memory rule. Vocab outer's
extra memory is at most ``4NH`` plus tiles. With one token chunk tokens outer holds no float32 ``dw``
at all (:func:`ce_xla.backward.dw_dtype`), which the rule does not count.

Forcing: ``XlaBackend(keep_logits_budget_bytes=...)`` sets the budget (0: vocab outer whenever
``w`` is narrower than float32 and ``V > N``); ``StatsSpec.keep_logits`` (``ce_core``'s
``keep_logits=``) forces an order per call, ``True`` tokens outer and ``False`` vocab outer, and
``XlaBackend(gradient_order=...)`` for every call of that backend. A backend order and a per-call
``keep_logits`` that disagree are a ``ValueError`` (:func:`resolve_order`). ``keep_logits=True``
keeps the logits only where a full row chunk fits the logits budget (full-row mode); vocab-chunked
statistics recompute each tile's logits tokens outer too.

**Chunk sizes** come from the platform's budgets (:mod:`ce_xla.target`, which gives the
figures; ``budget`` = 64 MiB float32 logits, 512 MiB on GPU):

1. Full rows when at least ``min_rows`` rows fit: ``vocab_chunk = V``, ``token_chunk = budget //
   (4 V)`` rounded down to a multiple of :data:`TOKEN_ALIGN`, capped at N, then evened out over the
   chunks that takes (``ceil(N / rows)`` chunks of ``ceil(N / chunks)`` rows, aligned up), so the
   overlapping last chunk recomputes few rows (at 4096 tokens, 1760-row chunks recomputed 1184
   rows; three chunks of 1368 recompute 8). ``min_rows`` is
   :data:`MIN_FULL_ROW_TOKENS` (32) tokens outer, where full rows feed the 6NHV pass, and the
   platform's ``stats_rows`` vocab outer (1024 on accelerators, where every token chunk streams
   all of ``w`` and fewer rows would be bandwidth-bound; 32 on CPU).
2. Otherwise a vocab-chunked tile: ``token_chunk`` = :data:`VOCAB_MODE_TOKENS` tokens outer or
   ``stats_rows`` vocab outer (capped at N, evened out likewise), and
   ``vocab_chunk = budget // (4 token_chunk)`` (tokens
   outer: ``// (4 max(token_chunk, H))``, since its ``[H, vocab_chunk]`` ``dw`` tile must fit too),
   a multiple of :data:`VOCAB_ALIGN`.
3. Tokens outer, ``grad_chunk`` is V when ``4HV`` fits the platform's ``grad_slice_bytes`` (8 MiB
   on CPU, to keep each ``delta`` tile and ``dw`` update in cache, which made the fused pass about
   5% faster there; 64 MiB on accelerators, where each slice is a kernel launch), else that budget
   over ``4H``; in vocab-chunked mode it is ``vocab_chunk``. The fused pass reuses the statistics
   rows (``token_chunk``) for its gradient tiles; the recompute pass (the VJP of the statistics:
   per-token outputs such as :func:`ce_core.linear_log_probs`) is not tied to them and takes
   ``grad_token_chunk`` rows: as many as keep a float32 ``[rows, grad_chunk]`` tile within the
   platform's ``recompute_tile_bytes`` (8 MiB; 64 MiB on GPU), at least ``token_chunk``, spread evenly over the
   chunks. Each token chunk streams all of ``w`` and reads and writes all of ``dw``, so at N=512
   H=1536 V=151936 f32 on CPU one 512-row chunk instead of five of 104 rows took the RL
   objective's fwd+bwd from 1.64-1.71x to 1.39-1.42x the three-matmul floor (two of 256 rows: 1.47x).
4. Vocab outer, ``grad_chunk = dw_slice_bytes // (4H)`` and ``grad_token_chunk = grad_tile_bytes //
   (4 grad_chunk)``, at least :data:`MIN_GRAD_TOKEN_CHUNK` (32 MiB and 8 MiB on TPU:
   2048 columns x 1024 rows at H = 4096; 128 MiB and 64 MiB on GPU: 8192 x 2048; 8 MiB and 2 MiB
   on CPU).

Every ``grad_chunk`` is a multiple of :data:`VOCAB_ALIGN` and at least :data:`MIN_GRAD_CHUNK`
(or V); every token chunk a multiple of :data:`TOKEN_ALIGN` (or N).

Chunks need not divide N or V: the last chunk starts early, overlapping the one before it, and the
overlap is masked (never counted twice, never in the logsumexp), so neither ``x`` nor ``w`` is ever
padded or copied.

Explicit sizes (:class:`ce_core.BlockSizes`): ``b_block_size`` is every token chunk and
``v_block_size`` every vocab chunk (``v_block_size < V`` selects vocab-chunked statistics, and is
the gradient slice too); a size at or above its dimension means one chunk over it. The backend
never splits the hidden dimension, so an ``h_block_size`` below H is a ``ValueError``; so is any
size that is not a positive int. A field left ``None`` is filled in by the rule above.
"""

from __future__ import annotations

import dataclasses
from typing import Literal

import numpy as np
from numpy.typing import DTypeLike

from ce_core import BlockSizes
from ce_xla.target import CPU, KEEP_LOGITS_BUDGET_CAP_BYTES, PlatformBudgets, budgets_for, keep_logits_budget

GradientOrder = Literal["tokens_outer", "vocab_outer"]
GRADIENT_ORDERS: tuple[GradientOrder, ...] = ("tokens_outer", "vocab_outer")

#: Bytes of one float32 logits chunk ``[token_chunk, vocab_chunk]`` on CPU and TPU (GPU: 4x, ``ce_xla.target``).
LOGITS_BUDGET_BYTES = CPU.logits_bytes
#: Narrowest gradient slice the rule picks (wider than the budget when H is very large).
MIN_GRAD_CHUNK = 512
#: Vocab outer: fewest rows of a gradient tile (each tile streams its ``w`` slice; 64 rows measured
#: 1.15x slower than 128-1024 on CPU, and accelerators need ``3 x rows`` above their ridge point).
MIN_GRAD_TOKEN_CHUNK = 256
#: Fewest rows worth a full-row chunk tokens outer; below this the vocabulary is chunked instead.
MIN_FULL_ROW_TOKENS = 32
#: Token chunks are multiples of this (unless they cover all N tokens).
TOKEN_ALIGN = 8
#: Vocab chunks and gradient slices are multiples of this (unless they cover all V columns).
VOCAB_ALIGN = 128
#: Token chunk of vocab-chunked statistics tokens outer when none is given.
VOCAB_MODE_TOKENS = 256
#: With live rows (ignored tokens skipped), at least this many token chunks, so that the chunks that hold
#: only dead rows are worth skipping (at most a quarter of N is computed beyond the live rows) ...
LIVE_ROWS_CHUNKS = 4
#: ... but no chunk narrower than this for it: each chunk streams all of ``w`` (and, tokens outer,
#: updates a float32 ``dw``), which narrow chunks do not amortise.
MIN_LIVE_ROWS_CHUNK = 256

_F32 = 4


@dataclasses.dataclass(frozen=True)
class ChunkPlan:
    """Chunk sizes and gradient loop order for one problem; every size is in ``[1, dimension]``.

    ``[token_chunk, vocab_chunk]`` is a statistics tile; ``[grad_token_chunk, grad_chunk]`` a
    gradient tile (its ``grad_chunk`` columns are one ``dw`` slice), except in the fused tokens-outer
    pass, whose gradient tiles reuse the statistics tile's ``token_chunk`` rows.
    """

    n: int
    h: int
    v: int
    token_chunk: int
    vocab_chunk: int
    grad_chunk: int
    grad_token_chunk: int
    gradient_order: GradientOrder

    def __post_init__(self) -> None:
        if self.gradient_order not in GRADIENT_ORDERS:
            raise ValueError(f"gradient_order must be one of {GRADIENT_ORDERS}, got {self.gradient_order!r}")

    @property
    def full_rows(self) -> bool:
        """Whether a statistics tile holds whole logit rows."""
        return self.vocab_chunk == self.v

    @property
    def fused(self) -> bool:
        """Whether a scalar loss forms ``dx`` and ``dw`` in the statistics pass (tokens outer)."""
        return self.gradient_order == "tokens_outer"

    @property
    def token_chunks(self) -> int:
        return _ceil_div(self.n, self.token_chunk)

    @property
    def vocab_chunks(self) -> int:
        return _ceil_div(self.v, self.vocab_chunk)

    @property
    def grad_chunks(self) -> int:
        return _ceil_div(self.v, self.grad_chunk)

    @property
    def grad_token_chunks(self) -> int:
        return _ceil_div(self.n, self.grad_token_chunk)


def gradient_order(n: int, h: int, v: int, x_dtype: DTypeLike, w_dtype: DTypeLike,
                   keep_logits_budget_bytes: int = KEEP_LOGITS_BUDGET_CAP_BYTES) -> GradientOrder:
    """``"tokens_outer"`` when its extra memory over vocab outer, :func:`keep_logits_extra_bytes`, is at
    most ``keep_logits_budget_bytes`` (default: the 4 GiB cap; the backend passes its device's budget),
    else ``"vocab_outer"``."""
    extra = keep_logits_extra_bytes(n, h, v, x_dtype, w_dtype)
    return "tokens_outer" if extra <= keep_logits_budget_bytes else "vocab_outer"


def keep_logits_extra_bytes(n: int, h: int, v: int, x_dtype: DTypeLike, w_dtype: DTypeLike) -> int:
    """Bytes tokens outer holds beyond vocab outer: its float32 ``dw`` accumulator (``4HV``, none when ``w``
    is float32: the accumulator is the gradient) minus vocab outer's float32 ``dx`` one (``4NH``, none when
    ``x`` is float32). Negative when vocab outer's is the larger."""
    dw_extra = _F32 * h * v if np.dtype(w_dtype).itemsize < _F32 else 0
    dx_extra = _F32 * n * h if np.dtype(x_dtype).itemsize < _F32 else 0
    return dw_extra - dx_extra


def resolve_order(order: GradientOrder | None, keep_logits: bool | None) -> GradientOrder | None:
    """The forced gradient order, if any: ``order`` (a backend's), or ``keep_logits`` (a call's: ``True``
    tokens outer, ``False`` vocab outer); ``None`` when neither forces one. ``ValueError`` when they disagree.
    """
    if order is not None and order not in GRADIENT_ORDERS:
        raise ValueError(f"gradient_order must be one of {GRADIENT_ORDERS}, got {order!r}")
    if keep_logits is None:
        return order
    wanted: GradientOrder = "tokens_outer" if keep_logits else "vocab_outer"
    if order is not None and order != wanted:
        raise ValueError(
            f"xla backend: keep_logits={keep_logits} asks for gradient order {wanted!r}, but this backend was "
            f"built with gradient_order={order!r}; drop one of them"
        )
    return wanted


def plan_chunks(
    n: int,
    h: int,
    v: int,
    block_sizes: BlockSizes | None = None,
    *,
    x_dtype: DTypeLike = np.float32,
    w_dtype: DTypeLike = np.float32,
    order: GradientOrder | None = None,
    budget_bytes: int | None = None,
    grad_budget_bytes: int | None = None,
    platform: str = "cpu",
    keep_logits: bool | None = None,
    keep_logits_budget_bytes: int | None = None,
    live_rows: bool = False,
) -> ChunkPlan:
    """The chunk plan for ``x: [n, h]``, ``w: [h, v]``: explicit sizes checked, the rest by the rule.

    ``live_rows``: the call skips dead rows (contract version 4), so token chunks the rule picks are cut
    to at most ``ceil(n / LIVE_ROWS_CHUNKS)`` rows, but not below ``MIN_LIVE_ROWS_CHUNK``: chunks of
    dead rows only are then a saving worth having (:func:`_live_rows_cap`). Not where one tokens-outer
    chunk of a ``w`` narrower than float32 would become several (a float32 ``dw`` accumulator).

    The gradient order is ``order`` or ``keep_logits`` when either forces one (:func:`resolve_order`),
    else :func:`gradient_order` within ``keep_logits_budget_bytes`` (``None``: the platform's budget for
    its assumed memory, :func:`ce_xla.target.keep_logits_budget`: 4 GiB on CPU, 2 GiB on accelerators;
    the backend passes its device's). ``budget_bytes`` and ``grad_budget_bytes`` (``None``: the
    platform's) override the logits budget and the tokens-outer ``dw`` slice budget.
    """
    for name, value in (("budget_bytes", budget_bytes), ("grad_budget_bytes", grad_budget_bytes)):
        if value is not None and value <= 0:
            raise ValueError(f"{name} must be positive, got {value}")
    if keep_logits_budget_bytes is not None and keep_logits_budget_bytes < 0:
        raise ValueError(f"keep_logits_budget_bytes must be at least 0, got {keep_logits_budget_bytes}")
    check_block_sizes(block_sizes, h)
    order = resolve_order(order, keep_logits)
    if order is None:
        if keep_logits_budget_bytes is None:
            keep_logits_budget_bytes = keep_logits_budget(platform)
        order = gradient_order(n, h, v, x_dtype, w_dtype, keep_logits_budget_bytes)
    budgets = budgets_for(platform)
    overrides = {"logits_bytes": budget_bytes, "grad_slice_bytes": grad_budget_bytes}
    budgets = dataclasses.replace(budgets, **{k: val for k, val in overrides.items() if val is not None})
    n_, v_ = max(n, 1), max(v, 1)
    rows = None if block_sizes is None else block_sizes.b_block_size
    cols = None if block_sizes is None else block_sizes.v_block_size

    token, vocab = _stats_tile(n_, h, v_, rows, cols, order, budgets)
    # One token chunk tokens outer writes a narrow w's dw once, in its dtype; several would hold a float32
    # dw (measured 1.12x the time with no token ignored, bf16 1024 x 512 x 16384 on CPU): no cut then.
    adds_float32_dw = order == "tokens_outer" and token >= n_ and np.dtype(w_dtype).itemsize < _F32
    cap = _live_rows_cap(n_) if live_rows and rows is None and not adds_float32_dw else n_

    def capped(chunk: int) -> int:
        return chunk if chunk <= cap else _even_rows(n_, cap)

    token = capped(token)
    if order == "tokens_outer":
        grad = vocab if vocab < v_ else _slice_width(h, v_, budgets.grad_slice_bytes, whole_if_fits=True)
        grad_rows = token if rows is not None else _recompute_rows(n_, token, grad, budgets.recompute_tile_bytes)
        return ChunkPlan(n, h, v, token, vocab, grad, capped(grad_rows), order)
    grad_rows, grad = _vocab_outer_tile(n_, h, v_, rows, cols, budgets)
    return ChunkPlan(n, h, v, token, vocab, grad, capped(grad_rows), order)


def _stats_tile(n: int, h: int, v: int, token: int | None, vocab: int | None, order: GradientOrder,
                budgets: PlatformBudgets) -> tuple[int, int]:
    """``(token_chunk, vocab_chunk)`` of a statistics tile, explicit sizes kept (rules 1 and 2)."""
    budget_cols = budgets.logits_bytes // _F32  # float32 elements in one logits tile
    if order == "tokens_outer":
        min_rows, tiled_rows, dw_rows = MIN_FULL_ROW_TOKENS, VOCAB_MODE_TOKENS, h
    else:
        min_rows, tiled_rows, dw_rows = budgets.stats_rows, budgets.stats_rows, 1
    if vocab is None:
        rows = token if token is not None else min_rows
        if min(rows, n) * v <= budget_cols:
            vocab = v
        else:
            rows = min(token if token is not None else tiled_rows, n)
            vocab = _align_down(budget_cols // max(rows, dw_rows, 1), VOCAB_ALIGN)
    vocab = min(vocab, v)
    if token is None:
        return _even_rows(n, _align_down(budget_cols // v, TOKEN_ALIGN) if vocab == v else tiled_rows), vocab
    return min(token, n), vocab


def _vocab_outer_tile(n: int, h: int, v: int, rows: int | None, cols: int | None,
                      budgets: PlatformBudgets) -> tuple[int, int]:
    """``(grad_token_chunk, grad_chunk)`` of a vocab-outer gradient tile, explicit sizes kept (rule 4)."""
    cols = min(cols, v) if cols is not None else _slice_width(h, v, budgets.dw_slice_bytes)
    if rows is None:
        rows = max(_align_down(budgets.grad_tile_bytes // _F32 // cols, TOKEN_ALIGN), MIN_GRAD_TOKEN_CHUNK)
    return min(rows, n), cols


def _recompute_rows(n: int, token: int, grad: int, budget_bytes: int) -> int:
    """Rows of a tokens-outer recompute tile ``[rows, grad]`` (rule 3): float32 within ``budget_bytes``,
    at least ``token``, and evened out over the ``ceil(n / rows)`` chunks so the last one barely overlaps."""
    return _even_rows(n, max(_align_down(budget_bytes // _F32 // max(grad, 1), TOKEN_ALIGN), token))


def _live_rows_cap(n: int) -> int:
    """The most rows a token chunk may hold when dead rows are skipped (see :func:`plan_chunks`)."""
    return max(_ceil_div(_ceil_div(n, LIVE_ROWS_CHUNKS), TOKEN_ALIGN) * TOKEN_ALIGN, MIN_LIVE_ROWS_CHUNK)


def _even_rows(n: int, rows: int) -> int:
    """At most ``rows`` rows per chunk, evened out over the ``ceil(n / rows)`` chunks (aligned), so the
    last chunk, which starts early and overlaps the one before it, recomputes few rows."""
    if rows >= n:
        return n
    per_chunk = _ceil_div(n, _ceil_div(n, rows))
    return min(_ceil_div(per_chunk, TOKEN_ALIGN) * TOKEN_ALIGN, n)


def _slice_width(h: int, v: int, budget_bytes: int, whole_if_fits: bool = False) -> int:
    """Columns of a float32 ``[h, width]`` ``dw`` slice within ``budget_bytes``: aligned, >= MIN_GRAD_CHUNK."""
    if whole_if_fits and h * v * _F32 <= budget_bytes:
        return v
    return min(max(_align_down(budget_bytes // _F32 // max(h, 1), VOCAB_ALIGN), MIN_GRAD_CHUNK), v)


def check_block_sizes(block_sizes: BlockSizes | None, h: int) -> None:
    """``ValueError`` naming the field when ``block_sizes`` holds a size this backend cannot use.

    ``BlockSizes`` itself guarantees positive ints (ce_core checks it on construction); what is left
    is this backend's own rule: it never splits the hidden dimension.
    """
    if block_sizes is None:
        return
    if block_sizes.h_block_size is not None and block_sizes.h_block_size < h:
        raise ValueError(
            f"xla backend: BlockSizes.h_block_size={block_sizes.h_block_size} is below H={h}; this backend "
            f"never splits the hidden dimension (leave h_block_size None)"
        )


def _align_down(value: int, multiple: int) -> int:
    """``value`` rounded down to a multiple of ``multiple``, and at least ``min(value, multiple)``, >= 1."""
    if value >= multiple:
        return value - value % multiple
    return max(value, 1)


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)
