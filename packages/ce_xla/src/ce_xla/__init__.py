"""Chunked ``lax.fori_loop`` backend for ce_core: O(chunk) memory wherever XLA runs.

Streams over token chunks (and over vocab chunks where one full row chunk would exceed the memory
budget), never holding the ``[N, V]`` logits; ``row_stats`` has a custom VJP with O(N) residuals.
Gradients run tokens outer (float32 ``dw`` accumulator; scalar losses then take the fused path that
forms ``dx`` and ``dw`` in the forward pass, 6NHV) or vocab outer (float32 ``dx`` accumulator, each
``dw`` slice written once, so no ``[H, V]`` float32 temporary: what a bf16 ``w`` takes when that
temporary would not fit the keep-logits budget, ``min(4 GiB, device memory / 8)``). The order and
chunk rule are documented in :mod:`ce_xla.tiling`, the per-platform budgets in :mod:`ce_xla.target`.
"""

from ce_xla.backend import XlaBackend, make_backend
from ce_xla.tiling import LOGITS_BUDGET_BYTES, ChunkPlan, gradient_order, plan_chunks

__version__ = "0.2.0"

__all__ = ["LOGITS_BUDGET_BYTES", "ChunkPlan", "XlaBackend", "gradient_order", "make_backend", "plan_chunks"]
