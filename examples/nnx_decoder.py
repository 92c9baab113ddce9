"""A small Flax NNX decoder whose LM head is its input embedding (tied), trained through ``ce_core``.

The model: token embedding (``nnx.Embed``, table ``[V, H]``), pre-norm transformer blocks (causal
self-attention with rotary positions, a SwiGLU MLP, RMSNorm), a final RMSNorm, and the embedding
table again as the LM head. Two uses, each against the same model on materialised logits:

- Pretraining (next-token cross-entropy, AdamW through optax) on a synthetic copy task: the loss
  comes from ``linear_cross_entropy`` and never builds the ``[tokens, V]`` logits.
- The RL path: sampled completions scored, then a GRPO-style policy-gradient step whose per-token
  log-probabilities and entropies come from ``linear_log_probs`` at each sequence's sampling
  temperature.

The head is reached through two small functions, :func:`tied_head_loss` and
:func:`sequence_log_probs`; each marks the one line that changes when ``w_layout="vh"`` (the
``[V, H]`` table used as it is, no transposed copy), ``return_argmax=True`` and per-sequence
temperatures land in ``ce_core``.

Run it for a short log: ``uv run python examples/nnx_decoder.py``.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from ce_core import default_chain, linear_cross_entropy, linear_log_probs

IGNORE = -100  # ce_core's default ignore_index: prompt tokens and unpredictable targets


@dataclasses.dataclass(frozen=True)
class DecoderConfig:
    """Sizes of the decoder; the vocab is deliberately not a multiple of 128."""

    vocab_size: int = 1000
    hidden_size: int = 64
    num_layers: int = 2
    num_heads: int = 4
    mlp_size: int = 128


def rotary(x: jax.Array) -> jax.Array:
    """Rotary position embedding of ``x [B, T, heads, D]`` (positions ``0..T-1``, pairs ``(i, i + D/2)``)."""
    half = x.shape[-1] // 2
    frequencies = 10_000.0 ** (-jnp.arange(half, dtype=jnp.float32) / half)
    angles = jnp.arange(x.shape[1], dtype=jnp.float32)[:, None] * frequencies  # [T, D/2]
    cos, sin = jnp.cos(angles)[:, None, :], jnp.sin(angles)[:, None, :]
    first, second = x[..., :half], x[..., half:]
    return jnp.concatenate([first * cos - second * sin, second * cos + first * sin], axis=-1)


class Block(nnx.Module):
    """Pre-norm transformer block: causal rotary self-attention, then a SwiGLU MLP."""

    def __init__(self, config: DecoderConfig, *, rngs: nnx.Rngs):
        hidden = config.hidden_size
        self.num_heads = config.num_heads
        self.attention_norm = nnx.RMSNorm(hidden, rngs=rngs)
        self.qkv = nnx.Linear(hidden, 3 * hidden, use_bias=False, rngs=rngs)
        self.attention_out = nnx.Linear(hidden, hidden, use_bias=False, rngs=rngs)
        self.mlp_norm = nnx.RMSNorm(hidden, rngs=rngs)
        self.mlp_in = nnx.Linear(hidden, 2 * config.mlp_size, use_bias=False, rngs=rngs)  # gate and value
        self.mlp_out = nnx.Linear(config.mlp_size, hidden, use_bias=False, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        batch, length, hidden = x.shape
        qkv = self.qkv(self.attention_norm(x)).reshape(batch, length, 3, self.num_heads, hidden // self.num_heads)
        q, k, v = rotary(qkv[:, :, 0]), rotary(qkv[:, :, 1]), qkv[:, :, 2]
        attended = jax.nn.dot_product_attention(q, k, v, is_causal=True)
        x = x + self.attention_out(attended.reshape(batch, length, hidden))
        gate, value = jnp.split(self.mlp_in(self.mlp_norm(x)), 2, axis=-1)
        return x + self.mlp_out(jax.nn.silu(gate) * value)


class Decoder(nnx.Module):
    """Token ids ``[B, T]`` -> final hidden states ``[B, T, H]``; the LM head is :attr:`table` (tied)."""

    def __init__(self, config: DecoderConfig, *, rngs: nnx.Rngs):
        self.embed = nnx.Embed(config.vocab_size, config.hidden_size, rngs=rngs)
        self.blocks = nnx.List([Block(config, rngs=rngs) for _ in range(config.num_layers)])
        self.final_norm = nnx.RMSNorm(config.hidden_size, rngs=rngs)

    def __call__(self, tokens: jax.Array) -> jax.Array:
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.final_norm(x)

    @property
    def table(self) -> jax.Array:
        """The embedding table ``[V, H]``: row ``j`` embeds token ``j`` and is also its output vector."""
        return self.embed.embedding[...]


# ----------------------------------------------------------------------------------------------
# The head: fused (ce_core) and materialised (the reference).

HeadLoss = Callable[[jax.Array, jax.Array, jax.Array], tuple[jax.Array, jax.Array]]


def tied_head_loss(hidden: jax.Array, labels: jax.Array, table: jax.Array, **options) -> tuple[jax.Array, jax.Array]:
    """Mean next-token cross-entropy of ``hidden [B, T, H]`` under the tied head ``table [V, H]``, fused.

    Returns ``(loss, predicted)``: ``predicted`` is each token's argmax (``-1`` where ignored), from the
    same pass, for the accuracy. ``w_layout="vh"`` reads the table as it is stored: no transposed copy.
    """
    return linear_cross_entropy(hidden, labels, table, w_layout="vh", return_argmax=True, **options)


def materialised_head_loss(hidden: jax.Array, labels: jax.Array, table: jax.Array) -> tuple[jax.Array, jax.Array]:
    """The same loss from the full float32 logits ``hidden @ table.T`` (optax), and their argmax."""
    logits = hidden.astype(jnp.float32) @ table.astype(jnp.float32).T
    counted = labels != IGNORE
    losses = optax.softmax_cross_entropy_with_integer_labels(logits, jnp.where(counted, labels, 0))
    loss = jnp.sum(jnp.where(counted, losses, 0.0)) / jnp.maximum(jnp.sum(counted), 1)
    return loss, jnp.argmax(logits, axis=-1)


def token_accuracy(predicted: jax.Array, labels: jax.Array) -> jax.Array:
    """Share of counted tokens whose argmax is the label."""
    counted = labels != IGNORE
    return jnp.sum((predicted == labels) & counted) / jnp.maximum(jnp.sum(counted), 1)


# ----------------------------------------------------------------------------------------------
# Pretraining on a synthetic copy task.


def copy_task_batch(key: jax.Array, batch: int, length: int, alphabet: int, period: int) -> tuple[jax.Array, jax.Array]:
    """``(inputs, labels)``, both ``[batch, length]``: a random pattern of ``period`` tokens, repeated.

    Patterns use the first ``alphabet`` token ids only, so a few dozen steps show learning: first the
    alphabet (the loss falls from ``log V`` towards ``log alphabet``), then copying.

    The label of position ``t`` is token ``t + 1``; until the pattern has been seen once it cannot
    be predicted, so those labels are ``IGNORE`` (the loss and the accuracy skip them).
    """
    pattern = jax.random.randint(key, (batch, period), 0, alphabet)
    tokens = jnp.tile(pattern, (1, -(-(length + 1) // period)))[:, : length + 1]
    labels = jnp.where(jnp.arange(length) >= period - 1, tokens[:, 1:], IGNORE)
    return tokens[:, :-1], labels


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """Optimiser and data of the pretraining run (batch 4, 32 tokens a row)."""

    steps: int = 5
    batch: int = 4
    length: int = 32
    period: int = 8
    alphabet: int = 16
    learning_rate: float = 1e-2
    weight_decay: float = 0.01
    seed: int = 0


def init_model(config: DecoderConfig, seed: int) -> tuple[nnx.GraphDef, nnx.State]:
    """The model split into its static graph and its parameters (a pytree ``jax.jit`` and optax take)."""
    return nnx.split(Decoder(config, rngs=nnx.Rngs(seed)), nnx.Param)


def make_train_step(graphdef: nnx.GraphDef, optimizer: optax.GradientTransformation, head_loss: HeadLoss):
    """A jitted AdamW step ``(params, opt_state, inputs, labels) -> (params, opt_state, loss, accuracy)``."""

    def loss_fn(params, inputs, labels):
        model = nnx.merge(graphdef, params)
        return head_loss(model(inputs), labels, model.table)

    @jax.jit
    def step(params, opt_state, inputs, labels):
        (loss, predicted), grads = jax.value_and_grad(loss_fn, has_aux=True)(params, inputs, labels)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss, token_accuracy(predicted, labels)

    return step


def pretrain(config: DecoderConfig, train: TrainConfig, head_loss: HeadLoss,
             ) -> tuple[nnx.GraphDef, nnx.State, list[tuple[float, float]]]:
    """Train from the init of ``train.seed`` on batches that depend only on the seed and the step.

    Returns the graph, the trained parameters, and ``(loss, accuracy)`` per step, so two runs with
    different heads can be compared step by step.
    """
    graphdef, params = init_model(config, train.seed)
    optimizer = optax.adamw(train.learning_rate, weight_decay=train.weight_decay)
    opt_state = optimizer.init(params)
    step = make_train_step(graphdef, optimizer, head_loss)
    data_key = jax.random.key(train.seed + 1)
    log = []
    for i in range(train.steps):
        inputs, labels = copy_task_batch(jax.random.fold_in(data_key, i), train.batch, train.length,
                                         train.alphabet, train.period)
        params, opt_state, loss, accuracy = step(params, opt_state, inputs, labels)
        log.append((float(loss), float(accuracy)))
    return graphdef, params, log


# ----------------------------------------------------------------------------------------------
# The RL path: sampling, per-token log-probs and entropy, a GRPO-style step.


def sequence_log_probs(hidden: jax.Array, tokens: jax.Array, table: jax.Array, temperatures: float | Sequence[float],
                       **options) -> tuple[jax.Array, jax.Array]:
    """Per-token ``(logp, entropy)`` ``[B, T]`` of ``tokens`` (``IGNORE`` where not sampled: 0 for both), fused.

    Sequence ``b`` was sampled at ``temperatures[b]`` (passed as a per-sequence ``[B, 1]``
    temperature: one fused call for the whole batch), or all at one temperature. ``options`` go to
    ``linear_log_probs``.
    """
    if isinstance(temperatures, int | float):
        temperature: float | jax.Array = float(temperatures)
    else:
        temperature = jnp.asarray(temperatures, jnp.float32)[:, None]
    return linear_log_probs(hidden, tokens, table, w_layout="vh", temperature=temperature, return_entropy=True,
                            **options)



def materialised_log_probs(hidden: jax.Array, tokens: jax.Array, table: jax.Array,
                           temperatures: float | Sequence[float]) -> tuple[jax.Array, jax.Array]:
    """The same from the full float32 logits ``hidden @ table.T / T_b``."""
    scale = jnp.broadcast_to(jnp.asarray(temperatures, jnp.float32), tokens.shape[:1])[:, None, None]
    log_p = jax.nn.log_softmax(hidden.astype(jnp.float32) @ table.astype(jnp.float32).T / scale, axis=-1)
    counted = tokens != IGNORE
    logp = jnp.take_along_axis(log_p, jnp.where(counted, tokens, 0)[..., None], axis=-1)[..., 0]
    entropy = -jnp.sum(jnp.exp(log_p) * log_p, axis=-1)
    return jnp.where(counted, logp, 0.0), jnp.where(counted, entropy, 0.0)


LogProbsFn = Callable[[jax.Array, jax.Array, jax.Array, float | Sequence[float]], tuple[jax.Array, jax.Array]]


@functools.partial(jax.jit, static_argnums=(0, 3, 4))
def sample(graphdef: nnx.GraphDef, params: nnx.State, prompts: jax.Array, completion_length: int,
           temperatures: tuple[float, ...], key: jax.Array) -> jax.Array:
    """Prompts ``[B, P]`` completed to ``[B, P + completion_length]``, row ``b`` sampled at ``temperatures[b]``.

    No KV cache (the model is tiny): each step reruns the prefix and takes one position's logits, ``[B, V]``.
    """
    model = nnx.merge(graphdef, params)
    batch, prompt_length = prompts.shape
    tokens = jnp.concatenate([prompts, jnp.zeros((batch, completion_length), prompts.dtype)], axis=1)
    inverse_temperature = 1.0 / jnp.asarray(temperatures, jnp.float32)[:, None]

    def next_token(t, tokens):
        hidden = model(tokens)[:, t - 1]  # causal: the placeholder zeros after t do not reach it
        logits = (hidden @ model.table.T) * inverse_temperature
        return tokens.at[:, t].set(jax.random.categorical(jax.random.fold_in(key, t), logits).astype(tokens.dtype))

    return jax.lax.fori_loop(prompt_length, prompt_length + completion_length, next_token, tokens)


def group_advantages(rewards: jax.Array, group_size: int, eps: float = 1e-6) -> jax.Array:
    """Each sequence's reward standardised within its group of ``group_size`` (GRPO)."""
    grouped = rewards.reshape(-1, group_size)
    standardised = (grouped - grouped.mean(axis=1, keepdims=True)) / (grouped.std(axis=1, keepdims=True) + eps)
    return standardised.reshape(rewards.shape)


@dataclasses.dataclass(frozen=True)
class RlConfig:
    """The RL batch: ``num_prompts`` prompts, ``group_size`` samples each, per-sequence temperatures."""

    num_prompts: int = 2
    group_size: int = 4
    period: int = 8
    alphabet: int = 16  # as in pretraining
    prompt_repeats: int = 2  # the prompt shows the pattern this many times; the completion should continue it
    completion_length: int = 16
    temperatures: tuple[float, ...] = (0.7, 1.0)  # cycled over the sequences of a group
    clip_epsilon: float = 0.2
    entropy_coefficient: float = 1e-3
    learning_rate: float = 1e-3
    seed: int = 0

    def sequence_temperatures(self) -> tuple[float, ...]:
        return tuple(self.temperatures[i % len(self.temperatures)] for i in range(self.num_prompts * self.group_size))


def rollout(graphdef: nnx.GraphDef, params: nnx.State, rl: RlConfig) -> dict[str, jax.Array]:
    """Samples a group of completions per prompt and scores them: the batch a GRPO step trains on.

    Reward: the share of completion tokens that continue the prompt's repeating pattern.
    Returns ``tokens [B, L]``, ``targets [B, L-1]`` (next tokens, ``IGNORE`` on the prompt),
    ``rewards`` and ``advantages`` ``[B]``.
    """
    prompt_key, sample_key = jax.random.split(jax.random.key(rl.seed))
    pattern = jax.random.randint(prompt_key, (rl.num_prompts, rl.period), 0, rl.alphabet)
    prompts = jnp.repeat(jnp.tile(pattern, (1, rl.prompt_repeats)), rl.group_size, axis=0)
    tokens = sample(graphdef, params, prompts, rl.completion_length, rl.sequence_temperatures(), sample_key)
    prompt_length = prompts.shape[1]
    expected = jnp.tile(prompts[:, : rl.period], (1, -(-rl.completion_length // rl.period)))[:, : rl.completion_length]
    rewards = jnp.mean(tokens[:, prompt_length:] == expected, axis=1, dtype=jnp.float32)
    sampled = jnp.arange(1, tokens.shape[1]) >= prompt_length
    targets = jnp.where(sampled, tokens[:, 1:], IGNORE)
    return {"tokens": tokens, "targets": targets, "rewards": rewards,
            "advantages": group_advantages(rewards, rl.group_size)}


def policy_loss(params: nnx.State, graphdef: nnx.GraphDef, batch: dict[str, jax.Array], old_logp: jax.Array,
                rl: RlConfig, log_probs: LogProbsFn = sequence_log_probs) -> tuple[jax.Array, jax.Array]:
    """GRPO-style loss ``-min(r A, clip(r) A) - alpha * entropy`` per sampled token, mean per sequence, then over
    sequences; ``r = exp(logp - old_logp)``. Returns ``(loss, mean entropy)``."""
    model = nnx.merge(graphdef, params)
    hidden = model(batch["tokens"][:, :-1])
    logp, entropy = log_probs(hidden, batch["targets"], model.table, rl.sequence_temperatures())
    ratio = jnp.exp(logp - old_logp)
    advantage = batch["advantages"][:, None]
    clipped = jnp.clip(ratio, 1.0 - rl.clip_epsilon, 1.0 + rl.clip_epsilon)
    per_token = -jnp.minimum(ratio * advantage, clipped * advantage) - rl.entropy_coefficient * entropy
    mask = (batch["targets"] != IGNORE).astype(jnp.float32)
    per_sequence = jnp.sum(per_token * mask, axis=1) / jnp.maximum(jnp.sum(mask, axis=1), 1.0)
    return jnp.mean(per_sequence), jnp.sum(entropy * mask) / jnp.maximum(jnp.sum(mask), 1.0)


def token_log_probs(params: nnx.State, graphdef: nnx.GraphDef, batch: dict[str, jax.Array], rl: RlConfig,
                    log_probs: LogProbsFn = sequence_log_probs) -> tuple[jax.Array, jax.Array]:
    """``(logp, entropy)`` of the batch's sampled tokens under ``params`` (a trainer stores the sampling
    policy's ``logp`` at rollout time: the ``old_logp`` of the ratio)."""
    model = nnx.merge(graphdef, params)
    return log_probs(model(batch["tokens"][:, :-1]), batch["targets"], model.table, rl.sequence_temperatures())


def make_rl_step(graphdef: nnx.GraphDef, optimizer: optax.GradientTransformation, rl: RlConfig,
                 log_probs: LogProbsFn = sequence_log_probs):
    """A jitted policy-gradient step ``(params, opt_state, batch, old_logp) -> (params, opt_state, loss, entropy)``."""

    @jax.jit
    def step(params, opt_state, batch, old_logp):
        (loss, entropy), grads = jax.value_and_grad(policy_loss, has_aux=True)(params, graphdef, batch, old_logp, rl,
                                                                              log_probs)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss, entropy

    return step


def demo(config: DecoderConfig = DecoderConfig(), train: TrainConfig = TrainConfig(steps=60),
         rl: RlConfig = RlConfig(), rl_steps: int = 3) -> None:
    """Pretrain with the fused head and, from the same init, with materialised logits; then a few GRPO steps."""
    print(f"decoder: V={config.vocab_size} H={config.hidden_size} layers={config.num_layers}, tied head; "
          f"copy task, batch {train.batch} x {train.length} tokens, AdamW lr {train.learning_rate}; "
          f"fused head on {default_chain()[0]!r} (this platform's default backend)")
    graphdef, params, fused = pretrain(config, train, tied_head_loss)
    _, _, reference = pretrain(config, train, materialised_head_loss)
    print("step  fused loss  materialised loss  accuracy (materialised)")
    for i, ((loss, _), (expected, accuracy)) in enumerate(zip(fused, reference, strict=True)):
        if i % 10 == 0 or i == train.steps - 1:
            print(f"{i:4d}  {loss:10.5f}  {expected:17.5f}  {accuracy:8.3f}")
    drift = [abs(a - b) / abs(b) for (a, _), (b, _) in zip(fused, reference, strict=True)]
    print(f"largest relative loss difference: {max(drift[:5]):.1e} over the first 5 steps, "
          f"{max(drift):.1e} over all {train.steps} (float32 rounding, compounded by training)")

    batch = rollout(graphdef, params, rl)
    log_probs = jax.jit(token_log_probs, static_argnums=(1, 3, 4))
    logp, entropy = log_probs(params, graphdef, batch, rl, sequence_log_probs)
    expected_logp, expected_entropy = log_probs(params, graphdef, batch, rl, materialised_log_probs)
    print(f"RL: {rl.num_prompts} prompts x {rl.group_size} samples at temperatures {rl.sequence_temperatures()}; "
          f"mean reward {float(batch['rewards'].mean()):.3f}")
    print(f"    fused vs materialised: max |d logp| {float(jnp.max(jnp.abs(logp - expected_logp))):.1e}, "
          f"max |d entropy| {float(jnp.max(jnp.abs(entropy - expected_entropy))):.1e}")
    optimizer = optax.adam(rl.learning_rate)
    opt_state = optimizer.init(params)
    step = make_rl_step(graphdef, optimizer, rl)
    old_logp = logp  # the sampling policy's, fixed for the steps on this batch
    for i in range(rl_steps):
        params, opt_state, loss, mean_entropy = step(params, opt_state, batch, old_logp)
        print(f"    GRPO step {i}: loss {float(loss):+.5f}, mean entropy {float(mean_entropy):.4f}")


if __name__ == "__main__":
    from ce_core.extend import quiet_libtpu_without_tpu

    quiet_libtpu_without_tpu()  # libtpu is installed for TPU compiles; without a TPU it would complain at start-up
    demo()
