"""Materialised-logits backend for ce_core: the plain-autodiff oracle inside the library.

It holds the full ``[N, V]`` float32 logits (and autodiff keeps them for the backward pass), so it
is the simplest correct implementation and the memory baseline the streaming backends beat.
"""

from ce_reference.backend import ReferenceBackend, make_backend, row_stats

__version__ = "0.2.0"

__all__ = ["ReferenceBackend", "make_backend", "row_stats"]
