"""Wall-clock timing of compiled JAX programs, interleaved across contenders.

On a shared, noisy machine a contender timed in one block can be penalised by whatever else ran
then. Here every repeat is a *round* that calls each contender once (round-robin, the starting
position rotating from round to round), so slow phases of the machine hit every contender alike;
each contender's time is the median of its rounds. Every call ends with ``block_until_ready``.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections.abc import Callable, Mapping
from typing import Any

import jax


@dataclasses.dataclass
class Timing:
    """Per-call wall-clock seconds of one contender; ``error`` when a call raised."""

    seconds: list[float] = dataclasses.field(default_factory=list)
    error: str | None = None

    @property
    def median_ms(self) -> float | None:
        """Median over the timed rounds, in milliseconds (None when nothing was timed)."""
        return 1e3 * statistics.median(self.seconds) if self.seconds else None


def block(value: Any) -> Any:
    """``jax.block_until_ready`` on every array leaf of ``value``; returns ``value``."""
    return jax.block_until_ready(value)


def time_call(fn: Callable[[], Any]) -> float:
    """Seconds for one call of ``fn`` including ``block_until_ready`` of its result."""
    start = time.perf_counter()
    block(fn())
    return time.perf_counter() - start


def interleaved(
    contenders: Mapping[str, Callable[[], Any]],
    *,
    repeats: int,
    warmup: int = 1,
    on_call: Callable[[str], None] | None = None,
) -> dict[str, Timing]:
    """Time every contender ``repeats`` times, round-robin, after ``warmup`` untimed rounds.

    Round ``r`` calls the contenders starting at position ``r mod k`` (so none is always first or
    last). A contender that raises is recorded with its error and left out of later rounds; the
    others go on. ``on_call(name)`` is called after every call (for a progress bar).
    """
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    names = list(contenders)
    results = {name: Timing() for name in names}
    for round_index in range(warmup + repeats):
        offset = round_index % len(names) if names else 0
        for name in names[offset:] + names[:offset]:
            timing = results[name]
            if timing.error is not None:
                continue
            try:
                elapsed = time_call(contenders[name])
            except Exception as error:  # a failing contender gets a row, the run goes on
                timing.error = f"{type(error).__name__}: {error}"
                timing.seconds.clear()
            else:
                if round_index >= warmup:
                    timing.seconds.append(elapsed)
            if on_call is not None:
                on_call(name)
    return results
