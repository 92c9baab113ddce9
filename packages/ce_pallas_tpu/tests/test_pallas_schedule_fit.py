"""The small-grid bilinear fit behind ``ce-bench schedule`` (pure arithmetic, no compile)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

from ce_pallas_tpu.common import KernelConfig
from ce_pallas_tpu.tooling.schedule.chips import SCHEDULE_CHIPS, mxu_cycles
from ce_pallas_tpu.tooling.schedule.grid_fit import BilinearFit, grid_points, small_grid


def _config(n: int, v: int, block_b: int, block_v: int, cores: int) -> KernelConfig:
    return KernelConfig(n=n, hidden=4096, hp=4096, v=v, block_b=block_b, block_h=4096, block_v=block_v,
                        num_cores=cores, logit_soft_cap=None, with_sum=False, interpret=False, vmem_limit_bytes=None)


@pytest.mark.parametrize("cores", [1, 2])
def test_small_grids_keep_the_tiles_and_the_raggedness(cores):
    full = _config(8000, 128256, 512, 512, cores)  # ragged last token block and last vocab block
    for kb, kv in grid_points(full):
        small = small_grid(full, kb, kv)
        assert (small.nb, small.nv_per_core, small.block_b, small.block_v) == (kb, kv, full.block_b, full.block_v)
        assert small.n % small.block_b == full.n % full.block_b
        assert small.v % small.block_v == full.v % full.block_v
        # A core short of a block at full size is short of one at the small size too.
        assert small.num_cores * small.nv_per_core - small.nv == full.num_cores * full.nv_per_core - full.nv


def test_grid_points_shrink_with_the_grid():
    assert grid_points(_config(8192, 128256, 512, 512, 2)) == [(2, 2), (2, 3), (3, 2), (3, 3)]
    assert grid_points(_config(512, 4096, 512, 512, 1)) == [(1, 2), (1, 3)]
    assert grid_points(_config(256, 512, 512, 512, 1)) == [(1, 1)]


def test_the_fit_is_exact_for_a_bilinear_total():
    def total(kb, kv):
        return 700 + 30 * kb + 11 * kv + 1000 * kb * kv

    fit = BilinearFit.of({(kb, kv): total(kb, kv) for kb in (2, 3) for kv in (2, 3)})
    assert fit.total(16, 126) == pytest.approx(total(16, 126))
    assert fit.interior() == pytest.approx(1000)
    line = BilinearFit.of({(1, 2): total(1, 2), (1, 3): total(1, 3)})
    assert line.total(1, 40) == pytest.approx(total(1, 40)) and line.interior() is None


def test_mxu_minimum_per_generation():
    # v5p forward, 512 x 4096 x 512 tile: 512 rows x 32 x 4 weight tiles over 4 MXUs.
    assert mxu_cycles("v5p", "forward", 512, 4096, 512) == 16384
    # v6e backward, b=256, H=4096, vb=1024: three products of 16384 row-tiles over 2 MXUs x 2 rows.
    assert mxu_cycles("v6e", "backward", 256, 4096, 1024) == 3 * 256 * 16 * 4 / 4
    # The clock follows from the peak rate: 16384 cycles on v5p are 9.36 us.
    assert 16384 / SCHEDULE_CHIPS["v5p"].clock_hz == pytest.approx(9.36e-6, rel=1e-3)


def test_a_step_moves_at_least_its_changing_operand_blocks():
    from ce_pallas_tpu.tooling.schedule.records import Job
    from ce_pallas_tpu.tooling.schedule.worker import block_bytes_per_step

    cfg = _config(8192, 128256, 1024, 2048, 1)  # 8 token blocks x 63 vocab blocks, H=4096, bf16
    forward = block_bytes_per_step(Job("forward", 8192, 4096, 128256), cfg)
    # The 16 MiB w block every step, and the 8 MiB x block once per token block (63 steps).
    assert forward == pytest.approx(4096 * 2048 * 2 + 1024 * 4096 * 2 / 63)
    backward = block_bytes_per_step(Job("backward", 8192, 4096, 128256), cfg)
    # x and the float32 dx partial in and out every step; w and dw once per vocab block (8 steps).
    assert backward == pytest.approx(1024 * 4096 * (2 + 8) + 2 * 4096 * 2048 * 2 / 8)


def test_a_kept_backward_is_measured_as_the_chunk_of_its_call_it_is(monkeypatch):
    """The kept backward's float32 ``dw`` starts at zero in a call's first chunk, is added onto the running sum
    in the chunks between and leaves in ``w``'s dtype from the last: each role compiles its own kernel (the
    running sum an operand only where it is read), and its HBM floor moves that ``dw``'s bytes."""
    from ce_core import StatsSpec
    from ce_pallas_tpu.backward import BackwardConfig
    from ce_pallas_tpu.tooling.schedule import CHUNK_ROLES, Job, chunk_roles
    from ce_pallas_tpu.tooling.schedule.programs import kernel_config, kernel_program
    from ce_pallas_tpu.tooling.schedule.worker import block_bytes_per_step

    assert chunk_roles(1) == {"only": 1} and chunk_roles(2) == {"first": 1, "last": 1}
    assert chunk_roles(11) == {"first": 1, "middle": 9, "last": 1}
    with pytest.raises(ValueError, match="chunks"):
        chunk_roles(0)
    with pytest.raises(ValueError, match="chunk_role"):
        Job("backward", 1024, 4096, 128256, keep_logits=True, chunk_role="second")
    monkeypatch.setenv("CE_PALLAS_TPU_TARGET", "v6e")
    spec = StatsSpec(keep_logits=True)
    sharding = jax.sharding.SingleDeviceSharding(jax.devices("cpu")[0])
    per_step, cfg = {}, None
    for role in CHUNK_ROLES:
        cfg = kernel_config("backward", 1024, 4096, 128256, "bfloat16", "bfloat16", spec, chunk_role=role)
        assert isinstance(cfg, BackwardConfig)
        assert (cfg.dw_from_running, cfg.dw_to_running) == (role in ("middle", "last"), role in ("first", "middle"))
        _, operands = kernel_program("backward", cfg, "bfloat16", "bfloat16", sharding)
        running = [o for o in operands if o.shape == (4096, cfg.nv * cfg.block_v) and o.dtype == jnp.float32]
        assert len(running) == cfg.dw_from_running, role
        per_step[role] = block_bytes_per_step(Job("backward", 1024, 4096, 128256, keep_logits=True,
                                                  chunk_role=role), cfg)
    assert cfg is not None
    dw_block = 4096 * cfg.block_v / cfg.nb  # one dw entry of a vocab block, spread over its token steps
    assert per_step["middle"] - per_step["only"] == pytest.approx(dw_block * (8 - 2))
    assert per_step["first"] - per_step["only"] == pytest.approx(dw_block * (4 - 2))
    assert per_step["last"] - per_step["only"] == pytest.approx(dw_block * 4)


def test_the_schedule_jobs_of_a_kept_call_are_its_kernel_calls_at_the_plans_tiles(monkeypatch):
    """``kept_jobs``: v6e, Llama-3 8B's head at 4096 tokens (one forward chunk, the backward in three pieces)
    measures the forward once and each piece's backward in its role, at the plan's tiles and rows (the plan
    at 1024 rows alone would take 512-row blocks; at 4096 rows whole it shrinks its chunk); at 16384 tokens
    (eleven 1536-token chunks) the backward's first, middle (nine runs) and last."""
    from ce_core import StatsSpec
    from ce_pallas_tpu import kept_logits
    from ce_pallas_tpu.target import CHIP_FACTS, Target
    from ce_pallas_tpu.tooling.schedule import kept_jobs
    from ce_pallas_tpu.tooling.schedule.programs import kernel_config

    v6e = Target("v6e", CHIP_FACTS["v6e"].num_cores, None)
    bf16, spec = jnp.bfloat16, StatsSpec(keep_logits=True)
    plan = kept_logits.plan_chunks(4096, 4096, 128256, bf16, bf16, spec, v6e)
    jobs = kept_jobs(plan)
    assert [(job.kernel, job.n, job.chunk_role, runs) for job, runs in jobs] == [
        ("forward", 4096, "middle", 1), ("backward", 1536, "first", 1), ("backward", 1536, "middle", 1),
        ("backward", 1024, "last", 1)]
    monkeypatch.setenv("CE_PALLAS_TPU_TARGET", "v6e")
    for job, _ in jobs:
        cfg = kernel_config(job.kernel, job.n, job.h, job.v, job.x_dtype, job.w_dtype, spec, tiles=job.tiles,
                            hidden_split=job.hidden_split, chunk_role=job.chunk_role)
        expected = plan.forward if job.kernel == "forward" else plan.backward
        assert (cfg.n, cfg.block_b, cfg.block_v) == (job.n, expected.block_b, expected.block_v)
    long = kept_logits.plan_chunks(16384, 4096, 128256, bf16, bf16, spec, v6e)
    assert [(job.n, job.chunk_role, runs) for job, runs in kept_jobs(long) if job.kernel == "backward"] == [
        (1536, "first", 1), (1536, "middle", 9), (1536, "last", 1)]


def test_a_kept_forward_takes_the_hidden_size_whole_where_it_fits_and_its_job_pins_its_hidden_tile(monkeypatch):
    """Llama-3 70B's head at 4096 tokens (1024-token chunks): the recompute plan for a chunk takes hidden tiles, the
    kept forward the hidden size whole where that fits VMEM (v5e at the same 512 x 1024 tiles, v5p at half the
    vocab block); with the tiles set (v5e, 256 x 2048 x 512) it keeps them, and its schedule job pins the hidden tile (a
    job with the hidden size whole measured another kernel, and the matrix table found no record), with the
    entropy's statistic and without."""
    from ce_core import BlockSizes, StatsSpec
    from ce_pallas_tpu import kept_logits
    from ce_pallas_tpu.target import CHIP_FACTS, Target
    from ce_pallas_tpu.tooling.schedule import kept_jobs
    from ce_pallas_tpu.tooling.schedule.programs import kernel_config

    bf16 = jnp.bfloat16
    for generation, block_v in (("v5e", 1024), ("v5p", 512)):
        target = Target(generation, CHIP_FACTS[generation].num_cores, None)
        plan = kept_logits.plan_chunks(4096, 8192, 128256, bf16, bf16, StatsSpec(keep_logits=True), target)
        assert (plan.chunk, plan.forward.block_b, plan.forward.block_h, plan.forward.block_v) == (
            1024, 512, 8192, block_v)
    v5e = Target("v5e", CHIP_FACTS["v5e"].num_cores, None)
    monkeypatch.setenv("CE_PALLAS_TPU_TARGET", "v5e")
    for with_expected in (False, True):
        spec = StatsSpec(keep_logits=True, with_expected=with_expected, block_sizes=BlockSizes(256, 2048, 512))
        plan = kept_logits.plan_chunks(4096, 8192, 128256, bf16, bf16, spec, v5e)
        assert plan.forward.nh == 4, plan.forward
        (job, runs), *_ = kept_jobs(plan)
        assert job.kernel == "forward" and runs == plan.chunks and job.tiles == (256, 2048, 512)
        cfg = kernel_config(job.kernel, job.n, job.h, job.v, job.x_dtype, job.w_dtype, spec, tiles=job.tiles,
                            hidden_split=job.hidden_split, chunk_role=job.chunk_role)
        assert (cfg.block_b, cfg.block_h, cfg.block_v, cfg.nh) == (256, 2048, 512, 4)


def test_the_schedule_jobs_of_a_kept_rl_call_ask_for_the_entropy_statistic(monkeypatch):
    """The RL objective with an entropy bonus (``with_expected``): v6e, Qwen2.5-0.5B's tied head, 16384 tokens. Its
    plan's forward takes 2048 x 2048 tiles (the plain loss's 4096 x 2048 do not fit with the expected logit's
    state; 2048 x 2048 beats 4096 x 1024 with it), every job asks for the statistic, and the configs the schedule
    worker builds from them are the plan's kernels with it (the backward with the entropy's cotangent in the
    exponent; the label's term in ``delta``, as the plain loss's at this width, where ``dw`` is held transposed)."""
    from ce_core import StatsSpec
    from ce_pallas_tpu import kept_logits
    from ce_pallas_tpu.backward import BackwardConfig
    from ce_pallas_tpu.target import CHIP_FACTS, Target
    from ce_pallas_tpu.tooling.schedule import kept_jobs
    from ce_pallas_tpu.tooling.schedule.programs import kernel_config

    v6e = Target("v6e", CHIP_FACTS["v6e"].num_cores, None)
    bf16 = jnp.bfloat16
    spec = StatsSpec(keep_logits=True, w_layout="vh", with_expected=True)
    plan = kept_logits.plan_chunks(16384, 896, 151936, bf16, bf16, spec, v6e)
    plain = kept_logits.plan_chunks(16384, 896, 151936, bf16, bf16, StatsSpec(keep_logits=True, w_layout="vh"), v6e)
    assert ((plan.forward.block_b, plan.forward.block_v), (plain.forward.block_b, plain.forward.block_v)) == (
        (2048, 2048), (4096, 2048))
    jobs = kept_jobs(plan, w_layout="vh")
    assert [(job.kernel, job.chunk_role, runs) for job, runs in jobs] == [
        ("forward", "middle", 4), ("backward", "first", 1), ("backward", "middle", 2), ("backward", "last", 1)]
    assert all(job.with_expected for job, _ in jobs)
    assert not any(job.with_expected for job, _ in kept_jobs(plain, w_layout="vh"))
    monkeypatch.setenv("CE_PALLAS_TPU_TARGET", "v6e")
    for job, _ in jobs:
        job_spec = StatsSpec(keep_logits=True, w_layout="vh", with_expected=job.with_expected)
        cfg = kernel_config(job.kernel, job.n, job.h, job.v, job.x_dtype, job.w_dtype, job_spec, tiles=job.tiles,
                            hidden_split=job.hidden_split, chunk_role=job.chunk_role)
        expected = plan.forward if job.kernel == "forward" else plan.backward
        assert cfg.with_expected and (cfg.block_b, cfg.block_v) == (expected.block_b, expected.block_v)
        if job.kernel == "backward":
            assert isinstance(cfg, BackwardConfig)
            assert cfg.cotangent_in_exponent and cfg.kept_dw_transposed and not cfg.label_rows


def test_a_job_the_profiler_aborted_on_keeps_its_variant(monkeypatch):
    """libtpu's profiler kills the worker on some kernels: that job's row says so, still naming what was
    asked (the RL objective's rows once read "plain"), and the jobs after it run in a fresh worker."""
    from ce_pallas_tpu.tooling import schedule
    from ce_pallas_tpu.tooling.schedule.records import Job, KernelSchedule

    jobs = [Job("backward", 4096, 4096, 128256, with_expected=True), Job("forward", 4096, 4096, 128256)]
    calls = []

    def worker(generation, remaining, quiet):
        calls.append(list(remaining))
        if len(calls) == 1:
            return [], "libtpu aborted (signal 6): LLO_CHECK failure"
        job = remaining[0]
        return [KernelSchedule(generation, job.kernel, job.n, job.h, job.v, job.x_dtype, job.w_dtype,
                               variant=job.variant, ratio=1.02)], None

    monkeypatch.setattr(schedule, "_run_worker", worker)
    aborted, measured = schedule.measure("v5p", jobs)
    assert (aborted.variant, aborted.error) == ("rl", "libtpu aborted (signal 6): LLO_CHECK failure")
    assert (measured.kernel, measured.variant, measured.ratio) == ("forward", "", 1.02)
    assert calls == [jobs, jobs[1:]]
