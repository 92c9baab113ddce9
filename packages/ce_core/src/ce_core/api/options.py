"""The keyword options of every public function, written once.

Each option is declared once as a typed keyword (the ``TypedDict`` groups below, which the public
functions take as ``**options: Unpack[...]``, so type checkers check every call) and once as a field
of :class:`Options`, the frozen, validated value carried inside with every default applied. A new
option is one line in a group and one field here; the public functions do not change.

- :class:`LogitOptions`: what the logits are and how they are computed (every function);
- :class:`LossTerms`: how per-token losses are weighted and reduced (the loss functions);
- :class:`PlacementOptions`: how the plain call is laid out over a mesh (not the sharded wrapper,
  which takes its layout as ``batch_axes``/``vocab_axis``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any, TypedDict

import jax
from jax.typing import ArrayLike

from ce_core.api import validation
from ce_core.contract.block_sizes import BlockSizes
from ce_core.sharded.placement import InSpecs


class LogitOptions(TypedDict, total=False):
    """The logits ``cap(x @ w) / temperature`` and how a backend computes them.

    Attributes:
      logit_soft_cap: ``c``: logits become ``c * tanh(z / c)`` before the temperature.
      temperature: ``T > 0``: the logits are ``cap(x . w) / T``; every feature applies to those. A
        number (static), or an array broadcastable to ``labels`` (per token, or per sequence as
        ``[B, 1]``; may be traced). Not differentiated. Concrete values that are not finite and
        positive are a ``ValueError``; a traced bad value makes that token's loss (or log-prob) NaN.
      w_layout: ``"hv"`` (the default): ``w`` is ``[H, V]``; ``"vh"``: ``w`` is ``[V, H]`` (vocab entries
        as rows: an input embedding table used as a tied head, or a torch ``Linear`` weight). No
        transpose is made; ``dw`` comes back in the layout given, and "vocab-split" means split on
        the vocab dimension of that layout.
      ignore_index: label value of tokens that count for nothing (no loss, no weight, no gradient).
      implementation: ``None`` for the platform's default chain, a backend name, or a sequence of
        names tried in order (falling back, with a warning, past backends that cannot run it).
      block_sizes: explicit tile sizes for the backend; ``None`` lets it choose.
      precision: MXU precision of the products, as jax names it (``"default"``: bf16 operands with
        float32 accumulation, ``"high"``, ``"highest"``, or a ``jax.lax.Precision``); ``None`` for
        the backend's default.
    """

    logit_soft_cap: float | None
    temperature: float | ArrayLike
    ignore_index: int
    implementation: str | Sequence[str] | None
    block_sizes: BlockSizes | None
    precision: str | jax.lax.Precision | None
    w_layout: str


class LossTerms(TypedDict, total=False):
    """How per-token losses are formed, weighted and reduced.

    Attributes:
      reduction: ``"mean"`` (weighted mean over non-ignored tokens, 0 when there are none), ``"sum"``
        or ``"none"`` (per-token losses, shape of ``labels``).
      weights: optional ``[...]`` float per-token weights, the shape of ``labels``.
      logsumexp_weight: z-loss coefficient ``lam``: adds ``lam * lse**2`` per token.
      label_smoothing: ``eps`` in ``[0, 1)``, the ``optax.smooth_labels`` convention.
      keep_logits: how the gradient of a scalar loss is formed. ``True``: keep each token chunk's
        logits between the statistics and the gradient pass (6NHV of matmul work, no recompute; the
        backend holds a float32 ``dw`` accumulator and one chunk's logits); ``False``: recompute them in
        the backward pass (8NHV, the least memory); ``None`` (the default): the backend's plan
        chooses within its memory budget. Backends without a no-recompute path ignore it; with
        ``reduction="none"`` the cotangents arrive only in the backward pass, so ``True`` is an error.
    """

    reduction: str
    weights: ArrayLike | None
    logsumexp_weight: float
    label_smoothing: float
    keep_logits: bool | None


class PlacementOptions(TypedDict, total=False):
    """How the plain call is laid out over a mesh (see the README, "Inside your own sharded train step").

    Attributes:
      vocab_axis_name: inside your own ``shard_map`` with ``w`` split over V along this mesh axis
        (shard k holding vocab ids ``[k * V_local, (k + 1) * V_local)``), combine the shards'
        statistics with collectives; ``labels`` stay global ids. Reductions cover the tokens of this
        call, so with tokens also split, reduce with ``"sum"`` and ``psum`` yourself.
      in_specs: ``(x_spec, w_spec)``, the ``PartitionSpec`` s of ``x`` and ``w`` on the mesh in use:
        the layout the call runs in (inputs laid out otherwise are resharded to it). Under Auto mesh
        axes (GSPMD) the layout is not visible at trace time: state it to run as your step lays out
        ``x`` and ``w``; ``None`` there: every token split over every mesh axis and ``w`` gathered.
        Under Explicit axes ``None`` reads the layout from the types.
    """

    vocab_axis_name: str | None
    in_specs: InSpecs | None


class LossOptions(LogitOptions, LossTerms, PlacementOptions, total=False):
    """The options of :func:`ce_core.linear_cross_entropy`."""


class LogProbsOptions(LogitOptions, PlacementOptions, total=False):
    """The options of :func:`ce_core.linear_log_probs`."""


class ShardedLossOptions(LogitOptions, LossTerms, total=False):
    """The options of :func:`ce_core.sharded_linear_cross_entropy` besides its layout."""


@dataclasses.dataclass(frozen=True)
class Options:
    """Every option, validated, defaults applied (hashable: the static part of a jitted call).

    ``weights`` is an array, so it travels beside this object, not in it; so does an array
    ``temperature`` (``temperature`` here then stays 1.0), while a number stays a static field.
    """

    logit_soft_cap: float | None = None
    temperature: float = 1.0
    ignore_index: int = -100
    implementation: str | tuple[str, ...] | None = None
    block_sizes: BlockSizes | None = None
    precision: str | None = None
    reduction: str = "mean"
    logsumexp_weight: float = 0.0
    label_smoothing: float = 0.0
    vocab_axis_name: str | None = None
    in_specs: InSpecs | None = None
    w_layout: str = "hv"
    keep_logits: bool | None = None

    @classmethod
    def of(cls, function: str, accepted: type,
           keywords: Mapping[str, Any]) -> tuple[Options, jax.Array | None, Any]:
        """``(options, weights, temperature)`` from ``function``'s keywords, each checked (a ``ValueError`` naming it).

        ``temperature`` is ``None`` for a number (kept static in the options), else the array given,
        unchecked (it needs the labels' shape: :func:`ce_core.api.validation.temperature_tokens`).

        ``accepted`` is the function's ``TypedDict``: a keyword outside it is an error that lists them.
        """
        names: frozenset[str] = getattr(accepted, "__optional_keys__", frozenset())
        unknown = sorted(set(keywords) - names)
        if unknown:
            raise ValueError(f"{function}() got unexpected keyword argument(s) {unknown}; it takes {sorted(names)}")
        values = dict(keywords)
        weights = values.pop("weights", None)
        temperature = None
        if "temperature" in values and not validation.is_static_number(values["temperature"]):
            if isinstance(values["temperature"], (bool, str)) or values["temperature"] is None:
                validation.check_temperature(values["temperature"])
            temperature = values.pop("temperature")
        # Sequences as tuples: the options are hashable, the static part of a jitted call.
        if isinstance(values.get("in_specs"), list):
            values["in_specs"] = tuple(values["in_specs"])
        implementation = values.get("implementation")
        if implementation is not None and not isinstance(implementation, str):
            try:
                values["implementation"] = tuple(implementation)
            except TypeError:
                raise ValueError(f"implementation must be None, a backend name or a sequence of names, "
                                 f"got {implementation!r}") from None
        values["precision"] = validation.check_precision(values.get("precision"))
        options = cls(**values)
        options.check()
        return options, None if weights is None else validation.as_array(weights, "weights"), temperature

    def check(self) -> None:
        """Each scalar option's range and type."""
        validation.check_options(self.reduction, self.ignore_index, self.logsumexp_weight, self.logit_soft_cap,
                                 self.label_smoothing)
        validation.check_temperature(self.temperature)
        validation.check_vocab_axis_name(self.vocab_axis_name)
        validation.check_w_layout(self.w_layout)
        validation.check_keep_logits(self.keep_logits, self.reduction)
        if self.block_sizes is not None and not isinstance(self.block_sizes, BlockSizes):
            raise ValueError(f"block_sizes must be None or a ce_core.BlockSizes, got {self.block_sizes!r}")
