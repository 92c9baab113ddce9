"""Chunked ``lax.fori_loop`` backend for ce_core: O(chunk) memory wherever XLA runs.

Streams over token chunks (and over vocab chunks where one full row chunk would exceed the memory
budget), never holding the ``[N, V]`` logits; ``row_stats`` has a custom VJP with O(N) residuals,
and scalar losses take the fused path that forms ``dx`` and ``dw`` in the forward pass (6NHV).
The chunk rule is documented in :mod:`ce_xla.chunking`.
"""

from ce_xla.backend import XlaBackend, make_backend
from ce_xla.chunking import LOGITS_BUDGET_BYTES, ChunkPlan, gradient_order, plan_chunks

__version__ = "0.1.0"

__all__ = ["LOGITS_BUDGET_BYTES", "ChunkPlan", "XlaBackend", "gradient_order", "make_backend", "plan_chunks"]
