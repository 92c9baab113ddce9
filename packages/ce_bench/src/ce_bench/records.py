"""The bench's output record (one row of the table, one object of the JSON list)."""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from ce_core.extend import CompileResult

#: Row statuses. ``ok``: timed; ``compiled``: compile-only / AOT success; ``unsupported``: the
#: implementation declined the call (UnsupportedError / NotImplementedError); ``failed``: it raised;
#: ``refused``: not run because it would not fit in memory.
STATUSES = ("ok", "compiled", "unsupported", "failed", "refused")


@dataclasses.dataclass
class Record:
    """One implementation on one shape and dtype. Times in ms, memory in bytes, errors relative."""

    backend: str
    shape: str
    n: int
    h: int
    v: int
    dtype: str
    reduction: str
    status: str = "ok"
    reason: str | None = None
    kind: str = "backend"  # "backend" | "floor"
    fwd_ms: float | None = None
    fwd_bwd_ms: float | None = None
    tokens_per_s: float | None = None
    floor_fwd_ms: float | None = None
    floor_fwd_bwd_ms: float | None = None
    floor_ratio: float | None = None
    fwd_floor_ratio: float | None = None
    temp_bytes: int | None = None
    fwd_temp_bytes: int | None = None
    argument_bytes: int | None = None
    output_bytes: int | None = None
    max_rel_err: float | None = None
    err_loss: float | None = None
    err_dx: float | None = None
    err_dw: float | None = None
    err_note: str | None = None
    compile_s: float | None = None
    block_sizes: str | None = None
    repeats: int | None = None
    note: str | None = None
    device: str | None = None
    target: str | None = None
    hbm_bytes: int | None = None
    mesh: str | None = None  # ``ce-bench sharding``: the DATAxVOCAB mesh (sizes are then per device)
    call: str | None = None  # ``ce-bench sharding``: how the loss was called (sharded_memory.CALLS)
    ignored: float | None = None  # ``--ignored``: the share of tokens whose label is ignored
    ignored_pattern: str | None = None  # and where they sit (``ce_bench.ignored.PATTERNS``)

    def take_memory(self, fwd_bwd: CompileResult, fwd: CompileResult | None = None) -> None:
        """Compile time and sizes of the forward+backward program (and the forward's temporaries)."""
        self.compile_s = fwd_bwd.seconds
        self.temp_bytes, self.argument_bytes, self.output_bytes = (
            fwd_bwd.temp_bytes, fwd_bwd.argument_bytes, fwd_bwd.output_bytes)
        if fwd is not None:
            self.fwd_temp_bytes = fwd.temp_bytes

    def to_json(self) -> dict[str, Any]:
        """A JSON-safe dict (NaN and infinities become None)."""
        out = dataclasses.asdict(self)
        for key, value in out.items():
            if isinstance(value, float) and not math.isfinite(value):
                out[key] = None
        return out


def write_json(records: Iterable[Record | dict[str, Any]], path: str | Path) -> Path:
    """Write the records (or plain JSON objects, as ``ce-bench schedule`` and ``tune`` make) as a JSON
    list; creates parent directories. Returns the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    items = [record.to_json() if isinstance(record, Record) else record for record in records]
    path.write_text(json.dumps(items, indent=2) + "\n", encoding="utf-8")
    return path


def read_json(path: str | Path) -> list[Record]:
    """Records from a file written by :func:`write_json`.

    Raises:
      OSError: the file cannot be read.
      ValueError: it is not JSON, or not a list of objects.
      TypeError: an object lacks a field every record has.
    """
    fields = {field.name for field in dataclasses.fields(Record)}
    items = json.loads(Path(path).read_text(encoding="utf-8"))
    if not isinstance(items, list) or not all(isinstance(item, dict) for item in items):
        raise ValueError("not a JSON list of records (objects)")
    return [Record(**{key: value for key, value in item.items() if key in fields}) for item in items]


def short_reason(error: BaseException, limit: int = 400) -> str:
    """``Type: first meaningful lines`` of an exception (ExceptionGroups: their sub-exceptions; a
    message that embeds a traceback: its first line and the traceback's last)."""
    if isinstance(error, BaseExceptionGroup):
        return "; ".join(short_reason(sub, limit // max(1, len(error.exceptions))) for sub in error.exceptions)[:limit]
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    marker = "Traceback (most recent call last)"
    if lines and any(marker in line for line in lines):  # a wrapped host-side error: keep its cause
        lines = [lines[0].split(marker)[0].strip() or lines[0], lines[-1]]
    text = " ".join(lines[:2]) if lines else ""
    text = f"{type(error).__name__}: {text}" if text else type(error).__name__
    return text if len(text) <= limit else text[: limit - 3] + "..."


def classify(error: BaseException) -> str:
    """``unsupported`` for NotImplementedError (ce_core.UnsupportedError included, also inside an
    ExceptionGroup), else ``failed``."""
    if isinstance(error, BaseExceptionGroup):
        return "unsupported" if all(classify(sub) == "unsupported" for sub in error.exceptions) else "failed"
    return "unsupported" if isinstance(error, NotImplementedError) else "failed"
