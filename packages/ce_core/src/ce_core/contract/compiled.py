"""What one compile of a program tells: whether it compiled, how long it took, the memory it needs.

XLA reports per compiled program the bytes of its arguments, outputs and *temporaries* (every
buffer that is neither: materialised logits, loop carries, workspace). The temporaries of a loss's
forward+backward program are what a fused loss keeps small, and they are deterministic, so tests
can bound them exactly and reports can print them without running anything.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from typing import Any


@dataclasses.dataclass(frozen=True)
class CompileResult:
    """The outcome of compiling one program; sizes in bytes (``None`` when the compiler reports none)."""

    ok: bool
    seconds: float = 0.0
    temp_bytes: int | None = None
    argument_bytes: int | None = None
    output_bytes: int | None = None
    alias_bytes: int | None = None
    error: str | None = None

    @property
    def total_bytes(self) -> int | None:
        """Arguments + outputs + temporaries - aliased (donated) bytes: the program's footprint."""
        if self.temp_bytes is None or self.argument_bytes is None or self.output_bytes is None:
            return None
        return self.temp_bytes + self.argument_bytes + self.output_bytes - (self.alias_bytes or 0)

    @classmethod
    def of(cls, compiled: Any, seconds: float = 0.0) -> CompileResult:
        """The sizes of a ``jax.stages.Compiled`` from its ``memory_analysis()``."""
        try:
            analysis = compiled.memory_analysis()
        except Exception:  # some PJRT plugins do not implement it
            analysis = None
        if isinstance(analysis, (list, tuple)):  # one entry per device on some versions
            analysis = analysis[0] if analysis else None
        if analysis is None:
            return cls(True, seconds)

        def size(name: str) -> int | None:
            value = getattr(analysis, name, None)
            return None if value is None else int(value)

        return cls(True, seconds, size("temp_size_in_bytes"), size("argument_size_in_bytes"),
                   size("output_size_in_bytes"), size("alias_size_in_bytes"))

    @classmethod
    def failure(cls, error: BaseException, seconds: float = 0.0) -> CompileResult:
        """A failed compile, with the first line of the error."""
        return cls(False, seconds, error=first_line(error))


def compile_program(compile_fn: Callable[[], Any], *, raise_errors: bool = True) -> tuple[Any, CompileResult]:
    """``(compiled, result)`` of ``compile_fn()``, timed; with ``raise_errors=False`` a failure is a result.

    ``compile_fn`` returns a ``jax.stages.Compiled`` (``lambda: jax.jit(f).lower(*args).compile()``,
    with whatever context the lowering needs entered inside it). ``compiled`` is ``None`` when the
    compile failed.
    """
    start = time.perf_counter()
    try:
        compiled = compile_fn()
    except Exception as error:
        if raise_errors:
            raise
        return None, CompileResult.failure(error, time.perf_counter() - start)
    return compiled, CompileResult.of(compiled, time.perf_counter() - start)


def first_line(error: BaseException, limit: int = 300) -> str:
    """``'TypeName: first non-empty line of the message'``, at most ``limit`` characters."""
    text = f"{type(error).__name__}: {error}"
    for line in text.splitlines():
        if line.strip():
            return line.strip()[:limit]
    return text[:limit]
