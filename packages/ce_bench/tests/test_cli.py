"""The ``ce-bench`` command end to end on tiny shapes: JSON fields, PNG, refusals, failing rows."""

from __future__ import annotations

import io
import json
import sys
from collections.abc import Iterator
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import ce_core
import ce_reference
from ce_bench import cli, runner
from ce_bench.presets import Shape

REQUIRED_FIELDS = {"backend", "n", "h", "v", "dtype", "fwd_ms", "fwd_bwd_ms", "tokens_per_s", "temp_bytes",
                   "max_rel_err", "floor_ratio"}
TINY = "64x32x512"


def _ours() -> str:
    return ",".join(name for name in ("reference", "xla") if name in ce_core.available_backends())


def test_cli_runs_a_tiny_shape_and_writes_json_and_png(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    json_path, png_path = tmp_path / "out" / "bench.json", tmp_path / "out" / "bench.png"
    code = cli.main(["--shapes", TINY, "--backends", _ours(), "--repeats", "2", "--json", str(json_path),
                     "--plot", str(png_path), "--no-progress"])
    assert code == 0
    printed = capsys.readouterr().out
    assert "fwd+bwd ms" in printed and "matmul floor" in printed

    records = json.loads(json_path.read_text())
    assert isinstance(records, list) and records
    backends = [record for record in records if record["kind"] == "backend"]
    assert [record["backend"] for record in backends] == _ours().split(",")
    for record in backends:
        assert REQUIRED_FIELDS <= set(record)
        assert record["status"] == "ok", record
        assert (record["n"], record["h"], record["v"], record["dtype"]) == (64, 32, 512, "float32")
        assert record["fwd_ms"] > 0 and record["fwd_bwd_ms"] > 0 and record["tokens_per_s"] > 0
        assert record["floor_ratio"] > 0 and record["temp_bytes"] is not None
        assert record["max_rel_err"] < 1e-4, record
    png = png_path.read_bytes()
    assert len(png) > 1000 and png.startswith(b"\x89PNG\r\n\x1a\n")


def test_default_output_directory(tmp_path: Path) -> None:
    code = cli.main(["--shapes", "32x16x256", "--backends", "reference", "--repeats", "1", "--out",
                     str(tmp_path / "bench-out"), "--no-progress", "--no-floor"])
    assert code == 0
    assert (tmp_path / "bench-out" / "ce-bench.json").stat().st_size > 0
    assert (tmp_path / "bench-out" / "ce-bench.png").stat().st_size > 0


def test_oversized_shape_is_refused_up_front_with_the_memory_it_needs(tmp_path: Path) -> None:
    json_path = tmp_path / "refused.json"
    # 1M tokens x 8192 x 262144 in float32: w alone is 8 GiB, the inputs and gradients ~96 GiB.
    code = cli.main(["--shapes", "1048576x8192x262144", "--backends", "reference", "--json", str(json_path),
                     "--no-progress", "--memory-budget", "16"])
    assert code == 0
    (record, floor) = json.loads(json_path.read_text())
    assert record["status"] == "refused" and floor["status"] == "refused"
    assert "GiB" in record["reason"] and "budget 16.00 GiB" in record["reason"]
    assert record["fwd_ms"] is None


def test_compiled_footprint_refusal_names_the_temporaries_and_compile_only_lifts_it() -> None:
    shape = Shape(2048, 64, 16384)  # inputs ~4.5 MiB; reference logits [N, V] f32 = 128 MiB
    config = runner.RunConfig(shapes=[shape], dtypes=[jnp.float32], names=["reference"], repeats=1,
                              memory_budget_bytes=64 * 2**20, measure_floor=False)
    (record,) = runner.run(config, progress=False)
    assert record.status == "refused" and record.reason is not None, record
    assert "temporaries" in record.reason and "compile-only" in record.reason
    assert record.temp_bytes is not None and record.temp_bytes >= 2048 * 16384 * 4

    config.compile_only = True
    (record,) = runner.run(config, progress=False)
    assert record.status == "compiled" and record.reason is None
    assert record.temp_bytes is not None and record.temp_bytes >= 2048 * 16384 * 4 and record.fwd_ms is None


class _Broken(ce_core.Backend):
    name = "bench_test_broken"
    contract_version = ce_core.CONTRACT_VERSION

    def row_stats(self, x, w, labels, spec, *, row_scale=None, live=None):
        raise RuntimeError("broken at trace time")


class _Declines(ce_core.Backend):
    name = "bench_test_declines"
    contract_version = ce_core.CONTRACT_VERSION

    def check(self, problem):
        raise ce_core.UnsupportedError(f"bench_test_declines cannot do V={problem.v}")

    def row_stats(self, x, w, labels, spec, *, row_scale=None, live=None):  # pragma: no cover - never reached
        raise AssertionError


class _FailsAtRunTime(ce_core.Backend):
    name = "bench_test_runtime"
    contract_version = ce_core.CONTRACT_VERSION

    def row_stats(self, x, w, labels, spec, *, row_scale=None, live=None):
        def explode(value):
            raise ValueError("exploded while running")

        stats = ce_reference.row_stats(x, w, labels, spec)
        probe = jax.pure_callback(explode, jax.ShapeDtypeStruct((x.shape[0],), jnp.float32),
                                  jax.lax.stop_gradient(x[:, 0]).astype(jnp.float32))
        return stats._replace(lse=stats.lse + 0.0 * probe)


@pytest.fixture
def broken_backends() -> Iterator[list[str]]:
    classes = (_Broken, _Declines, _FailsAtRunTime)
    for cls in classes:
        ce_core.register_backend(cls.name, cls, replace=True)
    yield [cls.name for cls in classes]
    for cls in classes:
        ce_core.unregister_backend(cls.name)


def test_failing_backends_get_rows_with_the_reason_and_the_run_goes_on(broken_backends: list[str]) -> None:
    names = [*broken_backends, "no_such_backend", "reference"]
    config = runner.RunConfig(shapes=[Shape(32, 16, 256)], dtypes=[jnp.float32], names=names, repeats=1,
                              measure_floor=False)
    records = {record.backend: record for record in runner.run(config, progress=False)}
    assert set(records) == set(names)
    reasons = {name: record.reason or "" for name, record in records.items()}
    assert records["bench_test_broken"].status == "failed"
    assert "broken at trace time" in reasons["bench_test_broken"]
    assert records["bench_test_declines"].status == "unsupported"
    assert "cannot do V=256" in reasons["bench_test_declines"]
    assert records["bench_test_runtime"].status == "failed"
    assert "exploded while running" in reasons["bench_test_runtime"]
    assert records["no_such_backend"].status == "failed" and "unknown backend" in reasons["no_such_backend"]
    assert records["reference"].status == "ok" and (records["reference"].fwd_bwd_ms or 0) > 0


def test_error_is_not_measured_above_the_oracle_limit() -> None:
    config = runner.RunConfig(shapes=[Shape(32, 16, 256)], dtypes=[jnp.float32], names=["reference"], repeats=1,
                              measure_floor=False, oracle_max_elements=1000)
    (record,) = runner.run(config, progress=False)
    assert record.status == "ok" and record.max_rel_err is None and record.err_note is not None
    assert "not measured" in record.err_note and "8,192" in record.err_note


def test_bfloat16_and_sum_reduction() -> None:
    config = runner.RunConfig(shapes=[Shape(64, 32, 512)], dtypes=[jnp.bfloat16], names=["reference"], repeats=1,
                              reduction="sum")
    (record, floor) = runner.run(config, progress=False)
    assert record.status == "ok" and record.dtype == "bfloat16" and record.reduction == "sum"
    assert record.max_rel_err is not None and record.max_rel_err < 2e-2
    assert floor.kind == "floor" and floor.fwd_bwd_ms is not None and floor.fwd_bwd_ms > 0


def test_list_and_sharding_subcommands(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["list"]) == 0
    listed = capsys.readouterr().out
    assert "llama3-8b" in listed and "128256" in listed and "reference" in listed

    json_path = tmp_path / "sharding.json"
    assert cli.main(["sharding", "--backends", "reference", "--shapes", "64x32x512", "--meshes", "1x1,2x2",
                     "--calls", "wrapper,explicit,auto", "--time", "1", "--json", str(json_path)]) == 0
    records = json.loads(json_path.read_text())
    expected = [(mesh, call) for mesh in ("1x1", "2x2") for call in ("wrapper", "explicit", "auto")]
    assert [(r["mesh"], r["call"]) for r in records] == expected
    assert all(r["status"] == "ok" and r["fwd_bwd_ms"] > 0 for r in records), records
    sharded = [r["temp_bytes"] for r in records if r["mesh"] == "2x2"]
    assert max(sharded) < min(r["temp_bytes"] for r in records if r["mesh"] == "1x1")  # each call splits the work
    assert "per-device temp" in capsys.readouterr().out


def test_report_subcommand_rerenders_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    json_path = tmp_path / "run.json"
    assert cli.main(["--shapes", "32x16x256", "--backends", "reference", "--repeats", "1", "--json", str(json_path),
                     "--no-files", "--no-progress"]) == 0
    capsys.readouterr()
    assert cli.main(["report", str(json_path), "--format", "markdown", "--plot", str(tmp_path / "again.png")]) == 0
    out = capsys.readouterr().out
    assert out.startswith("| backend |") and "| reference |" in out
    assert (tmp_path / "again.png").stat().st_size > 1000


@pytest.mark.slow  # three bench runs (11 s): the slow tier since 2026-12-03
@pytest.mark.parametrize(("objective", "tokamax_reason"),
                         [("rl", "log-probability"), ("distill", "distillation"), ("distill_dense", "distillation")])
def test_rl_and_distill_objectives_run_and_match_their_oracles(tmp_path: Path, objective: str,
                                                               tokamax_reason: str) -> None:
    json_path = tmp_path / f"{objective}.json"
    assert cli.main(["--shapes", "64x32x512", "--backends", "reference,xla,tokamax:xla", "--objective", objective,
                     "--repeats", "1", "--json", str(json_path), "--no-files", "--no-progress"]) == 0
    records = {r["backend"]: r for r in json.loads(json_path.read_text())}
    for name in ("reference", "xla"):
        assert records[name]["status"] == "ok" and records[name]["reduction"] == objective
        assert records[name]["max_rel_err"] < 1e-5, records[name]
    assert records["tokamax:xla"]["status"] == "unsupported"
    assert tokamax_reason in records["tokamax:xla"]["reason"]


def test_the_bench_teacher_is_valid_and_the_same_from_numpy_and_jax() -> None:
    from ce_bench.objectives import DISTILL_K, synthetic_teacher

    labels = np.array([[3, -100, 511], [0, 7, 256]])
    ids, log_probs = synthetic_teacher(labels, 512)
    jax_ids, jax_log_probs = synthetic_teacher(jnp.asarray(labels), 512)
    assert ids.shape == log_probs.shape == (2, 3, DISTILL_K) and ids.dtype == np.int32
    assert ((ids >= 0) & (ids < 512)).all() and (ids[..., 0] == np.where(labels < 0, 0, labels)).all()
    assert np.array_equal(ids, np.asarray(jax_ids)) and np.allclose(log_probs, np.asarray(jax_log_probs))
    assert np.allclose(np.exp(log_probs).sum(-1), 0.9, rtol=1e-5)


@pytest.mark.slow
def test_sharding_on_a_tpu_topology_compiles_without_a_tpu(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CE_PALLAS_TPU_INTERPRET", raising=False)
    monkeypatch.setenv("CE_PALLAS_TPU_TARGET", "v5p")  # the subcommand sets it from the topology too
    json_path = tmp_path / "topology.json"
    assert cli.main(["sharding", "--topology", "v5p:2x2x1", "--backends", "pallas_tpu,xla", "--shapes", "256x256x1024",
                     "--meshes", "2x2", "--calls", "explicit,auto", "--json", str(json_path)]) == 0
    records = {(r["backend"], r["call"]): r for r in json.loads(json_path.read_text())}
    assert all(r["device"] == "v5p:2x2x1" for r in records.values())
    for backend in ("pallas_tpu", "xla"):
        explicit, auto = records[backend, "explicit"], records[backend, "auto"]
        assert explicit["status"] == "compiled" and explicit["temp_bytes"] > 0, explicit
        assert explicit["note"] == "all-gathers: none", explicit
        # Auto axes run shard_map over the default layout (tokens over every axis, w whole): on a
        # 2x2 mesh with w split on V that compiles for TPU and gathers w once, nothing else.
        assert auto["status"] == "compiled" and auto["temp_bytes"] > 0, auto
        assert auto["note"] == "all-gathers: 256x1024", auto


# --- the command line's contract: help, usage errors, exit statuses, progress bar ---------------

SUBCOMMAND_NAMES = ("run", "aot", "schedule", "tune", "tied", "sharding", "report", "list")


def test_help_lists_every_subcommand_with_a_description(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    listed = {line.split()[0]: line for line in out.split("subcommands", 1)[1].splitlines()[1:] if line.strip()}
    assert set(listed) == set(SUBCOMMAND_NAMES), listed
    for name, line in listed.items():
        assert len(line.split()) > 3, f"{name} has no description: {line!r}"
    for name in SUBCOMMAND_NAMES:  # and each one listed answers its own --help
        with pytest.raises(SystemExit) as exit_info:
            cli.main([name, "--help"])
        assert exit_info.value.code == 0
        usage = capsys.readouterr().out
        assert usage.startswith("usage: ce-bench" + ("" if name == "run" else f" {name}")), usage[:80]


USAGE_ERRORS = [
    (["--tokens", "-3"], ["--tokens", "positive integer", "'-3'"]),
    (["--memory-budget", "-1"], ["--memory-budget", "positive number of GiB", "'-1'"]),
    (["--memory-budget", "inf"], ["--memory-budget", "'inf'"]),
    (["--repeats", "0"], ["--repeats", "positive integer", "'0'"]),
    (["--warmup", "0"], ["--warmup", "positive integer"]),
    (["--seed", "-1"], ["--seed", ">= 0"]),
    (["--oracle-max-elements", "many"], ["--oracle-max-elements", "'many'"]),
    (["--shapes", "12x3"], ["--shapes", "malformed shape '12x3'", "NxHxV"]),
    (["--shapes", "small,nope"], ["--shapes", "unknown shape 'nope'"]),
    (["--dtype", "float7"], ["--dtype", "unknown dtype 'float7'"]),
    (["--backends", "reference,no_such_backend"], ["--backends", "unknown backend 'no_such_backend'", "reference"]),
    (["run", "--tokens", "0"], ["--tokens", "positive integer"]),
    (["aot", "--target", "v5p", "--tokens", "0"], ["--tokens", "positive integer"]),
    (["aot", "--target", "v5p", "--backends", "xla,tokamax:nope"], ["--backends", "'tokamax:nope'"]),
    (["schedule", "--target", "v5p", "--shapes", "12x3"], ["--shapes", "malformed shape '12x3'"]),
    (["tune", "--target", "v4"], ["--target", "invalid choice: 'v4'"]),
    (["tune", "--target", "v5e", "--buckets", "llama3,nope"], ["unknown bucket(s) nope", "huge_batch"]),
    (["tune", "--target", "v5e", "--candidates", "0"], ["--candidates", "positive integer"]),
    (["tune", "--target", "v5e", "--kernels", "sideways"], ["--kernels", "'sideways'"]),
    (["tune", "--target", "v5e", "--shape", "512x256x2048", "--write"], ["--write", "leave out --shape"]),
    (["tune", "--target", "v5e", "--shape", "12x3"], ["malformed shape '12x3'"]),
    (["tune", "--target", "v5e", "--shapes", "512x256x2048", "--write"], ["--shapes", "leave out --write"]),
    (["tune", "--target", "v5e", "--shapes", "512x256"], ["malformed shape '512x256'"]),
    (["tune", "--target", "v5e", "--shapes", "512x256x2048", "--dtype", "int3"], ["unknown dtype 'int3'"]),
    (["tune", "--target", "v5e", "--objective", "rl"], ["--objective", "go with --shapes"]),
    (["sharding", "--meshes", "2x"], ["--meshes", "DATAxVOCAB"]),
    (["sharding", "--time", "-1"], ["--time", ">= 0"]),
    (["sharding", "--backends", "no_such_backend"], ["--backends", "unknown backend 'no_such_backend'"]),
    (["frobnicate"], ["unknown subcommand 'frobnicate'", "sharding"]),
    (["list", "--shapes", "small"], ["unrecognized arguments"]),
]


@pytest.mark.parametrize("argv,expected", USAGE_ERRORS, ids=[" ".join(argv) for argv, _ in USAGE_ERRORS])
def test_bad_arguments_are_usage_errors_that_name_the_flag(argv: list[str], expected: list[str],
                                                           capsys: pytest.CaptureFixture[str],
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")  # `ce-bench aot` sets it; undone after the test
    with pytest.raises(SystemExit) as exit_info:
        cli.main(argv)
    assert exit_info.value.code == 2
    captured = capsys.readouterr()
    assert "Traceback" not in captured.err and captured.err.startswith("usage: ce-bench"), captured.err
    message = captured.err.splitlines()[-1]
    for fragment in expected:
        assert fragment in message, (fragment, message)


def test_exit_status_is_1_only_when_every_backend_row_fails(broken_backends: list[str],
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    options = ["--shapes", "32x16x256", "--repeats", "1", "--no-floor", "--no-files", "--no-progress"]
    assert cli.main([*options, "--backends", "bench_test_broken,bench_test_declines"]) == 1
    captured = capsys.readouterr()
    assert "broken at trace time" in captured.out and "cannot do V=256" in captured.out  # the table says why
    assert "every backend failed or was unsupported" in captured.err
    assert cli.main([*options, "--backends", "bench_test_broken,reference"]) == 0
    assert "every backend" not in capsys.readouterr().err


def test_the_progress_bar_is_drawn_only_on_a_terminal(monkeypatch: pytest.MonkeyPatch) -> None:
    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    for stream, drawn in ((Terminal(), True), (io.StringIO(), False)):
        monkeypatch.setattr(sys, "stderr", stream)
        bar = runner.Progress(True, "progress-test")
        bar.add(2)
        bar.step("first")
        bar.close()
        assert ("progress-test" in stream.getvalue()) == drawn, stream.getvalue()
    terminal = Terminal()
    monkeypatch.setattr(sys, "stderr", terminal)
    bar = runner.Progress(False, "progress-test")
    bar.add(1)
    bar.close()
    assert terminal.getvalue() == ""  # --no-progress: nothing even on a terminal


def test_a_run_with_stderr_redirected_draws_no_bar(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["--shapes", "32x16x256", "--backends", "reference", "--repeats", "1", "--no-floor",
                     "--no-files"]) == 0  # no --no-progress: stderr (captured) is not a terminal
    err = capsys.readouterr().err
    assert "\r" not in err and "step/s" not in err and "ce-bench:" not in err, err


def test_report_of_an_unreadable_file_is_a_usage_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    not_a_list, not_json = tmp_path / "object.json", tmp_path / "garbage.json"
    not_a_list.write_text('{"backend": "xla"}')
    not_json.write_text("not json")
    for path, fragment in ((tmp_path / "missing.json", "No such file"), (not_a_list, "not a JSON list"),
                           (not_json, "Expecting value")):
        with pytest.raises(SystemExit) as exit_info:
            cli.main(["report", str(path)])
        assert exit_info.value.code == 2
        err = capsys.readouterr().err
        assert "Traceback" not in err and f"cannot read records from {path}" in err and fragment in err, err


def test_ce_bench_prints_no_libtpu_complaints_on_a_machine_without_tpu() -> None:
    """libtpu (installed to compile for TPU topologies) is loaded by JAX's platform discovery; off a
    TPU VM it would print "Failed to find host bounds" and an E0000 line in every run."""
    import os
    import subprocess
    import sys

    from ce_core.extend import host_has_tpu

    assert not host_has_tpu()  # this suite runs on machines without a TPU
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TPU_", "JAX_PLATFORMS"))}
    env["ALLOW_MULTIPLE_LIBTPU_LOAD"] = "1"
    script = "import sys; from ce_bench.cli import main; sys.exit(main(['list']))"
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300,
                            check=True)
    assert "reference" in result.stdout
    assert "host bounds" not in result.stderr and "E0000" not in result.stderr, result.stderr
