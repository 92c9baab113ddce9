"""Each kernel alone, as a jit-able function of abstract operands (what the schedule compiles)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from ce_pallas_tpu.backward import BackwardConfig, LabelRows, backward_call, running_dw_shape
from ce_pallas_tpu.common import KernelConfig, LiveBlocks
from ce_pallas_tpu.forward import ForwardConfig, forward_call, kept_maxima_shape
from ce_pallas_tpu.layout import cdiv
from ce_pallas_tpu.tooling.schedule.records import running_dw


def kernel_config(kernel: str, n: int, hidden: int, v: int, x_dtype: Any, w_dtype: Any, spec: Any,
                  tiles: tuple[int, int | None, int] | None = None, w_buffers: int | None = None,
                  hidden_split: int | None = None, delta_over_logits: bool | None = None,
                  chunk_role: str = "middle", x_transposed: bool | None = None) -> KernelConfig:
    """The kernel's config for a problem on the current target, with ``tiles`` ``(block_b, block_h,
    block_v)`` if given (``block_h`` ``None``: the whole hidden dimension); a kept-logits kernel's plan
    is for one chunk of ``n`` tokens, its backward in ``hidden_split`` hidden tiles if given (and forming
    ``delta`` once over them or not, ``delta_over_logits``, if given), its ``dw`` starting and ending as
    the ``chunk_role`` chunk of a call does (``records.CHUNK_ROLES``), holding ``x`` transposed or not
    (``x_transposed``) if given.

    Unlike explicit ``BlockSizes``, the tiles are not checked against the VMEM model (the
    compile is the judge here), and they apply to this kernel only.
    """
    import dataclasses

    from ce_pallas_tpu import ops
    from ce_pallas_tpu.target import active_cores, current_target

    if spec.keep_logits:  # one chunk of n tokens of the no-recompute path
        from ce_pallas_tpu import kept_logits

        kept = kept_logits.plan_chunks(n, hidden, v, jnp.dtype(x_dtype), jnp.dtype(w_dtype), spec, chunk_tokens=n,
                                       hidden_split=hidden_split)
        # The kernel at n rows even where the plan shrinks its chunk to fit VMEM (a piece's or a long chunk's forward
        # whose own plan is shorter: the job pins the tiles, kept_calls.kept_jobs).
        cfg = dataclasses.replace(kept.forward if kernel == "forward" else kept.backward, n=n)
        if kernel == "backward":
            reads, writes = running_dw(chunk_role)
            cfg = dataclasses.replace(cfg, dw_from_running=reads, dw_to_running=writes)
        if delta_over_logits is not None and kernel == "backward":
            cfg = dataclasses.replace(cfg, delta_over_logits=delta_over_logits)
        if x_transposed is not None and kernel == "backward":
            cfg = dataclasses.replace(cfg, x_transposed=x_transposed)
    else:
        plan = ops.make_plan(n, hidden, v, jnp.dtype(x_dtype), jnp.dtype(w_dtype), spec)
        cfg = plan.forward if kernel == "forward" else plan.backward
    if tiles is not None:
        block_b, block_h, block_v = tiles
        block_b, block_v = min(block_b, n), min(block_v, v)
        whole = getattr(cfg, "hidden_tile", cfg.hp)  # a kept backward's hidden tile (its products' extent)
        cfg = dataclasses.replace(cfg, block_b=block_b, block_h=whole if block_h is None else block_h,
                                  block_v=block_v, num_cores=active_cores(current_target().num_cores, cdiv(v, block_v)))
        if isinstance(cfg, ForwardConfig) and cfg.kept_bf16:  # the pinned block's lane-maxima groups
            from ce_pallas_tpu import kept_logits

            cfg = dataclasses.replace(cfg, kept_maxima_columns=kept_logits.lane_maxima_columns(cfg))
    if w_buffers is not None and kernel == "backward":
        cfg = dataclasses.replace(cfg, w_buffers=w_buffers)
    return cfg


def spread_label_rows(cfg: BackwardConfig) -> LabelRows:
    """:attr:`BackwardConfig.label_rows`' rows of a call whose ``N`` labels fall evenly over its vocab blocks
    (constants of the program, so that the static profile walks each block's share of them)."""
    first = jnp.arange(cfg.nv + 1, dtype=jnp.int32) * cfg.n // cfg.nv
    entry = jnp.arange(cfg.n, dtype=jnp.int32)
    return LabelRows(first=first, token=entry * 7919 % cfg.n, row=entry * 97 % cfg.block_v,
                     coefficient=jnp.full((cfg.n,), -1e-4, jnp.float32))


def kernel_program(kernel: str, cfg: KernelConfig, x_dtype: str, w_dtype: str, sharding: jax.sharding.Sharding,
                   live_blocks: int | None = None) -> tuple[Callable[..., Any], tuple[jax.ShapeDtypeStruct, ...]]:
    """``(fn, operands)``: ``jax.jit(fn).lower(*operands)`` compiles just that kernel for ``cfg``.

    ``live_blocks``: the kernel walks that many live token blocks (the first ones, constants of the
    program, so the static profile follows them), as a call with ignored tokens does; ``None``: the
    kernel without the walk (every block), as a ``return_lse`` call runs it.
    """
    blocks = None
    if live_blocks is not None:
        blocks = LiveBlocks.of(jnp.arange(cfg.n) < min(live_blocks, cfg.nb) * cfg.block_b, cfg.block_b)

    def operand(shape: tuple[int, ...], dtype: Any) -> jax.ShapeDtypeStruct:
        return jax.ShapeDtypeStruct(shape, jnp.dtype(dtype), sharding=sharding)

    kept = getattr(cfg, "keep_logits", False) or getattr(cfg, "kept_logits", False)
    logits_shape = (cfg.padded_n, cfg.num_cores * cfg.nv_per_core * cfg.block_v)
    x = operand((cfg.n, cfg.hidden), x_dtype)
    w = operand((cfg.v, cfg.hidden) if cfg.w_layout == "vh" else (cfg.hidden, cfg.v), w_dtype)
    labels = operand((cfg.n, 1), jnp.int32)
    if kernel == "forward":
        assert isinstance(cfg, ForwardConfig), cfg
        shape = logits_shape if kept else None
        return (lambda x_, w_, y_: forward_call(x_, w_, y_, cfg, kept_shape=shape, live_blocks=blocks)), (x, w, labels)
    assert isinstance(cfg, BackwardConfig), cfg
    column = operand((cfg.n, 1), jnp.float32)
    n_optional = cfg.with_sum + 2 * cfg.with_expected  # g_sum, then expected and g_expected
    columns = (column,) * (3 + n_optional)
    running = running_dw_shape(cfg)
    kept_operands: tuple[jax.ShapeDtypeStruct, ...] = ()
    if kept:  # the chunk's logits, and the running float32 dw where the chunk adds onto it
        kept_operands = (operand(logits_shape, jnp.bfloat16 if cfg.kept_bf16 else jnp.float32),)
        if getattr(cfg, "dw_from_running", False):
            kept_operands += (operand(running, jnp.float32),)
    if cfg.kept_bf16:  # and the lane maxima of bf16 kept logits, last
        kept_operands += (operand(kept_maxima_shape(logits_shape, cfg.kept_block_v), jnp.float32),)

    def backward(x_, w_, y_, lse, g_lse, g_label, *optional):
        rest = list(optional)
        maxima = rest.pop() if cfg.kept_bf16 else None
        g_sum = rest.pop(0) if cfg.with_sum else None
        expected, g_expected = (rest.pop(0), rest.pop(0)) if cfg.with_expected else (None, None)
        kept_in = (rest.pop(0), rest.pop(0) if rest else None) if kept else None
        return backward_call(x_, w_, y_, lse, g_lse, g_label, g_sum, expected, g_expected, cfg, kept=kept_in,
                             live_blocks=blocks, label_rows=spread_label_rows(cfg) if cfg.label_rows else None,
                             kept_maxima=maxima)

    return backward, (x, w, labels, *columns, *kept_operands)
