"""The census of one step of libtpu's executed-bundle trace (text in, counts out; no compile)."""

from __future__ import annotations

from pathlib import Path

import pytest

from ce_pallas_tpu.tooling.schedule.census import census, executed_pieces, matmul_pieces, step_census

#: Two grid steps, the second with one product fewer held in a spill slot, then the kernel's tail.
TRACE = """\
0x0: bundle slots:
  %s1_s1 = smov.u32 0

0x1: bundle slots:
  %2 = vmatmul.mubr.bf16.gmra.mxu0 %v0_v0
  %v3_v1 = vpop.f32.mrf.mxu0
0x2: bundle slots:
  %4 = vst [vmem:[#allocation7_spill] sm:$0xff] /*vst_source=*/%v3_v1
  %v5_v2 = vld [vmem:[#allocation7_spill] sm:$0xff]
  %v6_v3 = vadd.f32 %v5_v2, %v3_v1
0x3: bundle slots:
  %7 = vst [vmem:[%s1_s1] sm:$0xff] /*vst_source=*/%v6_v3
  %8 = sbr.rel target = $region3
0x4: bundle slots:
  %9 = vmatmul.mubr.bf16.gmra.mxu0 %v0_v0
  %v10_v1 = vpop.f32.mrf.mxu0
  %v11_v3 = vadd.f32 %v10_v1, %v10_v1
0x5: bundle slots:
  %12 = vst [vmem:[%s1_s1] sm:$0xff] /*vst_source=*/%v11_v3
  %13 = sbr.rel target = $region3
0x6: bundle slots:
  %14 = vsyncadd [#allocation3], 0
"""

CRITICAL = """\
Length to end: 9, %2 = vmatmul.mubr.bf16.gmra.mxu0 %v0_v0
Length to end: 8, %v3_v1 = vpop.f32.mrf.mxu0
Length to end: 7, %4 = vst [vmem:[#allocation7_spill] sm:$0xff] /*vst_source=*/%v3_v1
Length to end: 6, %v5_v2 = vld [vmem:[#allocation7_spill] sm:$0xff]
Length to end: 3, %v10_v1 = vpop.f32.mrf.mxu0
Length to end: 2, %12 = vst [vmem:[%s1_s1] sm:$0xff] /*vst_source=*/%v11_v3
"""


def test_a_trace_splits_into_pieces_at_its_branches_back_and_the_steps_are_the_pieces_with_products():
    pieces = list(executed_pieces(TRACE.splitlines(keepends=True)))
    assert [bundles for bundles, _ in pieces] == [4, 2, 1]  # the first holds the prologue's bundle
    assert [len(instructions) for _, instructions in pieces] == [8, 5, 1]
    assert matmul_pieces(pieces) == [0, 1]


def test_a_step_counts_its_stores_and_loads_to_spill_slots_what_they_saved_and_its_critical_instructions():
    pieces = list(executed_pieces(TRACE.splitlines(keepends=True)))
    first = census(*pieces[0], CRITICAL.splitlines())
    assert (first.bundles, first.stores, first.spill_stores, first.loads, first.spill_loads) == (4, 2, 1, 1, 1)
    assert first.spilled_from == {"vpop.f32.mrf.mxu0": 1}
    assert first.family("vpop.f32.mrf") == 1 and first.ops["vadd.f32"] == 1
    assert first.critical == {"vmatmul.mubr.bf16.gmra.mxu0": 1, "vpop.f32.mrf.mxu0": 1, "vst": 1, "vld": 1}
    second = census(*pieces[1], CRITICAL.splitlines())
    assert (second.stores, second.spill_stores, second.loads) == (1, 0, 0)
    assert second.critical == {"vpop.f32.mrf.mxu0": 1, "vst": 1}


def test_the_step_census_of_a_dump_takes_the_shortest_step_and_refuses_two_critical_paths(tmp_path: Path):
    (tmp_path / "k.1_bundles.txt").write_text(TRACE)
    assert step_census(tmp_path, "k").bundles == 2  # the second step, without its spill
    assert step_census(tmp_path, "k").critical == {}  # no critical path dumped
    (tmp_path / "k.1_critical_path.txt").write_text(CRITICAL)
    assert step_census(tmp_path, "k").critical == {"vpop.f32.mrf.mxu0": 1, "vst": 1}
    (tmp_path / "k.2_critical_path.txt").write_text(CRITICAL)
    with pytest.raises(RuntimeError, match="one critical path"):
        step_census(tmp_path, "k")
