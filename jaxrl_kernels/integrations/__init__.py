"""Integrations with RL trainers. Each submodule is optional and imports its trainer.

- :mod:`jaxrl_kernels.integrations.tunix`: tunix policy losses ``"jaxrl_grpo"`` and
  ``"jaxrl_ppo"`` (``pip install "jaxrl_kernels[tunix]"``).
"""
