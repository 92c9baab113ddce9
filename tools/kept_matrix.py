"""The kept-logits kernels across the model-head matrix, from libtpu's static schedule (no TPU needed).

    uv run python tools/kept_matrix.py kernels GEN [--heads a,b] [--skip-recompute | --only-recompute] [--tokens 4096]
        [--kept-backward-only] [--objective rl]
    uv run python tools/kept_matrix.py materialised GEN --heads a,b --v-small 8192 --tokens 2048,4096 [--objective rl]
    uv run python tools/kept_matrix.py scale-op GEN --head H --tokens N --v-small V --op OP --from-v V0
        --via-tokens N0 [--objective rl]
    uv run python tools/kept_matrix.py table [--save]

``kernels``: per head of ``ce_bench.presets.MODEL_HEADS`` (tied heads in their ``[V, H]`` layout), the
chunk ``kept_logits.plan_chunks`` picks at N = 4096 and 16384, the kept forward and backward kernels at one
chunk (``schedule.Job(kernel, chunk, h, v, keep_logits=True)``) and the recompute kernels at full N, all in
one ``schedule.measure`` call per generation. ``materialised``: ``step.measure_step_ops(gen, "materialised",
n, h, v_small)`` (the whole value_and_grad step of the materialised baseline) at two token counts above the
roofline ridge and a reduced vocabulary, to be scaled linearly to the full V. ``scale-op``: an op of such a point
that the profiler could not walk, priced from its profiles at smaller points (:func:`cmd_scale_op`). ``table``:
the figures.
``--objective rl``: the fused RL objective with an entropy bonus instead of the plain loss: its kernels take the
entropy's statistic (``StatsSpec(with_expected=True)``, as ``linear_token_objective`` with
``PolicyLoss(entropy_coefficient=...)`` asks), and its baseline is ``step.py``'s ``materialised_rl`` step. (A policy
loss without the entropy bonus runs the plain loss's kernels: its cotangents are per-row values too.)
Raw records go to docs/notes/data/kept-logits-matrix.json (each command updates its own part).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import math
import sys
import time
from pathlib import Path

DATA = Path(__file__).resolve().parents[1] / "docs/notes/data/kept-logits-matrix.json"
TOKENS = (4096, 16384)
#: Heads tied to the input embedding: measured in the layout their models store them in (``[V, H]``).
TIED = {"qwen2.5-0.5b", "qwen2.5-1.5b", "qwen3-0.6b", "gemma2-2b", "gemma2-9b"}
GENERATIONS = ("v5e", "v5p", "v6e")
#: The objectives measured: the plain mean loss, and the RL objective with an entropy bonus (the entropy statistic).
OBJECTIVES = ("loss", "rl")
#: The materialised baseline's step of each objective (``ce_pallas_tpu.tooling.schedule.step.LOSSES``).
BASELINE_PATHS = {"loss": "materialised", "rl": "materialised_rl"}


def objective_of(record: dict) -> str:
    """A plan's or materialised point's objective (records before the RL objective was measured: the loss)."""
    return record.get("objective", "loss")


def plan_key(name: str, n: int, objective: str) -> str:
    return f"{name}@{n}" if objective == "loss" else f"{name}@{n}:{objective}"


def heads(selected: str | None) -> list[tuple[str, int, int]]:
    from ce_bench.presets import MODEL_HEADS

    names = None if not selected else selected.split(",")
    return [head for head in MODEL_HEADS if names is None or head[0] in names]


def layout(name: str) -> str:
    return "vh" if name in TIED else "hv"


def kept_plan(gen: str, n: int, h: int, v: int, w_layout: str, objective: str = "loss"):
    import jax.numpy as jnp

    from ce_core import StatsSpec
    from ce_pallas_tpu import kept_logits
    from ce_pallas_tpu.target import CHIP_FACTS, Target

    target = Target(gen, CHIP_FACTS[gen].num_cores, None)
    # The plain mean loss, as the schedule worker builds it; the RL objective with the entropy's statistic.
    spec = StatsSpec(w_layout=w_layout, keep_logits=True, with_expected=objective == "rl")
    return kept_logits.plan_chunks(n, h, v, jnp.bfloat16, jnp.bfloat16, spec, target=target)


def load() -> dict:
    return json.loads(DATA.read_text()) if DATA.exists() else {}


def save(data: dict) -> None:
    DATA.parent.mkdir(parents=True, exist_ok=True)
    DATA.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")


def environment() -> dict:
    import importlib.metadata as md
    import platform

    versions = {name: md.version(name) for name in ("jax", "jaxlib", "libtpu", "optax") if _has(name, md)}
    return {"machine": platform.machine(), "node": platform.node(), "python": platform.python_version(), **versions}


def _has(name: str, md) -> bool:
    try:
        md.version(name)
        return True
    except md.PackageNotFoundError:
        return False


def commit() -> str:
    import subprocess

    root = DATA.parents[3]
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True).stdout
    dirty = subprocess.run(["git", "status", "--porcelain", "--", "packages/ce_pallas_tpu/src"], cwd=root,
                           capture_output=True, text=True).stdout
    return head.strip() + ("+dirty-src" if dirty.strip() else "")


def cmd_kernels(args: argparse.Namespace) -> None:
    from ce_pallas_tpu.tooling import schedule

    gen, objective = args.gen, args.objective
    rl = objective == "rl"
    jobs, kept_jobs, plans = [], [], {}
    tokens = TOKENS if args.tokens is None else tuple(int(t) for t in args.tokens.split(","))
    for name, h, v in heads(args.heads):
        lay = layout(name)
        for n in tokens:
            plan = kept_plan(gen, n, h, v, lay, objective)
            key = plan_key(name, n, objective)
            plans[key] = {"head": name, "n": n, "h": h, "v": v, "w_layout": lay, "objective": objective,
                          "chunk": plan.chunk,
                                    "chunks": plan.chunks, "extra_bytes": plan.extra_bytes,
                                    "logits_shape": list(plan.logits_shape),
                                    "running_dw_shape": list(plan.running_dw_shape),
                                    "forward_tiles": [plan.forward.block_b, plan.forward.block_h, plan.forward.block_v],
                                    "backward_tiles": [plan.backward.block_b, plan.backward.block_h,
                                                       plan.backward.block_v],
                                    "backward_cores": plan.backward.num_cores,
                                    "backward_hp": plan.backward.hp,
                                    "backward_x_transposed": plan.backward.x_transposed,
                                    "backward_label_rows": plan.backward.label_rows,
                                    "pieces": list(plan.pieces)}
            # The forward once a chunk, the backward once a piece of each chunk in its call's role (the float32 dw
            # started, added onto, ended differently), and the middle role of each piece's rows: a stand-in for the
            # cycles of a role whose profile reads below its MXU minimum (the last's, on v6e).
            calls = schedule.kept_jobs(plan, w_layout=lay)
            plans[key]["calls"] = [[job.kernel, job.n, job.chunk_role, count] for job, count in calls]
            kept = [job for job, _ in calls]
            kept += [dataclasses.replace(job, chunk_role="middle") for job in kept
                     if job.kernel == "backward" and job.chunk_role != "middle"]
            if not args.only_recompute:
                kept_jobs += [job for job in dict.fromkeys(kept) if job not in kept_jobs]
    # --kept-backward-only: the kept forwards' records stand (a change to the backward alone) and stay current; a
    # forward without a record of its job (an older plan's tiles, say) is measured.
    recorded = {json.dumps(old["job"], sort_keys=True) for old in load().get("kernels", {}).get(gen, [])}
    jobs += [job for job in kept_jobs if not (args.kept_backward_only and job.kernel == "forward"
                                              and json.dumps(dataclasses.asdict(job), sort_keys=True) in recorded)]
    if not args.skip_recompute:
        for name, h, v in heads(args.heads):
            jobs += [schedule.Job(k, n, h, v, w_layout=layout(name), with_expected=rl) for n in tokens
                     for k in ("forward", "backward")]
    start = time.time()
    records = schedule.measure(gen, jobs)
    data = load()
    data.setdefault("environment", environment())
    kernels = data.setdefault("kernels", {}).setdefault(gen, [])
    if not args.only_recompute and set(tokens) == set(TOKENS):  # earlier plans' kept records (other chunks): stale
        # As JSON: a job's tiles are a tuple here and a list in the records (compared raw, a forward that
        # --kept-backward-only kept was dropped as stale).
        current = {json.dumps(dataclasses.asdict(job), sort_keys=True) for job in jobs + kept_jobs}
        measured = {(h, v) for _, h, v in heads(args.heads)}
        kernels[:] = [old for old in kernels if not old["job"]["keep_logits"]
                      or old["job"].get("with_expected", False) != rl  # the other objective's
                      or json.dumps(old["job"], sort_keys=True) in current
                      or (old["job"]["h"], old["job"]["v"]) not in measured]
    for job, record in zip(jobs, records, strict=True):
        entry = {"job": dataclasses.asdict(job), **record.to_json()}
        key = json.dumps(entry["job"], sort_keys=True)  # as JSON: tiles are a tuple here, a list in the records
        kernels[:] = [old for old in kernels if json.dumps(old["job"], sort_keys=True) != key] + [entry]
    data.setdefault("plans", {}).setdefault(gen, {}).update(plans)
    data.setdefault("runs", []).append({"command": " ".join(sys.argv), "gen": gen, "objective": objective,
                                        "jobs": len(jobs),
                                        "wall_s": round(time.time() - start, 1), "commit": commit(),
                                        "utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())})
    save(data)


def cmd_materialised(args: argparse.Namespace) -> None:
    from ce_pallas_tpu.tooling.schedule import step

    path, objective = BASELINE_PATHS[args.objective], args.objective
    for name, h, v in heads(args.heads):
        for n in (int(t) for t in args.tokens.split(",")):
            start = time.time()
            point = {"head": name, "n": n, "h": h, "v_small": args.v_small, "v_full": v}
            if objective != "loss":
                point["objective"] = objective
            try:
                ops = step.measure_step_ops(args.gen, path, n, h, args.v_small)
                entry = {**point, **dataclasses.asdict(ops), "wall_s": round(time.time() - start, 1)}
            except Exception as error:  # recorded, the next one goes on
                entry = {**point, "error": f"{type(error).__name__}: {str(error)[:300]}",
                         "wall_s": round(time.time() - start, 1)}
            same = (name, n, args.v_small, objective)
            data = load()  # afresh for each point: a kernels run may have saved its records meanwhile
            data.setdefault("environment", environment())
            out = data.setdefault("materialised", {}).setdefault(args.gen, [])
            out[:] = [o for o in out if (o["head"], o["n"], o["v_small"], objective_of(o)) != same] + [entry]
            save(data)
            print(f"{args.gen} {path} {name} N={n} V={args.v_small}: "
                  f"{entry.get('xla_cycles', entry.get('error'))} ({entry['wall_s']} s)", file=sys.stderr, flush=True)


def cmd_scale_op(args: argparse.Namespace) -> None:
    """Price an op the profiler could not walk at a materialised point (its compile killed for memory) from its
    profiles at smaller points: ``c(N, V) = c(N, V0) * c(N0, V) / c(N0, V0)``, its growth in V measured at fewer
    tokens. Stored with the point (``op_estimates``); :func:`point_ms` then counts it instead of its estimate."""
    from ce_pallas_tpu.tooling.schedule import step

    path, objective = BASELINE_PATHS[args.objective], args.objective
    ((name, h, _),) = heads(args.head)
    n, v, n0, v0 = args.tokens, args.v_small, args.via_tokens, args.from_v
    def measure(tokens: int, vocab: int) -> step.OpCycles:
        ops = step.measure_ops(args.gen, path, tokens, h, vocab)
        if args.op not in ops:
            raise SystemExit(f"the step at N={tokens}, V={vocab} has no op {args.op!r}")
        return ops[args.op]

    target = measure(n, v)
    print(f"{args.op} at N={n}, V={v}: profiled {target.profiled}, unprofiled {target.unprofiled:.0f}",
          file=sys.stderr, flush=True)
    points = {}
    for pn, pv in ((n, v0), (n0, v0), (n0, v)):
        measured = measure(pn, pv)
        if measured.profiled is None:
            raise SystemExit(f"{args.op} has no profile at N={pn}, V={pv}")
        points[f"{pn}x{pv}"] = measured.profiled
        print(f"{args.op} at N={pn}, V={pv}: {measured.profiled}", file=sys.stderr, flush=True)
    cycles = points[f"{n}x{v0}"] * points[f"{n0}x{v}"] / points[f"{n0}x{v0}"]
    if target.profiled is not None:  # the profiler walked it after all: its own figure (the points' kept beside)
        cycles = float(target.profiled)
    data = load()
    point = next((e for e in data.get("materialised", {}).get(args.gen, []) if e["head"] == name and e["n"] == n
                  and e["v_small"] == v and objective_of(e) == objective and not e.get("error")), None)
    if point is None:
        raise SystemExit(f"no materialised point {args.gen} {name} N={n} V={v} ({objective}): measure it first")
    if args.op not in (point.get("estimated_ops") or []):
        raise SystemExit(f"{args.op} was profiled at that point: nothing to price")
    point.setdefault("op_estimates", {})[args.op] = {
        "cycles": cycles, "unprofiled": target.unprofiled, "profiles": points,
        "rule": f"c({n}, {v}) = c({n}, {v0}) * c({n0}, {v}) / c({n0}, {v0})", "commit": commit(),
        "utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    save(data)
    print(f"{args.op} at N={n}, V={v}: {cycles:.0f} cycles (was charged {target.unprofiled:.0f})", file=sys.stderr)


# ----------------------------------------------------------------------------------------------- figures

def _ms(record: dict) -> float | None:
    if record.get("error") or record.get("kernel_us") is None:
        return None
    return max(record["kernel_us"], record["hbm_floor_us"]) / 1e3


def _find(records: list[dict], tiles: list[int] | None = None, **job) -> dict | None:
    """The record of the job with these fields (and, if given, these measured tiles)."""
    for record in records:
        fields = {"chunk_role": "middle", **record["job"]}  # records before 2026-12-01 measured the middle chunk
        if all(fields.get(key) == value for key, value in job.items()) and (
                tiles is None or record.get("tiles") == tiles):
            return record
    return None


def _usable(record: dict | None) -> dict | None:
    """The record, unless it failed or its profile claims less than the kernel's MXU minimum."""
    if record is None or record.get("error") or (record.get("ratio") or 0.0) < 1.0:
        return None
    return record


def _backward_record(records: list[dict], plan: dict, rows: int, role: str) -> dict | None:
    """The record of ``plan``'s backward over ``rows`` rows in ``role``, at the plan's tiles."""
    return _find(records, kernel="backward", n=rows, h=plan["h"], v=plan["v"], keep_logits=True,
                 w_layout=plan["w_layout"], tiles=plan["backward_tiles"], chunk_role=role,
                 with_expected=objective_of(plan) == "rl")


def _backward_ms(records: list[dict], plan: dict, rows: int, role: str) -> float | None:
    """That backward's ms: its record's, or where that is missing, failed or reads below the MXU minimum, the
    middle role's cycles at the same rows beside the role's own HBM floor (the middle's without one)."""
    own, raw_middle = _backward_record(records, plan, rows, role), _backward_record(records, plan, rows, "middle")
    usable, middle = _usable(own), _usable(raw_middle)
    if usable is not None:
        return _ms(usable)
    if middle is None:  # no role reads at or above the MXU minimum: the record as it is (the row says so)
        raw = own if own is not None and not own.get("error") else raw_middle
        return None if raw is None or raw.get("error") else _ms(raw)
    floor = own["hbm_floor_us"] if own is not None and own.get("hbm_floor_us") else middle["hbm_floor_us"]
    return max(middle["kernel_us"], floor) / 1e3


def _is_gather(op: str) -> bool:
    return op.split(" ")[0].startswith("gather_offload")


@functools.cache
def gather_cycles_per_entry(gen: str, objective: str = "loss") -> float | None:
    """What step.py charges the SparseCore label pick per ``[N, V]`` entry on ``gen``: its three ops at a float32
    read each, from the points whose only estimated ops are those (the same rate at every N and V measured)."""
    rates = [e["estimated_cycles"] / (e["n"] * e["v_small"]) for e in load().get("materialised", {}).get(gen, [])
             if e.get("estimated_ops") and all(_is_gather(op) for op in e["estimated_ops"])
             and objective_of(e) == objective]
    return sum(rates) / len(rates) if rates else None


def point_ms(gen: str, e: dict) -> float:
    """One compiled materialised step's ms. The label pick offloaded to the SparseCore
    (gather_offload_async_start/update/done) has no static profile; step.py charges each of the three ops
    its operands' bytes, i.e. a whole float32 [N, V] read, for a gather of N values: those estimates are
    dropped here (the raw sum stays in the record; where another op was estimated beside them, the gather's
    share at :func:`gather_cycles_per_entry`'s rate). Other estimated ops (a matmul fusion the profiler
    aborted on: its flops at the peak) are kept, unless ``scale-op`` priced the op from its profiles at smaller
    points (``op_estimates``)."""
    from ce_pallas_tpu.tooling.schedule.chips import SCHEDULE_CHIPS

    total = e["kernel_cycles"] + e["xla_cycles"]
    for estimate in (e.get("op_estimates") or {}).values():  # an estimated op priced by ``scale-op`` instead
        total += estimate["cycles"] - estimate["unprofiled"]
    ops = e.get("estimated_ops") or []
    if ops and all(_is_gather(op) for op in ops):
        total -= e["estimated_cycles"]
    elif any(_is_gather(op) for op in ops):
        rate = gather_cycles_per_entry(gen, objective_of(e))
        if rate is None:
            raise ValueError(f"{gen}: no point prices the label pick alone, so {e['head']} at N={e['n']} "
                             "cannot drop it")
        total -= rate * e["n"] * e["v_small"]
    return total / SCHEDULE_CHIPS[gen].clock_hz * 1e3


def materialised_fit(gen: str, name: str, entries: list[dict], v_small: int | None = None) -> dict | None:
    """``a + b N`` through the two largest token counts at the reduced V, in ms, scaled to the full V."""
    from ce_pallas_tpu.tooling.schedule.chips import SCHEDULE_CHIPS

    clock = SCHEDULE_CHIPS[gen].clock_hz
    points = {e["n"]: point_ms(gen, e) for e in entries
              if e["head"] == name and not e.get("error") and (v_small is None or e["v_small"] == v_small)}
    raw = {e["n"]: (e["kernel_cycles"] + e["xla_cycles"]) / clock * 1e3 for e in entries
           if e["head"] == name and not e.get("error") and (v_small is None or e["v_small"] == v_small)}
    if len(points) < 2:
        return None
    (n0, y0), (n1, y1) = sorted(points.items())[-2:]
    slope = (y1 - y0) / (n1 - n0)
    small = next(e for e in entries if e["head"] == name and not e.get("error")
                 and (v_small is None or e["v_small"] == v_small))
    return {"intercept_ms": y0 - slope * n0, "slope_ms_per_token": slope, "points_ms": points, "raw_points_ms": raw,
            "v_small": small["v_small"], "v_full": small["v_full"], "scale": small["v_full"] / small["v_small"]}


def default_choice(gen: str, n: int, h: int, v: int, w_layout: str, objective: str = "loss") -> str:
    """What ``keep_logits=None`` does here (``kept_logits.choose``): ``kept@CHUNK`` or ``recompute``."""
    import jax.numpy as jnp

    from ce_core import StatsSpec
    from ce_pallas_tpu import kept_logits
    from ce_pallas_tpu.target import CHIP_FACTS, Target

    if not hasattr(kept_logits, "choose"):
        return "-"
    target = Target(gen, CHIP_FACTS[gen].num_cores, None)
    plan = kept_logits.choose(n, h, v, jnp.bfloat16, jnp.bfloat16,
                              StatsSpec(w_layout=w_layout, with_expected=objective == "rl"), target)
    return "recompute" if plan is None else f"kept@{plan.chunk}"


def materialised_model(gen: str, name: str, entries: list[dict]) -> dict | None:
    """``T(N, V) = a + b N + c V + d N V`` (ms) through every point of the head (least squares; exact on a
    2 x 2 grid), where the points span two N and two V: the ``[N, H]`` and ``[N]`` work (``b N``) and the
    fixed part (``a``) are then not scaled with V. None with fewer."""
    import numpy as np

    mine = [e for e in entries if e["head"] == name and not e.get("error")]
    # The 2 x 2 grid: the two largest V with the same two largest N (other points are checks, not fitted).
    by_v = {}
    for e in mine:
        by_v.setdefault(e["v_small"], {})[e["n"]] = e
    grids = [(v, tuple(sorted(ns)[-2:])) for v, ns in by_v.items() if len(ns) >= 2]
    common = [g for g in grids if sum(1 for other in grids if other[1] == g[1]) >= 2]
    if len(common) < 2:
        return None
    common.sort()
    (v0, ns), (v1, _) = [g for g in common if g[1] == common[-1][1]][-2:]
    mine = [by_v[v][n] for v in (v0, v1) for n in ns]
    ms = {(e["n"], e["v_small"]): point_ms(gen, e) for e in mine}
    keys = sorted(ms)
    a = np.array([[1.0, n, v, n * v] for n, v in keys])
    y = np.array([ms[k] for k in keys])
    coef, *_ = np.linalg.lstsq(a, y, rcond=None)
    residual = max(abs(float(a[i] @ coef) - y[i]) / y[i] for i in range(len(keys)))
    return {"coef_a_b_c_d": [float(c) for c in coef], "points_ms": {f"{n}x{v}": ms[(n, v)] for n, v in keys},
            "max_residual": residual, "v_full": mine[0]["v_full"]}


def materialised_long_v(gen: str, name: str, entries: list[dict], model: dict) -> dict | None:
    """Where the head has a point at a larger V than ``model``'s grid (one N of the grid, the most this machine
    compiles): the step at that N along the line in V through the grid's larger V and that point, taken to the
    full V, and scaled in N as the grid's larger V scales. v6e's step is not linear in V at 4096-8192 (Llama-3
    8B's 16384 entries cost 8% more than that line says, Qwen2.5-0.5B's full V 13-25% less): the longer line
    holds the larger V's cost. None without such a point."""
    grid = {tuple(int(x) for x in key.split("x")): ms for key, ms in model["points_ms"].items()}
    v1 = max(v for _, v in grid)
    longer = [e for e in entries if e["head"] == name and not e.get("error") and e["v_small"] > v1
              and (e["n"], v1) in grid]
    if not longer:
        return None
    point = max(longer, key=lambda e: e["v_small"])
    n0, v_big = point["n"], point["v_small"]
    per_entry = (point_ms(gen, point) - grid[n0, v1]) / (v_big - v1)
    at_n0 = grid[n0, v1] + per_entry * (model["v_full"] - v1)
    (na, ya), (nb, yb) = sorted((n, ms) for (n, v), ms in grid.items() if v == v1)
    slope = (yb - ya) / (nb - na)

    def at_v1(n: int) -> float:
        return ya + slope * (n - na)

    return {"n0": n0, "v_big": v_big, "ms_at_n0": at_n0, "ms_per_entry_at_n0": per_entry,
            "scale": {str(n): at_v1(n) / at_v1(n0) for n in TOKENS}}


def rows() -> list[dict]:
    from ce_pallas_tpu.target import CHIP_FACTS
    from ce_pallas_tpu.tooling.schedule import chunk_roles
    from ce_pallas_tpu.tooling.schedule.chips import SCHEDULE_CHIPS

    data = load()
    out = []
    for gen in GENERATIONS:
        records = data.get("kernels", {}).get(gen, [])
        chip = SCHEDULE_CHIPS[gen]
        cores = CHIP_FACTS[gen].num_cores
        peak = chip.bf16_flops * cores
        for plan in data.get("plans", {}).get(gen, {}).values():
            name, n, h, v, lay, chunk = plan["head"], plan["n"], plan["h"], plan["v"], plan["w_layout"], plan["chunk"]
            objective = objective_of(plan)
            rl = objective == "rl"
            mat = [e for e in data.get("materialised", {}).get(gen, []) if objective_of(e) == objective]
            # The kernels the plan runs: records of another plan at the same chunk (other tiles) do not count.
            fwd = _find(records, kernel="forward", n=chunk, h=h, v=v, keep_logits=True, w_layout=lay,
                        tiles=plan["forward_tiles"], with_expected=rl)
            # Each backward call (a chunk, or a piece of one: plans since 2026-12-02 list their calls) in its role;
            # a role not measured (records before 2026-12-01), failed, or profiled below its MXU minimum (impossible:
            # v6e Llama-3 8B's last 1536-token chunk read 0.62) counts at the middle role's cycles at the same rows
            # and its own HBM floor where it has one.
            calls = [(rows, role, count) for kernel, rows, role, count in plan.get("calls", []) if kernel == "backward"]
            calls = calls or [(chunk, role, count) for role, count in chunk_roles(plan["chunks"]).items()]
            roles = {f"{rows}:{role}": count for rows, role, count in calls}
            by_role = {f"{rows}:{role}": _usable(_backward_record(records, plan, rows, role))
                       for rows, role, _ in calls}
            # The backward the row's ratios quote: the first usable of each call's record and the middle role's at
            # the first call's rows; where none is usable (v6e's H=3584 heads: every record reads below its MXU
            # minimum, libtpu optimistic) the first that did not fail, the row then a lower bound, flagged.
            candidates = [*(_backward_record(records, plan, rows, role) for rows, role, _ in calls),
                          _backward_record(records, plan, calls[0][0], "middle")]
            bwd = next((record for record in candidates if _usable(record) is not None), None)
            below = bwd is None
            if below:
                bwd = next((record for record in candidates if record is not None and not record.get("error")), None)
            rfwd = _find(records, kernel="forward", n=n, h=h, v=v, keep_logits=False, w_layout=lay, with_expected=rl)
            rbwd = _find(records, kernel="backward", n=n, h=h, v=v, keep_logits=False, w_layout=lay, with_expected=rl)
            mxu_ms = 8 * n * h * v / peak * 1e3
            row = {"gen": gen, "objective": objective, "head": name, "n": n, "h": h, "v": v, "w_layout": lay,
                   "chunk": chunk,
                   "chunks": plan["chunks"], "extra_gib": plan["extra_bytes"] / 2**30, "mxu_8nhv_ms": mxu_ms,
                   "pieces": plan.get("pieces", []),
                   "kept_bwd_roles_as_middle": [role for role in roles if by_role[role] is None],
                   "kept_bwd_below_mxu": below}
            fm, bm = (None if r is None else _ms(r) for r in (fwd, bwd))
            row["kept_fwd_ratio"] = None if fwd is None else fwd.get("ratio")
            row["kept_bwd_ratio"] = None if bwd is None else bwd.get("ratio")
            row["kept_errors"] = [r["error"] for r in (fwd, bwd) if r is not None and r.get("error")]
            hp_vp = math.prod(plan["running_dw_shape"])
            # XLA around the kept kernels (since 27cad1a the first chunk's backward starts the float32 running
            # dw and the last writes dw in w's dtype: no zeroing, no slice and cast): per chunk the dx fusion
            # (the cores' float32 partials read, the bf16 dx piece read and written: cores*4*C*Hp + 4*C*H bytes)
            # at the core's HBM bandwidth. For reference, what the zeroing (4 Hp Vp written) and the slice and
            # cast (4 H V read, 2 H V written) cost before that commit.
            # (Records before the running dw could be held transposed name no Hp: their running dw is in w's layout.)
            hp = plan.get("backward_hp", plan["running_dw_shape"][0 if lay == "hv" else 1])
            dw_bytes = 4 * hp_vp + 4 * h * v + 2 * h * v
            dx_bytes = plan["chunks"] * (plan["backward_cores"] * 4 * chunk * hp + 4 * chunk * h)
            if plan.get("backward_x_transposed"):  # the chunk's x transposed for the backward: bf16 read, written
                dx_bytes += plan["chunks"] * 4 * chunk * hp
            if plan.get("pieces"):  # the pieces' dx joined into the chunk's: bf16 read and written
                dx_bytes += plan["chunks"] * 4 * chunk * h
            row["pre_27cad1a_xla_dw_ms"] = dw_bytes / chip.hbm_bytes_per_s * 1e3
            row["kept_xla_dx_ms"] = dx_bytes / chip.hbm_bytes_per_s * 1e3
            row["kept_xla_ms"] = row["kept_xla_dx_ms"]
            if plan.get("backward_label_rows"):  # the label's term by rows: its XLA work once a backward call
                measured = data.get("label_rows_xla", {}).get(gen, {}).get(name)
                if measured is None:
                    row["kept_errors"] = [*row["kept_errors"], "label rows' XLA work not measured (label_rows_xla.py)"]
                else:
                    calls_rows = sum(count * rows for rows, _, count in calls)  # every call's rows, all chunks
                    row["kept_xla_label_rows_ms"] = (measured["cycles"] * calls_rows / measured["rows"]
                                                     / chip.clock_hz * 1e3)
                    row["kept_xla_ms"] += row["kept_xla_label_rows_ms"]
            if fm is not None and bm is not None and fwd is not None and bwd is not None:
                row["kept_fwd_ms_chunk"], row["kept_bwd_ms_chunk"] = fm, bm
                row["kept_bwd_hbm_bound"] = bwd["hbm_floor_us"] > bwd["kernel_us"]
                row["kept_fwd_hbm_bound"] = fwd["hbm_floor_us"] > fwd["kernel_us"]
                role_ms = {f"{rows}:{role}": _backward_ms(records, plan, rows, role) or bm for rows, role, _ in calls}
                row["kept_bwd_ms_by_role"] = role_ms
                backwards_ms = sum(count * role_ms[role] for role, count in roles.items())
                row["kept_kernels_ms"] = plan["chunks"] * fm + backwards_ms  # fm: checked above
                row["kept_ms"] = row["kept_kernels_ms"] + row["kept_xla_ms"]
                row["kept_kernels_8nhv"] = row["kept_kernels_ms"] / mxu_ms
                row["kept_8nhv"] = row["kept_ms"] / mxu_ms
            rm_fwd, rm_bwd = (None if r is None else _ms(r) for r in (rfwd, rbwd))
            if rm_fwd is not None and rm_bwd is not None:
                row["recompute_ms"] = rm_fwd + rm_bwd
                row["recompute_8nhv"] = row["recompute_ms"] / mxu_ms
                if "kept_ms" in row:
                    row["kept_over_recompute"] = row["kept_ms"] / row["recompute_ms"]
            row["recompute_errors"] = [r["error"] for r in (rfwd, rbwd) if r is not None and r.get("error")]
            row["default_choice"] = default_choice(gen, n, h, v, lay, objective)
            model = materialised_model(gen, name, mat)
            v_used = sorted({e["v_small"] for e in mat if e["head"] == name and not e.get("error")})
            fit = None
            for v_small in reversed(v_used):  # the single-V fallback: the largest V with two N
                fit = materialised_fit(gen, name, mat, v_small)
                if fit is not None:
                    break
            if model is not None:
                a, b, c, d = model["coef_a_b_c_d"]
                row["materialised_ms"] = a + b * n + c * v + d * n * v
                points, residual = len(model["points_ms"]), model["max_residual"]
                row["materialised_method"] = f"bilinear N,V ({points} points, residual {residual:.3f})"
                row["materialised_model"] = model
                longer = materialised_long_v(gen, name, mat, model)
                if longer is not None:
                    row["materialised_bilinear_ms"] = row["materialised_ms"]
                    row["materialised_ms"] = longer["ms_at_n0"] * longer["scale"][str(n)]
                    row["materialised_method"] = (f"V line to {longer['v_big']} at N={longer['n0']}, "
                                                  "scaled in N as the bilinear grid's larger V")
                    row["materialised_long_v"] = longer
                if fit is not None:
                    single = fit["intercept_ms"] + fit["slope_ms_per_token"] * n
                    row["materialised_single_v_ms"] = single * fit["scale"]
                row["materialised_8nhv"] = row["materialised_ms"] / mxu_ms
                if "kept_ms" in row:
                    row["kept_over_materialised"] = row["kept_ms"] / row["materialised_ms"]
            elif fit is not None:
                row["materialised_method"] = f"V={fit['v_small']} scaled x{fit['scale']:.2f}"
                row["materialised_ms"] = (fit["intercept_ms"] + fit["slope_ms_per_token"] * n) * fit["scale"]
                row["materialised_8nhv"] = row["materialised_ms"] / mxu_ms
                row["materialised_fit"] = fit
                if "kept_ms" in row:
                    row["kept_over_materialised"] = row["kept_ms"] / row["materialised_ms"]
            out.append(row)
    return out


def _f(value, digits=2, bold=None) -> str:
    if value is None:
        return "-"
    text = f"{value:,.{digits}f}"
    return f"**{text}**" if bold is not None and value <= bold else text


def cmd_table(args: argparse.Namespace) -> None:
    table = rows()
    data = load()
    if args.save:  # the derived rows beside the raw records (not while a measurement may be writing the file)
        data["rows"] = table
        save(data)
    from ce_bench.presets import MODEL_HEADS

    order = {name: i for i, (name, _, _) in enumerate(MODEL_HEADS)}
    table.sort(key=lambda r: (GENERATIONS.index(r["gen"]), order[r["head"]], r["n"]))
    for gen, objective in ((gen, objective) for objective in OBJECTIVES for gen in GENERATIONS):
        selected = [r for r in table if r["gen"] == gen and r["objective"] == objective]
        if not selected:
            continue
        print(f"\n### {gen}{'' if objective == 'loss' else f' ({objective} objective)'}\n")
        print("| head | N | chunk | kept kernels ms (fwd/bwd ratio) | kept XLA ms | kept ms | kept/8NHV | "
              "recompute ms | rec/8NHV | materialised ms | mat/8NHV | kept/mat | extra GiB | default |")
        print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|")
        for r in selected:
            fwd_bwd = (r.get("kept_fwd_ratio"), r.get("kept_bwd_ratio"))
            flag = " (a)" if r.get("kept_bwd_below_mxu") else ""
            ratios = "" if fwd_bwd == (None, None) else f" ({_f(fwd_bwd[0], 3)}/{_f(fwd_bwd[1], 3)})"
            print(f"| {r['head']}{' (vh)' if r['w_layout'] == 'vh' else ''} | {r['n']} | {r['chunk']} "
                  f"| {_f(r.get('kept_kernels_ms'))}{ratios} | {_f(r['kept_xla_ms'])} | {_f(r.get('kept_ms'))} "
                  f"| {_f(r.get('kept_8nhv'), 3)}{flag} | {_f(r.get('recompute_ms'))} "
                  f"| {_f(r.get('recompute_8nhv'), 3)} "
                  f"| {_f(r.get('materialised_ms'))} | {_f(r.get('materialised_8nhv'), 3)} "
                  f"| {_f(r.get('kept_over_materialised'), 2)} | {r['extra_gib']:.2f} | {r['default_choice']} |")
    print("\n(a) Its backward's profile reads below the kernel's MXU minimum (libtpu optimistic): a lower bound.")
    print("\n### materialised step points (ms at the reduced V; fit through the two N; scaled to the full V)\n")
    print("| gen | objective | head | V small | N: ms | intercept ms | ms / 1k tokens | scale | at N=4096 | at N=16384 "
          "| errors |")
    print("|---|---|---|---:|---|---:|---:|---:|---:|---:|---|")
    for gen in GENERATIONS:
        entries = data.get("materialised", {}).get(gen, [])
        for objective, name, v_small in sorted({(objective_of(e), e["head"], e["v_small"]) for e in entries}):
            mine = [e for e in entries if e["head"] == name and e["v_small"] == v_small
                    and objective_of(e) == objective]
            fit = materialised_fit(gen, name, mine, v_small)
            errors = "; ".join(f"N={e['n']}: " + (f"error {e['error'][:60]}" if e.get("error") else
                                                  f"abort, {', '.join(e.get('estimated_ops') or [])} estimated")
                               for e in mine if e.get("error") or e.get("abort"))
            pts = ", ".join(f"{n}: {ms:.3f}" for n, ms in sorted(fit["points_ms"].items())) if fit else "-"
            at = ["-", "-"] if fit is None else [
                f"{(fit['intercept_ms'] + fit['slope_ms_per_token'] * n) * fit['scale']:.2f}" for n in TOKENS]
            print(f"| {gen} | {objective} | {name} | {v_small} | {pts} | {_f(fit and fit['intercept_ms'], 3)} "
                  f"| {_f(fit and fit['slope_ms_per_token'] * 1e3, 3)} | {_f(fit and fit['scale'], 2)} | {at[0]} "
                  f"| {at[1]} | {errors or '-'} |")


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    kernels = sub.add_parser("kernels")
    kernels.add_argument("gen", choices=GENERATIONS)
    kernels.add_argument("--heads")
    kernels.add_argument("--skip-recompute", action="store_true")
    kernels.add_argument("--only-recompute", action="store_true")
    kernels.add_argument("--kept-backward-only", action="store_true",
                         help="measure the kept backwards only, the forwards' records kept as they stand")
    kernels.add_argument("--tokens", help="comma-separated token counts of TOKENS (default all; a subset keeps the "
                         "other counts' records)")
    kernels.add_argument("--objective", choices=OBJECTIVES, default="loss")
    kernels.set_defaults(fn=cmd_kernels)
    mat = sub.add_parser("materialised")
    mat.add_argument("gen", choices=GENERATIONS)
    mat.add_argument("--heads", required=True)
    mat.add_argument("--v-small", type=int, default=8192)
    mat.add_argument("--tokens", default="2048,4096")
    mat.add_argument("--objective", choices=OBJECTIVES, default="loss")
    mat.set_defaults(fn=cmd_materialised)
    scale = sub.add_parser("scale-op")
    scale.add_argument("gen", choices=GENERATIONS)
    scale.add_argument("--head", required=True)
    scale.add_argument("--tokens", type=int, required=True)
    scale.add_argument("--v-small", type=int, required=True)
    scale.add_argument("--op", required=True)
    scale.add_argument("--from-v", type=int, required=True, help="a V at which the op is profiled at --tokens")
    scale.add_argument("--via-tokens", type=int, required=True, help="fewer tokens, at which it is profiled at both V")
    scale.add_argument("--objective", choices=OBJECTIVES, default="loss")
    scale.set_defaults(fn=cmd_scale_op)
    table = sub.add_parser("table")
    table.add_argument("--save", action="store_true")
    table.set_defaults(fn=cmd_table)
    args = parser.parse_args(argv)
    args.fn(args)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
