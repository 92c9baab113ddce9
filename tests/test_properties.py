"""Property tests: random shapes and options, every available backend vs the float64 oracle.

Hypothesis draws new examples each run (a failure prints how to reproduce it), so a dozen per run (six for
pallas_tpu's interpreted kernels) add up to breadth across runs.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ce_core.testing import Case, compare_with_oracle, random_problem

cases = st.builds(
    Case,
    reduction=st.sampled_from(["mean", "sum", "none"]),
    use_weights=st.booleans(),
    logsumexp_weight=st.sampled_from([0.0, 1e-4, 1e-2]),
    logit_soft_cap=st.sampled_from([None, 1.0, 30.0]),
    label_smoothing=st.sampled_from([0.0, 0.1, 0.5]),
)
batch_shapes = st.lists(st.integers(1, 9), min_size=1, max_size=3).map(tuple)


#: Examples a run draws per backend: pallas_tpu's interpreted kernels (the interpreter tier) take a few seconds an
#: example, so it draws half as many; across runs each backend still sees new shapes every time.
EXAMPLES = {"pallas_tpu": 6}


@pytest.mark.cpu_rows_slow
def test_matches_oracle(backend_name):
    @settings(max_examples=EXAMPLES.get(backend_name, 12), deadline=None)
    @given(case=cases, batch_shape=batch_shapes, hidden=st.integers(1, 70), vocab=st.integers(2, 600),
           seed=st.integers(0, 2**16), ignore_fraction=st.sampled_from([0.0, 0.3, 1.0]))
    def matches(case, batch_shape, hidden, vocab, seed, ignore_fraction):
        x, labels, w = random_problem(seed, batch_shape, hidden, vocab, ignore_fraction=ignore_fraction)
        compare_with_oracle(backend_name, case, x, labels, w, seed=seed)

    matches()
