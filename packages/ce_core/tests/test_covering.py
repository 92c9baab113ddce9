"""``covering_array``: the rows meet every pair of values (and every required product), deterministically."""

from __future__ import annotations

import itertools

import pytest

from ce_core.testing import covering_array

FACTORS = {"reduction": ["mean", "sum", "none"], "weights": [False, True], "cap": [None, 2.0],
           "smoothing": [0.0, 0.1], "backend": ["reference", "xla", "pallas_tpu"], "dtype": ["f32", "bf16"]}


def combinations_met(rows, names):
    return {tuple(row[name] for name in names) for row in rows}


def test_every_pair_of_values_meets_and_the_rows_are_few():
    rows = covering_array(FACTORS)
    for a, b in itertools.combinations(FACTORS, 2):
        assert combinations_met(rows, (a, b)) == set(itertools.product(FACTORS[a], FACTORS[b])), (a, b)
    assert all(set(row) == set(FACTORS) for row in rows)
    full_product = 3 * 2 * 2 * 2 * 3 * 2
    assert 9 <= len(rows) <= 13 < full_product  # at least 3 x 3 (the two largest factors)


def test_required_groups_get_their_full_product():
    rows = covering_array(FACTORS, require=[("backend", "reduction", "dtype")])
    assert combinations_met(rows, ("backend", "reduction", "dtype")) == set(
        itertools.product(FACTORS["backend"], FACTORS["reduction"], FACTORS["dtype"]))
    assert len(rows) == 18


def test_deterministic_and_the_first_row_holds_every_first_value():
    assert covering_array(FACTORS) == covering_array(dict(FACTORS))
    assert covering_array(FACTORS)[0] == {name: values[0] for name, values in FACTORS.items()}
    assert covering_array({"only": [1, 2, 3]}) == [{"only": 1}, {"only": 2}, {"only": 3}]


@pytest.mark.parametrize("factors,require,match", [
    ({"a": []}, (), "factor 'a' has no values"),
    ({"a": [1]}, [("a", "b")], r"require names \['b'\]"),
])
def test_bad_arguments_are_named(factors, require, match):
    with pytest.raises(ValueError, match=match):
        covering_array(factors, require=require)
