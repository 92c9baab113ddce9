"""A pair of heads (contract version 5: a dense distillation teacher): both heads' logit tiles in one grid step.

The student's ``a = s cap_s(x @ w)`` and the teacher's ``b = s cap_t(u @ v)`` tiles (``u = teacher_x``, ``v =
teacher_w``, :mod:`ce_core.contract.pair`) are formed side by side in VMEM and never reach HBM. Two kernels:

- **Statistics** (:func:`pair_stats_call`), grid ``(token blocks, vocab blocks)``, the vocab axis a reduction.
  ``online``: each row keeps a running max and sum of exps per head (an online logsumexp) and, for a KL, the
  divergence's running sum against the running max of the distribution that weighs it
  (``sum_j e^(b_j - m_b) (b_j - a_j)`` for the forward KL, ``sum_j e^(a_j - m_a) (a_j - b_j)`` for the reverse),
  rescaled with that max; at the row's last block ``KL(q||p) = sum_j q_j (b_j - a_j) - lse_b + lse_a`` (the
  reverse alike). ``given`` (the whole rows' lses known: a JSD's second pass, a vocab shard's part): each tile
  adds its terms of the contract's sums as they stand.
- **Gradient** (:func:`pair_grad_call`), one chunk of ``block_b`` token rows per call, grid ``(cores, vocab
  blocks per core)``: the chunk's ``x`` and ``u`` stay in VMEM, each step recomputes both heads' tiles for its
  vocab block, forms the student's ``delta`` from the whole rows' statistics, adds ``delta @ w.T`` into the
  core's float32 ``dx`` (resident over the core's blocks) and writes ``dw``'s block as the running float32 sum
  it read plus ``x.T @ delta`` (the sum's blocks aliased in and out: each is read and written once a call).
  The wrapper walks the chunks (a ``fori_loop``) and sums the cores' ``dx``.

A KL's value and gradient take two passes over both heads (statistics, gradient: ``2N(Hs + Ht)V`` and then
``2N(Hs + Ht)V + 4N Hs V`` of products); the JSD three (its mixture needs the whole rows' lses first).

Ragged edges: vocab columns past ``V`` are set to a large negative finite logit in both heads (their
probabilities are 0 and every term of theirs is 0; ``-inf`` would make ``0 * (inf - inf)``), and ``w``'s garbage
columns are zeroed before ``dx``'s product; rows past ``N`` and dead rows (``live`` false) have their hidden
states zeroed, and a dead row's cotangent is 0. Hidden sizes need not be multiples of 128: the blocks span
the round-up and the garbage past ``H`` is zeroed in both operands (:func:`ce_pallas_tpu.common.zero_hidden_tail`).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from ce_core.extend import PairSpec, vary_like
from ce_pallas_tpu import common
from ce_pallas_tpu.layout import LANES, round_up

#: The logit given to vocab columns past ``V``: far below any real one, yet finite.
MASKED_LOGIT = -1e30
#: The statistics kernels' modes: KLs in one pass, the lses alone, or the sums with the lses given.
MODES = ("online", "lses", "given")


@dataclasses.dataclass(frozen=True)
class PairConfig:
    """Static shape and tiling of one pair kernel call (hashable)."""

    n: int  # token rows of the call (the gradient kernel: of its chunk)
    hs: int  # the student's hidden size
    ht: int  # the teacher's hidden size
    v: int  # vocab size
    block_b: int  # token rows per block (the gradient kernel: per chunk)
    block_v: int  # vocab columns per block
    num_cores: int  # the gradient kernel's core split of the vocab blocks
    spec: PairSpec
    precision: str  # "default" (bf16 MXU passes), "high" or "highest"
    interpret: object  # False, or pltpu.InterpretParams
    vmem_limit_bytes: int | None

    @property
    def hsp(self) -> int:
        return round_up(self.hs, LANES)

    @property
    def htp(self) -> int:
        return round_up(self.ht, LANES)

    @property
    def nb(self) -> int:
        return pl.cdiv(self.n, self.block_b)

    @property
    def nv(self) -> int:
        return pl.cdiv(self.v, self.block_v)

    @property
    def nv_per_core(self) -> int:
        return self.nv // self.num_cores


# ---------------------------------------------------------------------------------------------
# Traced inside the kernels.


def _operand(ref, hidden: int, hp: int, rows_valid: jax.Array | None = None) -> jax.Array:
    """A token block ``[rows, Hp]`` with the garbage past ``hidden`` (and, given, the rows not valid) zeroed."""
    value = ref[...]
    if hidden != hp:
        cols = jax.lax.broadcasted_iota(jnp.int32, value.shape, 1)
        value = jnp.where(cols < hidden, value, jnp.zeros((), value.dtype))
    if rows_valid is not None:
        value = jnp.where(rows_valid, value, jnp.zeros((), value.dtype))
    return value


def _head_block(ref, hidden: int, hp: int, layout: str, block=None, cfg: PairConfig | None = None) -> jax.Array:
    """A head's vocab block (``[Hp, c]``, or ``[c, Hp]`` for ``"vh"``) with the garbage past ``hidden`` zeroed, and
    given the vocab ``block`` (and ``cfg``) its columns past ``V`` too (the mask built along the block's own vocab
    axis: Mosaic reshapes no boolean vector)."""
    value = ref[...]
    hidden_axis, vocab_axis = (0, 1) if layout == "hv" else (1, 0)
    if hidden != hp:
        rows = jax.lax.broadcasted_iota(jnp.int32, value.shape, hidden_axis)
        value = jnp.where(rows < hidden, value, jnp.zeros((), value.dtype))
    if block is not None and cfg is not None:
        cols = block * cfg.block_v + jax.lax.broadcasted_iota(jnp.int32, value.shape, vocab_axis)
        value = jnp.where(cols < cfg.v, value, jnp.zeros((), value.dtype))
    return value


def _logits(x: jax.Array, w: jax.Array, layout: str, cap: float | None, scale: jax.Array, precision: str,
            cols_valid: jax.Array) -> tuple[jax.Array, jax.Array | None]:
    """``s * cap(x @ w)`` (float32 ``[rows, c]``, columns past ``V`` at :data:`MASKED_LOGIT`) and ``cap'`` there."""
    raw = common.matmul(x, w, precision) if layout == "hv" else common.matmul_nt(x, w, precision)
    capped, t = common.soft_cap(raw, cap)
    slope = None if t is None else 1.0 - t * t
    return jnp.where(cols_valid, scale * capped, MASKED_LOGIT), slope


def _cols_valid(block, cfg: PairConfig) -> jax.Array:
    cols = block * cfg.block_v + jax.lax.broadcasted_iota(jnp.int32, (1, cfg.block_v), 1)
    return cols < cfg.v


def _rows_valid(block, rows: int, n: int, live: jax.Array) -> jax.Array:
    """Rows before ``n`` whose ``live`` (``[rows, 1]`` float32, 1 or 0) is set, as ``[rows, 1]`` bools."""
    row_ids = block * rows + jax.lax.broadcasted_iota(jnp.int32, (rows, 1), 0)
    return (row_ids < n) & (live > 0.5)


def _sum(terms: jax.Array) -> jax.Array:
    return jnp.sum(terms, axis=1, keepdims=True)


def _log_mixture(log_p: jax.Array, log_q: jax.Array, beta: float) -> jax.Array:
    """``log(beta q + (1 - beta) p)`` (the contract's mixture)."""
    return jnp.logaddexp(jnp.log(beta) + log_q, jnp.log1p(-beta) + log_p)


def _given_terms(a: jax.Array, b: jax.Array, lse_a: jax.Array, lse_b: jax.Array,
                 spec: PairSpec) -> tuple[jax.Array, jax.Array]:
    """This tile's part of the divergence's and the JSD's ``student_term`` sums (``[rows, 1]`` each), the lses
    given: :func:`ce_core.extend.pair_stats_of`'s terms, per tile."""
    log_p, log_q = a - lse_a, b - lse_b
    p, q = jnp.exp(log_p), jnp.exp(log_q)
    if spec.divergence == "forward_kl":
        return _sum(q * (log_q - log_p)), jnp.zeros_like(lse_a)
    if spec.divergence == "reverse_kl":
        return _sum(p * (log_p - log_q)), jnp.zeros_like(lse_a)
    log_m = _log_mixture(log_p, log_q, spec.beta)
    student = _sum(p * (log_p - log_m))
    return spec.beta * _sum(q * (log_q - log_m)) + (1.0 - spec.beta) * student, student


def _delta(a: jax.Array, b: jax.Array, slope: jax.Array | None, scale: jax.Array, lse_a: jax.Array,
           lse_b: jax.Array, divergence: jax.Array, student_term: jax.Array, g: jax.Array,
           spec: PairSpec) -> jax.Array:
    """The cotangent of the student's raw logits (:func:`ce_core.extend.pair_delta`, stats as ``[rows, 1]``)."""
    log_p, log_q = a - lse_a, b - lse_b
    p = jnp.exp(log_p)
    if spec.divergence == "forward_kl":
        d_a = p - jnp.exp(log_q)
    elif spec.divergence == "reverse_kl":
        d_a = p * ((log_p - log_q) - divergence)
    else:
        d_a = (1.0 - spec.beta) * p * ((log_p - _log_mixture(log_p, log_q, spec.beta)) - student_term)
    delta = (g * scale) * d_a
    return delta if slope is None else delta * slope


# ---------------------------------------------------------------------------------------------
# The statistics kernel.


def _stats_tiles(x_ref, w_ref, u_ref, v_ref, scale_ref, live_ref, cfg: PairConfig) -> tuple[jax.Array, jax.Array]:
    """Both heads' logit tiles of this grid step ``(token block, vocab block)``, dead rows zeroed first."""
    spec = cfg.spec
    i, j = pl.program_id(0), pl.program_id(1)
    rows = _rows_valid(i, cfg.block_b, cfg.n, live_ref[...])
    cols = _cols_valid(j, cfg)
    scale = scale_ref[...]
    student = _head_block(w_ref, cfg.hs, cfg.hsp, spec.w_layout)
    a = _logits(_operand(x_ref, cfg.hs, cfg.hsp, rows), student, spec.w_layout, spec.logit_soft_cap, scale,
                cfg.precision, cols)[0]
    teacher = _head_block(v_ref, cfg.ht, cfg.htp, spec.teacher_w_layout)
    b = _logits(_operand(u_ref, cfg.ht, cfg.htp, rows), teacher, spec.teacher_w_layout, spec.teacher_logit_soft_cap,
                scale, cfg.precision, cols)[0]
    return a, b


def _given_kernel(x_ref, w_ref, u_ref, v_ref, scale_ref, live_ref, lse_a_ref, lse_b_ref, div_ref, student_ref,
                  div_acc, student_acc, *, cfg: PairConfig):
    """The sums' parts over this call's columns, the whole rows' lses given."""
    a, b = _stats_tiles(x_ref, w_ref, u_ref, v_ref, scale_ref, live_ref, cfg)
    j = pl.program_id(1)

    @pl.when(j == 0)
    def _():
        div_acc[...] = jnp.zeros_like(div_acc)
        student_acc[...] = jnp.zeros_like(student_acc)

    div, student = _given_terms(a, b, lse_a_ref[...], lse_b_ref[...], cfg.spec)
    div_acc[...] += div
    student_acc[...] += student

    @pl.when(j == cfg.nv - 1)
    def _():
        div_ref[...] = div_acc[...]
        student_ref[...] = student_acc[...]


def _online_kernel(x_ref, w_ref, u_ref, v_ref, scale_ref, live_ref, lse_a_ref, lse_b_ref, div_ref, m_a, z_a, m_b,
                   z_b, s_acc, *, cfg: PairConfig, with_divergence: bool):
    """Both lses by an online logsumexp and, ``with_divergence`` (a KL), its running sum."""
    a, b = _stats_tiles(x_ref, w_ref, u_ref, v_ref, scale_ref, live_ref, cfg)
    j = pl.program_id(1)
    forward = cfg.spec.divergence == "forward_kl"

    @pl.when(j == 0)
    def _():
        for ref in (m_a, m_b):
            ref[...] = jnp.full(ref.shape, MASKED_LOGIT, jnp.float32)
        for ref in (z_a, z_b, s_acc):
            ref[...] = jnp.zeros_like(ref)

    def update(m_ref, z_ref, logits: jax.Array) -> tuple[jax.Array, jax.Array]:
        """The online logsumexp's step; returns the exps against the new max and the old sums' rescale."""
        new_max = jnp.maximum(m_ref[...], jnp.max(logits, axis=1, keepdims=True))
        rescale = jnp.exp(m_ref[...] - new_max)
        exps = jnp.exp(logits - new_max)
        z_ref[...] = z_ref[...] * rescale + _sum(exps)
        m_ref[...] = new_max
        return exps, rescale

    exps_a, rescale_a = update(m_a, z_a, a)
    exps_b, rescale_b = update(m_b, z_b, b)
    if with_divergence:  # each masked column has a == b (both MASKED_LOGIT) and adds nothing
        if forward:
            s_acc[...] = s_acc[...] * rescale_b + _sum(exps_b * (b - a))
        else:
            s_acc[...] = s_acc[...] * rescale_a + _sum(exps_a * (a - b))

    @pl.when(j == cfg.nv - 1)
    def _():
        lse_a = m_a[...] + jnp.log(z_a[...])
        lse_b = m_b[...] + jnp.log(z_b[...])
        lse_a_ref[...] = lse_a
        lse_b_ref[...] = lse_b
        if not with_divergence:
            div_ref[...] = jnp.zeros_like(lse_a)
        elif forward:
            div_ref[...] = s_acc[...] / z_b[...] - lse_b + lse_a
        else:
            div_ref[...] = s_acc[...] / z_a[...] - lse_a + lse_b


def _head_spec(hp: int, block_v: int, layout: str, index) -> pl.BlockSpec:
    """A head's vocab block ``index(*grid) -> block`` in its layout."""
    if layout == "hv":
        return pl.BlockSpec((hp, block_v), lambda *grid: (0, index(*grid)))
    return pl.BlockSpec((block_v, hp), lambda *grid: (index(*grid), 0))


def pair_stats_call(x: jax.Array, w: jax.Array, u: jax.Array, v: jax.Array, scale: jax.Array, live: jax.Array,
                    cfg: PairConfig, mode: str,
                    lse: tuple[jax.Array, jax.Array] | None = None) -> tuple[jax.Array, ...]:
    """``(lse_a, lse_b, divergence)`` (``mode`` ``"online"``; ``"lses"``: the divergence 0) or ``(divergence,
    student_term)`` (``"given"``, with the whole rows' ``lse``), each float32 ``[N, 1]``. ``scale`` and ``live``:
    float32 ``[N, 1]`` (the row scale; 1 where a row is live, 0 where not)."""
    if mode not in MODES:
        raise ValueError(f"pair_stats_call: mode must be one of {MODES}, got {mode!r}")
    if (mode == "given") != (lse is not None):
        raise ValueError("pair_stats_call: the lses are given in mode 'given', and only there")
    rows = lambda i, j: (i, 0)  # noqa: E731
    row_spec = pl.BlockSpec((cfg.block_b, 1), rows)
    in_specs = [pl.BlockSpec((cfg.block_b, cfg.hsp), rows), _head_spec(cfg.hsp, cfg.block_v, cfg.spec.w_layout,
                                                                         lambda i, j: j),
                pl.BlockSpec((cfg.block_b, cfg.htp), rows), _head_spec(cfg.htp, cfg.block_v,
                                                                         cfg.spec.teacher_w_layout, lambda i, j: j),
                row_spec, row_spec]
    inputs = [x, w, u, v, scale, live]
    if mode == "given":
        assert lse is not None
        in_specs += [row_spec, row_spec]
        inputs += [lse[0].reshape(-1, 1), lse[1].reshape(-1, 1)]
    outputs = 2 if mode == "given" else 3
    scratch_count = 2 if mode == "given" else 5
    axes, inputs = common.per_device_operands(inputs, cfg.interpret)
    return pl.pallas_call(
        (functools.partial(_given_kernel, cfg=cfg) if mode == "given"
         else functools.partial(_online_kernel, cfg=cfg, with_divergence=mode == "online")),
        grid=(cfg.nb, cfg.nv),
        in_specs=in_specs,
        out_specs=[row_spec] * outputs,
        out_shape=[common.out_type((cfg.n, 1), jnp.float32, axes)] * outputs,
        scratch_shapes=[pltpu.VMEM((cfg.block_b, 1), jnp.float32)] * scratch_count,
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary"),
                                             vmem_limit_bytes=cfg.vmem_limit_bytes),
        interpret=cfg.interpret,
        cost_estimate=pl.CostEstimate(flops=2 * cfg.n * (cfg.hsp + cfg.htp) * cfg.v,
                                      transcendentals=2 * cfg.n * cfg.v,
                                      bytes_accessed=cfg.nb * (w.size * w.dtype.itemsize + v.size * v.dtype.itemsize)),
        name=f"ce_pallas_tpu_pair_stats_{mode}",
    )(*inputs)


# ---------------------------------------------------------------------------------------------
# The gradient kernel.


def _grad_kernel(x_ref, w_ref, u_ref, v_ref, scale_ref, live_ref, lse_a_ref, lse_b_ref, div_ref, student_ref,
                 g_ref, dw_in_ref, dx_ref, dw_ref, dx_acc, *, cfg: PairConfig):
    spec = cfg.spec
    c, j = pl.program_id(0), pl.program_id(1)
    block = c * cfg.nv_per_core + j
    rows = _rows_valid(0, cfg.block_b, cfg.n, live_ref[...])
    cols = _cols_valid(block, cfg)
    scale = scale_ref[...]
    x = _operand(x_ref, cfg.hs, cfg.hsp, rows)
    w = _head_block(w_ref, cfg.hs, cfg.hsp, spec.w_layout, block, cfg)
    a, slope = _logits(x, w, spec.w_layout, spec.logit_soft_cap, scale, cfg.precision, cols)
    b = _logits(_operand(u_ref, cfg.ht, cfg.htp, rows),
                _head_block(v_ref, cfg.ht, cfg.htp, spec.teacher_w_layout), spec.teacher_w_layout,
                spec.teacher_logit_soft_cap, scale, cfg.precision, cols)[0]
    g = jnp.where(rows, g_ref[...], 0.0)
    delta = _delta(a, b, slope, scale, lse_a_ref[...], lse_b_ref[...], div_ref[...], student_ref[...], g, spec)
    delta = jnp.where(cols, delta, 0.0).astype(common.mxu_dtype(cfg.precision))

    @pl.when(j == 0)
    def _():
        dx_acc[...] = jnp.zeros_like(dx_acc)

    if spec.w_layout == "hv":
        dx_acc[...] += common.matmul_nt(delta, w, cfg.precision)
        dw_ref[...] = dw_in_ref[...] + common.matmul_tn(x, delta, cfg.precision)
    else:
        dx_acc[...] += common.matmul(delta, w, cfg.precision)
        dw_ref[...] = dw_in_ref[...] + common.matmul_tn(delta, x, cfg.precision)

    @pl.when(j == cfg.nv_per_core - 1)
    def _():
        dx_ref[...] = dx_acc[...].reshape(dx_ref.shape)


def pair_grad_call(x: jax.Array, w: jax.Array, u: jax.Array, v: jax.Array, rows: dict[str, jax.Array],
                   running_dw: jax.Array, cfg: PairConfig) -> tuple[jax.Array, jax.Array]:
    """One chunk's float32 ``dx`` (``[cores, rows, Hsp]``, summed by the caller) and the running float32 ``dw`` plus
    the chunk's share (``running_dw``: ``w``'s layout, padded to whole blocks). ``rows``: float32 ``[rows, 1]`` each of
    ``scale``, ``live``, ``lse``, ``teacher_lse``, ``divergence``, ``student_term`` and ``g``."""
    nvc = cfg.nv_per_core
    column = lambda c, j: c * nvc + j  # noqa: E731
    whole = lambda c, j: (0, 0)  # noqa: E731
    row_spec = pl.BlockSpec((cfg.block_b, 1), whole)
    dw_spec = _head_spec(cfg.hsp, cfg.block_v, cfg.spec.w_layout, column)
    names = ("scale", "live", "lse", "teacher_lse", "divergence", "student_term", "g")
    in_specs = [pl.BlockSpec((cfg.block_b, cfg.hsp), whole),
                _head_spec(cfg.hsp, cfg.block_v, cfg.spec.w_layout, column),
                pl.BlockSpec((cfg.block_b, cfg.htp), whole),
                _head_spec(cfg.htp, cfg.block_v, cfg.spec.teacher_w_layout, column),
                *[row_spec] * len(names), dw_spec]
    inputs = [x, w, u, v, *[rows[name] for name in names], running_dw]
    axes, inputs = common.per_device_operands(inputs, cfg.interpret)
    dx, dw = pl.pallas_call(
        functools.partial(_grad_kernel, cfg=cfg),
        grid=(cfg.num_cores, nvc),
        in_specs=in_specs,
        out_specs=[pl.BlockSpec((1, cfg.block_b, cfg.hsp), lambda c, j: (c, 0, 0)), dw_spec],
        out_shape=[common.out_type((cfg.num_cores, cfg.block_b, cfg.hsp), jnp.float32, axes),
                   common.out_type(running_dw.shape, jnp.float32, axes)],
        scratch_shapes=[pltpu.VMEM((cfg.block_b, cfg.hsp), jnp.float32)],
        input_output_aliases={len(inputs) - 1: 1},
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary"),
                                             vmem_limit_bytes=cfg.vmem_limit_bytes),
        interpret=cfg.interpret,
        cost_estimate=pl.CostEstimate(flops=2 * cfg.block_b * (cfg.hsp + cfg.htp) * cfg.v
                                      + 4 * cfg.block_b * cfg.hsp * cfg.v,
                                      transcendentals=2 * cfg.block_b * cfg.v,
                                      bytes_accessed=w.size * w.dtype.itemsize + v.size * v.dtype.itemsize
                                      + 2 * running_dw.size * 4),
        name="ce_pallas_tpu_pair_grad",
    )(*inputs)
    return dx, dw



# ---------------------------------------------------------------------------------------------
# Plans and the backend's entry points.

#: Tiles ``(statistics token block, gradient chunk rows, vocab block)`` to use instead of the rule's (tests set
#: small ones so that a call takes several of each); ``None``: :func:`make_configs` decides.
BLOCKS: tuple[int, int, int] | None = None
#: The rule's largest tiles: statistics token blocks, gradient chunks and vocab blocks.
STATS_ROWS, CHUNK_ROWS, VOCAB_COLUMNS = 512, 1024, 512
#: Rows and columns are multiples of these (a bf16 block's rows fill whole packed sublanes).
ROW_ALIGN = 16


def _grad_vmem_bytes(chunk: int, hsp: int, htp: int, block_v: int, x_bytes: int, u_bytes: int, w_bytes: int,
                     v_bytes: int) -> int:
    """The gradient kernel's VMEM: double-buffered operands and ``dw`` blocks, ``dx``, and ~6 float32 tiles."""
    operands = chunk * (hsp * x_bytes + htp * u_bytes) + block_v * (hsp * w_bytes + htp * v_bytes)
    return 2 * operands + 4 * hsp * block_v * 4 + 3 * chunk * hsp * 4 + 6 * chunk * block_v * 4


def make_configs(n: int, hs: int, ht: int, v: int, dtypes: tuple[Any, Any, Any, Any], spec: PairSpec,
                 target) -> tuple[PairConfig, PairConfig]:
    """The statistics kernel's and the gradient kernel's configs for ``n`` rows on ``target``."""
    from ce_pallas_tpu import tiling
    from ce_pallas_tpu.target import interpret_params

    sizes = [jnp.dtype(d).itemsize for d in dtypes]
    precision = common.resolve_precision(dtypes[0], dtypes[1], spec.precision)
    interpret = interpret_params(target)
    limit = None if target.interpret else tiling.vmem_limit(target)
    rows_cap = round_up(n, ROW_ALIGN) if n > ROW_ALIGN else n  # a statistics block may overhang N
    if BLOCKS is not None:
        stats_rows, chunk, block_v = BLOCKS
    else:
        stats_rows, chunk, block_v = STATS_ROWS, CHUNK_ROWS, VOCAB_COLUMNS
        budget = (limit or tiling.vmem_limit(target)) * 3 // 4
        hsp, htp = round_up(hs, LANES), round_up(ht, LANES)
        while chunk > 128 and _grad_vmem_bytes(chunk, hsp, htp, block_v, *sizes) > budget:
            chunk //= 2
    # A gradient chunk is a slice of exactly ``chunk`` rows (the last one moved back to end at ``N``): at most
    # ``N``, and whole packed sublanes where ``N`` has that many.
    stats_rows = min(stats_rows, rows_cap)
    chunk = n if n <= ROW_ALIGN else min(chunk, n // ROW_ALIGN * ROW_ALIGN)
    block_v = min(block_v, round_up(v, LANES))
    nv = pl.cdiv(v, block_v)
    cores = target.num_cores if nv % target.num_cores == 0 else 1
    base = PairConfig(n=n, hs=hs, ht=ht, v=v, block_b=stats_rows, block_v=block_v, num_cores=1, spec=spec,
                      precision=precision, interpret=interpret, vmem_limit_bytes=limit)
    return base, dataclasses.replace(base, n=chunk, block_b=chunk, num_cores=cores)


def _column(values: jax.Array | None, n: int, fill: float = 0.0) -> jax.Array:
    """A float32 ``[N, 1]`` column of ``values`` (``fill`` where ``None``)."""
    if values is None:
        return jnp.full((n, 1), fill, jnp.float32)
    return values.astype(jnp.float32).reshape(n, 1)


def pair_row_stats(x: jax.Array, w: jax.Array, u: jax.Array, v: jax.Array, spec: PairSpec, *,
                   row_scale: jax.Array, lse: tuple[jax.Array, jax.Array] | None = None,
                   live: jax.Array | None = None):
    """:class:`ce_core.extend.PairStats` of every row (contract version 5; dead rows' statistics are those of
    zero hidden states): one pass for a KL, two for the JSD, one with the whole rows' ``lse`` given."""
    from ce_core.extend import PairStats
    from ce_pallas_tpu.target import current_target

    n, vocab = x.shape[0], _vocab(w, spec.w_layout)
    cfg, _ = make_configs(n, x.shape[1], u.shape[1], vocab, (x.dtype, w.dtype, u.dtype, v.dtype), spec,
                          current_target())
    scale, alive = _column(row_scale, n, 1.0), _column(live, n, 1.0)
    flat = lambda column: column.reshape(n)  # noqa: E731
    jsd = spec.divergence == "jsd"
    if lse is None and not jsd:
        lse_a, lse_b, divergence = pair_stats_call(x, w, u, v, scale, alive, cfg, "online")
        return PairStats(flat(lse_a), flat(lse_b), flat(divergence))
    if lse is None:
        lse_a, lse_b, _ = pair_stats_call(x, w, u, v, scale, alive, cfg, "lses")
        lse = (flat(lse_a), flat(lse_b))
    divergence, student = pair_stats_call(x, w, u, v, scale, alive, cfg, "given", lse=lse)
    return PairStats(lse[0], lse[1], flat(divergence), flat(student) if jsd else None)


def pair_grads(x: jax.Array, w: jax.Array, u: jax.Array, v: jax.Array, stats, g: jax.Array, spec: PairSpec, *,
               row_scale: jax.Array, live: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
    """``dx`` and ``dw`` of ``sum(g * divergence)`` given the whole rows' statistics: the gradient kernel over
    chunks of rows (the last one moved back to end at ``N``; its rows an earlier chunk took get ``g = 0`` and
    keep that chunk's ``dx``), ``dw`` summed in float32 across them."""
    from ce_pallas_tpu.target import current_target

    n, vocab = x.shape[0], _vocab(w, spec.w_layout)
    if n == 0:
        return jnp.zeros_like(x), jnp.zeros_like(w)
    _, cfg = make_configs(n, x.shape[1], u.shape[1], vocab, (x.dtype, w.dtype, u.dtype, v.dtype), spec,
                          current_target())
    chunk = cfg.block_b
    columns = {"scale": _column(row_scale, n, 1.0), "live": _column(live, n, 1.0), "lse": _column(stats.lse, n),
               "teacher_lse": _column(stats.teacher_lse, n), "divergence": _column(stats.divergence, n),
               "student_term": _column(stats.student_term, n), "g": _column(g, n)}
    chunks = pl.cdiv(n, chunk)

    def step(k, carry):
        dx, dw = carry
        start = jnp.minimum(k * chunk, n - chunk)
        owned = (start + jnp.arange(chunk) >= k * chunk).reshape(chunk, 1)
        take = lambda a: jax.lax.dynamic_slice_in_dim(a, start, chunk)  # noqa: E731
        rows = {name: take(value) for name, value in columns.items()}
        rows["g"] = jnp.where(owned, rows["g"], 0.0)
        dx_parts, dw = pair_grad_call(take(x), w, take(u), v, rows, dw, cfg)
        dx_chunk = jnp.sum(dx_parts, axis=0)[:, : x.shape[1]].astype(x.dtype)
        dx_chunk = jnp.where(owned, dx_chunk, take(dx))
        return jax.lax.dynamic_update_slice_in_dim(dx, dx_chunk, start, 0), dw

    # The running dw spans whole blocks (an aliased operand's blocks must lie inside it).
    padded = (cfg.hsp, cfg.nv * cfg.block_v)
    padded = padded if spec.w_layout == "hv" else padded[::-1]
    initial = vary_like((jnp.zeros_like(x), jnp.zeros(padded, jnp.float32)), x, w, u, v, *columns.values())
    dx, dw = jax.lax.fori_loop(0, chunks, step, initial)
    return dx, dw[: w.shape[0], : w.shape[1]].astype(w.dtype)


def _vocab(w: jax.Array, layout: str) -> int:
    return w.shape[1] if layout == "hv" else w.shape[0]
