"""The head-to-head run: plan (compile everything, refuse what does not fit), then measure.

1. **Plan**, before anything executes: for every shape, dtype and contender, ``jax.jit(...).lower(
   ShapeDtypeStruct...).compile()`` the forward and the forward+backward programs and read
   ``compiled.memory_analysis()``. A contender that cannot be compiled gets a row saying why
   (``unsupported`` / ``failed``). A shape whose inputs alone exceed the memory budget, or a contender
   whose compiled footprint does, is ``refused`` with the number of bytes it would need: no
   out-of-memory crash. ``--compile-only`` stops here (and refuses nothing).
2. **Measure**, per shape and dtype: draw inputs once, call every contender once (warm-up; its
   forward+backward outputs are compared with the float64 oracle), then time all of them
   round-robin (:func:`ce_bench.timing.interleaved`) together with the matmul floor.
"""

from __future__ import annotations

import dataclasses
import gc
import os
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ce_bench import accuracy, ignored, memory, objectives
from ce_bench.contenders import Contender
from ce_bench.floor import FLOOR_NAME, floor_bytes, floor_programs
from ce_bench.presets import Shape
from ce_bench.records import Record, classify, short_reason
from ce_bench.timing import block, interleaved
from ce_core.extend import CompileResult

#: Share of the available memory a run may plan to use by default.
DEFAULT_BUDGET_FRACTION = 0.8


@dataclasses.dataclass
class RunConfig:
    """What to run. ``names`` are contender names (``reference``, ``xla``, ``tokamax:xla``, ...)."""

    shapes: Sequence[Shape]
    dtypes: Sequence[Any]
    names: Sequence[str]
    reduction: str = "mean"
    repeats: int = 5
    warmup: int = 1
    compile_only: bool = False
    measure_floor: bool = True
    oracle_max_elements: int = accuracy.DEFAULT_MAX_ELEMENTS
    memory_budget_bytes: int | None = None
    seed: int = 0
    #: The share of tokens whose label is ignored (``ce_bench.ignored``), and where they sit.
    ignored: float = 0.0
    ignored_pattern: str = "prompts"


@dataclasses.dataclass
class _Planned:
    """A compiled contender waiting to be measured."""

    record: Record
    fwd: Any = None
    fwd_bwd: Any = None


def stderr_is_terminal() -> bool:
    """Whether ``sys.stderr`` (where tqdm draws) is a terminal: not a pipe, a file or a CI log."""
    isatty = getattr(sys.stderr, "isatty", None)
    return bool(isatty is not None and isatty())


class Progress:
    """A tqdm bar (or nothing) whose total grows as the plan is made.

    The bar is drawn only when ``enabled`` and stderr is a terminal: redirected to a file or a CI
    log, its carriage-return redraws would only add noise.
    """

    def __init__(self, enabled: bool, description: str = "ce-bench") -> None:
        self._bar = None
        if enabled and stderr_is_terminal():
            from tqdm.auto import tqdm

            self._bar = tqdm(total=0, desc=description, unit="step", dynamic_ncols=True, leave=False)

    def add(self, steps: int) -> None:
        """Announce ``steps`` more steps."""
        if self._bar is not None:
            self._bar.total += steps
            self._bar.refresh()

    def step(self, text: str | None = None) -> None:
        """One step done; ``text`` describes what is running now."""
        if self._bar is not None:
            if text:
                self._bar.set_postfix_str(text, refresh=False)
            self._bar.update(1)

    def close(self) -> None:
        """Remove the bar."""
        if self._bar is not None:
            self._bar.close()


def device_description(device: Any | None = None) -> str:
    """``'cpu: cpu (2 cores)'``, ``'gpu: NVIDIA H100'``, ``'tpu: TPU v5 lite'``."""
    described = jax.devices()[0] if device is None else device
    text = f"{described.platform}: {described.device_kind}"
    if described.platform == "cpu":
        text += f" ({os.cpu_count()} cores)"
    return text


def budget_bytes(override: int | None) -> int | None:
    """The memory a run may plan to use: ``override``, else 80% of what is available now."""
    if override is not None:
        return override
    available = memory.available_bytes()
    return None if available is None else int(DEFAULT_BUDGET_FRACTION * available)


def make_inputs(seed: int, n: int, h: int, v: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``x [N, H]``, ``labels [N]``, ``w [H, V]``: the distribution of
    ``ce_core.testing.random_problem`` (logits of order 1) with every label valid, drawn directly
    in float32 so the host never holds a float64 copy of ``w``."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, h), dtype=np.float32)
    w = rng.standard_normal((h, v), dtype=np.float32)
    w *= np.float32(1.0 / np.sqrt(h))
    labels = rng.integers(0, v, size=(n,), dtype=np.int32)
    return x, labels, w


def input_structs(shape: Shape, dtype: Any, sharding: Any = None) -> tuple[jax.ShapeDtypeStruct, ...]:
    """``ShapeDtypeStruct`` s of ``(x, labels, w)`` for lowering (optionally with a sharding)."""
    kwargs = {} if sharding is None else {"sharding": sharding}
    return (jax.ShapeDtypeStruct((shape.n, shape.h), dtype, **kwargs),
            jax.ShapeDtypeStruct((shape.n,), jnp.int32, **kwargs),
            jax.ShapeDtypeStruct((shape.h, shape.v), dtype, **kwargs))


def compile_programs(fwd: Callable[..., Any], fwd_bwd: Callable[..., Any],
                     structs: Sequence[jax.ShapeDtypeStruct]) -> tuple[Any, Any, float]:
    """Compiled ``(fwd, fwd_bwd)`` and the seconds both compiles took."""
    start = time.perf_counter()
    compiled_fwd = jax.jit(fwd).lower(*structs).compile()
    compiled_fwd_bwd = jax.jit(fwd_bwd).lower(*structs).compile()
    return compiled_fwd, compiled_fwd_bwd, time.perf_counter() - start


def run(config: RunConfig, *, progress: bool = True) -> list[Record]:
    """Run the bench and return one :class:`Record` per (shape, dtype, contender), plus a
    ``matmul floor`` row per (shape, dtype) when the floor is measured. Never raises for a
    contender's failure: that contender's row says why."""
    device = jax.devices()[0]
    device_text = device_description(device)
    budget = budget_bytes(config.memory_budget_bytes)
    device_limit = None if device.platform == "cpu" else memory.device_memory_bytes(device)
    bar = Progress(progress)
    records: list[Record] = []
    try:
        plans = []
        for shape in config.shapes:
            for dtype in config.dtypes:
                plans.append(_plan(shape, jnp.dtype(dtype), config, budget, device, device_limit, device_text, bar))
        for plan in plans:
            records += _measure(plan, config, budget, bar)
    finally:
        bar.close()
    return records


@dataclasses.dataclass
class _ShapePlan:
    shape: Shape
    dtype: Any
    planned: list[_Planned]
    floor: _Planned | None


def _base_record(name: str, shape: Shape, dtype: Any, config: RunConfig, device_text: str) -> Record:
    return Record(backend=name, shape=shape.label, n=shape.n, h=shape.h, v=shape.v,
                  dtype=jnp.dtype(dtype).name, reduction=config.reduction, note=shape.note or None,
                  device=device_text, repeats=None if config.compile_only else config.repeats,
                  ignored=config.ignored or None, ignored_pattern=config.ignored_pattern if config.ignored else None)


def _plan(shape: Shape, dtype: Any, config: RunConfig, budget: int | None, device: Any,
          device_limit: int | None, device_text: str, bar: Progress) -> _ShapePlan:
    itemsize = jnp.dtype(dtype).itemsize
    on_cpu = device.platform == "cpu"
    host = memory.host_input_bytes(shape.n, shape.h, shape.v)
    base = memory.input_bytes(shape.n, shape.h, shape.v, itemsize)
    base_need = host + base if on_cpu else host
    structs = input_structs(shape, dtype)
    planned: list[_Planned] = []
    bar.add(len(config.names) + (1 if config.measure_floor and not config.compile_only else 0))

    shape_refusal = None
    if not config.compile_only:
        if budget is not None and base_need > budget:
            shape_refusal = (f"refused: inputs and gradients alone need {memory.gib(base_need)} "
                             f"(x, w, labels, dx, dw), memory budget {memory.gib(budget)}")
        elif device_limit is not None and base > device_limit:
            shape_refusal = (f"refused: inputs and gradients need {memory.gib(base)} on the device, "
                             f"which has {memory.gib(device_limit)}")

    for name in config.names:
        bar.step(f"compile {name} {shape.label}")
        record = _base_record(name, shape, dtype, config, device_text)
        planned.append(_Planned(record))
        if shape_refusal:
            record.status, record.reason = "refused", shape_refusal
            continue
        contender = Contender(name)
        record.block_sizes = contender.block_sizes(shape.n, shape.h, shape.v, dtype)
        try:
            fwd, fwd_bwd = contender.programs(config.reduction)
            compiled_fwd, compiled_fwd_bwd, seconds = compile_programs(fwd, fwd_bwd, structs)
        except Exception as error:  # the row says why; the run goes on
            record.status, record.reason = classify(error), short_reason(error)
            continue
        stats = CompileResult.of(compiled_fwd_bwd, seconds)
        record.take_memory(stats, CompileResult.of(compiled_fwd))
        if config.compile_only:
            record.status = "compiled"
            continue
        refusal = refusal_reason(stats, host, on_cpu, budget, device_limit)
        if refusal:
            record.status, record.reason = "refused", refusal
            continue
        planned[-1].fwd, planned[-1].fwd_bwd = compiled_fwd, compiled_fwd_bwd

    floor = None
    if config.measure_floor and not config.compile_only:
        bar.step(f"compile floor {shape.label}")
        record = _base_record(FLOOR_NAME, shape, dtype, config, device_text)
        record.kind = "floor"
        floor = _Planned(record)
        need = floor_bytes(shape.n, shape.h, shape.v, itemsize) + (host if on_cpu else 0)
        if shape_refusal:
            record.status, record.reason = "refused", shape_refusal
        elif budget is not None and on_cpu and need > budget:
            record.status = "refused"
            record.reason = f"refused: the matmul floor needs {memory.gib(need)}, memory budget {memory.gib(budget)}"
        else:
            try:
                floor.fwd, floor.fwd_bwd, record.compile_s = compile_programs(*floor_programs(), structs)
                record.temp_bytes = CompileResult.of(floor.fwd_bwd).temp_bytes
            except Exception as error:
                record.status, record.reason = classify(error), short_reason(error)
    return _ShapePlan(shape, dtype, planned, floor)


def refusal_reason(stats: CompileResult, host: int, on_cpu: bool, budget: int | None,
                   device_limit: int | None) -> str | None:
    """Why a compiled program with these ``stats`` must not run here (None when it fits).

    On a CPU the program's arguments, outputs and temporaries plus ``host`` bytes of NumPy inputs
    must fit the budget; on an accelerator the program must fit the device's memory.
    """
    total = stats.total_bytes
    if total is None:
        return None
    parts = (f"{memory.gib(stats.argument_bytes)} arguments + {memory.gib(stats.output_bytes)} outputs + "
             f"{memory.gib(stats.temp_bytes)} temporaries")
    if on_cpu and budget is not None and total + host > budget:
        return (f"refused: needs {memory.gib(total + host)} ({parts} + {memory.gib(host)} host inputs), "
                f"memory budget {memory.gib(budget)}; --compile-only reports memory without running")
    if device_limit is not None and total > device_limit:
        return (f"refused: needs {memory.gib(total)} of device memory ({parts}), "
                f"the device has {memory.gib(device_limit)}")
    return None


def _measure(plan: _ShapePlan, config: RunConfig, budget: int | None, bar: Progress) -> list[Record]:
    records = [item.record for item in plan.planned]
    runnable = [item for item in plan.planned if item.fwd is not None]
    floor = plan.floor if plan.floor is not None and plan.floor.fwd is not None else None
    if config.compile_only or not (runnable or floor):
        return records + ([plan.floor.record] if plan.floor is not None else [])

    shape, dtype = plan.shape, plan.dtype
    x_host, labels_host, w_host = make_inputs(config.seed, shape.n, shape.h, shape.v)
    labels_host = ignored.ignore_tokens(labels_host, config.ignored, config.ignored_pattern, seed=config.seed)
    x, labels, w = jnp.asarray(x_host, dtype), jnp.asarray(labels_host), jnp.asarray(w_host, dtype)
    del x_host, w_host

    expected = None
    skip = accuracy.oracle_skip_reason(shape.n, shape.h, shape.v, max_elements=config.oracle_max_elements,
                                       budget_bytes=budget)
    if skip is None and runnable:
        expected = objectives.expected_outputs(np.asarray(x.astype(jnp.float32)), labels_host,
                                             np.asarray(w.astype(jnp.float32)), config.reduction)

    contenders: dict[str, Callable[[], Any]] = {}
    owners: dict[str, tuple[_Planned, str]] = {}
    bar.add(2 * (len(runnable) + (1 if floor else 0)) * (1 + config.repeats))
    for item in runnable + ([floor] if floor else []):
        record = item.record
        try:
            bar.step(f"warm-up {record.backend} {shape.label}")
            outputs = block(item.fwd_bwd(x, labels, w))
            bar.step()
            block(item.fwd(x, labels, w))
            for _ in range(config.warmup - 1):
                block(item.fwd_bwd(x, labels, w))
                block(item.fwd(x, labels, w))
        except Exception as error:
            record.status, record.reason = classify(error), short_reason(error)
            bar.add(-2 * config.repeats)
            continue
        if record.kind == "backend":
            if expected is not None:
                errors = accuracy.compare(outputs, expected)
                record.err_loss, record.err_dx, record.err_dw = errors.loss, errors.dx, errors.dw
                record.max_rel_err = errors.max
            else:
                record.err_note = skip
        del outputs
        for kind, program in (("fwd", item.fwd), ("fwd_bwd", item.fwd_bwd)):
            key = f"{record.backend}/{kind}"
            contenders[key] = (lambda program=program, args=(x, labels, w): program(*args))
            owners[key] = (item, kind)
    del expected
    gc.collect()

    timings = interleaved(contenders, repeats=config.repeats, warmup=0,
                          on_call=lambda key: bar.step(f"time {key} {shape.label}"))
    for key, timing in timings.items():
        item, kind = owners[key]
        record = item.record
        if timing.error is not None:
            record.status, record.reason = "failed", timing.error
            continue
        setattr(record, f"{kind}_ms", timing.median_ms)

    floor_fwd = floor.record.fwd_ms if floor else None
    floor_fwd_bwd = floor.record.fwd_bwd_ms if floor else None
    out = records + ([plan.floor.record] if plan.floor is not None else [])
    for record in out:
        if record.fwd_bwd_ms:
            record.tokens_per_s = shape.n / (record.fwd_bwd_ms / 1e3)
        record.floor_fwd_ms, record.floor_fwd_bwd_ms = floor_fwd, floor_fwd_bwd
        if record.fwd_bwd_ms and floor_fwd_bwd:
            record.floor_ratio = record.fwd_bwd_ms / floor_fwd_bwd
        if record.fwd_ms and floor_fwd:
            record.fwd_floor_ratio = record.fwd_ms / floor_fwd
    del contenders, x, labels, w
    gc.collect()
    return out


@dataclasses.dataclass
class Prepared:
    """One contender compiled for one shape, with inputs on the device (for pytest-benchmark)."""

    fwd: Any
    fwd_bwd: Any
    stats: CompileResult
    args: tuple[jax.Array, jax.Array, jax.Array]
    block_sizes: str | None


def prepare(name: str, shape: Shape, dtype: Any, *, reduction: str = "mean", seed: int = 0,
            budget: int | None = None) -> Prepared:
    """Compile ``name`` for ``shape`` and put random inputs on the device.

    Raises:
      MemoryError: it would not fit (the message says how much it needs), checked before any input
        is drawn.
      Exception: whatever the contender raises while compiling (``UnsupportedError`` included).
    """
    device = jax.devices()[0]
    contender = Contender(name)
    fwd, fwd_bwd, _ = compile_programs(*contender.programs(reduction), input_structs(shape, dtype))
    stats = CompileResult.of(fwd_bwd)
    on_cpu = device.platform == "cpu"
    reason = refusal_reason(stats, memory.host_input_bytes(shape.n, shape.h, shape.v), on_cpu,
                            budget_bytes(budget), None if on_cpu else memory.device_memory_bytes(device))
    if reason:
        raise MemoryError(reason)
    x, labels, w = make_inputs(seed, shape.n, shape.h, shape.v)
    args = (jnp.asarray(x, dtype), jnp.asarray(labels), jnp.asarray(w, dtype))
    return Prepared(fwd, fwd_bwd, stats, args, contender.block_sizes(shape.n, shape.h, shape.v, dtype))
