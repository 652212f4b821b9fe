"""End-to-end RL fine-tuning demo: a small Flax transformer learns addition.

``python -m jaxrl_kernels.demo --help`` (or the ``jaxrl-kernels-demo`` script).
Needs the ``demo`` extra: flax, optax, matplotlib.
"""

from jaxrl_kernels.demo.algos import ALGOS, RLConfig
from jaxrl_kernels.demo.task import AdditionTask
from jaxrl_kernels.demo.train import Config, Demo, run

__all__ = ["ALGOS", "AdditionTask", "Config", "Demo", "RLConfig", "run"]
