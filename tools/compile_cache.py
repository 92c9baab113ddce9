"""One compile per distinct TPU program in a test session: a cache keyed by the program itself.

The slow tier compiles full-size TPU programs through libtpu's deviceless topologies (10-25 s each, most
of it the Pallas forward kernel), and tests written apart sometimes build the very same program: an
Auto-axes call with its layout stated compiles to the Explicit-axes program to the byte. JAX caches an
executable per lowering object only, so each test would compile it again; this cache keys the
executable by the lowered module's text, the devices it is compiled for and the compiler options,
and hands the same executable to every later lowering of that program in the process (tests that
share programs belong to one module, which ``--dist loadscope`` keeps on one worker). Only TPU
programs are cached: they never run here, and the CPU programs the other tests run stay
as JAX makes them.

:func:`install` patches ``MeshComputation.compile`` (JAX internals, so test-only); :data:`STATS` counts
what was compiled and reused.
"""

from __future__ import annotations

import hashlib
import time
from typing import Any

STATS = {"compiled": 0, "reused": 0, "seconds_compiling": 0.0, "seconds_saved": 0.0}
_executables: dict[str, tuple[Any, float]] = {}
_installed: list[bool] = []


def program_key(computation: Any, compiler_options: Any, device_assignment: Any) -> str | None:
    """The cache key of a TPU computation (None for any other platform, or a device assignment given)."""
    devices = computation._device_list
    if device_assignment is not None or devices is None or "tpu" not in tuple(computation._platforms):
        return None
    digest = hashlib.sha256(computation.as_text().encode())
    digest.update(repr([(d.platform, d.device_kind, d.id, getattr(d, "coords", None)) for d in devices]).encode())
    digest.update(repr((computation._compiler_options_kvs, compiler_options)).encode())
    return digest.hexdigest()


def install() -> None:
    """Route every TPU compile of this process through the cache (idempotent)."""
    from jax._src.interpreters import pxla

    if _installed:
        return
    _installed.append(True)
    original = pxla.MeshComputation.compile

    def compile(self: Any, compiler_options: Any = None, *, device_assignment: Any = None) -> Any:
        key = program_key(self, compiler_options, device_assignment)
        if key is None:
            return original(self, compiler_options, device_assignment=device_assignment)
        if key in _executables:
            executable, seconds = _executables[key]
            STATS["reused"] += 1
            STATS["seconds_saved"] += seconds
            return executable
        start = time.perf_counter()
        executable = original(self, compiler_options)
        seconds = time.perf_counter() - start
        _executables[key] = (executable, seconds)
        STATS["compiled"] += 1
        STATS["seconds_compiling"] += seconds
        return executable

    pxla.MeshComputation.compile = compile
