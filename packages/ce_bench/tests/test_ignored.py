"""``--ignored``: the bench's labels ignore about the asked share of tokens, where the pattern says."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from ce_bench import cli
from ce_bench.ignored import IGNORE_INDEX, ignore_tokens


@pytest.mark.parametrize("pattern", ["prompts", "padding"])
@pytest.mark.parametrize("fraction", [0.0, 0.25, 0.5, 0.9, 1.0])
def test_share_and_place_of_the_ignored_tokens(pattern, fraction):
    labels = np.arange(40_000, dtype=np.int32) % 1000
    out = ignore_tokens(labels, fraction, pattern, seed=3, sequence=128)
    ignored = out == IGNORE_INDEX
    assert ignored.sum() == round(fraction * labels.size)  # exactly the share asked for, in all
    assert np.array_equal(out[~ignored], labels[~ignored])
    sequences = np.array_split(ignored, np.arange(128, labels.size, 128))
    for sequence in sequences:  # contiguous: a prefix (prompts) or a suffix (padding) of each sequence
        count = int(sequence.sum())
        where = slice(0, count) if pattern == "prompts" else slice(sequence.size - count, sequence.size)
        assert sequence[where].all()
    if 0 < fraction < 1:
        assert len({int(s.sum()) for s in sequences}) > 1  # sequences differ, as in a real batch


def test_bad_arguments_are_refused_by_name():
    with pytest.raises(ValueError, match="fraction"):
        ignore_tokens(np.zeros(4, np.int32), 1.5, "prompts", seed=0)
    with pytest.raises(ValueError, match="pattern"):
        ignore_tokens(np.zeros(4, np.int32), 0.5, "middle", seed=0)
    with pytest.raises(SystemExit):
        cli.main(["run", "--ignored", "2", "--backends", "reference", "--shapes", "64x32x256"])


def test_run_records_the_ignored_share(tmp_path: Path):
    path = tmp_path / "run.json"
    assert cli.main(["run", "--backends", "xla,reference", "--shapes", "256x32x512", "--ignored", "0.5",
                     "--ignored-pattern", "padding", "--repeats", "1", "--no-floor", "--memory-shapes", "none",
                     "--json", str(path), "--no-files"]) == 0
    records = json.loads(path.read_text())
    assert {r["backend"] for r in records} == {"xla", "reference"}
    assert all(r["ignored"] == 0.5 and r["ignored_pattern"] == "padding" and r["status"] == "ok" for r in records)
    assert all(r["max_rel_err"] is not None and r["max_rel_err"] < 1e-4 for r in records)  # against the oracle
