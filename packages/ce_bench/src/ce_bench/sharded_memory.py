"""The loss on a simulated CPU mesh: per-device memory (compile only) and, optionally, CPU time.

``ce-bench sharding`` compiles ``jax.value_and_grad`` (w.r.t. ``x`` and ``w``) of the mean loss on
``data x vocab`` meshes of simulated CPU devices, called three ways (``CALLS``):

- ``wrapper``: :func:`ce_core.sharded_linear_cross_entropy` with ``batch_axes``/``vocab_axis``;
- ``explicit``: the plain :func:`ce_core.linear_cross_entropy` under ``jax.set_mesh`` of a
  ``jax.make_mesh`` mesh (Explicit axes), inputs typed with their shardings;
- ``auto``: the plain call on ``NamedSharding`` inputs of an Auto-axes mesh (GSPMD/Shardy), with
  the default layout (every token split over every axis, ``w`` gathered);
- ``auto_stated``: the same with the inputs' layout stated in ``in_specs``.

``x`` is split over ``data`` and ``w`` over ``vocab`` on V. ``memory_analysis()`` of the SPMD program
gives per-device sizes (and the compiled HLO its all-gathers, by result shape), so Llama-3-sized
shapes compile here without running. With ``topology``
(e.g. ``"v5p:2x2x1"``) the meshes are made of a deviceless TPU topology's devices instead, and the
programs compiled by libtpu for that TPU (compile only; ``pallas_tpu`` then compiles its real kernels). With ``time``
the programs also run on random inputs, interleaved round-robin per mesh (:mod:`ce_bench.timing`);
8 simulated devices share this machine's cores, so times compare calls, not hardware.
"""

from __future__ import annotations

import contextlib
import os
import re
from collections.abc import Callable, Sequence
from typing import Any

from ce_bench.records import Record, classify, short_reason
from ce_core.extend import compile_program

DEVICE_COUNT = 8
DEFAULT_MESHES = ((1, 1), (8, 1), (2, 4), (1, 8))
CALLS = ("wrapper", "explicit", "auto", "auto_stated")
#: An all-gather in compiled HLO text (also the async start on TPU), and its result shape.
ALL_GATHER = re.compile(r"=\s*\(?[a-z0-9]+\[(?P<dims>[\d,]*)\][^=\n]*?\ball-gather(?:-start)?\(")


def all_gather_shapes(hlo: str) -> list[str]:
    """The result shapes (``"4096x128256"``) of the all-gathers in compiled HLO text."""
    return [m["dims"].replace(",", "x") for m in ALL_GATHER.finditer(hlo)]


def request_simulated_devices(count: int = DEVICE_COUNT) -> None:
    """Ask XLA for ``count`` CPU devices; effective only before JAX initialises its CPU backend."""
    flag = "--xla_force_host_platform_device_count"
    if flag not in os.environ.get("XLA_FLAGS", ""):
        os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {flag}={count}".strip()


def mesh_devices(topology: str | None) -> list[Any]:
    """The simulated CPU devices, or a deviceless TPU topology's."""
    import jax

    if topology is None:
        return jax.devices("cpu")
    from ce_pallas_tpu.tooling.aot import topology_devices

    return topology_devices(topology)


def _compile_context(topology: str | None, mesh: Any) -> contextlib.ExitStack:
    """A fresh context for lowering or running one program: the pallas_tpu target of ``topology``
    (while compiling for it), and ``jax.set_mesh(mesh)`` when ``mesh`` has Explicit axes."""
    import jax

    stack = contextlib.ExitStack()
    if topology is not None:
        from ce_pallas_tpu.target import normalize_generation, targeting

        stack.enter_context(targeting(normalize_generation(topology.split(":")[0])))
    if mesh.abstract_mesh.explicit_axes:
        stack.enter_context(jax.set_mesh(mesh))
    return stack


def _program(backend: str, call: str, data: int, vocab: int, topology: str | None = None
             ) -> tuple[Any, Callable[[], contextlib.ExitStack], dict[str, Any]]:
    """``(jitted value_and_grad, context factory, shardings)`` of one way of calling the loss."""
    import jax
    from jax.sharding import AxisType, NamedSharding, PartitionSpec

    from ce_core import linear_cross_entropy, sharded_linear_cross_entropy

    devices = mesh_devices(topology)
    if len(devices) < data * vocab:
        raise RuntimeError(f"need {data * vocab} devices, have {len(devices)}"
                           + ("" if topology else "; call request_simulated_devices() first"))
    axis_type = AxisType.Explicit if call == "explicit" else AxisType.Auto
    mesh = jax.make_mesh((data, vocab), ("data", "vocab"), axis_types=(axis_type,) * 2, devices=devices[: data * vocab])
    vocab_axis = "vocab" if vocab > 1 else None
    if call == "wrapper":
        def loss(x, labels, w):
            return sharded_linear_cross_entropy(x, labels, w, mesh=mesh, batch_axes=("data",), vocab_axis=vocab_axis,
                                                implementation=backend)
    elif call in ("explicit", "auto", "auto_stated"):
        specs = (PartitionSpec("data", None), PartitionSpec(None, vocab_axis)) if call == "auto_stated" else None

        def loss(x, labels, w):
            return linear_cross_entropy(x, labels, w, implementation=backend, in_specs=specs)
    else:
        raise ValueError(f"unknown call {call!r}; one of {CALLS}")
    shardings = dict(x=NamedSharding(mesh, PartitionSpec("data", None)),
                     labels=NamedSharding(mesh, PartitionSpec("data")),
                     w=NamedSharding(mesh, PartitionSpec(None, vocab_axis)))
    return jax.jit(jax.value_and_grad(loss, argnums=(0, 2))), lambda: _compile_context(topology, mesh), shardings


def sharded_temp_bytes(
    backend: str, n: int, h: int, v: int, dtype: str, data: int, vocab: int, call: str = "wrapper",
    topology: str | None = None,
) -> Record:
    """Compile fwd+bwd on a ``data x vocab`` mesh: a ``compiled`` record with per-device sizes, or
    ``unsupported``/``failed`` with the reason."""
    import jax
    import jax.numpy as jnp

    record = Record(backend=backend, shape=f"{n}x{h}x{v}", n=n, h=h, v=v, dtype=dtype, reduction="mean",
                    status="compiled", device=topology or "cpu", mesh=f"{data}x{vocab}", call=call)

    def compile_fn() -> Any:
        step, context, shardings = _program(backend, call, data, vocab, topology)
        args = (jax.ShapeDtypeStruct((n, h), jnp.dtype(dtype), sharding=shardings["x"]),
                jax.ShapeDtypeStruct((n,), jnp.int32, sharding=shardings["labels"]),
                jax.ShapeDtypeStruct((h, v), jnp.dtype(dtype), sharding=shardings["w"]))
        with context():
            return step.lower(*args).compile()

    try:
        compiled, result = compile_program(compile_fn)
    except Exception as error:  # the row says why; the sweep goes on
        record.status, record.reason = classify(error), short_reason(error)
        return record
    record.take_memory(result)
    record.note = "all-gathers: " + (", ".join(all_gather_shapes(compiled.as_text() or "")) or "none")
    return record


def time_calls(records: list[Record], *, repeats: int, seed: int = 0) -> None:
    """Run every compiled record's program on random inputs, interleaved per mesh: ``fwd_bwd_ms`` is the
    median time of one ``value_and_grad`` call, and the status becomes ``ok`` (or ``failed``)."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from ce_bench.timing import interleaved

    by_mesh: dict[tuple[Any, ...], list[Record]] = {}
    for record in records:
        if record.status == "compiled" and record.mesh is not None:
            key = (record.mesh, record.n, record.h, record.v, record.dtype)
            by_mesh.setdefault(key, []).append(record)
    for (mesh, n, h, v, dtype), group in by_mesh.items():
        rng = np.random.default_rng(seed)
        x = rng.standard_normal((n, h), np.float32)
        w = (rng.standard_normal((h, v), np.float32) / np.sqrt(h)).astype(np.float32)
        labels = rng.integers(0, v, n).astype(np.int32)
        data, vocab = (int(part) for part in mesh.split("x"))
        contenders = {}
        for record in group:
            step, context, shardings = _program(record.backend, record.call or "wrapper", data, vocab)
            with context():
                args = (jax.device_put(jnp.asarray(x, dtype), shardings["x"]),
                        jax.device_put(labels, shardings["labels"]),
                        jax.device_put(jnp.asarray(w, dtype), shardings["w"]))

            def run(step=step, context=context, args=args):
                with context():
                    return step(*args)

            contenders[f"{record.backend}/{record.call}"] = run
        timings = interleaved(contenders, repeats=repeats)
        for record in group:
            timing = timings[f"{record.backend}/{record.call}"]
            record.fwd_bwd_ms, record.repeats = timing.median_ms, repeats
            record.status = "failed" if timing.error else "ok"
            if timing.error:
                record.reason = f"error when run: {timing.error}"


def sweep(backends: Sequence[str], n: int, h: int, v: int, dtype: str,
          meshes: Sequence[tuple[int, int]] = DEFAULT_MESHES,
          calls: Sequence[str] = ("wrapper",), topology: str | None = None) -> list[Record]:
    """:func:`sharded_temp_bytes` for every backend, call and mesh."""
    return [sharded_temp_bytes(b, n, h, v, dtype, d, m, c, topology)
            for d, m in meshes for b in backends for c in calls]


def format_table(records: Sequence[Record]) -> str:
    """A Markdown table of a :func:`sweep`, with each mesh's saving against the same call on 1x1."""
    unsharded = {(r.backend, r.call): r.temp_bytes for r in records if r.mesh == "1x1"}
    timed = any(r.fwd_bwd_ms is not None for r in records)
    lines = ["| backend | call | N x H x V, dtype | mesh (data x vocab) | per-device temp | vs 1 device "
             "| per-device args | all-gathers |" + (" fwd+bwd time |" if timed else ""),
             "|---|---|---|---|---|---|---|---|" + ("---|" if timed else "")]
    for r in records:
        shape = f"{r.n} x {r.h} x {r.v}, {r.dtype}"
        if r.temp_bytes is None or r.argument_bytes is None:
            lines.append(f"| {r.backend} | {r.call} | {shape} | {r.mesh} | {r.status}: {r.reason} | | | |"
                         + (" |" if timed else ""))
            continue
        base = unsharded.get((r.backend, r.call))
        ratio = f"{r.temp_bytes / base:.3f}x" if base else "n/a"
        time = f" {r.fwd_bwd_ms:,.0f} ms |" if r.fwd_bwd_ms is not None else (" |" if timed else "")
        gathers = (r.note or "").removeprefix("all-gathers: ")
        lines.append(f"| {r.backend} | {r.call} | {shape} | {r.mesh} | {r.temp_bytes / 2**20:,.1f} MiB "
                     f"| {ratio} | {r.argument_bytes / 2**20:,.1f} MiB | {gathers} |" + time)
    return "\n".join(lines)
