"""Ignored tokens in the bench's labels (``--ignored``): prompts before completions, or padding after them.

RL and completion-only SFT batches ignore a third to a half of their tokens. The bench's ``N`` tokens
are read as sequences of ``sequence`` tokens (the last one shorter when they do not divide ``N``); each
sequence ignores a share of its tokens drawn around ``fraction`` (uniform on ``[max(0, 2f - 1), min(1, 2f)]``),
so sequences differ as in a real batch, and the shares are then scaled so that ``round(f N)`` tokens are
ignored in all (a bench row's figure is for that fraction, whatever the draw):

- ``"prompts"``: the sequence's first tokens (a prompt before its completion);
- ``"padding"``: its last tokens (padding after a sequence shorter than the longest).
"""

from __future__ import annotations

import numpy as np

PATTERNS = ("prompts", "padding")
#: Tokens per sequence unless ``--sequence`` says otherwise.
DEFAULT_SEQUENCE = 512
IGNORE_INDEX = -100


def ignore_tokens(labels: np.ndarray, fraction: float, pattern: str, *, seed: int,
                  sequence: int = DEFAULT_SEQUENCE) -> np.ndarray:
    """``labels`` (``[N]``) with about ``fraction`` of its tokens set to ``-100`` as ``pattern`` says."""
    if not 0.0 <= fraction <= 1.0:
        raise ValueError(f"fraction must be in [0, 1], got {fraction!r}")
    if pattern not in PATTERNS:
        raise ValueError(f"pattern must be one of {PATTERNS}, got {pattern!r}")
    if sequence < 1:
        raise ValueError(f"sequence must be positive, got {sequence!r}")
    labels = np.array(labels, np.int32)
    if fraction == 0.0:
        return labels
    rng = np.random.default_rng([seed, 43])
    starts = np.arange(0, labels.size, sequence)
    lengths = np.minimum(sequence, labels.size - starts)
    low, high = max(0.0, 2 * fraction - 1), min(1.0, 2 * fraction)
    counts = _scaled_counts(rng.uniform(low, high, starts.size) * lengths, lengths, round(fraction * labels.size))
    for start, length, count in zip(starts, lengths, counts, strict=True):
        if pattern == "prompts":
            labels[start:start + count] = IGNORE_INDEX
        else:
            labels[start + length - count:start + length] = IGNORE_INDEX
    return labels


def _scaled_counts(draws: np.ndarray, lengths: np.ndarray, total: int) -> np.ndarray:
    """Whole counts, each at most its sequence's length, in proportion to ``draws`` as far as the lengths
    allow, summing to ``total``."""
    counts = np.zeros(lengths.size, np.int64)
    weights = np.maximum(draws, 1e-9)
    while (missing := total - int(counts.sum())) > 0:
        room = lengths - counts
        share = np.where(room > 0, weights, 0.0)
        add = np.minimum(room, np.floor(missing * share / share.sum()).astype(np.int64))
        if add.sum() == 0:  # the remainder, one token each, to the sequences with room and the largest draws
            order = np.argsort(-share, kind="stable")[:missing]
            add = np.zeros_like(counts)
            add[order[room[order] > 0]] = 1
        counts += add
    return counts
