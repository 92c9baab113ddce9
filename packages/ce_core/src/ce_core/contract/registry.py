"""Backend registry: discovery by entry point, lazy loading, platform defaults, fallback chains.

Installing a backend wheel is all it takes to make its name selectable: the wheel declares an
entry point in the group ``ce_core.backends`` whose object is a zero-argument factory returning a
:class:`~ce_core.contract.backend.Backend`. Nothing is imported until a name is first used.
"""

from __future__ import annotations

import importlib.metadata
import threading
import warnings
from collections.abc import Callable, Sequence

import jax

from ce_core.contract.backend import CONTRACT_VERSION, SUPPORTED_CONTRACT_VERSIONS, Backend, Problem, StatsSpec
from ce_core.contract.errors import FallbackWarning, UnsupportedError
from ce_core.contract.pair import PAIR_VERSION

ENTRY_POINT_GROUP = "ce_core.backends"

BackendFactory = Callable[[], Backend]

_lock = threading.Lock()
_registered: dict[str, BackendFactory] = {}
_loaded: dict[str, Backend] = {}
_warned: set[tuple[str, str]] = set()


def register_backend(name: str, factory: BackendFactory, *, replace: bool = False) -> None:
    """Register a backend in this process (takes precedence over an entry point of that name)."""
    if not isinstance(name, str) or not name:
        raise ValueError(f"backend name must be a non-empty str, got {name!r}")
    if not callable(factory):
        raise ValueError(f"factory for backend {name!r} must be callable, got {factory!r}")
    with _lock:
        if name in _registered and not replace:
            raise ValueError(f"backend {name!r} is already registered; pass replace=True to replace it")
        _registered[name] = factory
        _loaded.pop(name, None)


def unregister_backend(name: str) -> None:
    """Forget an in-process registration (entry points of that name become visible again)."""
    with _lock:
        _registered.pop(name, None)
        _loaded.pop(name, None)


def _entry_points() -> dict[str, importlib.metadata.EntryPoint]:
    return {ep.name: ep for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP)}


def installed_backends() -> tuple[str, ...]:
    """Names of every registered or installed backend, without importing any of them."""
    return tuple(sorted(set(_registered) | set(_entry_points())))


def get_backend(name: str) -> Backend:
    """The backend called ``name``, importing it on first use."""
    with _lock:
        if name in _loaded:
            return _loaded[name]
        factory = _registered.get(name)
    if factory is None:
        entry_point = _entry_points().get(name)
        if entry_point is None:
            raise ValueError(
                f"unknown backend {name!r}; installed backends: {list(installed_backends())}, "
                f"available here: {list(available_backends())}"
            )
        factory = entry_point.load()
    backend = factory()
    _check_backend(name, backend)
    with _lock:
        return _loaded.setdefault(name, backend)


def _check_backend(name: str, backend: object) -> None:
    if not isinstance(backend, Backend):
        raise TypeError(f"factory of backend {name!r} returned {type(backend).__name__}, not a ce_core.Backend")
    if backend.contract_version is None:
        raise RuntimeError(f"backend {name!r} ({type(backend).__name__}) does not declare contract_version")
    if backend.contract_version not in SUPPORTED_CONTRACT_VERSIONS:
        raise RuntimeError(
            f"backend {name!r} implements ce_core backend contract version {backend.contract_version}, "
            f"but this ce_core speaks versions {list(SUPPORTED_CONTRACT_VERSIONS)} (current: {CONTRACT_VERSION}); "
            "install matching versions"
        )


def available_backends() -> tuple[str, ...]:
    """Names of the installed backends that can run on this platform right now."""
    names = []
    for name in installed_backends():
        try:
            if get_backend(name).is_available():
                names.append(name)
        except Exception:
            continue
    return tuple(names)


def default_chain(platform: str | None = None) -> tuple[str, ...]:
    """The backends tried, in order, when ``implementation=None`` on ``platform`` (default: JAX's).

    Each backend declares the platforms it is a default for, with a priority
    (:attr:`Backend.default_priority`); the chain lists those that declare ``platform`` (or ``"*"``),
    highest priority first. Loads every installed backend (a broken install is left out).
    """
    platform = platform or jax.default_backend()
    ranked = []
    for name in installed_backends():
        try:
            priorities = get_backend(name).default_priority
        except Exception:
            continue
        priority = priorities.get(platform, priorities.get("*"))
        if priority is not None:
            ranked.append((-priority, name))
    return tuple(name for _, name in sorted(ranked))


def select_backend(implementation: str | Sequence[str] | None, problem: Problem) -> Backend:
    """The first backend in the chain that accepts ``problem``.

    A single name raises that backend's own :class:`UnsupportedError`. A sequence (or the platform
    default for ``None``) falls through unsupported backends, warning once per backend and reason,
    and raises an ``ExceptionGroup`` of every reason when none accepts.
    """
    if isinstance(implementation, str):
        backend = get_backend(implementation)
        _ensure_runs(backend, problem)
        return backend
    if implementation is None:
        chain = list(default_chain())
        if not chain:
            raise ValueError(f"no installed backend is a default on platform {jax.default_backend()!r}; "
                             f"installed: {list(installed_backends())}; name one with implementation=")
    else:
        chain = list(implementation)
        if not chain or not all(isinstance(name, str) for name in chain):
            raise ValueError("implementation must be None, a backend name or a non-empty sequence of names, "
                             f"got {implementation!r}")
    installed = installed_backends()
    errors: list[UnsupportedError] = []
    for position, name in enumerate(chain):
        try:
            # A chain may name a backend whose package this machine lacks (pallas_tpu on a GPU box):
            # that is one more reason to move on, not an error.
            if name not in installed:
                raise UnsupportedError(f"backend {name!r} is not installed; installed backends: {list(installed)}")
            backend = get_backend(name)
            _ensure_runs(backend, problem)
        except UnsupportedError as error:
            errors.append(error)
            if position + 1 < len(chain):
                _warn_once(name, str(error), chain[position + 1])
            continue
        return backend
    raise ExceptionGroup(f"no backend in {chain} can run this call", errors)


def _ensure_runs(backend: Backend, problem: Problem) -> None:
    if not backend.is_available():
        raise UnsupportedError(f"backend {backend.name!r} is not available on platform {jax.default_backend()!r}")
    needed = PAIR_VERSION if problem.pair is not None else problem.spec.needs_version
    if (backend.contract_version or 0) < needed:
        needs = "the pair statistics of a dense distillation teacher" if problem.pair else _needs(problem.spec)
        raise UnsupportedError(f"backend {backend.name!r} implements contract version {backend.contract_version}, "
                               f"which lacks what this call needs (version {needed}: {needs})")
    backend.check(problem)


def _needs(spec: StatsSpec) -> str:
    """What a spec asks for beyond contract version 1, in words."""
    needs = [name for name, wanted in (("a [V, H] head (w_layout='vh')", spec.w_layout != "hv"),
                                       ("the argmax statistic", spec.with_argmax),
                                       ("a per-token row scale", spec.with_row_scale),
                                       ("the expected-logit statistic (entropy)", spec.with_expected)) if wanted]
    return ", ".join(needs)


def _warn_once(name: str, reason: str, next_name: str) -> None:
    with _lock:
        if (name, reason) in _warned:
            return
        _warned.add((name, reason))
    warnings.warn(f"ce_core: backend {name!r} cannot run this call ({reason}); falling back to {next_name!r}",
                  FallbackWarning, stacklevel=4)
