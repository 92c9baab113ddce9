"""Exceptions shared by ce_core and its backends."""

from __future__ import annotations


class UnsupportedError(NotImplementedError):
    """A backend cannot run this particular call (shape, dtype, option or platform).

    The message says why. A fallback chain catches it and moves on to the next backend;
    a single explicit backend name lets it propagate to the caller.
    """


class FallbackWarning(UserWarning):
    """Emitted (once per backend and reason) when a fallback chain skips a backend."""
