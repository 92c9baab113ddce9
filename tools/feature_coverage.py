"""Which (feature, backend, placement) triples a pytest run exercises, read from the calls it makes.

A test's name says what it means to test; this records what its calls really ran. With
``CE_FEATURE_COVERAGE_DIR`` set, the repository's conftest.py registers this module as a pytest
plugin in every worker, and it wraps two of ce_core's internals:

- ``prepare``, which every public entry point calls once per trace: the backend chosen, the placement
  (local, the caller's ``shard_map``, Explicit axes, Auto axes with the default or a stated layout, the
  sharded wrapper) and the features the call asks for (reduction, weights, z-loss, soft cap, label
  smoothing, temperature, ``w_layout``, extra outputs, log-probs and entropy, dtype, precision, tiles);
- ``ops.run``, which runs each backend entry point (``row_stats``, ``row_stats_vjp``,
  ``row_stats_and_grads``) under a placement, and whether it ran under ``vmap``.

Run as a script it runs pytest so (or reads the logs of a run made so, ``--logs``), prints the triples
(or writes them as JSON), and with ``--compare BASELINE.json`` lists the triples the baseline holds that
this run does not, and fails. ``tools/fast_tier_triples.json`` is the fast tier's baseline (every triple
it ran on 2026-11-27, before its products became covering arrays); CI checks the fast tier against it::

    uv run python tools/feature_coverage.py --compare tools/fast_tier_triples.json        # the fast tier
    uv run python tools/feature_coverage.py --json after.json -- tests -k parity           # some tests

Arguments after ``--`` go to pytest (default: the fast tier, as ``uv run pytest`` runs it), which runs
in the current directory: run it from another checkout to record that checkout's tests.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import pytest

LOG_DIR_VARIABLE = "CE_FEATURE_COVERAGE_DIR"
_current_test = ["(collection)"]
_placement_names: dict[Any, str] = {}


def placement_name(placement: Any, via_wrapper: bool) -> str:
    """One of local, callers_shard_map, explicit, auto_default, auto_stated, wrapper."""
    if via_wrapper:
        return "wrapper"
    if placement.kind == "local":
        return "callers_shard_map" if placement.typed or placement.vocab_axes else "local"
    if placement.stated is not None:
        return "auto_stated" if not placement.mesh.explicit_axes else "explicit_stated"
    return "explicit" if placement.mesh.explicit_axes else "auto_default"


def call_features(entry: str, options: Any, call: Any, kwargs: dict[str, Any]) -> list[str]:
    """The features one public call asks for (see the module docstring)."""
    spec = call.spec
    features = [entry]
    if entry == "loss":
        features.append(f"reduction={options.reduction}")
        if kwargs.get("weights") is not None:
            features.append("weights")
        if options.logsumexp_weight:
            features.append("z_loss")
        if options.label_smoothing:
            features.append("label_smoothing")
    if spec.with_expected:
        features.append("entropy")
    if options.logit_soft_cap is not None:
        features.append("soft_cap")
    if kwargs.get("temperature_tokens") is not None:
        features.append("temperature=per_token")
    elif options.temperature != 1.0:
        features.append("temperature=scalar")
    if options.w_layout == "vh":
        features.append("w_layout=vh")
    if spec.with_argmax:
        features.append("return_argmax")
    if options.ignore_index != -100:
        features.append("custom_ignore_index")
    if options.precision is not None:
        features.append("precision")
    if options.block_sizes is not None:
        features.append("block_sizes")
    features.append(f"dtype={call.x.dtype}")
    return features


def _wrap_prepare(entry: str, original: Callable[..., Any], record: Callable[[str, str, list[str]], None]):
    def prepare(x, labels, w, placement, **kwargs):
        call = original(x, labels, w, placement, **kwargs)
        via_wrapper = any(frame.f_code.co_name == "sharded_linear_cross_entropy" for frame in _frames())
        name = placement_name(placement, via_wrapper)
        _placement_names[placement] = name
        record(call.backend.name, name, call_features(entry, kwargs["options"], call, kwargs))
        return call

    return prepare


def _wrap_run(original: Callable[..., Any], record: Callable[[str, str, list[str]], None]):
    from jax._src.interpreters.batching import BatchTracer

    def run(fn, placement, *args):
        features = [f"path={type(fn).__name__}"]
        if any(isinstance(a, BatchTracer) for a in args):
            features.append("vmap")
        record(fn.backend.name, _placement_names.get(placement, "unknown"), features)
        return original(fn, placement, *args)

    return run


def _frames() -> Iterable[Any]:
    frame = sys._getframe(1)
    while frame is not None:
        yield frame
        frame = frame.f_back


def pytest_configure(config: pytest.Config) -> None:
    log_dir = os.environ.get(LOG_DIR_VARIABLE)
    if not log_dir:
        return
    Path(log_dir).mkdir(parents=True, exist_ok=True)
    import ce_core.api.log_probs
    import ce_core.api.loss
    import ce_core.api.prepare
    import ce_core.sharded.ops

    worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
    log = Path(log_dir) / f"{worker}-{os.getpid()}.jsonl"

    def record(backend: str, placement: str, features: list[str]) -> None:
        with log.open("a") as file:
            file.write(json.dumps([_current_test[0], backend, placement, features]) + "\n")

    original = ce_core.api.prepare.prepare
    patch = pytest.MonkeyPatch()  # for the whole session
    patch.setattr(ce_core.api.loss, "prepare", _wrap_prepare("loss", original, record))
    patch.setattr(ce_core.api.log_probs, "prepare", _wrap_prepare("log_probs", original, record))
    patch.setattr(ce_core.sharded.ops, "run", _wrap_run(ce_core.sharded.ops.run, record))


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    _current_test[0] = item.nodeid


def triples(log_dir: Path) -> dict[tuple[str, str, str], list[str]]:
    """``(feature, backend, placement) -> the tests that exercised it`` from a run's logs."""
    found: dict[tuple[str, str, str], set[str]] = {}
    for path in log_dir.glob("*.jsonl"):
        for line in path.read_text().splitlines():
            test, backend, placement, features = json.loads(line)
            for feature in features:
                found.setdefault((feature, backend, placement), set()).add(test)
    return {key: sorted(tests) for key, tests in sorted(found.items())}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", type=Path, help="write the triples (and the tests behind each) here")
    parser.add_argument("--compare", type=Path, help="a baseline JSON: list (and fail on) the triples it holds and "
                                                     "this run lacks")
    parser.add_argument("--logs", type=Path, help="read a run made with CE_FEATURE_COVERAGE_DIR=LOGS instead of "
                                                  "running pytest")
    parser.add_argument("--quiet", action="store_true", help="print only the comparison")
    parser.add_argument("pytest_args", nargs="*", help="arguments for pytest (after --)")
    args = parser.parse_args(argv)
    status = 0
    if args.logs is not None:
        found = triples(args.logs)
    else:
        with tempfile.TemporaryDirectory() as log_dir:
            status = subprocess.call([sys.executable, "-m", "pytest", "-q", *args.pytest_args],
                                     env=dict(os.environ, **{LOG_DIR_VARIABLE: log_dir}))
            found = triples(Path(log_dir))
    if not args.quiet:
        print(f"\n{len(found)} (feature, backend, placement) triples exercised (pytest exit status {status}):")
        for feature, backend, placement in found:
            print(f"  {feature:28} {backend:12} {placement}")
    if args.json:
        args.json.write_text(json.dumps([[*key, tests] for key, tests in found.items()], indent=1))
    if args.compare:
        baseline = {tuple(entry[:3]) for entry in json.loads(args.compare.read_text())}
        lost = sorted(baseline - set(found))
        print(f"{len(baseline) - len(lost)} of the {len(baseline)} (feature, backend, placement) triples of "
              f"{args.compare} exercised; {len(found)} in all")
        for feature, backend, placement in lost:
            print(f"  not exercised: {feature:28} {backend:12} {placement}")
        return 1 if lost else status
    return status


if __name__ == "__main__":
    sys.exit(main())
