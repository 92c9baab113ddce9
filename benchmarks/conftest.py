"""pytest-benchmark suite of ce_bench: every contender x shape, forward+backward.

Not part of the default ``uv run pytest`` (the root ``testpaths`` do not include ``benchmarks/``).

    uv run pytest benchmarks --benchmark-only --benchmark-group-by=param:shape     # measure
    uv run pytest benchmarks --benchmark-disable                                   # CI: run once
    uv run pytest benchmarks --ce-shapes=small,llama3-8b --ce-dtype=bfloat16 --benchmark-only ...

Contenders are ``ce_bench.contenders.default_names()`` (every ce_core backend available here plus
tokamax's implementations); ``tokamax:mosaic_tpu`` is only collected on a TPU.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from ce_bench.presets import Shape


class ShapeParam(str):
    """The ``shape`` parameter: its text ("small 1024x512x16384") names the benchmark group under
    ``--benchmark-group-by=param:shape``; ``.shape`` is the :class:`ce_bench.presets.Shape`."""

    shape: Shape

    def __new__(cls, shape: Shape) -> ShapeParam:
        value = super().__new__(cls, shape.label)
        value.shape = shape
        return value


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("ce-bench")
    group.addoption("--ce-shapes", default="tiny,small",
                    help="comma-separated presets or NxHxV for the benchmarks (default: tiny,small)")
    group.addoption("--ce-dtype", default="float32", help="dtype of x and w (default: float32)")
    group.addoption("--ce-backends", default=None, help="comma-separated contenders (default: all available)")
    group.addoption("--ce-rounds", type=int, default=5, help="timed rounds per benchmark (default: 5)")


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if not {"backend", "shape"} <= set(metafunc.fixturenames):
        return
    import jax

    from ce_bench import contenders, presets

    config = metafunc.config
    shapes = presets.parse_shapes(config.getoption("--ce-shapes"), reduced_for_cpu=jax.default_backend() == "cpu")
    names = contenders.parse_names(config.getoption("--ce-backends"))
    if config.getoption("--ce-backends") is None and jax.default_backend() != "tpu":
        names = [name for name in names if name != "tokamax:mosaic_tpu"]
    params = [ShapeParam(shape) for shape in shapes]
    metafunc.parametrize("shape", params, ids=[shape.name or shape.label for shape in shapes])
    metafunc.parametrize("backend", names)


@pytest.fixture(autouse=True)
def _quiet_absl() -> None:
    logging.getLogger("absl").setLevel(logging.ERROR)
