"""Forward+backward of every contender on every shape, for pytest-benchmark.

``extra_info`` carries the shape, dtype, tokens/s (from the median), temporary bytes of the
compiled program (``memory_analysis``) and the block sizes. Unlike ``ce-bench`` (which interleaves
contenders round-robin), pytest-benchmark times one test after another; on a noisy machine prefer
the CLI's numbers.
"""

from __future__ import annotations

import jax
import pytest

from ce_bench import presets, runner
from ce_bench.timing import block


def test_fwd_bwd(benchmark, backend: str, shape, request: pytest.FixtureRequest) -> None:
    problem: presets.Shape = shape.shape  # the parameter is a ShapeParam (see conftest.py)
    dtypes = request.config.getoption("--ce-dtype")
    assert isinstance(dtypes, str), dtypes
    dtype = presets.parse_dtypes(dtypes)[0]
    try:
        prepared = runner.prepare(backend, problem, dtype)
    except MemoryError as error:
        pytest.skip(str(error))
    except NotImplementedError as error:  # ce_core.UnsupportedError, tokamax's device check
        pytest.skip(f"{backend} does not support {problem.label}: {error}")

    benchmark.extra_info.update(backend=backend, shape=problem.label, n=problem.n, h=problem.h, v=problem.v,
                                dtype=dtype.name, temp_bytes=prepared.stats.temp_bytes,
                                block_sizes=prepared.block_sizes, device=runner.device_description())
    args = prepared.args
    loss, (dx, dw) = benchmark.pedantic(lambda: block(prepared.fwd_bwd(*args)),
                                        rounds=request.config.getoption("--ce-rounds"), iterations=1,
                                        warmup_rounds=1)
    assert dx.shape == args[0].shape and dw.shape == args[2].shape
    assert bool(jax.numpy.isfinite(loss))
    if benchmark.stats is not None:  # None under --benchmark-disable
        median = benchmark.stats.stats.median
        benchmark.extra_info["tokens_per_s"] = problem.n / median if median > 0 else None
