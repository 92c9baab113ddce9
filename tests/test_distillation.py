"""linear_distillation_loss with a sparse (top-k) teacher on every backend, against the float64 oracle."""

from __future__ import annotations

import os
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from ce_core import linear_distillation_loss
from ce_core.testing import TOLERANCES, distillation_oracle, max_rel_error, random_problem

IGNORE = -100


def top_k_teacher(seed: int, tokens: tuple[int, ...], vocab: int, k: int, *, padded: int = 0):
    """A teacher's top-``k`` ids and log-probs per token (from logits of scale 1), the last ``padded`` entries
    of the first token ``-inf`` (padding)."""
    rng = np.random.default_rng(seed)
    logits = rng.standard_normal((*tokens, vocab))
    log_q = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    indices = np.argsort(-log_q, axis=-1)[..., :k].astype(np.int32)
    log_probs = np.take_along_axis(log_q, indices, axis=-1).astype(np.float32)
    if padded:
        log_probs.reshape(-1, k)[0, k - padded:] = -np.inf
    return indices, log_probs


def check(x: Any, w: Any, labels: Any, indices: Any, log_probs: Any, *, dtype: str, w_layout: str = "hv",
          **options: Any) -> None:
    """Value and ``dx``, ``dw`` against the oracle (``reduction="none"`` through ``sum(cotangent * loss)``)."""
    reduction = options.get("reduction", "mean")
    cotangent = np.linspace(-1.0, 2.0, int(np.prod(x.shape[:-1]))).reshape(x.shape[:-1])
    xj, wj = jnp.asarray(x, dtype), jnp.asarray(w if w_layout == "hv" else np.ascontiguousarray(w.T), dtype)

    def loss(a, b):
        out = linear_distillation_loss(a, b, labels=labels, teacher_indices=indices, teacher_log_probs=log_probs,
                                       w_layout=w_layout, **options)
        return out if reduction != "none" else jnp.sum(out * cotangent)

    value, (dx, dw) = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))(xj, wj)
    oracle_options = {key: value for key, value in options.items() if key not in ("implementation",)}
    expected = distillation_oracle(np.asarray(xj.astype(jnp.float32)), np.asarray(wj.astype(jnp.float32)).T
                                   if w_layout == "vh" else np.asarray(wj.astype(jnp.float32)), labels=labels,
                                   teacher_indices=indices, teacher_log_probs=log_probs,
                                   cotangent=cotangent if reduction == "none" else None, **oracle_options)
    expected_value = expected["loss"] if reduction != "none" else np.sum(expected["loss"] * cotangent)
    expected_dw = expected["dw"] if w_layout == "hv" else expected["dw"].T
    assert dx.dtype == xj.dtype and dw.dtype == wj.dtype and dw.shape == wj.shape
    value_tol, grad_tol = TOLERANCES[dtype]
    errors = {"loss": max_rel_error(value, expected_value), "dx": max_rel_error(dx.astype(jnp.float32), expected["dx"]),
              "dw": max_rel_error(dw.astype(jnp.float32), expected_dw)}
    assert errors["loss"] <= value_tol and max(errors["dx"], errors["dw"]) <= grad_tol, errors


@pytest.mark.covering(reduction=("mean", "sum", "none"), temperature=("number", "per_token"), cap=(None, 2.0),
                      hard=(0.0, 0.3), w_layout=("hv", "vh"), dtype=("float32", "bfloat16"),
                      with_labels=(True, False), backends="turns")
def test_a_sparse_teacher_matches_the_float64_oracle(backend_name, reduction, temperature, cap, hard, w_layout,
                                                     dtype, with_labels):
    """Ragged tokens and vocabulary, ignored tokens, a padded teacher entry: every option against the oracle."""
    x, labels, w = random_problem(3, (3, 7), 24, 203, ignore_fraction=0.25)
    indices, log_probs = top_k_teacher(4, (3, 7), 203, 6, padded=2)
    temp: Any = 0.8 if temperature == "number" else np.linspace(0.6, 1.4, 21, dtype=np.float32).reshape(3, 7)
    weights = np.linspace(0.5, 1.5, 21, dtype=np.float32).reshape(3, 7)
    check(x, w, labels if with_labels or hard else None, indices, log_probs, dtype=dtype, w_layout=w_layout,
          reduction=reduction, temperature=temp, logit_soft_cap=cap, hard_label_weight=hard, weights=weights,
          implementation=backend_name)


def test_the_student_is_one_fused_pass_and_the_hard_label_at_another_temperature_a_second(backend_name, monkeypatch):
    """A scalar loss: the student's gradient is formed in its forward pass (``row_stats_and_grads``; the
    statistics alone, whose VJP would be a backward pass, never run), once for the teacher's mass and the hard
    label at temperature 1, twice when the temperature differs (the hard label's cross-entropy is at
    temperature 1); values against the oracle."""
    from ce_core.sharded import ops

    calls: list[str] = []
    fused = ops.row_stats_and_grads

    def recorded(*args, **kwargs):
        calls.append("fused")
        return fused(*args, **kwargs)

    def no_backward_pass(*args, **kwargs):
        raise AssertionError("row_stats ran: the gradient would take a backward pass")

    monkeypatch.setattr(ops, "row_stats_and_grads", recorded)
    monkeypatch.setattr(ops, "row_stats", no_backward_pass)
    x, labels, w = random_problem(5, (13,), 16, 57)
    indices, log_probs = top_k_teacher(6, (13,), 57, 4)
    for temperature, passes in ((1.0, 1), (0.7, 2)):
        calls.clear()
        check(x, w, labels, indices, log_probs, dtype="float32", hard_label_weight=0.5, temperature=temperature,
              implementation=backend_name)
        assert len(calls) == passes, (temperature, calls)


def test_every_entry_is_the_forward_kl_and_padding_counts_for_nothing():
    """With all V entries the sparse teacher is the dense forward KL; ``-inf`` entries change nothing."""
    x, labels, w = random_problem(7, (9,), 16, 31)
    rng = np.random.default_rng(8)
    teacher_x, teacher_w = rng.standard_normal((9, 12)), rng.standard_normal((12, 31)) / np.sqrt(12)
    b = teacher_x @ teacher_w
    log_q = b - np.log(np.exp(b).sum(-1, keepdims=True))
    every = np.tile(np.arange(31, dtype=np.int32), (9, 1))
    dense = distillation_oracle(x, w, teacher_x, teacher_w, labels)
    value = jax.jit(lambda a, b: linear_distillation_loss(a, b, labels=labels, teacher_indices=every,
                                                          teacher_log_probs=log_q))(x, w)
    assert max_rel_error(value, dense["loss"]) <= 1e-5

    indices, log_probs = top_k_teacher(9, (9,), 31, 3)
    with_padding = (np.concatenate([indices, indices[:, :2]], axis=1),
                    np.concatenate([log_probs, np.full((9, 2), -np.inf, np.float32)], axis=1))
    step = jax.jit(jax.value_and_grad(lambda a, b, i, q: linear_distillation_loss(
        a, b, labels=labels, teacher_indices=i, teacher_log_probs=q), argnums=(0, 1)))
    (value, grads), (padded_value, padded_grads) = (step(x, w, *t) for t in ((indices, log_probs), with_padding))
    assert float(padded_value) == pytest.approx(float(value), rel=1e-6)
    for got, want in zip(padded_grads, grads, strict=True):
        assert max_rel_error(got, want) <= 1e-6


def test_ignored_tokens_count_for_nothing_even_with_nan_hidden_states(backend_name):
    """All ignored: 0 and zero gradients; NaN ``x`` rows at ignored tokens leave the rest finite and exact."""
    x, labels, w = random_problem(10, (2, 5), 16, 40)
    indices, log_probs = top_k_teacher(11, (2, 5), 40, 3)

    @jax.jit
    def value_and_grads(x_, y):
        return jax.value_and_grad(lambda a, b: linear_distillation_loss(
            a, b, labels=y, teacher_indices=indices, teacher_log_probs=log_probs, hard_label_weight=0.2,
            implementation=backend_name), argnums=(0, 1))(x_, w)

    value, (dx, dw) = value_and_grads(x, np.full((2, 5), IGNORE, np.int32))
    assert float(value) == 0.0 and not np.asarray(dx).any() and not np.asarray(dw).any()
    labels[0, :2] = IGNORE
    poisoned = x.copy()
    poisoned[0, :2] = np.nan
    value, (dx, dw) = value_and_grads(poisoned, labels)
    expected = distillation_oracle(x, w, labels=labels, teacher_indices=indices, teacher_log_probs=log_probs,
                                   hard_label_weight=0.2)
    assert np.isfinite(np.asarray(dx)).all() and np.isfinite(np.asarray(dw)).all()
    assert max_rel_error(value, expected["loss"]) <= 1e-5 and max_rel_error(dw, expected["dw"]) <= 1e-4
    assert not np.asarray(dx)[0, :2].any()


@pytest.mark.covering(axis_type=("explicit", "auto"), backends="turns")
def test_over_a_mesh_splitting_tokens_and_vocab_matches_the_oracle(backend_name, axis_type):
    """Tokens over "data", the head's vocab over "model": under Explicit axes each vocab shard gathers the teacher's
    entries it holds; under Auto axes the default layout (every token split, ``w`` whole). 4 devices for
    interpreted pallas_tpu."""
    devices = 4 if backend_name == "pallas_tpu" and os.environ.get("CE_PALLAS_TPU_INTERPRET") else 8
    kind = jax.sharding.AxisType.Explicit if axis_type == "explicit" else jax.sharding.AxisType.Auto
    mesh = jax.make_mesh((2, devices // 2), ("data", "model"), axis_types=(kind, kind),
                         devices=jax.devices("cpu")[:devices])
    x, labels, w = random_problem(19, (4, 6), 32, 320, ignore_fraction=0.2)
    indices, log_probs = top_k_teacher(20, (4, 6), 320, 5)
    options: dict[str, Any] = dict(temperature=0.8, hard_label_weight=0.2, logit_soft_cap=3.0)
    expected = distillation_oracle(x, w, labels=labels, teacher_indices=indices, teacher_log_probs=log_probs,
                                   **options)
    with jax.set_mesh(mesh):
        tokens = NamedSharding(mesh, P("data"))
        a = jax.device_put(x, NamedSharding(mesh, P("data", None, None)))
        b = jax.device_put(w, NamedSharding(mesh, P(None, "model")))
        y, i, lp = (jax.device_put(v, tokens) for v in (labels, indices, log_probs))
        value, (dx, dw) = jax.jit(jax.value_and_grad(lambda a_, b_: linear_distillation_loss(
            a_, b_, labels=y, teacher_indices=i, teacher_log_probs=lp, implementation=backend_name, **options),
            argnums=(0, 1)))(a, b)
    assert max_rel_error(value, expected["loss"]) <= 1e-5
    assert max_rel_error(dx, expected["dx"]) <= 1e-4 and max_rel_error(dw, expected["dw"]) <= 1e-4


def test_a_padded_head_keeps_its_first_vocab_size_entries():
    x, labels, w = random_problem(12, (8,), 16, 50)
    padded = np.concatenate([w, np.random.default_rng(13).standard_normal((16, 14)).astype(np.float32)], axis=1)
    indices, log_probs = top_k_teacher(14, (8,), 50, 5)
    value, (dx, dw) = jax.jit(jax.value_and_grad(lambda a, b: linear_distillation_loss(
        a, b, labels=labels, teacher_indices=indices, teacher_log_probs=log_probs, vocab_size=50),
        argnums=(0, 1)))(x, padded)
    expected = distillation_oracle(x, padded, labels=labels, teacher_indices=indices, teacher_log_probs=log_probs,
                                   vocab_size=50)
    assert max_rel_error(value, expected["loss"]) <= 1e-5 and max_rel_error(dx, expected["dx"]) <= 1e-4
    assert max_rel_error(dw[:, :50], expected["dw"]) <= 1e-4 and not np.asarray(dw[:, 50:]).any()


def test_traced_teacher_ids_out_of_range_make_their_tokens_nan_never_clipped():
    x, labels, w = random_problem(15, (4,), 8, 20, ignore_fraction=0.0)
    indices, log_probs = top_k_teacher(16, (4,), 20, 2)
    indices[1, 0] = 20
    per_token = jax.jit(lambda i: linear_distillation_loss(x, w, labels=labels, teacher_indices=i,
                                                           teacher_log_probs=log_probs, reduction="none"))(indices)
    assert np.isnan(np.asarray(per_token)[1]) and np.isfinite(np.asarray(per_token)[[0, 2, 3]]).all()


def test_bad_calls_are_clear_errors():
    x, labels, w = random_problem(17, (4,), 8, 20)
    indices, log_probs = top_k_teacher(18, (4,), 20, 2)
    sparse: dict[str, Any] = dict(teacher_indices=indices, teacher_log_probs=log_probs)
    with pytest.raises(ValueError, match="not both"):
        linear_distillation_loss(x, w, x, w, labels, **sparse)
    with pytest.raises(ValueError, match="both teacher_indices and teacher_log_probs"):
        linear_distillation_loss(x, w, labels=labels, teacher_indices=indices)
    with pytest.raises(ValueError, match="forward_kl"):
        linear_distillation_loss(x, w, labels=labels, divergence="reverse_kl", **sparse)
    with pytest.raises(ValueError, match="divergence"):
        linear_distillation_loss(x, w, labels=labels, divergence="kl", **sparse)
    with pytest.raises(ValueError, match="hard_label_weight needs labels"):
        linear_distillation_loss(x, w, hard_label_weight=0.5, **sparse)
    with pytest.raises(ValueError, match="hard_label_weight"):
        linear_distillation_loss(x, w, labels=labels, hard_label_weight=-1.0, **sparse)
    with pytest.raises(ValueError, match="reduction"):
        linear_distillation_loss(x, w, labels=labels, reduction="max", **sparse)
    with pytest.raises(ValueError, match=r"teacher_indices must be in \[0, 20\)"):
        linear_distillation_loss(x, w, labels=labels, teacher_indices=indices + 19, teacher_log_probs=log_probs)
    with pytest.raises(ValueError, match="teacher_indices and teacher_log_probs must both be"):
        linear_distillation_loss(x, w, labels=labels, teacher_indices=indices[:3], teacher_log_probs=log_probs[:3])
    with pytest.raises(ValueError, match="integer"):
        linear_distillation_loss(x, w, labels=labels, teacher_indices=log_probs, teacher_log_probs=log_probs)
    with pytest.raises(ValueError, match="vocab_size"):
        linear_distillation_loss(x, w, labels=labels, vocab_size=21, **sparse)
    bad = labels.copy()
    bad[1] = 20
    with pytest.raises(ValueError, match=r"labels must be in \[0, 20\) or equal ignore_index=-100"):
        linear_distillation_loss(x, w, labels=bad, **sparse)
    with pytest.raises(ValueError, match="labels must have"):
        linear_distillation_loss(x, w, labels=labels[:3], **sparse)
    with pytest.raises(ValueError, match="weights must have"):
        linear_distillation_loss(x, w, labels=labels, weights=np.ones(3), **sparse)
