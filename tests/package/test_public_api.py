"""The public API, pinned: the names ``jaxrl_kernels`` exports and each op's positional
parameters. A change here is a change users see; make it on purpose, with docs/api.md.

Since 0.2 the ops take their options as config values and the old keywords arrive through
``**deprecated`` (removed in 0.3); the positional parts did not change.
"""

import inspect

import jaxrl_kernels as jk
import jaxrl_kernels.dispatch
import jaxrl_kernels.integrations  # noqa: F401  (the public path jaxrl_kernels.integrations.tunix)

NAMES = [
    "DistillLoss",
    "Groups",
    "PolicyLoss",
    "Sampler",
    "TopKDistillLoss",
    "aggregate",
    "available_backends",
    "checks",
    "explain",
    "group_advantages",
    "grpo_loss",
    "head_grad_pieces",
    "kl_penalty",
    "linear_distill_loss",
    "linear_grpo_loss",
    "linear_logprobs",
    "linear_policy_gradient_loss",
    "linear_ppo_loss",
    "linear_topk_distill_loss",
    "linear_topk_logprobs",
    "memory_mode",
    "policy_gradient_loss",
    "ppo_loss",
    "ratio_kl",
    "token_logprobs",
    "use_backend",
]

POSITIONAL = {
    "aggregate": ["values", "mask", "mode"],
    "available_backends": ["op"],
    "explain": ["op"],
    "group_advantages": ["rewards"],
    "grpo_loss": ["policy_logits", "ref_logits", "actions", "old_logp", "rewards", "mask"],
    "head_grad_pieces": ["pieces"],
    "kl_penalty": ["logp", "ref_logp", "estimator"],
    "linear_distill_loss": ["hidden", "weight", "teacher_hidden", "teacher_weight", "mask"],
    "linear_grpo_loss": ["hidden", "weight", "actions", "old_logp", "rewards", "mask"],
    "linear_logprobs": ["hidden", "weight", "targets", "bias"],
    "linear_policy_gradient_loss": ["hidden", "weight", "actions", "advantages", "mask"],
    "linear_ppo_loss": ["hidden", "weight", "actions", "old_logp", "advantages", "mask"],
    "linear_topk_distill_loss": ["hidden", "weight", "teacher_ids", "teacher_logp", "mask"],
    "linear_topk_logprobs": ["hidden", "weight", "k"],
    "memory_mode": ["mode"],
    "policy_gradient_loss": ["logp", "advantages", "mask"],
    "ppo_loss": ["logp", "old_logp", "advantages", "mask"],
    "ratio_kl": ["policy_logits", "ref_logits", "actions", "old_logp", "mask"],
    "token_logprobs": ["logits", "targets"],
    "use_backend": ["name"],
    "checks": ["enabled"],
}

DEPRECATED = (
    "group_advantages",
    "grpo_loss",
    "linear_distill_loss",
    "linear_grpo_loss",
    "linear_logprobs",
    "linear_policy_gradient_loss",
    "linear_ppo_loss",
    "linear_topk_distill_loss",
    "policy_gradient_loss",
    "ppo_loss",
    "token_logprobs",
)
"""The ops whose old option keywords still arrive through ``**deprecated`` (until 0.3)."""


def test_exported_names():
    assert sorted(jk.__all__) == sorted(NAMES)
    for name in NAMES:
        assert getattr(jk, name) is not None
    assert jaxrl_kernels.dispatch.BACKENDS == ("ffi", "pallas", "chunked", "reference")


def test_positional_parameters():
    for name in NAMES:
        fn = getattr(jk, name)
        if inspect.isclass(fn):
            continue
        params = inspect.signature(fn).parameters.values()
        positional = [
            p.name for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
        ]
        assert positional == POSITIONAL[name], name


def test_deprecated_keywords_and_the_signatures_size():
    for name in NAMES:
        fn = getattr(jk, name)
        if inspect.isclass(fn):
            continue
        params = inspect.signature(fn).parameters.values()
        var = [p.name for p in params if p.kind is p.VAR_KEYWORD]
        want = ["deprecated"] if name in DEPRECATED else ["kwargs"] if name == "explain" else []
        assert var == want, name
    for name in ("linear_grpo_loss", "linear_ppo_loss"):
        named = [
            p
            for p in inspect.signature(getattr(jk, name)).parameters.values()
            if p.kind is not p.VAR_KEYWORD
        ]
        # 18 with the options as config values; 20 since packed rows added segment_ids and
        # num_segments beside mask: the batch's layout, as mask is, not options.
        assert len(named) <= 20, (name, len(named))
