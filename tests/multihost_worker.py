"""One of the two processes that tests/test_multihost.py starts (not collected by pytest: no ``test_`` prefix).

``python tests/multihost_worker.py PORT PROCESS_ID``: joins the other process through
``jax.distributed`` on ``127.0.0.1:PORT`` with gloo CPU collectives, builds meshes over all 8 devices
(4 per process; the parent sets ``XLA_FLAGS``), and runs the README's multi-host recipe: every process
draws the same global inputs from the same seed, places them on the mesh, and makes the same call.
Results are gathered with ``process_allgather`` and compared with the float64 oracle. Prints one
``ok <case>`` line per case; any failure is an exception, so a non-zero exit.

``CE_MULTIHOST_EXIT_EARLY=<id>``: process ``<id>`` exits with status 3 right after joining (backends up), to check
that the other process then fails within bounded time instead of hanging.
"""

from __future__ import annotations

import contextlib
import os
import re
import sys
import time
from typing import Any, TypedDict

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.multihost_utils import process_allgather
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import ce_core
from ce_core import linear_cross_entropy, linear_distillation_loss, linear_log_probs, sharded_linear_cross_entropy
from ce_core.testing import (
    covering_array,
    distillation_oracle,
    log_probs_oracle,
    max_rel_error,
    oracle,
    random_problem,
)

#: Short jax.distributed timeouts: a dead peer must end the job within a minute, not the defaults' minutes.
HEARTBEAT_TIMEOUT_S = 10
INITIALIZATION_TIMEOUT_S = 60
SHUTDOWN_TIMEOUT_S = 30


def join(port: int, process_id: int) -> None:
    # Before anything initialises a backend: cross-process collectives on CPU go through gloo.
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(
        coordinator_address=f"127.0.0.1:{port}",
        num_processes=2,
        process_id=process_id,
        initialization_timeout=INITIALIZATION_TIMEOUT_S,
        heartbeat_timeout_seconds=HEARTBEAT_TIMEOUT_S,
        shutdown_timeout_seconds=SHUTDOWN_TIMEOUT_S,
    )


def main() -> None:
    port, process_id = int(sys.argv[1]), int(sys.argv[2])
    join(port, process_id)
    assert jax.process_count() == 2 and jax.device_count() == 8 and jax.local_device_count() == 4, (
        jax.process_count(), jax.device_count(), jax.local_device_count())
    if os.environ.get("CE_MULTIHOST_EXIT_EARLY") == str(process_id):
        print(f"process {process_id}: exiting early on purpose", flush=True)
        os._exit(3)
    assert set(BACKENDS) <= set(ce_core.available_backends()), ce_core.available_backends()
    Checks(process_id).run()
    print(f"process {process_id}: all cases passed", flush=True)


BACKENDS = ("reference", "xla")
#: auto_stated: Auto axes with in_specs = the inputs' layout.
MODES = ("explicit", "auto", "auto_stated")
BATCH, H, V = (4, 6), 48, 320


class LossOptions(TypedDict, total=False):
    """Keyword options shared by the loss and its oracle."""

    label_smoothing: float
    logsumexp_weight: float
    logit_soft_cap: float


OPTIONS = LossOptions(label_smoothing=0.1, logsumexp_weight=1e-3, logit_soft_cap=3.0)
#: layout -> (spec of x [batch, seq, H], spec of w [H, V]); labels follow x's token dimensions.
LAYOUTS = {
    "data": (P("data", None, None), P(None, None)),
    "data_x_vocab": (P("data", None, None), P(None, "model")),
}
LOSS_TOL, GRAD_TOL = 1e-5, 1e-4


def gathered(value: jax.Array) -> np.ndarray:
    """The global value on every process (``process_allgather`` of a global array is the whole array)."""
    return np.asarray(process_allgather(value, tiled=True))


def check(name: str, actual: jax.Array, expected: np.ndarray, tol: float) -> None:
    error = max_rel_error(gathered(actual), expected)
    assert error < tol, f"{name}: relative error {error:.3g} >= {tol}"


class Checks:
    def __init__(self, process_id: int):
        self.process_id = process_id
        self.x, self.labels, self.w = random_problem(0, BATCH, H, V)
        self.expected = oracle(self.x, self.labels, self.w, **OPTIONS)
        self.meshes = {
            mode: jax.make_mesh((2, 4), ("data", "model"), axis_types=(axis_type,) * 2)
            for mode, axis_type in zip(MODES, (AxisType.Explicit, AxisType.Auto, AxisType.Auto), strict=True)
        }

    def run(self) -> None:
        """Every backend, mode and layout, each pair of them at least once (a covering array); eager calls,
        which run op by op across the processes (15-20 s each), once per mode and entry point, the backends
        taking turns."""
        for row in covering_array({"backend": BACKENDS, "mode": MODES, "layout": tuple(LAYOUTS)}):
            self.case(f"{row['backend']} jit {row['mode']} {row['layout']}", self.jitted_step, *row.values())
        for mode, backend in zip(MODES, BACKENDS * 2, strict=False):
            self.case(f"{backend} eager {mode}", self.eager_step, backend, mode)
        for backend, jitted in zip(BACKENDS, (False, True), strict=True):
            self.case(f"{backend} sharded_linear_cross_entropy {'jit' if jitted else 'eager'}", self.sharded_call,
                      backend, jitted)
        for backend, jitted in zip(BACKENDS, (True, False), strict=True):
            self.case(f"{backend} linear_log_probs {'jit' if jitted else 'eager'}", self.log_probs, backend, jitted)
        for backend in BACKENDS:
            if (ce_core.get_backend(backend).contract_version or 0) >= 3:
                self.case(f"{backend} jit explicit w_layout=vh return_argmax", self.tied_argmax, backend)
        for backend, mode in zip(BACKENDS, ("explicit", "auto"), strict=True):
            self.case(f"{backend} linear_distillation_loss dense teacher jit {mode}", self.distillation, backend, mode)
        self.case(f"{BACKENDS[-1]} linear_distillation_loss dense teacher reverse KL jit explicit", self.distillation,
                  BACKENDS[-1], "explicit", "reverse_kl")
        self.case("bad label named by the process that holds it", self.bad_label)

    def case(self, name: str, fn, *args) -> None:
        start = time.perf_counter()
        fn(*args)
        print(f"process {self.process_id}: ok {name} ({time.perf_counter() - start:.1f} s)", flush=True)

    def place(self, mode: str, x_spec: P, w_spec: P):
        """``x``, ``labels`` and ``w`` as global arrays on the mesh (labels split like x's tokens)."""
        mesh = self.meshes[mode]

        def put(value: np.ndarray, spec: P) -> jax.Array:
            return jax.make_array_from_callback(value.shape, NamedSharding(mesh, spec), lambda index: value[index])

        return put(self.x, x_spec), put(self.labels, P(*x_spec[:-1])), put(self.w, w_spec)

    def entered(self, mode: str):
        """Explicit axes are used as users use them, under ``jax.set_mesh``; Auto ones from the inputs alone."""
        return jax.set_mesh(self.meshes[mode]) if mode == "explicit" else contextlib.nullcontext()

    def assert_loss_and_grads(self, name: str, loss, dx, dw, expected) -> None:
        check(f"{name} loss", loss, expected["loss"], LOSS_TOL)
        check(f"{name} dx", dx, expected["dx"], GRAD_TOL)
        check(f"{name} dw", dw, expected["dw"], GRAD_TOL)

    def jitted_step(self, backend: str, mode: str, layout: str) -> None:
        specs = LAYOUTS[layout] if mode == "auto_stated" else None

        def loss_fn(x, labels, w):
            return linear_cross_entropy(x, labels, w, implementation=backend, in_specs=specs, **OPTIONS)

        with self.entered(mode):
            x, labels, w = self.place(mode, *LAYOUTS[layout])
            loss, (dx, dw) = jax.jit(jax.value_and_grad(loss_fn, argnums=(0, 2)))(x, labels, w)
        self.assert_loss_and_grads(f"jit {mode} {layout}", loss, dx, dw, self.expected)

    def eager_step(self, backend: str, mode: str) -> None:
        """The plain call without jit: the labels are concrete, so they are validated (each process its own)."""
        with self.entered(mode):
            x, labels, w = self.place(mode, *LAYOUTS["data_x_vocab"])
            specs = LAYOUTS["data_x_vocab"] if mode == "auto_stated" else None
            loss, (dx, dw) = jax.value_and_grad(
                lambda x_, w_: linear_cross_entropy(x_, labels, w_, implementation=backend, in_specs=specs, **OPTIONS),
                argnums=(0, 1))(x, w)
        self.assert_loss_and_grads(f"eager {mode}", loss, dx, dw, self.expected)

    def sharded_call(self, backend: str, jitted: bool) -> None:
        x, labels, w = self.place("auto", *LAYOUTS["data_x_vocab"])
        mesh = self.meshes["auto"]

        def loss_fn(x_, labels_, w_):
            return sharded_linear_cross_entropy(x_, labels_, w_, mesh=mesh, batch_axes="data", vocab_axis="model",
                                                implementation=backend, **OPTIONS)

        grad_fn = jax.value_and_grad(loss_fn, argnums=(0, 2))
        loss, (dx, dw) = (jax.jit(grad_fn) if jitted else grad_fn)(x, labels, w)
        self.assert_loss_and_grads("sharded", loss, dx, dw, self.expected)

    def log_probs(self, backend: str, jitted: bool) -> None:
        temperature = 0.7
        expected = log_probs_oracle(self.x, self.labels, self.w, temperature=temperature)

        def objective(x_, labels_, w_):
            logp, entropy = linear_log_probs(x_, labels_, w_, temperature=temperature, return_entropy=True,
                                             implementation=backend)
            return jnp.sum(logp) + jnp.sum(entropy), (logp, entropy)

        grad_fn = jax.value_and_grad(objective, argnums=(0, 2), has_aux=True)
        with self.entered("explicit"):
            x, labels, w = self.place("explicit", *LAYOUTS["data_x_vocab"])
            (_, (logp, entropy)), (dx, dw) = (jax.jit(grad_fn) if jitted else grad_fn)(x, labels, w)
        check("logp", logp, expected["logp"], LOSS_TOL)
        check("entropy", entropy, expected["entropy"], LOSS_TOL)
        check("log_probs dx", dx, expected["dx"], GRAD_TOL)
        check("log_probs dw", dw, expected["dw"], GRAD_TOL)

    def tied_argmax(self, backend: str) -> None:
        """A ``[V, H]`` head split on its vocab rows across both processes, with the per-token argmax."""
        w_vh = np.ascontiguousarray(self.w.T)
        mesh = self.meshes["explicit"]

        def loss_fn(x_, labels_, w_):
            return linear_cross_entropy(x_, labels_, w_, w_layout="vh", return_argmax=True, implementation=backend,
                                        **OPTIONS)

        with self.entered("explicit"):
            x, labels, _ = self.place("explicit", *LAYOUTS["data_x_vocab"])
            w = jax.make_array_from_callback(w_vh.shape, NamedSharding(mesh, P("model", None)),
                                             lambda index: w_vh[index])
            (loss, argmax), (dx, dw) = jax.jit(jax.value_and_grad(loss_fn, argnums=(0, 2), has_aux=True))(
                x, labels, w)
        check("vh loss", loss, self.expected["loss"], LOSS_TOL)
        check("vh dx", dx, self.expected["dx"], GRAD_TOL)
        check("vh dw", dw, self.expected["dw"].T, GRAD_TOL)
        cap = OPTIONS.get("logit_soft_cap")
        assert cap is not None
        z = cap * np.tanh(self.x.astype(np.float64) @ self.w / cap)
        want = np.where(self.labels != -100, np.argmax(z, -1), -1)
        assert (gathered(argmax) == want).all(), "vh argmax"

    def distillation(self, backend: str, mode: str, divergence: str = "jsd") -> None:
        """A dense teacher laid out like the student: tokens over "data", both vocabularies over "model" (under
        Explicit axes; Auto's default layout splits every token), the statistics combined across processes (the
        JSD's lses before its sums, a KL's by the chain rule)."""
        rng = np.random.default_rng(1)
        teacher_x = rng.standard_normal((*BATCH, 32)).astype(np.float32)
        teacher_w = (rng.standard_normal((32, V)) / np.sqrt(32)).astype(np.float32)
        options: dict[str, Any] = dict(divergence=divergence, temperature=0.8, logit_soft_cap=3.0,
                                       hard_label_weight=0.2)
        expected = distillation_oracle(self.x, self.w, teacher_x, teacher_w, self.labels, **options)
        mesh = self.meshes[mode]

        def put(value: np.ndarray, spec: P) -> jax.Array:
            return jax.make_array_from_callback(value.shape, NamedSharding(mesh, spec), lambda index: value[index])

        with self.entered(mode):
            x, labels, w = self.place(mode, *LAYOUTS["data_x_vocab"])
            tx, tw = put(teacher_x, P("data", None, None)), put(teacher_w, P(None, "model"))
            # Global arrays are arguments (a closure over arrays that span other processes is refused).
            loss, (dx, dw) = jax.jit(jax.value_and_grad(lambda a, b, c, d, y: linear_distillation_loss(
                a, b, c, d, y, implementation=backend, **options), argnums=(0, 1)))(x, w, tx, tw, labels)
        self.assert_loss_and_grads(f"distillation {mode}", loss, dx, dw, expected)

    def bad_label(self) -> None:
        """A bad label in each process's half of the tokens: each process names the one it holds, globally.

        Tokens are split over ``data``, whose two rows are the two processes' devices, so neither process
        can see the other's bad label; each must find its own and report its global position.
        """
        mesh = self.meshes["explicit"]
        label_sharding = NamedSharding(mesh, P("data", None))
        # The global [row, column] of one label on each process's devices (process 1's rows start at 2).
        bad_at = {}
        for device, index in label_sharding.devices_indices_map(BATCH).items():
            rows, columns = index
            bad_at.setdefault(device.process_index, (rows.stop - 1, (columns.start or 0) + 1 + device.process_index))
        assert sorted(bad_at) == [0, 1], bad_at
        assert bad_at[1][0] >= BATCH[0] // 2, bad_at  # a global row that is not also a local one
        labels = self.labels.copy()
        for row, column in bad_at.values():
            labels[row, column] = V + 7
        mine = bad_at[self.process_id]
        pattern = re.escape(f"labels[{mine[0]}, {mine[1]}] = {V + 7}")
        with jax.set_mesh(mesh):
            x, _, w = self.place("explicit", *LAYOUTS["data"])
            global_labels = jax.make_array_from_callback(BATCH, label_sharding, lambda index: labels[index])
            assert not global_labels.is_fully_addressable
            for name, call in (
                ("linear_cross_entropy", lambda: linear_cross_entropy(x, global_labels, w, implementation="reference")),
                ("sharded_linear_cross_entropy", lambda: sharded_linear_cross_entropy(
                    x, global_labels, w, mesh=mesh, implementation="reference")),
            ):
                try:
                    call()
                except ValueError as error:
                    assert re.search(pattern, str(error)), f"{name}: {error}"
                else:
                    raise AssertionError(f"{name}: no ValueError for the bad label at {mine}")


if __name__ == "__main__":
    main()
