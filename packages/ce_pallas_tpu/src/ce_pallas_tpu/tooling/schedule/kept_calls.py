"""The kernel calls of one kept-logits call (``keep_logits=True``), as schedule jobs with their run counts."""

from __future__ import annotations

import dataclasses
from typing import Any

from ce_pallas_tpu.tooling.schedule.records import Job, chunk_roles, role_of_running_dw


def kept_jobs(plan: Any, *, x_dtype: str = "bfloat16", w_dtype: str = "bfloat16",
              w_layout: str = "hv") -> list[tuple[Job, int]]:
    """``(job, runs)`` for each kernel a call of ``plan`` (a :class:`ce_pallas_tpu.kept_logits.KeptPlan`) runs:
    the forward once per chunk; the backward once per piece of each chunk (:attr:`KeptPlan.pieces`), each in the
    role its configuration gives it among all of them (:meth:`KeptPlan.piece_configs`: the float32 running ``dw``
    started by the first, added onto by the ones between, ended by the last; one call alone is ``only``). The jobs
    pin the plan's tiles (a piece's own plan may tile it otherwise) and its hidden tiles (the forward's where it
    takes the hidden size in tiles, the backward's split), and ask for the entropy's statistic where the plan's
    kernels take it (the RL objective with an entropy bonus)."""
    forward, backward = plan.forward, plan.backward
    forward_job = Job("forward", plan.chunk, plan.h, plan.v, x_dtype=x_dtype, w_dtype=w_dtype, w_layout=w_layout,
                      tiles=(forward.block_b, forward.block_h if forward.nh > 1 else None, forward.block_v),
                      keep_logits=True,
                      hidden_split=backward.hidden_split, with_expected=forward.with_expected)
    runs: dict[Job, int] = {forward_job: plan.chunks}
    for chunk_role, chunks in chunk_roles(plan.chunks).items():
        for config in plan.piece_configs(chunk_role):
            role = role_of_running_dw(config.dw_from_running, config.dw_to_running)
            job = dataclasses.replace(forward_job, kernel="backward", n=config.n, chunk_role=role,
                                      tiles=(backward.block_b, None, backward.block_v))
            runs[job] = runs.get(job, 0) + chunks
    return list(runs.items())
