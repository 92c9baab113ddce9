"""ce_core's own pieces of contract version 3: options, placement by layout, and the argmax over vocab shards."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from ce_core.api.options import LossOptions, Options
from ce_core.contract.backend import RowStats
from ce_core.sharded.placement import Placement, placement_from_specs
from ce_core.sharded.vocab_parallel import combine_vocab_shards


def test_a_number_temperature_stays_static_and_an_array_travels_beside():
    options, weights, temperature = Options.of("f", LossOptions, {"temperature": 0.5, "w_layout": "vh"})
    assert options.temperature == 0.5 and options.w_layout == "vh" and weights is None and temperature is None
    t = np.ones((2, 1), np.float32)
    options, _, temperature = Options.of("f", LossOptions, {"temperature": t})
    assert options.temperature == 1.0 and temperature is t
    hash(options)  # still a static of jit


@pytest.mark.parametrize("value", ["vh ", "HV", 1, None])
def test_a_bad_w_layout_is_named(value):
    with pytest.raises(ValueError, match="w_layout must be one of"):
        Options.of("f", LossOptions, {"w_layout": value})


def test_the_vocab_dimension_follows_the_layout():
    mesh = jax.sharding.AbstractMesh((2, 4), ("data", "model"))
    hv = placement_from_specs(mesh, P("data", None, None), P(None, "model"), 3)
    vh = placement_from_specs(mesh, P("data", None, None), P("model", None), 3, "vh")
    assert hv.vocab_axes == vh.vocab_axes == ("model",)
    assert vh.spec("w") == P("model", None) and hv.spec("w") == P(None, "model")
    # Under "vh" a split of w's second (hidden) dimension is not a vocab split: w is gathered over it.
    assert placement_from_specs(mesh, P("data", None, None), P(None, "model"), 3, "vh").vocab_axes == ()
    assert Placement(w_layout="vh") != Placement()  # part of the cache key of the ops


def test_vocab_shards_combine_to_the_lowest_global_argmax():
    # Four shards of 3 columns; per row, the shards' local max and argmax. Row 0: shards 1 and 3 tie on
    # the max (global 5 and 9): 5. Row 1: only shard 2 holds it (global 6). Row 2: every shard ties at
    # local index 0: global 0.
    local_max = jnp.array([[1.0, 2.0, 0.5, 2.0], [0.0, 1.0, 3.0, 2.0], [4.0, 4.0, 4.0, 4.0]]).T
    local_argmax = jnp.array([[0, 2, 1, 0], [1, 1, 0, 2], [0, 0, 0, 0]], jnp.int32).T

    def per_shard(top, index):
        zeros = jnp.zeros_like(top)
        stats = combine_vocab_shards(RowStats(zeros, zeros, max=top, argmax=index), ("v",), 3)
        assert stats.max is not None and stats.argmax is not None
        return stats.max, stats.argmax

    top, index = jax.vmap(per_shard, axis_name="v")(local_max, local_argmax)
    top, index = np.asarray(top), np.asarray(index)
    np.testing.assert_array_equal(index[0], [5, 6, 0])
    np.testing.assert_array_equal(top[0], [2.0, 3.0, 4.0])
