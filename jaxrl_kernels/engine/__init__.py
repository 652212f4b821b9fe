"""The engine: one custom_vjp skeleton (``vjp``) that turns per-device forward and backward
halves into a differentiable, sharded op, and the halves of the linear-head pipelines (lean:
``logprob_core``; fast: ``saved_logits``, ``fused_loss``, ``fused_distill``)."""
