"""Tables of bench records, as aligned text (terminal) or Markdown (docs).

Long texts (why a row failed, why a shape was reduced, why an error was not measured) go into
numbered notes under the table so the table stays narrow.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from ce_bench.memory import human_bytes
from ce_bench.records import Record

#: Longest note printed under a table.
NOTE_LIMIT = 240


def _ms(value: float | None) -> str:
    if value is None:
        return "-"
    return f"{value:.3g}" if value < 100 else f"{value:.0f}"


def _rate(value: float | None) -> str:
    if value is None:
        return "-"
    for unit, scale in (("M", 1e6), ("k", 1e3)):
        if value >= scale:
            return f"{value / scale:.3g}{unit}"
    return f"{value:.3g}"


def _ratio(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}x"


def _err(value: float | None) -> str:
    return "-" if value is None else f"{value:.1e}"


class _Notes:
    """Numbered footnotes, deduplicated."""

    def __init__(self) -> None:
        self.texts: list[str] = []

    def ref(self, text: str | None) -> str:
        if not text:
            return ""
        if len(text) > NOTE_LIMIT:  # the JSON keeps the longer text
            text = text[: NOTE_LIMIT - 3] + "..."
        if text not in self.texts:
            self.texts.append(text)
        return f"[{self.texts.index(text) + 1}]"


def _render(headers: Sequence[str], rows: Sequence[Sequence[str]], notes: _Notes, fmt: str,
            right: set[int]) -> str:
    if fmt == "markdown":
        lines = ["| " + " | ".join(headers) + " |",
                 "|" + "|".join("---:" if i in right else "---" for i in range(len(headers))) + "|"]
        lines += ["| " + " | ".join(cell.replace("|", "\\|") for cell in row) + " |" for row in rows]
        if notes.texts:
            lines.append("")
            lines += [f"[{i}] {text}  " for i, text in enumerate(notes.texts, 1)]
        return "\n".join(lines)
    widths = [max(len(headers[i]), *(len(row[i]) for row in rows)) if rows else len(headers[i])
              for i in range(len(headers))]

    def line(cells: Sequence[str]) -> str:
        return "  ".join(cell.rjust(widths[i]) if i in right else cell.ljust(widths[i])
                         for i, cell in enumerate(cells)).rstrip()

    out = [line(headers), line(["-" * width for width in widths])] + [line(row) for row in rows]
    if notes.texts:
        out.append("")
        out += [f"[{i}] {text}" for i, text in enumerate(notes.texts, 1)]
    return "\n".join(out)


def _status(record: Record, notes: _Notes) -> str:
    return record.status + notes.ref(record.reason)


def _shape(record: Record, notes: _Notes) -> str:
    return record.shape + notes.ref(record.note)


def run_table(records: Sequence[Record], fmt: str = "text") -> str:
    """The head-to-head table: time, throughput, floor ratio, temp memory and error per row."""
    notes = _Notes()
    headers = ["backend", "shape (N x H x V)", "dtype", "fwd ms", "fwd+bwd ms", "tokens/s", "vs floor",
               "temp mem", "max rel err", "status"]
    rows = []
    for record in records:
        err = _err(record.max_rel_err)
        if record.max_rel_err is None and record.err_note:
            err = "n/m" + notes.ref(record.err_note)
        rows.append([record.backend, _shape(record, notes), record.dtype, _ms(record.fwd_ms), _ms(record.fwd_bwd_ms),
                     _rate(record.tokens_per_s), _ratio(record.floor_ratio),
                     human_bytes(record.temp_bytes) if record.kind == "backend" else "-", err,
                     _status(record, notes)])
    return _render(headers, rows, notes, fmt, right={3, 4, 5, 6, 7, 8})


def compile_table(records: Sequence[Record], fmt: str = "text") -> str:
    """Compile-only / AOT table: status, temporaries of both programs, footprint and block sizes."""
    notes = _Notes()
    has_target = any(record.target for record in records)
    headers = (["target"] if has_target else []) + [
        "backend", "shape (N x H x V)", "dtype", "status", "fwd temp", "fwd+bwd temp", "args+outputs",
        "fits", "block sizes", "compile s"]
    rows = []
    for record in records:
        io = (None if record.argument_bytes is None or record.output_bytes is None
              else record.argument_bytes + record.output_bytes)
        fits = "-"
        if record.hbm_bytes and io is not None and record.temp_bytes is not None:
            fits = "yes" if io + record.temp_bytes <= record.hbm_bytes else "NO"
        rows.append(([record.target or "-"] if has_target else []) + [
            record.backend, _shape(record, notes), record.dtype, _status(record, notes),
            human_bytes(record.fwd_temp_bytes), human_bytes(record.temp_bytes), human_bytes(io), fits,
            record.block_sizes or "-", "-" if record.compile_s is None else f"{record.compile_s:.1f}"])
    offset = 1 if has_target else 0
    return _render(headers, rows, notes, fmt, right={offset + i for i in (4, 5, 6, 9)})


def _times(ratio: float) -> str:
    if ratio < 1:
        return f"{ratio:.2g}x"
    return f"{ratio:,.0f}x" if ratio >= 100 else f"{ratio:.1f}x" if ratio >= 10 else f"{ratio:.2f}x"


def memory_ratios(records: Sequence[Record], fmt: str = "text") -> str:
    """Per shape and dtype with a ``reference`` row: the reference's fwd+bwd temporaries over each
    other backend's (how many times less memory than materialising the logits); ``""`` when there is
    no such shape. Rows that were only compiled form their own groups."""
    groups: dict[tuple[str, str, str | None, bool], list[Record]] = {}
    for record in records:
        if record.kind == "backend" and record.temp_bytes:
            key = (record.shape, record.dtype, record.target, record.repeats is None)
            groups.setdefault(key, []).append(record)
    lines = []
    for (shape, dtype, target, _), rows in groups.items():
        reference = next((row.temp_bytes for row in rows if row.backend == "reference"), None)
        ratios = [f"{row.backend} {human_bytes(row.temp_bytes)} ({_times(reference / row.temp_bytes)})"
                  for row in rows if reference and row.temp_bytes and row.backend != "reference"]
        if reference and ratios:
            where = " ".join(part for part in (target, shape, dtype) if part)
            lines.append(f"{where}: reference {human_bytes(reference)}; " + ", ".join(ratios))
    if not lines:
        return ""
    head = ("fwd+bwd temporaries, with the reference's over each backend's (how many times less memory than "
            "materialising the logits):")
    if fmt == "markdown":
        return "\n".join([head, ""] + [f"- {line}" for line in lines])
    return "\n".join([head] + [f"  {line}" for line in lines])


def tables(records: Sequence[Record], fmt: str = "text") -> str:
    """What ``ce-bench`` prints: :func:`run_table` of the rows of a timed run, :func:`compile_table` of the
    rows that were only compiled (``repeats`` is None: ``--compile-only``, ``--memory-shapes``, ``aot``)
    and :func:`memory_ratios`."""
    timed = [record for record in records if record.repeats is not None]
    compiled = [record for record in records if record.repeats is None]
    parts = [run_table(timed, fmt)] if timed else []
    if compiled:
        if timed:
            parts.append("Compiled only, not run (memory_analysis at full size):")
        parts.append(compile_table(compiled, fmt))
    ratios = memory_ratios(records, fmt)
    return "\n\n".join(parts + ([ratios] if ratios else []))


def table(records: Sequence[Record], fmt: str = "text") -> str:
    """:func:`run_table` when anything was timed, else :func:`compile_table`."""
    chooser: Callable[[Sequence[Record], str], str] = (
        run_table if any(record.fwd_bwd_ms is not None or record.status == "ok" for record in records)
        else compile_table)
    return chooser(records, fmt)
