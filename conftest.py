"""Repository-wide pytest set-up.

JAX sees 8 simulated CPU devices, so the sharding tests can build real meshes on one machine
(the flag is read when JAX first initialises its CPU backend, which happens after this file runs).

``backend_name`` tests run on every backend available here; ``@pytest.mark.covering`` tests run the
rows of a covering array over their factors (:func:`pytest_generate_tests`).

With ``CE_FAIL_ON_SKIP=1`` (set by ``.ci/run``) a skipped test fails the run: in CI every test,
the TPU interpret-mode and ahead-of-time ones included, must really run.

Interpreted kernels on a mesh: a test computes its oracle before it calls an interpreted pallas_tpu
kernel over several devices, or waits for the kernel's result first. The TPU interpreter runs the
kernel's body as nested executions from host callbacks; eager ops dispatched behind the still-running
kernel (an op-by-op float64 oracle: dozens of them) take the CPU device's 32 in-flight slots, and the
nested executions wait for slots that free only after the kernel ends. jaxlib 0.12 deadlocks there
every time its compile caches are warm (tests/test_token_objective.py hung CI this way on 2026-12-04).
"""

from __future__ import annotations

import importlib
import os
import sys
from collections.abc import Sequence
from pathlib import Path

import pytest

import ce_core
from ce_core.contract.tpu_host import quiet_libtpu_without_tpu
from ce_core.testing import covering_array

# Deviceless TPU compiles load libtpu, which refuses to start while another process holds its
# lockfile; no TPU is driven here, so several loads are safe.
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
# Without a TPU, libtpu (installed to compile for TPU topologies) would print start-up complaints
# about the absent TPU host in every test process.
quiet_libtpu_without_tpu()

# The user's own tile cache (ce_pallas_tpu.tile_cache) must not steer the tests' tiles: the tests that
# exercise it point it at their own temporary file.
os.environ["CE_PALLAS_TPU_TILE_CACHE"] = "off"

_DEVICE_FLAG = "--xla_force_host_platform_device_count=8"
if _DEVICE_FLAG.split("=")[0] not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {_DEVICE_FLAG}".strip()


def backends_for(module: object) -> list[str]:
    """The backends a module's ``backend_name`` tests run: every one available here.

    pallas_tpu joins on CPU only with ``CE_PALLAS_TPU_INTERPRET=1`` (CI's interpreter tier sets it, with
    ``CE_PALLAS_TPU_TARGET=v5p``; its own package tests set it per test). A module that sets
    ``EIGHT_DEVICE_MESHES = True`` runs its ``backend_name`` tests on 8 simulated devices, where Pallas'
    race-checked TPU interpreter deadlocks in its cross-device barrier (and the generic interpreter is
    refused inside shard_map): there interpreted pallas_tpu is left out, and the module covers it with
    its own 4-device tests instead.
    """
    names = list(ce_core.available_backends())
    if getattr(module, "EIGHT_DEVICE_MESHES", False) and os.environ.get("CE_PALLAS_TPU_INTERPRET"):
        return [name for name in names if name != "pallas_tpu"]
    return names


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--backend", action="append", default=[], metavar="NAME",
                     help="run only the backend_name tests, and those only on this backend (repeatable); CI's "
                          "interpreter tier runs the cross-package suite this way with pallas_tpu")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """With ``--backend``, keep only the items parametrised with one of those ``backend_name`` values; with
    ``CE_ROTATION_SEED``, only this run's share of each ``@pytest.mark.rotating`` test's rows."""
    rotate(config, items, os.environ.get("CE_ROTATION_SEED"))
    wanted = config.getoption("--backend")
    if not wanted:
        return
    keep, drop = [], []
    for item in items:
        params = getattr(item, "callspec", None)
        (keep if params is not None and params.params.get("backend_name") in wanted else drop).append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep


def rotate(config: pytest.Config, items: list[pytest.Item], seed: str | None) -> None:
    """Deselect all but one share of the rows of each test marked ``@pytest.mark.rotating(shares=K)``.

    Row ``i`` (in collection order) of such a test runs when ``(i + seed) % K == 0``, so K consecutive seeds
    run every row once. CI's slow tier sets a new seed each run (printed, to rerun a failure with it); without
    ``CE_ROTATION_SEED`` every row runs. Used only for compile-only TPU checks that are rows of one matrix
    (a generation by a tile entry, say) whose every row costs libtpu half a minute to minutes.
    """
    if seed is None:
        return
    rows: dict[tuple[str, str], int] = {}
    drop = []
    for item in items:
        marker = item.get_closest_marker("rotating")
        if marker is None:
            continue
        shares = int(marker.kwargs.get("shares", 3))
        key = (str(item.path), getattr(item, "originalname", item.name))
        index = rows.get(key, 0)
        rows[key] = index + 1
        if (index + int(seed)) % shares:
            drop.append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
        dropped = set(map(id, drop))
        items[:] = [item for item in items if id(item) not in dropped]


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """Parametrise ``backend_name`` over :func:`backends_for` the test's module.

    A test marked ``@pytest.mark.covering(factor=values, ..., require=[(factor, ...), ...])`` runs the
    rows of :func:`ce_core.testing.covering_array` over its factors (``backend_name`` among them when
    the test takes it) instead of their full product: every pair of values meets once, and each group
    in ``require`` runs its full product. With ``backends="turns"`` the backends are not a factor but
    take turns over the rows (each backend runs, and each row runs once), for tests whose other factors
    already meet every backend elsewhere and cost seconds a row (eager calls on a mesh). With ``fast=K``
    the first ``K`` rows (those that meet the most pairs) run in the fast tier and the rest in the slow
    one: the whole array still runs in CI, a newcomer's ``uv run pytest`` runs its head. A test marked
    ``@pytest.mark.cpu_rows_slow`` runs its reference and xla rows in the slow tier (:func:`_tier_marks`).
    """
    covering = metafunc.definition.get_closest_marker("covering")
    if "backend_name" not in metafunc.fixturenames and covering is None:
        return
    backends = backends_for(metafunc.module) if "backend_name" in metafunc.fixturenames else None
    if covering is None:
        metafunc.parametrize("backend_name", [pytest.param(name, marks=_tier_marks(metafunc, name))
                                              for name in backends or []])
        return
    options = dict(covering.kwargs)
    require, turns = options.pop("require", ()), options.pop("backends", "pairs") == "turns"
    fast = options.pop("fast", None)
    factors: dict[str, Sequence[object]] = dict(options)
    if backends is not None and not turns:
        factors = {"backend_name": backends, **factors}
    rows = covering_array(factors, require=require)
    if backends is not None and turns:
        rows = [{"backend_name": backends[k % len(backends)], **rows[k % len(rows)]}
                for k in range(max(len(rows), len(backends)))]
    params = [pytest.param(*row.values(), id="-".join(f"{value}" for value in row.values()),
                           marks=(() if fast is None or k < fast else (pytest.mark.slow,))
                           or _tier_marks(metafunc, row.get("backend_name")))
              for k, row in enumerate(rows)]
    metafunc.parametrize(list(rows[0]), params)


def _tier_marks(metafunc: pytest.Metafunc, backend: object) -> tuple[pytest.MarkDecorator, ...]:
    """``(slow,)`` for a row of a test marked ``@pytest.mark.cpu_rows_slow`` on a backend other than pallas_tpu:
    its ``reference`` and ``xla`` rows run in the slow tier, its interpreted pallas_tpu row where it ran before
    (CI's interpreter tier, ``pytest tests --backend pallas_tpu``)."""
    if backend != "pallas_tpu" and metafunc.definition.get_closest_marker("cpu_rows_slow") is not None:
        return (pytest.mark.slow,)
    return ()


@pytest.fixture(autouse=True)
def _no_races_in_interpreted_pallas_tpu(request: pytest.FixtureRequest):
    """A ``backend_name == "pallas_tpu"`` test run in the race-checked interpreter fails on a race."""
    yield
    callspec = getattr(request.node, "callspec", None)
    if callspec is None or callspec.params.get("backend_name") != "pallas_tpu":
        return
    if os.environ.get("CE_PALLAS_TPU_INTERPRET") == "1":
        from jax._src.pallas.mosaic.interpret import interpret_pallas_call
        from jax.experimental.pallas import tpu as pltpu

        races = interpret_pallas_call.races
        pltpu.reset_tpu_interpret_mode_state()
        assert races is None or not races.races_found, "the TPU interpreter found a race"


# The test tools (tools/, not a package): the TPU compile cache, the feature-coverage recorder.
sys.path.insert(0, str(Path(__file__).parent / "tools"))
compile_cache = importlib.import_module("compile_cache")


def pytest_configure(config: pytest.Config) -> None:
    compile_cache.install()  # each distinct TPU program compiled once per process
    if os.environ.get("CE_FEATURE_COVERAGE_DIR"):  # record what the calls run (tools/feature_coverage.py)
        config.pluginmanager.register(importlib.import_module("feature_coverage"), "feature_coverage")


def pytest_testnodedown(node: object, error: object) -> None:
    """(xdist controller) Add up the compile cache's counts of a worker that finished."""
    worker_stats = getattr(node, "workeroutput", {}).get("compile_cache")
    for key, value in (worker_stats or {}).items():
        _TOTALS[key] = _TOTALS.get(key, 0) + value


_TOTALS: dict[str, float] = {}


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    totals = _TOTALS or compile_cache.STATS
    if totals.get("compiled") or totals.get("reused"):
        terminalreporter.write_line(
            f"TPU programs: {totals['compiled']:.0f} compiled ({totals['seconds_compiling']:.0f} s), "
            f"{totals['reused']:.0f} reused from the session's compile cache ({totals['seconds_saved']:.0f} s saved)")


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    workeroutput = getattr(session.config, "workeroutput", None)
    if workeroutput is not None:  # an xdist worker: hand the compile cache's counts to the controller
        workeroutput["compile_cache"] = dict(compile_cache.STATS)
    if os.environ.get("CE_FAIL_ON_SKIP") != "1":
        return
    reporter: pytest.TerminalReporter | None = session.config.pluginmanager.get_plugin("terminalreporter")
    if not reporter:  # e.g. under -p no:terminal
        return
    skipped = reporter.stats.get("skipped", [])
    if skipped and session.exitstatus == 0:
        names = ", ".join(report.nodeid for report in skipped[:10])
        reporter.ensure_newline()
        reporter.write_line(f"CE_FAIL_ON_SKIP=1: {len(skipped)} test(s) skipped, which fails this run: {names}",
                            red=True)
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
