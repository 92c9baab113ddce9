"""``ce-bench schedule --step value_and_grad``: the whole step's estimate from per-op static profiles.

The pure parts (summing profiles over an HLO module with a while loop, the linear extrapolation in N,
the records, the table and the flags) without libtpu; one slow test compiles a tiny step for v5p.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from ce_bench import cli, step_schedule
from ce_bench.commands import schedule as schedule_command
from ce_bench.presets import Shape
from ce_pallas_tpu.tooling.schedule import step
from ce_pallas_tpu.tooling.schedule.chips import SCHEDULE_CHIPS

HLO = """HloModule step

%fused_add (param_0: f32[128,256]) -> f32[128,256] {
  %param_0 = f32[128,256]{1,0} parameter(0)
  ROOT %add.9 = f32[128,256]{1,0} add(%param_0, %param_0)
}

%body (p: (s32[], f32[128,256])) -> (s32[], f32[128,256]) {
  %p = (s32[], f32[128,256]{1,0}) parameter(0)
  %loop_fusion = f32[128,256]{1,0:T(8,128)} fusion(%p), kind=kLoop, calls=%fused_add
  ROOT %t = (s32[], f32[128,256]{1,0}) tuple(%p, %loop_fusion)
}

%cond (p.1: (s32[], f32[128,256])) -> pred[] {
  %p.1 = (s32[], f32[128,256]{1,0}) parameter(0)
  ROOT %lt = pred[] compare(%p.1, %p.1), direction=LT
}

%fused_dot (param_0.1: bf16[128,256], param_1.1: bf16[256,512]) -> f32[128,512] {
  %param_0.1 = bf16[128,256]{1,0} parameter(0)
  %param_1.1 = bf16[256,512]{1,0} parameter(1)
  ROOT %convolution.1 = f32[128,512]{1,0} convolution(%param_0.1, %param_1.1), dim_labels=bf_io->bf
}

ENTRY %main (x: bf16[128,256], w: bf16[256,512]) -> f32[128,512] {
  %x = bf16[128,256]{1,0} parameter(0)
  %w = bf16[256,512]{1,0} parameter(1)
  %kernel = f32[128,256]{1,0} custom-call(%x, %w), custom_call_target="tpu_custom_call"
  %copy.1 = f32[128,256]{1,0} copy(%kernel)
  %copy.2 = f32[128,256]{1,0} copy(%kernel)
  %init = (s32[], f32[128,256]{1,0}) tuple(%x, %copy.1)
  %while.1 = (s32[], f32[128,256]{1,0}) while(%init), condition=%cond, body=%body, backend_config=TRIP
  ROOT %dot_fusion = f32[128,512]{1,0} fusion(%x, %w), kind=kOutput, calls=%fused_dot
}
""".replace("TRIP", '{"known_trip_count":{"n":"8"}}')


def _write_profile(root: Path, name: str, cycles: int, equivalents: int = 1) -> None:
    text = (f'hlo_op_estimate {{\n  hlo_op_name: "{name}"\n  estimated_cycles: {cycles}\n'
            f"  num_equivalent_hlos: {equivalents}\n}}\n")
    (root / f"{name}_TPU v5_static_llo_profile.textproto").write_text(text)


def test_profiles_are_summed_with_loop_trip_counts_and_equivalent_ops(tmp_path: Path) -> None:
    _write_profile(tmp_path, "kernel", 1000)
    _write_profile(tmp_path, "copy.1", 50, equivalents=2)  # copy.2 is the same op: one file for both
    _write_profile(tmp_path, "loop_fusion", 10)  # in the while body: walked once, runs 8 times
    profiles = step.read_op_profiles(tmp_path)
    assert sorted((p.name, p.cycles, p.equivalents) for p in profiles) == [
        ("copy.1", 50, 2), ("kernel", 1000, 1), ("loop_fusion", 10, 1)]
    module = step.parse_hlo(HLO)
    assert module.runs["loop_fusion"] == 8 and module.runs["copy.1"] == 1 and module.runs["lt"] == 9
    assert "add.9" not in module.runs  # inside a fusion: profiled as the fusion
    assert module.flops(module.ops["dot_fusion"]) == 2 * 128 * 512 * 256

    ops = step.sum_step(128, "v5p", HLO, profiles, cores=2)
    assert ops.kernel_cycles == 1000
    # dot_fusion has no profile: the longest of its HBM bytes, its flops at the peak, the cheapest op (10).
    chip = SCHEDULE_CHIPS["v5p"]
    hbm = (128 * 512 * 4 + 128 * 256 * 2 + 256 * 512 * 2) / chip.hbm_bytes_per_s * chip.clock_hz
    mxu = 2 * 128 * 512 * 256 / (2 * chip.bf16_flops) * chip.clock_hz
    dot = max(hbm, mxu, 10)
    assert ops.xla_cycles == pytest.approx(50 + 50 + 8 * 10 + dot)
    assert ops.estimated_cycles == pytest.approx(dot)
    assert ops.estimated_ops == ["dot_fusion"]
    assert ops.ops == 5 and ops.unprofiled_kernels == []
    # A kernel the profiler never walked (an abort took it) is named: its bytes say nothing of its cost.
    lost = step.sum_step(128, "v5p", HLO, [p for p in profiles if p.name != "kernel"], cores=2)
    assert lost.unprofiled_kernels == ["kernel"]
    with pytest.raises(RuntimeError, match="kernels kernel"):
        step_schedule.step_record("v5p", Shape(1024, 256, 512), "keep_logits", {128: lost, 256: lost}, [], 1e9)


def test_a_loop_without_a_known_trip_count_is_named() -> None:
    assert step.unknown_trip_counts(HLO.replace('{"known_trip_count":{"n":"8"}}', "{}")) == ["while.1"]
    assert step.unknown_trip_counts(HLO) == []


def test_type_bytes_counts_tuples_and_ignores_layouts() -> None:
    assert step.type_bytes("(f32[128,256]{1,0:T(8,128)}, bf16[4]{0})") == 128 * 256 * 4 + 4 * 2
    assert step.type_bytes("s32[]") == 4


def test_linear_extrapolation_in_tokens() -> None:
    fit = step.linear_fit({256: 3.0, 512: 5.0})
    assert (fit.intercept, fit.slope, fit.max_residual) == pytest.approx((1.0, 1 / 128, 0.0))
    assert step_schedule.extrapolate({256: 3.0, 512: 5.0}, 8192) == pytest.approx((65.0, 0.0))
    # Three points: the line through the two largest; the smallest (w-bound at small N) checks it.
    value, residual = step_schedule.extrapolate({256: 3.0, 512: 5.0, 1024: 10.0}, 2048)
    assert value == pytest.approx(20.0) and residual == pytest.approx((3.0 - 2.5) / 3.0)
    assert step_schedule.extrapolate({512: 7.0}, 512) == (7.0, 0.0)  # at the shape itself: as is


def test_small_token_counts_stay_below_the_shape() -> None:
    assert step_schedule.small_token_counts("materialised", 8192, [256, 512]) == [256, 512]
    assert step_schedule.small_token_counts("materialised", 300, [256, 512]) == [300]
    assert step_schedule.small_token_counts("recompute", 8192) == list(step.DEFAULT_STEP_TOKENS["recompute"])
    # A path looping over token chunks is compiled at one and two chunks (the loop body is the full-size one).
    assert step_schedule.small_token_counts("keep_logits", 8192, chunk=2048) == [2048, 4096]
    assert step_schedule.small_token_counts("keep_logits", 8192, [512, 1024], chunk=2048) == [512, 1024]


def test_the_8nhv_minimum_uses_the_chip_peak() -> None:
    # The figures of shared/notes/tpu-static-schedule.md at llama3-8b.
    assert step_schedule.minimum_ms("v5p", 8192, 4096, 128256) == pytest.approx(75.0, abs=0.05)
    assert step_schedule.minimum_ms("v6e", 8192, 4096, 128256) == pytest.approx(37.5, abs=0.05)
    assert step_schedule.minimum_ms("v5e", 8192, 4096, 128256) == pytest.approx(174.8, abs=0.05)


def _fake_ops(generation: str, path: str, n: int, h: int, v: int,
              loop: tuple[int, int, int] | None = None) -> step.StepOps:
    clock = SCHEDULE_CHIPS[generation].clock_hz
    per_token_ms = 0.01 if path == "materialised" else 0.001
    cycles = (0.5 + per_token_ms * n) * clock / 1e3
    return step.StepOps(n, kernel_cycles=123.0, xla_cycles=cycles, ops=3)


def _fake_kernels(shapes: list[Shape], kernels: tuple[str, ...],
                  loops: list[tuple[int, int, int] | None]) -> list[list[dict[str, Any]]]:
    """20 ms a kernel (per chunk where the path loops: ``repeats`` chunks), per shape."""
    return [[{"kernel": k, "kernel_us": 20_000.0, "hbm_floor_us": 1_000.0, "error": None,
              **({"repeats": -(-shape.n // loop[0])} if loop else {})} for k in kernels]
            for shape, loop in zip(shapes, loops, strict=True)]


def test_records_carry_the_estimate_its_ratios_and_the_baseline() -> None:
    shape = Shape(8192, 4096, 128256, name="llama3-8b")
    records = step_schedule.run_step_schedule("v5p", [shape], ["recompute", "materialised"], [256, 512], quiet=True,
                                              measure_ops=_fake_ops, kernel_schedule=_fake_kernels)
    recompute, materialised = records
    assert (recompute["path"], materialised["path"]) == ("recompute", "materialised")
    for record in records:
        assert record["objective"] == "loss" and record["shape"] == "llama3-8b 8192x4096x128256"
        assert record["extrapolated"] and record["ops_tokens"] == [256, 512]
        assert record["ratio_8nhv"] == pytest.approx(record["est_ms"] / record["minimum_8nhv_ms"])
        assert record["baseline_ms"] == pytest.approx(materialised["est_ms"])
    # recompute: the kernels' fit (2 x 20 ms) plus its XLA ops extrapolated (kernels of the small compiles left out).
    assert recompute["kernels_ms"] == pytest.approx(40.0)
    assert recompute["ops_ms"] == pytest.approx(0.5 + 0.001 * 8192)
    assert recompute["est_ms"] == pytest.approx(40.0 + 0.5 + 0.001 * 8192)
    # materialised: every op of the small compiles, extrapolated linearly.
    assert materialised["kernels_ms"] is None
    kernel_ms = 123.0 / SCHEDULE_CHIPS["v5p"].clock_hz * 1e3
    assert materialised["est_ms"] == pytest.approx(0.5 + 0.01 * 8192 + kernel_ms)
    table = step_schedule.step_table(records, "markdown")
    header, _, *rows = table.splitlines()
    assert "est. / 8NHV" in header and "baseline ms" in header
    assert "256,512 (linear to 8192)" in rows[0]
    json.dumps(records)  # plain JSON


def test_the_kept_step_is_compiled_at_its_full_size_plans_chunks_with_that_loop_pinned() -> None:
    """The keep_logits path's small compiles are whole multiples of the chunk its plan takes at the shape's
    own N, with that chunk and hidden split pinned: v6e, Llama-3 70B's head, 16384 tokens in 2048-token
    chunks (not the default chunk's 2560), where a plan of 4096 tokens left to itself takes one chunk."""
    import jax.numpy as jnp

    from ce_core import StatsSpec
    from ce_pallas_tpu import kept_logits
    from ce_pallas_tpu.target import CHIP_FACTS, Target

    n, h, v = 16384, 8192, 128256
    v6e = Target("v6e", CHIP_FACTS["v6e"].num_cores, None)
    full = kept_logits.plan_chunks(n, h, v, jnp.bfloat16, jnp.bfloat16, StatsSpec(keep_logits=True), v6e)
    assert step.loop_plan("keep_logits", "v6e", n, h, v) == (full.chunk, full.backward.hidden_split, 0)
    assert step.loop_plan("materialised", "v6e", n, h, v) is None
    small = kept_logits.plan_chunks(2 * full.chunk, h, v, jnp.bfloat16, jnp.bfloat16, StatsSpec(keep_logits=True),
                                    v6e)
    assert small.chunk != full.chunk != kept_logits.default_chunk(h, 2, v6e)  # why the loop is pinned
    asked: list[tuple[int, tuple[int, int, int] | None]] = []

    def ops(generation: str, path: str, tokens: int, h_: int, v_: int,
            loop: tuple[int, int, int] | None) -> step.StepOps:
        asked.append((tokens, loop))
        return _fake_ops(generation, path, tokens, h_, v_, loop)

    [record] = step_schedule.run_step_schedule("v6e", [Shape(n, h, v)], ["keep_logits"], quiet=True,
                                               measure_ops=ops, kernel_schedule=_fake_kernels)
    loop = (full.chunk, full.backward.hidden_split, 0)
    assert asked == [(full.chunk, loop), (2 * full.chunk, loop)]
    assert record["loop_chunk"] == full.chunk and record["loop_hidden_tiles"] == full.backward.hidden_split
    assert record["ops_tokens"] == [full.chunk, 2 * full.chunk]
    # The kernels from their grid fit at one chunk, once a chunk (the small compiles' kernels not counted).
    assert record["kernels_ms"] == pytest.approx(2 * 20.0 * full.chunks)
    assert record["ops_ms"] == pytest.approx(0.5 + 0.001 * n)


def test_a_kept_step_whose_backward_runs_in_pieces_is_compiled_with_its_chunk_and_pieces_pinned(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """v6e, Llama-3 8B's head at 4096 tokens: one forward chunk, the backward in pieces of at most 1536 rows
    (``loop_plan`` names the longest); pinned as the child compile pins it, two chunks' tokens take the same
    chunk and pieces."""
    import jax.numpy as jnp

    from ce_core import StatsSpec
    from ce_pallas_tpu import kept_logits
    from ce_pallas_tpu.target import CHIP_FACTS, Target

    assert step.loop_plan("keep_logits", "v6e", 4096, 4096, 128256) == (4096, 1, 1536)
    monkeypatch.setattr(kept_logits, "CHUNK_TOKENS", 4096)
    monkeypatch.setattr(kept_logits, "PIECE_TOKENS", 1536)
    v6e = Target("v6e", CHIP_FACTS["v6e"].num_cores, None)
    pinned = kept_logits.plan_chunks(8192, 4096, 128256, jnp.bfloat16, jnp.bfloat16, StatsSpec(keep_logits=True), v6e)
    assert (pinned.chunk, pinned.chunks, pinned.pieces) == (4096, 2, (1536, 1536, 1024))


def test_a_tied_heads_step_is_built_and_scheduled_in_its_layout(monkeypatch: pytest.MonkeyPatch) -> None:
    """``--w-layout vh`` with ``--step``: the materialised step over ``x @ w.T`` gives the ``[H, V]`` step's loss and
    the transpose of its ``dw``; the kept path's plan is the ``[V, H]`` head's (v6e, Qwen2.5-0.5B's width: ``dw``
    held transposed); the kernels' schedule is asked for that layout; the records and table carry it."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from ce_bench import schedule as kernel_schedule

    rng = np.random.default_rng(5)
    n, h, v = 24, 32, 50
    x = jnp.asarray(rng.standard_normal((n, h)) / np.sqrt(h), jnp.float32)
    w = jnp.asarray(rng.standard_normal((h, v)), jnp.float32)
    labels = jnp.asarray(rng.integers(0, v, n), jnp.int32)
    cpu = jax.sharding.SingleDeviceSharding(jax.devices("cpu")[0])
    by_layout = {}
    for layout, head in (("hv", w), ("vh", w.T)):
        fn, operands = step.step_program("materialised", n, h, v, cpu, "float32", w_layout=layout)
        assert operands[1].shape == head.shape
        by_layout[layout] = fn(x, head, labels)
    (loss_hv, (dx_hv, dw_hv)), (loss_vh, (dx_vh, dw_vh)) = by_layout["hv"], by_layout["vh"]
    np.testing.assert_allclose(loss_vh, loss_hv, rtol=1e-6)
    np.testing.assert_allclose(dx_vh, dx_hv, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(dw_vh, dw_hv.T, rtol=1e-5, atol=1e-7)

    assert step.kept_plan("v6e", 4096, 896, 151936, w_layout="vh").backward.kept_dw_transposed
    assert not step.kept_plan("v6e", 4096, 896, 151936).backward.kept_dw_transposed
    asked: list[str] = []
    monkeypatch.setattr(kernel_schedule, "run_kept_schedule",
                        lambda *args, w_layout="hv", **kwargs: asked.append(w_layout) or [])
    step_schedule._kernel_schedule("v6e", "bfloat16", True, "vh")([Shape(4096, 896, 151936)], ("forward",),
                                                                  [(4096, 1, 0)])
    assert asked == ["vh"]
    records = step_schedule.run_step_schedule("v6e", [Shape(4096, 896, 151936)], ["keep_logits", "materialised"],
                                              [1024, 2048], w_layout="vh", quiet=True, measure_ops=_fake_ops,
                                              kernel_schedule=_fake_kernels)
    assert [r["w_layout"] for r in records] == ["vh", "vh"]
    assert records[0]["baseline_ms"] == pytest.approx(records[1]["est_ms"])
    assert all("[V, H]" in row for row in step_schedule.step_table(records, "markdown").splitlines()[2:4])


def test_the_materialised_rl_step_is_the_fused_objectives_step() -> None:
    """The RL baseline (``materialised_rl``) computes what ``linear_token_objective`` with
    ``PolicyLoss(entropy_coefficient=0.01)`` computes on the same on-policy inputs (old log-probs the current ones,
    advantages +-1 by label parity, the token mean): its value and both gradients, in both layouts, against the
    fused objective on the xla backend, and its entropy bonus moves them (the baseline is not the plain loss)."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    import ce_core
    from ce_core.policy import PolicyInputs, PolicyLoss

    rng = np.random.default_rng(11)
    n, h, v = 24, 32, 50
    x = jnp.asarray(rng.standard_normal((n, h)) / np.sqrt(h), jnp.float32)
    w = jnp.asarray(rng.standard_normal((h, v)), jnp.float32)
    labels = jnp.asarray(rng.integers(0, v, n), jnp.int32)
    cpu = jax.sharding.SingleDeviceSharding(jax.devices("cpu")[0])

    def fused(x, w, coefficient=step.RL_ENTROPY_COEFFICIENT):
        logp = jax.lax.stop_gradient(ce_core.linear_log_probs(x, labels, w, implementation="reference"))
        inputs = PolicyInputs(old_logp=logp, advantages=jnp.where(labels % 2 == 0, 1.0, -1.0),
                              weights=jnp.full((n,), 1.0 / n))
        return ce_core.linear_token_objective(x, labels, w, PolicyLoss(entropy_coefficient=coefficient), inputs,
                                              implementation="xla")

    want_loss, (want_dx, want_dw) = jax.value_and_grad(fused, argnums=(0, 1))(x, w)
    for layout, head in (("hv", w), ("vh", w.T)):
        fn, _ = step.step_program("materialised_rl", n, h, v, cpu, "float32", w_layout=layout)
        loss, (dx, dw) = fn(x, head, labels)
        np.testing.assert_allclose(loss, want_loss, rtol=1e-5)
        np.testing.assert_allclose(dx, want_dx, rtol=1e-4, atol=1e-7)
        np.testing.assert_allclose(dw if layout == "hv" else dw.T, want_dw, rtol=1e-4, atol=1e-7)
    plain_dw = jax.grad(lambda w: fused(x, w, 0.0))(w)
    assert float(jnp.max(jnp.abs(plain_dw - want_dw))) > 1e-3 * float(jnp.max(jnp.abs(want_dw)))


def test_a_path_that_does_not_exist_yet_is_skipped_not_failed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(step, "path_unavailable",
                        lambda path: "ce_core.linear_cross_entropy has no keep_logits option yet"
                        if path == "keep_logits" else None)
    records = step_schedule.run_step_schedule("v6e", [Shape(4096, 1024, 32768)], ["keep_logits", "materialised"],
                                              quiet=True, measure_ops=_fake_ops, kernel_schedule=_fake_kernels)
    assert records[0]["skipped"] and records[0]["error"] is None and records[0]["est_ms"] is None
    assert records[0]["baseline_ms"] == pytest.approx(records[1]["est_ms"])
    row = step_schedule.step_table(records, "markdown").splitlines()[2]
    assert "skipped[1]" in row


def test_the_step_flags() -> None:
    parser = schedule_command.schedule_parser()
    args = parser.parse_args(["--target", "v5p", "--step", "value_and_grad", "--paths", "recompute,keep_logits",
                              "--step-tokens", "256,512"])
    assert schedule_command.parse_step_args(parser, args) == (["recompute", "keep_logits"], [256, 512])
    args = parser.parse_args(["--target", "v5p", "--step", "value_and_grad"])
    assert schedule_command.parse_step_args(parser, args) == (list(step_schedule.DEFAULT_STEP_PATHS), None)
    args = parser.parse_args(["--target", "v6e", "--step", "value_and_grad", "--w-layout", "vh"])  # a tied head's step
    assert schedule_command.parse_step_args(parser, args) == (list(step_schedule.DEFAULT_STEP_PATHS), None)
    for bad in (["--paths", "bogus"], ["--step-tokens", "256"], ["--objective", "rl"], ["--argmax"]):
        with pytest.raises(SystemExit):
            cli.main(["schedule", "--target", "v5p", "--step", "value_and_grad", *bad])
    with pytest.raises(SystemExit):
        cli.main(["schedule", "--target", "v5p", "--step", "grad"])


@pytest.mark.slow
@pytest.mark.rotating(shares=2)  # one layout a CI run, the other the next (conftest.rotate)
@pytest.mark.parametrize("layout", ["hv", "vh"])
def test_the_step_compiles_and_sums_for_v5p(tmp_path: Path, layout: str) -> None:
    """A tiny step for v5p, both paths, an ``[H, V]`` head or a tied ``[V, H]`` one: every figure comes out, above
    the 8NHV minimum's order."""
    json_path = tmp_path / "step.json"
    code = cli.main(["schedule", "--target", "v5p", "--step", "value_and_grad", "--shapes", "512x256x2048",
                     "--paths", "recompute,materialised", "--step-tokens", "128,256", "--w-layout", layout,
                     "--json", str(json_path), "--quiet"])
    assert code == 0
    records = json.loads(json_path.read_text())
    assert [r["path"] for r in records] == ["recompute", "materialised"]
    for record in records:
        assert record["error"] is None and record["w_layout"] == layout, record
        assert record["est_ms"] > 0 and record["ratio_8nhv"] > 0.5
        assert record["baseline_ms"] == records[1]["est_ms"]
    assert records[0]["kernels_ms"] > 0


@pytest.mark.slow
def test_each_op_of_a_compiled_step_has_its_profile_and_the_price_it_would_have_without_one() -> None:
    """``step.measure_ops`` (what ``tools/kept_matrix.py scale-op`` prices an op from): the materialised step for
    v5p at a tiny shape. Its matmul fusions are profiled, in the same cycles as the price charged without a profile
    (at least their flops at the MXU peak, within 5x of it); every op is priced at least its HBM bytes."""
    ops = step.measure_ops("v5p", "materialised", 512, 256, 2048)
    matmuls = [op for op in ops.values() if op.flops]
    assert len(matmuls) >= 2, ops  # the logits and the two gradients, fused or not
    chip = SCHEDULE_CHIPS["v5p"]
    for op in matmuls:
        assert op.profiled is not None, op
        peak = op.flops / chip.bf16_flops * chip.clock_hz  # one core: the price allows XLA's split over two
        assert peak / 2 <= op.unprofiled and 0.9 * peak / 2 <= op.profiled <= 5 * max(op.unprofiled, peak), op
    assert all(op.unprofiled > 0 for op in ops.values())
