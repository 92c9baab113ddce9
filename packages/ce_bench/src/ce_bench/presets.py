"""Named problem shapes: one small table, and the parser for ``--shapes``.

A preset has a *full* token count ``n`` (a realistic per-device batch, used by ``ce-bench aot`` and
``--compile-only``, where nothing executes) and a ``cpu_n`` used when the bench actually runs on a
CPU, where a full-size LM head would take minutes per step. Rows run with the reduced count say
so in the table (``note``).

Sources of the model dimensions (hidden size H, vocabulary V of the LM head):

- ``llama3-8b``: Meta Llama 3 8B, ``hidden_size=4096``, ``vocab_size=128256``
  (meta-llama/Meta-Llama-3-8B ``config.json``).
- ``qwen3``: Qwen3-8B, ``hidden_size=4096``, ``vocab_size=151936``, untied LM head
  (Qwen/Qwen3-8B ``config.json``; every Qwen3 dense model shares the 151936 vocabulary).
- ``rl-qwen2.5-1.5b``: one RL rollout of T=4096 tokens through Qwen2.5-1.5B's untied head
  (``hidden_size=1536``, ``vocab_size=151936``; Qwen/Qwen2.5-1.5B ``config.json``), the shape of a
  GRPO/PPO step's log-probabilities per device (``--objective rl``).
- ``gemma3``: Gemma 3 4B, ``hidden_size=2560`` and the Gemma 3 tokenizer's 262144 entries
  (google/gemma-3 configs; the multimodal 4B/12B/27B checkpoints pad the embedding to 262208 rows
  for image tokens; Gemma 1 and 2 used 256000). Gemma 3 has no final-logit soft cap.
"""

from __future__ import annotations

import dataclasses
import re

import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class Preset:
    """A named LM-head shape: ``n`` tokens, hidden size ``h``, vocabulary ``v``."""

    name: str
    n: int
    h: int
    v: int
    cpu_n: int | None = None
    source: str = ""


#: The preset table. ``cpu_n`` is what a CPU run uses (None: same as ``n``).
PRESETS: dict[str, Preset] = {
    p.name: p
    for p in (
        Preset("tiny", 256, 128, 4096, source="smoke test"),
        Preset("small", 1024, 512, 16384, source="a small LM head"),
        Preset("medium", 4096, 1024, 32768, cpu_n=2048, source="a mid-size LM head"),
        Preset("llama3-8b", 8192, 4096, 128256, cpu_n=128, source="Llama 3 8B: H=4096, V=128256"),
        Preset("qwen3", 8192, 4096, 151936, cpu_n=128, source="Qwen3-8B: H=4096, V=151936"),
        Preset("gemma3", 8192, 2560, 262144, cpu_n=128, source="Gemma 3 4B: H=2560, V=262144"),
        Preset("rl-qwen2.5-1.5b", 4096, 1536, 151936, cpu_n=512,
               source="one RL sequence, T=4096, Qwen2.5-1.5B head: H=1536, V=151936"),
    )
}

#: Model heads ``(name, H, V)`` of the ``models`` shape group (sources: each model's ``config.json``).
MODEL_HEADS: tuple[tuple[str, int, int], ...] = (
    ("llama3-8b", 4096, 128256),
    ("llama3-70b", 8192, 128256),
    ("qwen2.5-0.5b", 896, 151936),
    ("qwen2.5-1.5b", 1536, 151936),
    ("qwen2.5-7b", 3584, 152064),
    ("qwen3-0.6b", 1024, 151936),
    ("gemma2-2b", 2304, 256000),
    ("gemma2-9b", 3584, 256000),
)
#: Tokens per device of the ``models`` group: a short and a long step.
MODEL_TOKENS: tuple[int, ...] = (4096, 16384)
#: Named lists of shapes for ``--shapes``: ``models`` is every head of :data:`MODEL_HEADS` at every
#: token count of :data:`MODEL_TOKENS` (issue 25's matrix); ``models@4k``, ``models@16k`` each one count
#: (to run the halves under separate time limits).
SHAPE_GROUPS: dict[str, tuple[tuple[str, int, int, int], ...]] = {
    "models": tuple((f"{name}@{n // 1024}k", n, h, v) for name, h, v in MODEL_HEADS for n in MODEL_TOKENS),
    **{f"models@{n // 1024}k": tuple((f"{name}@{n // 1024}k", n, h, v) for name, h, v in MODEL_HEADS)
       for n in MODEL_TOKENS},
}

#: What ``ce-bench`` times with no ``--shapes`` (about half a minute on a 2-core CPU).
DEFAULT_RUN_SHAPES: tuple[str, ...] = ("tiny", "small")
#: What ``ce-bench`` also compiles with no ``--shapes``, at full N and without running it: the shape
#: where the materialised logits dominate memory (the reference needs GiB of temporaries), which the
#: small timed shapes cannot show (``--memory-shapes``).
DEFAULT_MEMORY_SHAPES: tuple[str, ...] = ("llama3-8b",)
#: What ``ce-bench aot`` compiles with no ``--shapes`` (full size: nothing executes).
DEFAULT_AOT_SHAPES: tuple[str, ...] = ("llama3-8b", "qwen3", "gemma3")

DTYPES: dict[str, jnp.dtype] = {
    "float32": jnp.dtype(jnp.float32),
    "bfloat16": jnp.dtype(jnp.bfloat16),
    "float16": jnp.dtype(jnp.float16),
}
_DTYPE_ALIASES = {"f32": "float32", "fp32": "float32", "bf16": "bfloat16", "f16": "float16", "fp16": "float16"}

_EXPLICIT = re.compile(r"^\s*(\d+)\s*[xX*]\s*(\d+)\s*[xX*]\s*(\d+)\s*$")
#: Something meant as dimensions (digits and separators only) that is not a valid ``NxHxV``.
_DIMENSIONS_LIKE = re.compile(r"^[\d\sxX*+-]+$")


@dataclasses.dataclass(frozen=True)
class Shape:
    """A concrete problem size to run: ``n x h x v``, with the preset it came from (if any)."""

    n: int
    h: int
    v: int
    name: str = ""
    note: str = ""

    @property
    def label(self) -> str:
        """``name NxHxV`` (or just ``NxHxV``), for tables and plots."""
        dims = f"{self.n}x{self.h}x{self.v}"
        return f"{self.name} {dims}" if self.name and self.name != dims else dims


def parse_shapes(spec: str | None, *, reduced_for_cpu: bool, default: tuple[str, ...] = DEFAULT_RUN_SHAPES,
                 tokens: int | None = None) -> list[Shape]:
    """Shapes from a comma-separated list of preset names and ``NxHxV`` triples.

    Args:
      spec: e.g. ``"small,llama3-8b,2048x1024x32000"``, or a group of :data:`SHAPE_GROUPS` such as
        ``"models"``; ``None`` or empty for ``default``.
      reduced_for_cpu: use each preset's ``cpu_n`` (and say so in the shape's ``note``).
      default: preset names used when ``spec`` is empty.
      tokens: override N of every preset (explicit ``NxHxV`` triples keep their own N).

    Raises:
      ValueError: an unknown preset name or a malformed / non-positive triple.
    """
    items = [item.strip() for item in (spec or "").split(",") if item.strip()] or list(default)
    shapes = []
    for item in items:
        match = _EXPLICIT.match(item)
        if match:
            n, h, v = (int(group) for group in match.groups())
            if min(n, h, v) <= 0:
                raise ValueError(f"shape {item!r}: N, H and V must be positive")
            shapes.append(Shape(n, h, v, name=f"{n}x{h}x{v}"))
            continue
        if item.lower() in SHAPE_GROUPS:
            shapes.extend(Shape(n, h, v, name=name) for name, n, h, v in SHAPE_GROUPS[item.lower()])
            continue
        preset = PRESETS.get(item.lower())
        if preset is None and _DIMENSIONS_LIKE.match(item):
            raise ValueError(f"malformed shape {item!r}: use NxHxV, three positive integers such as 2048x1024x32000")
        if preset is None:
            raise ValueError(f"unknown shape {item!r}: use NxHxV, one of the presets {sorted(PRESETS)} or a group "
                             f"{sorted(SHAPE_GROUPS)}")
        n, note = preset.n, ""
        if tokens is not None:
            n, note = tokens, f"N set to {tokens} (preset N={preset.n})"
        elif reduced_for_cpu and preset.cpu_n is not None and preset.cpu_n < preset.n:
            n, note = preset.cpu_n, f"N reduced from {preset.n} to {preset.cpu_n} for CPU ({preset.source})"
        shapes.append(Shape(n, preset.h, preset.v, name=preset.name, note=note))
    return shapes


def parse_dtypes(spec: str) -> list[jnp.dtype]:
    """dtypes from a comma-separated list (``float32``, ``bfloat16``/``bf16``, ``float16``/``f16``)."""
    names = [item.strip().lower() for item in spec.split(",") if item.strip()]
    if not names:
        raise ValueError("--dtype needs at least one dtype")
    dtypes = []
    for name in names:
        name = _DTYPE_ALIASES.get(name, name)
        if name not in DTYPES:
            raise ValueError(f"unknown dtype {name!r}: use one of {sorted(DTYPES)}")
        dtypes.append(DTYPES[name])
    return dtypes
