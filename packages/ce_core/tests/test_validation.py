"""Every bad argument gets a ValueError that names it."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import ce_core
from ce_core import BlockSizes, linear_cross_entropy
from ce_core.testing import random_problem

X, LABELS, W = random_problem(0, (4, 6), 16, 33)


def call(**overrides: Any):
    # Any: the overrides are deliberately of the wrong type or shape; the checks must name them.
    args: dict[str, Any] = dict(x=X, labels=LABELS, w=W, implementation="reference")
    args.update(overrides)
    return linear_cross_entropy(args.pop("x"), args.pop("labels"), args.pop("w"), **args)


@pytest.mark.parametrize(
    "overrides,match",
    [
        (dict(w=W[None]), r"w must have shape \[H, V\], got shape \(1, 16, 33\)"),
        (dict(w=W[:8]), r"hidden sizes differ: x has shape \(4, 6, 16\) \(H=16\) but w has shape \(8, 33\)"),
        (dict(x=np.float32(1.0)), r"x must have shape \[\.\.\., H\]"),
        (dict(labels=LABELS[:, :5]), r"labels must have shape x.shape\[:-1\] = \(4, 6\), got labels of shape \(4, 5\)"),
        (dict(labels=LABELS.astype(np.float32)), r"labels must be an integer array"),
        (dict(x=X.astype(np.int32)), r"x must be a floating array"),
        (dict(w=W.astype(np.int8)), r"w must be a floating array"),
        (dict(w=W[:, :0]), r"w must have at least one vocab column"),
        (dict(weights=np.ones((4, 5), np.float32)), r"weights must have the shape of labels \(4, 6\), got \(4, 5\)"),
        (dict(weights=np.ones((4, 6), np.int32)), r"weights must be a floating array"),
        (dict(reduction="avg"), r"reduction must be one of \('mean', 'sum', 'none'\), got 'avg'"),
        (dict(keep_logits="yes"), r"keep_logits must be None, True or False, got 'yes'"),
        (dict(keep_logits=True, reduction="none"), r'keep_logits=True needs reduction="mean" or "sum"'),
        (dict(label_smoothing=-0.1), r"label_smoothing must be in \[0, 1\), got -0.1"),
        (dict(label_smoothing=1.0), r"label_smoothing must be in \[0, 1\), got 1.0"),
        (dict(logit_soft_cap=0.0), r"logit_soft_cap must be None or > 0, got 0.0"),
        (dict(logit_soft_cap=-3.0), r"logit_soft_cap must be None or > 0"),
        (dict(logit_soft_cap=float("inf")), r"logit_soft_cap must be finite"),
        (dict(logsumexp_weight=-1e-4), r"logsumexp_weight must be >= 0"),
        (dict(logsumexp_weight=float("nan")), r"logsumexp_weight must be finite"),
        (dict(ignore_index=1.5), r"ignore_index must be an int"),
        (dict(block_sizes=(128, 128, 128)), r"block_sizes must be None or a ce_core.BlockSizes"),
        (dict(x="hello"), r"x must be an array, got str"),
    ],
)
def test_bad_argument_is_named(overrides, match):
    with pytest.raises(ValueError, match=match):
        call(**overrides)


def test_concrete_out_of_vocab_label_names_first_bad_position():
    labels = LABELS.copy()
    labels[1, 2] = 33
    labels[3, 0] = -5
    with pytest.raises(ValueError, match=r"labels\[1, 2\] = 33 \(2 bad labels in all\)"):
        call(labels=labels)


def test_negative_label_is_not_clamped():
    labels = LABELS.copy()
    labels[0, 0] = -1
    with pytest.raises(ValueError, match=r"labels\[0, 0\] = -1"):
        call(labels=labels)


def test_ignore_index_itself_is_accepted_even_when_out_of_vocab():
    labels = np.full_like(LABELS, 10_000)
    assert float(call(labels=labels, ignore_index=10_000)) == 0.0


def test_traced_option_is_refused():
    with pytest.raises(ValueError, match="label_smoothing must be a Python number"):
        jax.jit(lambda eps: call(label_smoothing=eps))(0.1)


@pytest.mark.parametrize("field", ["b_block_size", "h_block_size", "v_block_size"])
@pytest.mark.parametrize("value", [0, -128, 1.5, True, "128"])
def test_block_sizes_must_be_positive_ints(field, value):
    with pytest.raises(ValueError, match=f"BlockSizes.{field} must be a positive int or None"):
        BlockSizes(**{field: value})


def test_block_sizes_is_frozen_and_hashable():
    sizes = BlockSizes(256, None, 1024)
    assert hash(sizes) == hash(BlockSizes(256, None, 1024))
    with pytest.raises(AttributeError):
        sizes.b_block_size = 8  # type: ignore[misc]


def test_accepts_python_lists_and_int64_labels():
    nested_lists: Any = [[1.0, 0.0], [0.0, 1.0]]  # accepted at run time, though not a jax ArrayLike
    loss = linear_cross_entropy(nested_lists, np.array([0, 1], np.int64), jnp.eye(2), implementation="reference")
    expected = np.log(1 + np.e) - 1  # each row: logits (1, 0), label logit 1
    np.testing.assert_allclose(float(loss), expected, rtol=1e-6)


def test_int64_labels_that_int32_cannot_hold_are_refused_not_wrapped():
    x, _, w = random_problem(20, (3,), 8, 16)
    labels = np.array([1, 2**32 + 3, 2], np.int64)
    for fn in (linear_cross_entropy, ce_core.linear_log_probs):
        with pytest.raises(ValueError, match=r"labels\[1\] = 4294967299 does not fit in int32"):
            fn(x, labels, w)
    # int64 values that fit are fine
    assert np.isfinite(float(linear_cross_entropy(x, np.array([1, 3, 2], np.int64), w)))


def test_labels_held_in_shards_are_checked_shard_by_shard_with_global_positions():
    """The multi-host path (labels not fully addressable) reads each held shard once, never the whole array.

    Here every shard is held, so the shard-wise check must agree with the whole-array one on the first
    bad position and on the count, although each label is held 4 times (replicated over ``model``).
    """
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from ce_core.api.validation import _check_held_labels

    mesh = jax.make_mesh((2, 4), ("data", "model"), devices=jax.devices()[:8])
    labels = LABELS.copy()
    labels[3, 4] = 40
    labels[2, 5] = -7
    sharded = jax.device_put(labels, NamedSharding(mesh, P("data", None)))
    with pytest.raises(ValueError, match=r"labels\[2, 5\] = -7 \(2 bad labels in the shards process 0 holds"):
        _check_held_labels(sharded, 33, -100)
    _check_held_labels(jax.device_put(LABELS, NamedSharding(mesh, P("data", None))), 33, -100)
