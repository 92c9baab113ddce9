"""Ahead-of-time compilation for a TPU generation on a machine without a TPU.

With ``libtpu`` installed, ``jax.experimental.topologies.get_topology_desc`` describes a TPU slice
that is not there; its devices can be the sharding of ``ShapeDtypeStruct`` s, and
``jax.jit(f).lower(...).compile()`` then runs the real TPU compiler (Mosaic lowering and its VMEM
checks included). ``compiled.memory_analysis()`` gives the HBM each program needs.

Inside :func:`target_context`:

- ``ce_pallas_tpu.tooling.aot.compiling_for(target)``: an abstract mesh over the topology's device, so
  Pallas' ``pltpu.get_tpu_info()`` sees the target generation rather than the host CPU, and
  ``CE_PALLAS_TPU_TARGET=<target>``, which makes ``ce_pallas_tpu`` available off-TPU and picks its
  tuned block sizes for that generation (the topologies and targeting live there, once);
- tokamax's ``cross_compile`` option (when tokamax is installed), which lifts its "Not supported on
  cpu" device check so ``tokamax:mosaic_tpu`` is compiled for the target too. tokamax's own verdict
  for the target (``supported_on``: TPU v5 and newer for ``mosaic_tpu``) is still honoured: a
  generation it declines gets an ``unsupported`` row instead of a compile.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator, Sequence
from typing import Any

import jax
import jax.numpy as jnp

from ce_bench.contenders import Contender, default_names, tokamax_installed, tokamax_unsupported_reason
from ce_bench.presets import Shape
from ce_bench.records import Record, classify, short_reason
from ce_bench.runner import Progress, compile_programs, input_structs
from ce_core.extend import CompileResult

#: ``--target`` choices: the generations ``ce_pallas_tpu.tooling.aot`` has a one-chip topology for.
TOPOLOGIES: dict[str, str] = {
    "v4": "v4:1x1x1 (megacore)",
    "v5e": "v5e:1x1",
    "v5p": "v5p:1x1x1",
    "v6e": "v6e:1x1",
    "tpu7x": "tpu7x:1x1x1 (first TensorCore)",
}


class AotUnavailableError(RuntimeError):
    """The TPU compiler cannot be reached (no libtpu or ce-pallas-tpu, or an unknown target)."""


def _pallas_aot() -> Any:
    """``ce_pallas_tpu.tooling.aot``: the one place that makes TPU topology devices and targets them."""
    try:
        from ce_pallas_tpu.tooling import aot
    except ImportError as error:
        raise AotUnavailableError(
            f"ahead-of-time compilation needs ce-pallas-tpu and libtpu: pip install 'ce-bench[tpu]' ({error})"
        ) from error
    return aot


def tpu_device(target: str) -> Any:
    """The device of a one-chip topology of generation ``target``."""
    if target not in TOPOLOGIES:
        raise AotUnavailableError(f"unknown TPU target {target!r}; choose one of {sorted(TOPOLOGIES)}")
    aot = _pallas_aot()
    try:
        return aot.topology_device(target)
    except Exception as error:
        hint = ("another process holds libtpu's lockfile: set ALLOW_MULTIPLE_LIBTPU_LOAD=1 before JAX starts"
                if "lockfile" in str(error) else
                "ahead-of-time compilation needs libtpu: pip install 'ce-bench[tpu]' (or libtpu) on Linux x86_64")
        raise AotUnavailableError(f"cannot get a {target} topology ({short_reason(error)}); {hint}") from error


@contextlib.contextmanager
def target_context(target: str) -> Iterator[Any]:
    """Make JAX, ce_pallas_tpu and tokamax compile for ``target``; yields its device (module docstring)."""
    tpu_device(target)  # a clear AotUnavailableError first
    with contextlib.ExitStack() as stack:
        device = stack.enter_context(_pallas_aot().compiling_for(target))
        if tokamax_installed():
            import tokamax

            stack.enter_context(tokamax.config.cross_compile(True))
        yield device


def hbm_bytes() -> int | None:
    """HBM of one chip of the current (abstract) TPU device, from ``pltpu.get_tpu_info()``."""
    try:
        from jax.experimental.pallas import tpu as pltpu

        info = pltpu.get_tpu_info()
        return int(info.hbm_capacity_bytes) * int(info.num_cores or 1)
    except Exception:
        return None


def default_aot_names(target: str) -> list[str]:
    """Every ce_core backend available when compiling for ``target``, then tokamax's."""
    with _pallas_aot().targeting(target):
        return default_names()


def run_aot(target: str, shapes: Sequence[Shape], dtypes: Sequence[Any], names: Sequence[str] | None = None,
            *, reduction: str = "mean", progress: bool = True) -> list[Record]:
    """Compile the forward and forward+backward programs of each contender for ``target``.

    Returns one record per (shape, dtype, contender): ``compiled`` with HBM temporaries, arguments,
    outputs, the chip's HBM and the block sizes; or ``unsupported`` / ``failed`` with the reason.

    Raises:
      AotUnavailableError: libtpu is missing or ``target`` is unknown.
    """
    device = tpu_device(target)
    names = list(names) if names is not None else default_aot_names(target)
    sharding = jax.sharding.SingleDeviceSharding(device)
    device_text = f"tpu: {device.device_kind} (AOT for {target}, no TPU present)"
    bar = Progress(progress, f"ce-bench aot {target}")
    bar.add(len(shapes) * len(dtypes) * len(names))
    records = []
    try:
        with target_context(target):
            hbm = hbm_bytes()
            for shape in shapes:
                for dtype in dtypes:
                    dtype = jnp.dtype(dtype)
                    structs = input_structs(shape, dtype, sharding)
                    for name in names:
                        bar.step(f"{name} {shape.label}")
                        records.append(_compile_one(Contender(name), shape, dtype, structs, reduction, target,
                                                    device, device_text, hbm))
    finally:
        bar.close()
    return records


def _compile_one(contender: Contender, shape: Shape, dtype: Any, structs: Sequence[Any], reduction: str,
                 target: str, device: Any, device_text: str, hbm: int | None) -> Record:
    record = Record(backend=contender.name, shape=shape.label, n=shape.n, h=shape.h, v=shape.v,
                    dtype=jnp.dtype(dtype).name, reduction=reduction, status="compiled", note=shape.note or None,
                    device=device_text, target=target, hbm_bytes=hbm)
    record.block_sizes = contender.block_sizes(shape.n, shape.h, shape.v, dtype)
    declined = tokamax_unsupported_reason(contender, device)
    if declined:
        record.status, record.reason = "unsupported", declined
        return record
    start = time.perf_counter()
    try:
        fwd, fwd_bwd = contender.programs(reduction)
        compiled_fwd, compiled_fwd_bwd, seconds = compile_programs(fwd, fwd_bwd, structs)
    except Exception as error:
        record.status, record.reason = classify(error), short_reason(error)
        record.compile_s = time.perf_counter() - start
        return record
    record.take_memory(CompileResult.of(compiled_fwd_bwd, seconds), CompileResult.of(compiled_fwd))
    return record
