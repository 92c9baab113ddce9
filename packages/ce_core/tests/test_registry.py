"""Backend discovery, lazy import, platform defaults and fallback chains."""

from __future__ import annotations

import inspect
import subprocess
import sys
import warnings
from types import MappingProxyType
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import ce_core
from ce_core import Backend, FallbackWarning, RowStats, UnsupportedError, linear_cross_entropy
from ce_core.contract import registry
from ce_core.testing import random_problem
from ce_reference import row_stats as reference_row_stats

X, LABELS, W = random_problem(0, (12,), 8, 17)


class Refusing(Backend):
    """Refuses every call with a fixed reason."""

    contract_version = ce_core.CONTRACT_VERSION

    def __init__(self, name: str, reason: str = "too picky") -> None:
        self.name, self.reason = name, reason

    def check(self, problem):
        raise UnsupportedError(f"{self.reason} (n={problem.n}, v={problem.v})")

    def row_stats(self, x, w, labels, spec, *, row_scale=None, live=None):  # pragma: no cover - never reached
        raise AssertionError("check() refused this call")


class Counting(Backend):
    """Delegates to the reference math and counts calls."""

    contract_version = ce_core.CONTRACT_VERSION

    def __init__(self, name: str) -> None:
        self.name, self.calls = name, 0

    def row_stats(self, x, w, labels, spec, *, row_scale=None, live=None):
        self.calls += 1
        return reference_row_stats(x, w, labels, spec)


@pytest.fixture
def temporary_backends():
    names = []

    def add(backend: Backend) -> Backend:
        ce_core.register_backend(backend.name, lambda: backend)
        names.append(backend.name)
        return backend

    yield add
    for name in names:
        ce_core.unregister_backend(name)
    registry._warned.clear()


def test_importing_ce_core_imports_no_backend():
    code = (
        "import sys, ce_core\n"
        "ce_core.installed_backends()\n"
        "loaded = [m for m in sys.modules if m.split('.')[0] in "
        "('ce_reference', 'ce_xla', 'ce_pallas_tpu', 'ce_bench')]\n"
        "assert not loaded, loaded\n"
        "assert 'reference' in ce_core.installed_backends()\n"
        "ce_core.get_backend('reference')\n"
        "assert 'ce_reference' in sys.modules\n"
        "assert 'ce_xla' not in sys.modules and 'ce_pallas_tpu' not in sys.modules\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, env={"JAX_PLATFORMS": "cpu", "PATH": ""})


def test_reference_is_found_through_its_entry_point():
    entry_points = registry._entry_points()
    assert entry_points["reference"].value == "ce_reference:make_backend"
    backend = ce_core.get_backend("reference")
    assert backend.name == "reference" and type(backend).__module__.startswith("ce_reference")
    assert ce_core.get_backend("reference") is backend  # loaded once
    assert "reference" in ce_core.available_backends()


def test_unknown_name_lists_available_names():
    with pytest.raises(ValueError, match=r"unknown backend 'nope'; installed backends: \[.*'reference'.*\]"):
        linear_cross_entropy(X, LABELS, W, implementation="nope")


def test_a_chain_skips_a_backend_that_is_not_installed_with_one_warning():
    """As the README's ("pallas_tpu", "xla") chain must on a machine without ce-pallas-tpu."""
    with pytest.warns(FallbackWarning, match=r"backend 'not_here' cannot run this call \(backend 'not_here' is not "
                                             r"installed; .*\); falling back to 'reference'"):
        loss = linear_cross_entropy(X, LABELS, W, implementation=["not_here", "reference"])
    assert float(loss) == pytest.approx(float(linear_cross_entropy(X, LABELS, W, implementation="reference")))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once per backend and reason
        linear_cross_entropy(X, LABELS, W, implementation=["not_here", "reference"])
    with pytest.raises(ExceptionGroup, match=r"no backend in \['not_here', 'nor_here'\]") as caught:
        linear_cross_entropy(X, LABELS, W, implementation=["not_here", "nor_here"])
    assert all(isinstance(e, UnsupportedError) and "is not installed" in str(e) for e in caught.value.exceptions)


def test_single_name_raises_that_backends_error(temporary_backends):
    temporary_backends(Refusing("picky"))
    with pytest.raises(UnsupportedError, match=r"too picky \(n=12, v=17\)"):
        linear_cross_entropy(X, LABELS, W, implementation="picky")


def test_fallback_chain_warns_once_and_uses_next(temporary_backends):
    temporary_backends(Refusing("picky"))
    counting = temporary_backends(Counting("counting"))
    message = r"backend 'picky' cannot run this call \(too picky.*falling back to 'counting'"
    with pytest.warns(FallbackWarning, match=message):
        loss = linear_cross_entropy(X, LABELS, W, implementation=("picky", "counting"))
    assert counting.calls == 1
    expected = linear_cross_entropy(X, LABELS, W, implementation="reference")
    np.testing.assert_allclose(float(loss), float(expected), rtol=1e-6)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the same fallback a second time is silent
        linear_cross_entropy(X, LABELS, W, implementation=("picky", "counting"))


def test_all_failing_chain_raises_exception_group(temporary_backends):
    temporary_backends(Refusing("picky", "first reason"))
    temporary_backends(Refusing("fussy", "second reason"))
    with pytest.warns(FallbackWarning), pytest.raises(ExceptionGroup) as info:
        linear_cross_entropy(X, LABELS, W, implementation=["picky", "fussy"])
    reasons = [str(error) for error in info.value.exceptions]
    assert all(isinstance(error, UnsupportedError) for error in info.value.exceptions)
    assert "first reason" in reasons[0] and "second reason" in reasons[1]


def test_unavailable_backend_is_unsupported(temporary_backends):
    class Elsewhere(Counting):
        def is_available(self):
            return False

    temporary_backends(Elsewhere("elsewhere"))
    assert "elsewhere" not in ce_core.available_backends()
    assert "elsewhere" in ce_core.installed_backends()
    with pytest.raises(UnsupportedError, match="not available on platform 'cpu'"):
        linear_cross_entropy(X, LABELS, W, implementation="elsewhere")


def test_default_chains_per_platform():
    installed = ce_core.installed_backends()

    def chain(*names):
        return tuple(name for name in names if name in installed)

    assert ce_core.default_chain("tpu") == chain("pallas_tpu", "xla", "reference")
    assert ce_core.default_chain("gpu") == chain("xla", "reference")
    assert ce_core.default_chain("cpu") == chain("xla", "reference")
    assert ce_core.default_chain() == ce_core.default_chain(jax.default_backend())


def test_default_chain_is_used_when_implementation_is_none(temporary_backends):
    class Preferred(Counting):
        default_priority = MappingProxyType({jax.default_backend(): 1000})

    class Elsewhere(Counting):
        default_priority = MappingProxyType({"not-this-platform": 2000})

    preferred = temporary_backends(Preferred("preferred"))
    temporary_backends(Elsewhere("elsewhere"))
    assert ce_core.default_chain()[0] == "preferred" and "elsewhere" not in ce_core.default_chain()
    linear_cross_entropy(X, LABELS, W)
    assert preferred.calls == 1


def test_ce_core_names_no_backend():
    """Backends declare where they are the default; the registry holds no list of names."""
    source = inspect.getsource(registry)
    assert not any(f'"{name}"' in source for name in ("xla", "reference", "pallas_tpu"))


def test_register_backend_refuses_duplicates_and_non_backends(temporary_backends):
    temporary_backends(Counting("dup"))
    with pytest.raises(ValueError, match="already registered"):
        ce_core.register_backend("dup", lambda: Counting("dup"))
    def not_a_backend() -> Any:  # deliberately not a BackendFactory: the registry must refuse it
        return object()

    ce_core.register_backend("not-a-backend", not_a_backend)
    try:
        with pytest.raises(TypeError, match=r"returned object, not a ce_core\.Backend"):
            ce_core.get_backend("not-a-backend")
    finally:
        ce_core.unregister_backend("not-a-backend")


def test_contract_version_mismatch_is_refused(temporary_backends):
    class Old(Counting):
        contract_version = 0

    ce_core.register_backend("old", lambda: Old("old"))
    try:
        speaks = r"contract version 0, but this ce_core speaks versions \[1, 2, 3, 4, 5\]"
        with pytest.raises(RuntimeError, match=speaks):
            ce_core.get_backend("old")
    finally:
        ce_core.unregister_backend("old")


def test_backend_without_contract_version_is_refused():
    class Undeclared(Counting):
        contract_version = None

    ce_core.register_backend("undeclared", lambda: Undeclared("undeclared"))
    try:
        with pytest.raises(RuntimeError, match="does not declare contract_version"):
            ce_core.get_backend("undeclared")
    finally:
        ce_core.unregister_backend("undeclared")


def test_custom_backend_gets_the_fused_path_through_the_default_vjp(temporary_backends):
    counting = temporary_backends(Counting("counting"))
    grads = jax.grad(lambda w: linear_cross_entropy(X, LABELS, w, implementation="counting"))(jnp.asarray(W))
    expected = jax.grad(lambda w: linear_cross_entropy(X, LABELS, w, implementation="reference"))(jnp.asarray(W))
    np.testing.assert_allclose(np.asarray(grads), np.asarray(expected), rtol=1e-6, atol=1e-7)
    assert counting.calls == 1


def test_row_stats_of_labels_outside_the_vocab_are_zero():
    stats: RowStats = reference_row_stats(jnp.asarray(X), jnp.asarray(W), jnp.array([-1, 17, 3] + [0] * 9),
                                          ce_core.StatsSpec())
    assert float(stats.label[0]) == 0.0 and float(stats.label[1]) == 0.0 and float(stats.label[2]) != 0.0
