"""On-policy distillation between two sizes of the NNX decoder, with neither head's logits materialised.

The student (``examples/nnx_decoder.py``'s decoder, H=64) samples completions of copy-task prompts; the
teacher (the same decoder at H=128, pretrained on the task first) scores every sampled position; the student
takes a step on the reverse KL ``KL(p_student || p_teacher)`` over the sampled tokens, the mode-seeking
divergence on-policy distillation uses (GKD's ``beta = 1``). Both heads are the models' tied embedding
tables ``[V, H]``, used as stored (``w_layout="vh"``, ``teacher_w_layout="vh"``), and the loss is one call:

    linear_distillation_loss(student_hidden, student_table, teacher_hidden, teacher_table, targets,
                             divergence="reverse_kl", w_layout="vh", teacher_w_layout="vh")

``targets`` only marks which positions count (the sampled ones; the prompt is ``IGNORE``). The teacher is
data: its hidden states come from its own forward pass, outside the gradient.
:func:`materialised_reverse_kl` is the same loss from both heads' full float32 logits, for comparison.

Run it: ``uv run python examples/on_policy_distillation.py`` (about half a minute on a CPU).
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Callable
from pathlib import Path

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from ce_core import linear_distillation_loss

sys.path.insert(0, str(Path(__file__).resolve().parent))
import nnx_decoder as decoder

IGNORE = decoder.IGNORE
STUDENT = decoder.DecoderConfig()  # H=64
TEACHER = dataclasses.replace(decoder.DecoderConfig(), hidden_size=128, mlp_size=256)


def fused_reverse_kl(student_hidden: jax.Array, student_table: jax.Array, teacher_hidden: jax.Array,
                     teacher_table: jax.Array, targets: jax.Array, **options) -> jax.Array:
    """The mean reverse KL over the counted positions, streamed (``options`` go to the loss)."""
    return linear_distillation_loss(student_hidden, student_table, teacher_hidden, teacher_table, targets,
                                    divergence="reverse_kl", w_layout="vh", teacher_w_layout="vh", **options)


def materialised_reverse_kl(student_hidden: jax.Array, student_table: jax.Array, teacher_hidden: jax.Array,
                            teacher_table: jax.Array, targets: jax.Array) -> jax.Array:
    """The same from both heads' ``[B, T, V]`` float32 logits."""
    log_p = jax.nn.log_softmax(student_hidden.astype(jnp.float32) @ student_table.astype(jnp.float32).T, axis=-1)
    log_q = jax.nn.log_softmax(teacher_hidden.astype(jnp.float32) @ teacher_table.astype(jnp.float32).T, axis=-1)
    per_token = jnp.sum(jnp.exp(log_p) * (log_p - log_q), axis=-1)
    counted = targets != IGNORE
    return jnp.sum(jnp.where(counted, per_token, 0.0)) / jnp.maximum(jnp.sum(counted), 1)


DistillLoss = Callable[[jax.Array, jax.Array, jax.Array, jax.Array, jax.Array], jax.Array]


def teacher_scores(teacher_graph: nnx.GraphDef, teacher_params: nnx.State,
                   tokens: jax.Array) -> tuple[jax.Array, jax.Array]:
    """The teacher's hidden states at every position of ``tokens[:, :-1]`` and its head (data for the student)."""
    teacher = nnx.merge(teacher_graph, teacher_params)
    return jax.lax.stop_gradient(teacher(tokens[:, :-1])), jax.lax.stop_gradient(teacher.table)


def distillation_loss(params: nnx.State, graphdef: nnx.GraphDef, tokens: jax.Array, targets: jax.Array,
                      teacher_hidden: jax.Array, teacher_table: jax.Array,
                      loss: DistillLoss = fused_reverse_kl) -> jax.Array:
    """The student's loss on its own samples, scored by the teacher."""
    student = nnx.merge(graphdef, params)
    return loss(student(tokens[:, :-1]), student.table, teacher_hidden, teacher_table, targets)


def make_distillation_step(graphdef: nnx.GraphDef, optimizer: optax.GradientTransformation,
                           loss: DistillLoss = fused_reverse_kl):
    """A jitted step ``(params, opt_state, tokens, targets, teacher_hidden, teacher_table) -> (params, opt_state,
    loss)``."""

    @jax.jit
    def step(params, opt_state, tokens, targets, teacher_hidden, teacher_table):
        value, grads = jax.value_and_grad(distillation_loss)(params, graphdef, tokens, targets, teacher_hidden,
                                                             teacher_table, loss)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, value

    return step


@dataclasses.dataclass(frozen=True)
class DistillConfig:
    """The on-policy loop: prompts of the copy task, completions sampled by the student at temperature 1."""

    teacher_steps: int = 60
    steps: int = 12
    num_prompts: int = 8
    period: int = 8
    alphabet: int = 16
    prompt_repeats: int = 2
    completion_length: int = 8
    learning_rate: float = 3e-3
    seed: int = 0


def on_policy_batch(graphdef: nnx.GraphDef, params: nnx.State, config: DistillConfig,
                    step: int) -> tuple[jax.Array, jax.Array]:
    """The student's samples ``tokens [B, L]`` and ``targets [B, L-1]`` (the sampled next tokens; the prompt
    ``IGNORE``)."""
    prompt_key, sample_key = jax.random.split(jax.random.fold_in(jax.random.key(config.seed + 7), step))
    pattern = jax.random.randint(prompt_key, (config.num_prompts, config.period), 0, config.alphabet)
    prompts = jnp.tile(pattern, (1, config.prompt_repeats))
    temperatures = (1.0,) * config.num_prompts
    tokens = decoder.sample(graphdef, params, prompts, config.completion_length, temperatures, sample_key)
    sampled = jnp.arange(1, tokens.shape[1]) >= prompts.shape[1]
    return tokens, jnp.where(sampled, tokens[:, 1:], IGNORE)


def distill(config: DistillConfig = DistillConfig(), loss: DistillLoss = fused_reverse_kl,
            ) -> tuple[list[float], nnx.GraphDef, nnx.State]:
    """Pretrain the teacher, then ``config.steps`` on-policy steps of the student; the reverse KL per step."""
    teacher_graph, teacher_params, _ = decoder.pretrain(
        TEACHER, decoder.TrainConfig(steps=config.teacher_steps, period=config.period, alphabet=config.alphabet),
        decoder.tied_head_loss)
    graphdef, params = decoder.init_model(STUDENT, config.seed + 1)
    optimizer = optax.adam(config.learning_rate)
    opt_state = optimizer.init(params)
    step = make_distillation_step(graphdef, optimizer, loss)
    log = []
    for i in range(config.steps):
        tokens, targets = on_policy_batch(graphdef, params, config, i)
        teacher_hidden, teacher_table = teacher_scores(teacher_graph, teacher_params, tokens)
        params, opt_state, value = step(params, opt_state, tokens, targets, teacher_hidden, teacher_table)
        log.append(float(value))
    return log, graphdef, params


def demo(config: DistillConfig = DistillConfig()) -> None:
    print(f"teacher: H={TEACHER.hidden_size}, pretrained {config.teacher_steps} steps on the copy task; "
          f"student: H={STUDENT.hidden_size}, from its init; V={STUDENT.vocab_size}, tied heads")
    log, _, _ = distill(config)
    for i, value in enumerate(log):
        print(f"on-policy step {i:2d}: reverse KL(student || teacher) {value:.4f}")


if __name__ == "__main__":
    from ce_core.extend import quiet_libtpu_without_tpu

    quiet_libtpu_without_tpu()
    demo()
