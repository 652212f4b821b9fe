"""One on-policy distillation step (``--algo distill``): the losses and the served teacher.

:func:`make_distill_step` builds the jitted step: the student samples ``group_size`` answers to
each prompt with :func:`sampling.generate`, the frozen teacher runs forward on those answers
(``stop_gradient``), and the student takes an adamw step on

* ``linear_distill_loss(student_hidden, student_head, teacher_hidden, teacher_head, mask,
  config=jk.DistillLoss(divergence=...))``: the teacher scores every token over the whole
  vocabulary, and neither model's ``[B, T, V]`` logits are built; or, with ``teacher_topk``
  K > 0, a served teacher's reply (:func:`served_teacher`: per answer token its K most likely
  ids and their log-probs, through ``linear_topk_logprobs``, without gradient) and
  ``linear_topk_distill_loss(student_hidden, student_head, ids, logp, mask,
  config=jk.TopKDistillLoss(tail=...))``, the forward KL over those ids.

With ``loss="materialised"`` the same step runs the same losses in plain jnp
(:func:`materialised_distill_loss`, :func:`materialised_topk_distill_loss`: both heads'
logits, their log-softmaxes, ``lax.top_k`` for the served teacher), which
:mod:`jaxrl_kernels.demo.distill` times against ours.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

import jaxrl_kernels as jk
from jaxrl_kernels.demo import model as model_lib
from jaxrl_kernels.demo import rl_losses, rl_step, sampling
from jaxrl_kernels.demo.task import AdditionTask

LOSSES = ("jaxrl", "materialised")
"""The step's ``loss``: the jaxrl_kernels ops, or their materialised jnp versions."""
_LOG_TINY = float(np.log(np.finfo(np.float32).tiny))


def materialised_log_probs(hidden, weight, layout, temperature):
    """``log_softmax(hidden·Wᵀ / temperature)``: the ``[B, T, V]`` logits in the inputs' dtype,
    the log-softmax in float32."""
    z = jnp.einsum("btd,vd->btv" if layout == "vd" else "btd,dv->btv", hidden, weight)
    return jax.nn.log_softmax(z.astype(jnp.float32) / temperature, axis=-1)


def materialised_distill_loss(
    hidden,
    weight,
    teacher_hidden,
    teacher_weight,
    mask,
    *,
    weight_layout="vd",
    teacher_weight_layout="vd",
    config: jk.DistillLoss | None = None,
    temperature=1.0,
):
    """``linear_distill_loss`` in plain jnp, with the same arguments: both heads' ``[B, T, V]``
    logits (in the inputs' dtype, bf16 or float32), float32 log-softmaxes, the divergence of
    ``config`` (default ``jk.DistillLoss()``) per token."""
    config = config or jk.DistillLoss()
    ls = materialised_log_probs(hidden, weight, weight_layout, temperature)
    lt = materialised_log_probs(teacher_hidden, teacher_weight, teacher_weight_layout, temperature)
    ps, pt = jnp.exp(ls), jnp.exp(lt)
    if config.divergence == "reverse_kl":
        d = jnp.sum(ps * (ls - lt), axis=-1)
    elif config.divergence == "forward_kl":
        d = jnp.sum(pt * (lt - ls), axis=-1)
    else:
        beta = config.jsd_beta
        lm = jnp.logaddexp(jnp.log(beta) + lt, jnp.log1p(-beta) + ls)
        d = jnp.sum(beta * pt * (lt - lm) + (1 - beta) * ps * (ls - lm), axis=-1)
    d = jnp.where(mask != 0, d, 0.0)
    return jk.aggregate(d, mask, config.loss_agg_mode, max_len=config.max_len), d


def materialised_topk_distill_loss(
    hidden,
    weight,
    teacher_ids,
    teacher_logp,
    mask,
    *,
    weight_layout="vd",
    config: jk.TopKDistillLoss | None = None,
    temperature=1.0,
):
    """``linear_topk_distill_loss`` in plain jnp, with the same arguments: the student's
    ``[B, T, V]`` log-softmax gathered at the teacher's ids, per token
    ``Σ_k p_t,k (log p_t,k − log p_s,k)`` over the valid ids (``>= 0``), plus with
    ``config.tail == "bucket"`` ``r_t (log r_t − log r_s)`` with ``r = 1 − Σ_k p,k`` (0 where
    ``r_t <= 0``; ``log r_s`` at least log of float32's smallest normal)."""
    config = config or jk.TopKDistillLoss()
    valid = (teacher_ids >= 0) & (mask != 0)[..., None]
    ls = jnp.take_along_axis(
        materialised_log_probs(hidden, weight, weight_layout, temperature),
        jnp.maximum(teacher_ids, 0),
        axis=-1,
    )
    pt = jnp.where(valid, jnp.exp(teacher_logp.astype(jnp.float32)), 0.0)
    lt = jnp.where(pt > 0, teacher_logp.astype(jnp.float32), 0.0)
    d = jnp.sum(pt * (lt - ls), axis=-1)
    if config.tail == "bucket":
        r_t = 1.0 - jnp.sum(pt, axis=-1)
        r_s = 1.0 - jnp.sum(jnp.where(valid, jnp.exp(ls), 0.0), axis=-1)
        normal = r_s > np.exp(_LOG_TINY)
        log_r_s = jnp.where(normal, jnp.log(jnp.where(normal, r_s, 1.0)), _LOG_TINY)
        some = r_t > 0
        d = d + jnp.where(some, r_t * (jnp.log(jnp.where(some, r_t, 1.0)) - log_r_s), 0.0)
    d = jnp.where(mask != 0, d, 0.0)
    return jk.aggregate(d, mask, config.loss_agg_mode, max_len=config.max_len), d


def served_teacher(
    hidden,
    weight,
    k: int,
    *,
    weight_layout: str,
    temperature: float,
    backend: str | None,
    loss: str = "jaxrl",
) -> tuple[jax.Array, jax.Array]:
    """A served teacher's reply: per position its ``k`` most likely ids and their log-probs
    ``log softmax(hidden·Wᵀ / temperature)`` at those ids, ``([B, T, k] float32, [B, T, k]
    int32)``, without gradient; through ``linear_topk_logprobs`` (``loss="jaxrl"``, no logits
    built) or ``lax.top_k`` of the materialised log-softmax."""
    if loss == "jaxrl":
        logp, ids, _ = jk.linear_topk_logprobs(
            hidden, weight, k, weight_layout=weight_layout, temperature=temperature, backend=backend
        )
    else:
        logp, ids = jax.lax.top_k(
            materialised_log_probs(hidden, weight, weight_layout, temperature), k
        )
    return jax.lax.stop_gradient(logp), ids.astype(jnp.int32)


def _losses(
    loss: str,
    backend: str | None,
    *,
    config: jk.DistillLoss,
    topk_config: jk.TopKDistillLoss | None,
    temperature: float,
) -> tuple[Callable, Callable]:
    """``(whole_vocabulary, top_k)``: ``linear_distill_loss`` and ``linear_topk_distill_loss``
    (``loss="jaxrl"``) or their materialised jnp versions, with the run's options."""
    if loss == "jaxrl":
        whole = functools.partial(jk.linear_distill_loss, backend=backend)
        topk = functools.partial(jk.linear_topk_distill_loss, backend=backend)
    else:
        whole, topk = materialised_distill_loss, materialised_topk_distill_loss
    return (
        functools.partial(whole, config=config, temperature=temperature),
        functools.partial(topk, config=topk_config, temperature=temperature),
    )


def make_distill_step(
    student: model_lib.CausalLM,
    teacher: model_lib.CausalLM,
    task: AdditionTask,
    optimizer,
    *,
    group_size: int,
    temperature: float,
    config: jk.DistillLoss,
    backend: str | None,
    teacher_topk: int = 0,
    topk_config: jk.TopKDistillLoss | None = None,
    loss: str = "jaxrl",
) -> Callable:
    """The jitted step ``(state, teacher_params, prompts[n, P], sums[n], key) -> (state,
    metrics)``; ``state`` is the student's ``{"params", "opt_state", "step"}``.

    With ``teacher_topk`` K = 0 the student minimises ``config``'s divergence to the teacher
    over the whole vocabulary. With K > 0 the teacher is served (:func:`served_teacher`) and
    the student minimises the forward KL over its top-K ids (``topk_config``), ``topk_loss``
    in the metrics (with ``teacher_topk_mass``, the teacher's probability in those ids, mean
    per answer token). ``divergence`` in the metrics is the whole-vocabulary one (``config``)
    in both modes, on the step's tokens before the update."""
    whole, topk = _losses(
        loss, backend, config=config, topk_config=topk_config, temperature=temperature
    )

    def step(state, teacher_params, prompts, sums, key):
        prompts = jnp.repeat(prompts, group_size, axis=0)
        sums = jnp.repeat(sums, group_size, axis=0)
        actions, _, mask = sampling.generate(
            student, state["params"], prompts, key, max_new=task.max_new, temperature=temperature
        )
        sg = jax.lax.stop_gradient
        teacher_hidden = sg(rl_losses.answer_hidden(teacher, teacher_params, prompts, actions))
        teacher_weight, teacher_layout = model_lib.head_weight(
            teacher_params, teacher.tie_embeddings
        )
        teacher_weight = sg(teacher_weight)

        def whole_vocabulary(hidden, weight, layout):
            return whole(
                hidden,
                weight,
                teacher_hidden,
                teacher_weight,
                mask,
                weight_layout=layout,
                teacher_weight_layout=teacher_layout,
            )

        if teacher_topk:
            logp_t, ids_t = served_teacher(
                teacher_hidden,
                teacher_weight,
                teacher_topk,
                weight_layout=teacher_layout,
                temperature=temperature,
                backend=backend,
                loss=loss,
            )
            trained = lambda hidden, weight, layout: topk(
                hidden, weight, ids_t, logp_t, mask, weight_layout=layout
            )
        else:
            trained = whole_vocabulary

        def objective(params):
            weight, layout = model_lib.head_weight(params, student.tie_embeddings)
            hidden = rl_losses.answer_hidden(student, params, prompts, actions)
            value, per_token = trained(hidden, weight, layout)
            return value, (per_token, hidden)

        (value, (per_token, hidden)), grads = jax.value_and_grad(objective, has_aux=True)(
            state["params"]
        )
        if teacher_topk:
            weight, layout = model_lib.head_weight(state["params"], student.tie_embeddings)
            whole_value, whole_per_token = whole_vocabulary(sg(hidden), weight, layout)
            metrics = {
                "divergence": whole_value,
                "divergence_max": jnp.max(whole_per_token),
                "topk_loss": value,
                "topk_loss_max": jnp.max(per_token),
                "teacher_topk_mass": jk.aggregate(
                    jnp.sum(jnp.exp(logp_t), axis=-1), mask, "token_mean"
                ),
            }
        else:
            metrics = {"divergence": value, "divergence_max": jnp.max(per_token)}
        params, opt_state = rl_step.apply_updates(
            optimizer, state["params"], state["opt_state"], grads
        )
        scores = task.score(actions, sums)
        metrics.update(
            reward=jnp.mean(scores["reward"]),
            accuracy=jnp.mean(scores["correct"]),
            tokens=jnp.sum(mask),
        )
        return dict(state, params=params, opt_state=opt_state, step=state["step"] + 1), metrics

    return jax.jit(step)
