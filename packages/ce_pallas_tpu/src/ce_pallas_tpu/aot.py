"""Compile the loss for a TPU generation on a machine without a TPU (libtpu's deviceless topologies).

``jax.experimental.topologies.get_topology_desc`` describes one chip of a generation; its device can
be the sharding of ``ShapeDtypeStruct`` inputs, and ``jax.jit(f).lower(...).compile()`` then runs the
real TPU compiler, Mosaic and its VMEM checks included. ``compiled.memory_analysis()`` gives the HBM
the program needs. The tests compile every tuned tile entry this way; the AOT report uses it too.

Needs ``libtpu`` (the ``[tpu]`` extra). Set ``ALLOW_MULTIPLE_LIBTPU_LOAD=1`` before JAX starts when
another process on the machine may hold libtpu's lockfile (safe here: no TPU is driven).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import time
from collections.abc import Iterator
from typing import Any

import ce_core
import jax
import jax.numpy as jnp
import numpy as np

from ce_pallas_tpu.target import TARGET_ENV

#: Generation -> (topology name of one chip, extra topology options). v4 and v5p are taken in
#: their megacore configuration: one device with two TensorCores; TPU7x shows each TensorCore of a
#: chip as its own device, and the first one is used.
TOPOLOGIES: dict[str, tuple[str, dict[str, Any]]] = {
    "v4": ("v4:1x1x1", {"chip_config_name": "megacore"}),
    "v5e": ("v5e:1x1", {}),
    "v5p": ("v5p:1x1x1", {}),
    "v6e": ("v6e:1x1", {}),
    "tpu7x": ("tpu7x:1x1x1", {}),  # one chip, two devices of one TensorCore each
}

_devices: dict[str, Any] = {}


def topology_device(generation: str) -> Any:
    """The device of a one-chip deviceless topology of ``generation`` (cached)."""
    if generation not in _devices:
        from jax.experimental import topologies

        name, options = TOPOLOGIES[generation]
        _devices[generation] = topologies.get_topology_desc(topology_name=name, platform="tpu", **options).devices[0]
    return _devices[generation]


@contextlib.contextmanager
def compiling_for(generation: str) -> Iterator[Any]:
    """``CE_PALLAS_TPU_TARGET=generation`` and an abstract mesh over its device; yields the device."""
    device = topology_device(generation)
    previous = os.environ.get(TARGET_ENV)
    os.environ[TARGET_ENV] = generation
    mesh = jax.sharding.Mesh(np.array([device]), ("aot",))
    try:
        with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
            yield device
    finally:
        if previous is None:
            os.environ.pop(TARGET_ENV, None)
        else:
            os.environ[TARGET_ENV] = previous


@dataclasses.dataclass(frozen=True)
class CompileResult:
    """Outcome of one ahead-of-time compile of the loss and its gradients."""

    ok: bool
    temp_bytes: int | None  # HBM temporaries (memory_analysis().temp_size_in_bytes)
    argument_bytes: int | None
    output_bytes: int | None
    seconds: float
    error: str | None = None


def compile_loss_and_grads(
    generation: str,
    n: int,
    h: int,
    v: int,
    *,
    implementation: str = "pallas_tpu",
    dtype: Any = jnp.bfloat16,
    block_sizes: Any = None,
    raise_errors: bool = True,
    **options: Any,
) -> CompileResult:
    """Compile ``value_and_grad`` of the mean loss w.r.t. ``x`` and ``w`` for ``generation``."""
    start = time.perf_counter()
    try:
        with compiling_for(generation) as device:
            sharding = jax.sharding.SingleDeviceSharding(device)

            def loss(x, w, labels):
                return ce_core.linear_cross_entropy(
                    x, labels, w, implementation=implementation, block_sizes=block_sizes, **options
                )

            args = (
                jax.ShapeDtypeStruct((n, h), dtype, sharding=sharding),
                jax.ShapeDtypeStruct((h, v), dtype, sharding=sharding),
                jax.ShapeDtypeStruct((n,), jnp.int32, sharding=sharding),
            )
            compiled = jax.jit(jax.value_and_grad(loss, argnums=(0, 1))).lower(*args).compile()
        memory = compiled.memory_analysis()
        return CompileResult(
            True,
            int(memory.temp_size_in_bytes),
            int(memory.argument_size_in_bytes),
            int(memory.output_size_in_bytes),
            time.perf_counter() - start,
        )
    except Exception as error:  # noqa: BLE001 - reported, or re-raised below
        if raise_errors:
            raise
        return CompileResult(False, None, None, None, time.perf_counter() - start, _first_line(error))


def _first_line(error: BaseException) -> str:
    text = f"{type(error).__name__}: {error}"
    for line in text.splitlines():
        if line.strip():
            return line.strip()[:300]
    return text[:300]
