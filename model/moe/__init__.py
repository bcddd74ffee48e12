"""Mixture-of-Experts feed-forward layer.

  layer.py     the MoE layer and the functions the trainer calls on its diagnostics
  router.py    the one router: scores, top-R selection, balancing losses and biases
  dispatch.py  dispatch strategies (one function each, chosen once from the config)
  grouped.py   the grouped (ragged) expert matmul
"""

from model.moe.layer import MoE

__all__ = ["MoE"]
