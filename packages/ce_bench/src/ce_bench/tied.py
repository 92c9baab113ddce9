"""``ce-bench tied``: what a head tied to the input embedding costs, per way of passing it (compile only).

A tied head is the embedding table ``E [V, H]``. The model either passes it as it is stored
(``w_layout="vh"``), or transposed (``E.T``, today's habit), or unties it (a separate ``[H, V]``
head, the baseline). Each way is compiled as ``value_and_grad`` of a small language model's loss
w.r.t. the table and the hidden states (the table used as input embedding *and* as head, as a
training step uses it), on the host or for a TPU generation through libtpu's deviceless topology,
and reported as its temporaries and the ``[V, H]``-sized copies or transposes in the compiled HLO.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp

from ce_bench.presets import Shape
from ce_bench.report import _Notes, _render
from ce_core import linear_cross_entropy
from ce_core.extend import CompileResult, compile_program

#: The ways of passing the head: the table itself, its transpose, and an untied ``[H, V]`` head.
WAYS = ("vh", "transposed", "untied")
#: An HLO instruction that copies or transposes, with its result shape.
_MOVING = re.compile(r"^\s*(?:ROOT\s+)?%?[\w.\-]+\s*=\s*(?P<shape>\([^=]*?\)|\S+)\s+(?:transpose|copy|copy-start)\(")


def head_copies(hlo: str, h: int, v: int) -> int:
    """How many instructions of ``hlo`` copy or transpose an array of the head's size."""
    sized = re.compile(rf"\[({v},{h}|{h},{v})\]")
    return sum(1 for line in hlo.splitlines() if (match := _MOVING.match(line)) and sized.search(match["shape"]))


def _program(way: str, shape: Shape, dtype: Any, implementation: str | None):
    """``(fn, args)``: the loss of one step, differentiated w.r.t. the table (or head) and ``x``."""

    def loss(table, x, labels, head):
        # The table as the input embedding (a gather of some of its rows), then the head.
        hidden = x + table[labels].astype(x.dtype)
        if way == "vh":
            return linear_cross_entropy(hidden, labels, table, w_layout="vh", implementation=implementation)
        if way == "transposed":
            return linear_cross_entropy(hidden, labels, table.T, implementation=implementation)
        return linear_cross_entropy(hidden, labels, head, implementation=implementation)

    table = jax.ShapeDtypeStruct((shape.v, shape.h), dtype)
    head = jax.ShapeDtypeStruct((shape.h, shape.v), dtype) if way == "untied" else None
    args = (table, jax.ShapeDtypeStruct((shape.n, shape.h), dtype), jax.ShapeDtypeStruct((shape.n,), jnp.int32), head)
    argnums = (0, 1, 3) if way == "untied" else (0, 1)
    return jax.value_and_grad(loss, argnums=argnums), args


def compile_tied(way: str, shape: Shape, dtype: Any, *, target: str | None = None,
                 implementation: str | None = None) -> tuple[CompileResult, int | None]:
    """``(compile result, head-sized copies in the HLO or None)`` of one way, for ``target`` (None: here)."""
    fn, args = _program(way, shape, dtype, implementation)

    def compile_fn() -> Any:
        if target is None:
            return jax.jit(fn).lower(*args).compile()
        from ce_pallas_tpu.tooling import aot

        with aot.compiling_for(target) as device:
            sharding = jax.sharding.SingleDeviceSharding(device)
            placed = [None if a is None else jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding) for a in args]
            return jax.jit(fn).lower(*placed).compile()

    compiled, result = compile_program(compile_fn, raise_errors=False)
    hlo = None if compiled is None or not result.ok else compiled.as_text()
    return result, None if hlo is None else head_copies(hlo, shape.h, shape.v)


def run_tied(shapes: Sequence[Shape], dtype: Any, *, target: str | None, implementation: str | None,
             ways: Sequence[str] = WAYS) -> list[dict[str, Any]]:
    """One record per shape and way: temporaries, head-sized copies, and the ratio to the untied head."""
    records = []
    for shape in shapes:
        rows = []
        for way in ways:
            result, copies = compile_tied(way, shape, dtype, target=target, implementation=implementation)
            rows.append({"shape": shape.label, "way": way, "target": target or jax.default_backend(),
                         "implementation": implementation or "default", "ok": result.ok,
                         "temp_bytes": result.temp_bytes, "head_copies": copies, "error": result.error})
        untied = next((r["temp_bytes"] for r in rows if r["way"] == "untied"), None)
        for row in rows:
            temp = row["temp_bytes"]
            row["vs_untied"] = None if not untied or temp is None else temp / untied
        records.extend(rows)
    return records


def tied_table(records: Sequence[dict[str, Any]], fmt: str = "text") -> str:
    """Per shape and way: temporaries (MiB), over the untied head's, and head-sized copies."""
    notes = _Notes()
    headers = ["target", "backend", "shape (N x H x V)", "head passed as", "temporaries MiB", "vs untied",
               "[V, H] copies in HLO"]
    passed_as = {"vh": "table, w_layout='vh'", "transposed": "table.T", "untied": "untied [H, V] head"}
    rows = []
    for r in records:
        if not r["ok"]:
            rows.append([r["target"], r["implementation"], r["shape"], passed_as[r["way"]],
                         "failed" + notes.ref(r["error"] or "compile failed"), "-", "-"])
            continue
        rows.append([r["target"], r["implementation"], r["shape"], passed_as[r["way"]],
                     f"{r['temp_bytes'] / 2**20:,.1f}", "-" if r["vs_untied"] is None else f"{r['vs_untied']:.2f}x",
                     str(r["head_copies"])])
    return _render(headers, rows, notes, fmt, right={4, 5, 6})
