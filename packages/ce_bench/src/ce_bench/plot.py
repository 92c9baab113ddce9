"""A PNG comparing backends per shape: forward+backward time and temporary memory (bench), or
temporary memory of the forward and forward+backward programs (compile-only / AOT).

Both panels use log scales (shapes differ by orders of magnitude); every bar is labelled with its
value, and a row that did not run is marked with its status where its bar would be.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ce_bench.records import Record


def _group(record: Record) -> str:
    group = f"{record.shape}\n{record.dtype}" + (f" {record.target}" if record.target else "")
    return group + (f"\n{record.ignored:.0%} ignored ({record.ignored_pattern})" if record.ignored else "")


def _order(records: Sequence[Record]) -> tuple[list[str], list[str]]:
    groups: list[str] = []
    backends: list[str] = []
    for record in records:
        if _group(record) not in groups:
            groups.append(_group(record))
        if record.backend not in backends:
            backends.append(record.backend)
    return groups, backends


def _label(value: float) -> str:
    return f"{value:,.0f}" if value >= 1000 else f"{value:.3g}"


def _bars(axis: Any, records: Sequence[Record], field: str, scale: float, ylabel: str, title: str,
          colors: dict[str, Any]) -> None:
    groups, backends = _order(records)
    lookup = {(_group(record), record.backend): record for record in records}
    width = 0.8 / max(1, len(backends))
    values: list[float] = []
    for index, name in enumerate(backends):
        xs, ys = [], []
        for group_index, group in enumerate(groups):
            record = lookup.get((group, name))
            position = group_index - 0.4 + width * (index + 0.5)
            value = None if record is None else getattr(record, field)
            if value is None or value <= 0:
                if record is not None and record.status not in ("ok", "compiled"):
                    axis.text(position, 0.02, record.status, rotation=90, ha="center", va="bottom",
                              fontsize=6, color=colors[name], transform=axis.get_xaxis_transform())
                continue
            xs.append(position)
            ys.append(value / scale)
        if not xs:
            continue
        values += ys
        bars = axis.bar(xs, ys, width=width, label=name, color=colors[name],
                        hatch="//" if name == "matmul floor" else None)
        axis.bar_label(bars, labels=[_label(y) for y in ys], fontsize=6, rotation=90, padding=2)
    axis.set_xticks(range(len(groups)), groups, fontsize=7)
    axis.set_xlim(-0.5, len(groups) - 0.5)
    axis.set_yscale("log")
    if values:  # bars start well below the smallest value, so their heights compare
        axis.set_ylim(min(values) / 4, max(values) * 6)
    axis.set_ylabel(ylabel)
    axis.set_title(title, fontsize=9)
    axis.grid(axis="y", alpha=0.3, which="both")


def plot(records: Sequence[Record], path: str | Path, *, title: str = "") -> Path:
    """Draw the comparison and save it as a PNG at ``path`` (parent directories are created)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    groups, backends = _order(records)
    cycle = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    colors = {name: cycle[index % len(cycle)] for index, name in enumerate(backends)}
    width = min(24.0, max(9.0, 3.0 + 0.45 * len(groups) * max(1, len(backends))))
    fig, axes = plt.subplots(1, 2, figsize=(width, 5.0))
    if any(record.fwd_bwd_ms is not None for record in records):
        # Rows only compiled (``--memory-shapes``) have no time; their memory bars say they did not run.
        _bars(axes[0], [record for record in records if record.repeats is not None], "fwd_bwd_ms", 1.0, "ms (log)",
              "forward+backward time (median; lower is better)", colors)
        memory = [record if record.repeats is not None
                  else dataclasses.replace(record, shape=f"{record.shape}\ncompiled, not run")
                  for record in records if record.kind == "backend"]
        _bars(axes[1], memory, "temp_bytes", 2**20, "MiB (log)",
              "temporary memory of forward+backward (memory_analysis)", colors)
    else:
        _bars(axes[0], records, "fwd_temp_bytes", 2**20, "MiB (log)", "forward: temporary memory", colors)
        _bars(axes[1], records, "temp_bytes", 2**20, "MiB (log)", "forward+backward: temporary memory", colors)
    handles, labels = [], []
    for axis in axes:
        for handle, label in zip(*axis.get_legend_handles_labels(), strict=True):
            if label not in labels:
                handles.append(handle)
                labels.append(label)
    fig.legend(handles, labels, loc="lower center", ncol=min(6, max(1, len(labels))), fontsize=8, frameon=False)
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout(rect=(0, 0.07, 1, 0.96 if title else 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
