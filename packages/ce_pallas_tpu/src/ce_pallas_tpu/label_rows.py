"""The label's term of the kept backward by rows (:attr:`ce_pallas_tpu.backward.BackwardConfig.label_rows`).

The logit cotangent of a scalar loss has one term per row at its label's column, ``delta[r, y_r] += g_label[r]``.
Formed in the kernel it costs a compare and a select per logit, and v6e's narrow heads are bound by such
vector work. By rows instead, the kernel forms ``delta`` without it and each labelled row adds its share ``c``
to the two products: onto ``dw``'s row ``y`` inside the kernel (on the float32 tile, before ``dw`` is rounded to
``w``'s dtype: :func:`ce_pallas_tpu.backward._add_label_rows`) and onto ``dx`` here (``c w[y]``, float32).

``c`` is the difference the term makes to that entry of ``delta`` as the kernel rounds it for the products,
``round(d + g_label) - round(d)`` with ``d`` the entry without the term, so ``dx`` and ``dw`` are those of the
kernel with the term, up to the order of float32 sums (and where XLA's ``exp`` and the kernel's differ in the last
bit of ``d``, a rounding of that one entry).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from ce_pallas_tpu import common
from ce_pallas_tpu.backward import BackwardConfig, LabelRows
from ce_pallas_tpu.layout import LANES


def label_rows(logits: jax.Array, w: jax.Array, labels: jax.Array, lse: jax.Array, g_label: jax.Array,
               g_sum: jax.Array | None, row_scale: jax.Array | None, cfg: BackwardConfig,
               maxima: jax.Array | None = None, g_lse: jax.Array | None = None, expected: jax.Array | None = None,
               g_expected: jax.Array | None = None) -> tuple[LabelRows, jax.Array]:
    """``(the kernel's LabelRows, dx's share float32 [n, H])`` of one backward call's rows.

    ``logits`` is the kept buffer (the call's rows from block ``cfg.logits_row_block``), ``w`` the ``[V, H]`` head;
    ``labels`` (int32), ``lse``, ``g_label``, ``g_sum`` and ``row_scale`` are ``[n, 1]`` columns as the kernel
    takes them (with :attr:`BackwardConfig.cotangent_in_exponent`, ``|g_lse|`` or the entropy's ``|b|`` folded into
    ``lse``, the cotangents signed and ``g_lse`` the entropy's ``a / b``; without it ``g_lse`` as it is; with the
    entropy's terms ``expected`` and ``g_expected``);
    ``maxima`` the lane maxima of bf16 kept logits (:attr:`BackwardConfig.kept_bf16`). Rows whose term is 0
    (ignored, dead, zero-weighted) are left out."""
    n, dtype = cfg.n, common.mxu_dtype(cfg.precision)
    label = labels[:, 0]
    counted = (label >= 0) & (label < cfg.v) & (g_label[:, 0] != 0)
    column = jnp.where(counted, label, 0)
    row = cfg.logits_row_block * cfg.block_b + jnp.arange(n)
    raw = logits[row, column].astype(jnp.float32)
    maximum = None if maxima is None else maxima[row, column // cfg.kept_block_v * LANES + column % LANES]
    scale = None if row_scale is None else row_scale[:, 0]
    g_sum_row = None if g_sum is None else g_sum[:, 0]
    # The kernel's delta at the entry, formed by the kernel's own steps (:func:`ce_pallas_tpu.backward.
    # _logit_cotangent`): the probability, then with the label's term or without it the row terms.
    def entry(column_values: jax.Array | None) -> jax.Array | None:
        return None if column_values is None else column_values[:, 0]

    without, t = common.softmax_cotangent(raw, lse[:, 0], scale, cfg.logit_soft_cap, maximum,
                                          **common.softmax_cotangent_rows(cfg.cotangent_in_exponent, entry(g_lse),
                                                                          entry(expected), entry(g_expected)))
    with_term = common.delta_row_terms(without + g_label[:, 0], g_sum_row, t, scale)
    without = common.delta_row_terms(without, g_sum_row, t, scale)
    share = with_term.astype(dtype).astype(jnp.float32) - without.astype(dtype).astype(jnp.float32)
    share = jnp.where(counted & (share != 0), share, 0.0)

    # Sorted by label, the rows without a term last (past every block's end); block b's rows start at first[b].
    end = cfg.nv * cfg.block_v
    key = jnp.where(share != 0, column, end)
    order = jnp.argsort(key, stable=True).astype(jnp.int32)
    sorted_key = key[order]
    first = jnp.searchsorted(sorted_key, jnp.arange(cfg.nv + 1, dtype=jnp.int32) * cfg.block_v).astype(jnp.int32)
    rows = LabelRows(first=first, token=order, row=(sorted_key % cfg.block_v).astype(jnp.int32),
                     coefficient=share[order])
    dx_share = share[:, None] * jnp.take(w, column, axis=0).astype(jnp.float32)
    return rows, dx_share
