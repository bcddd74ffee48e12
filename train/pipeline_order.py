"""The trainer's state with its layer stacks in the circular pipeline's order, and back.

With train.pipeline_repeats = R > 1 the circular schedule (parallel/pipeline_circular.py)
needs stage s to hold the layer chunks s, s + S, ..., while the stacked leaves split over
"stage" contiguously. So while it trains, the trainer keeps those leaves' rows in pipeline
order (the parameters and everything shaped like them: the optimizer's moments), and in
layer order everywhere else:

  init / restore  -> `to_pipeline` (once; the rows move between stages once)
  train and eval steps read the pipeline order (the loop's Evaluator is told R)
  every checkpoint save (the orbax tier and the local tier) -> `to_layers` (a copy)

Checkpoints therefore stay in layer order, independent of the stage count and of R: a run
saved with R = 2 resumes with R = 1, other stages, or none, and every reader (load_run,
--mode eval / generate, export, convert) sees layer order. A save holds one extra copy of
the stacked leaves on the device until orbax has copied it to the host.

Which leaves: those whose sharding splits their first dimension over "stage" (only the
"layers" logical axis maps to it, parallel/rules.py).
"""

from __future__ import annotations

from typing import Any

import jax

from parallel import pipeline_circular
from parallel.pipeline import AXIS


def _splits_stages(sharding: Any) -> bool:
  spec = getattr(sharding, "spec", None)
  if not spec:
    return False
  first = spec[0]
  return first == AXIS or (isinstance(first, tuple) and AXIS in first)


class PipelineOrder:
  """The row order of one run's stacked state leaves (`shardings`: the TrainState's
  NamedShardings). Identity unless the run trains with the circular schedule."""

  def __init__(self, shardings: Any, stages: int, repeats: int):
    self.stages, self.repeats = stages, repeats
    self.active = stages > 1 and repeats > 1
    leaves, self._treedef = jax.tree.flatten(shardings)
    self._which = [i for i, s in enumerate(leaves) if _splits_stages(s)]
    out = [leaves[i] for i in self._which]
    perm = lambda f: lambda xs: [f(x, stages, repeats) for x in xs]
    self._to_pipeline = jax.jit(perm(pipeline_circular.to_pipeline_order),
                                out_shardings=out, donate_argnums=0)
    self._to_layers = jax.jit(perm(pipeline_circular.to_layer_order), out_shardings=out)

  @classmethod
  def for_run(cls, session: Any) -> PipelineOrder:
    """The order of `session`'s trainer (train/lifecycle/session.py Session)."""
    return cls(session.shardings, int(session.mesh.shape.get(AXIS, 1)),
               int(session.spec.train.pipeline_repeats))

  def _apply(self, fn, state: Any) -> Any:
    if not self.active:
      return state
    leaves = self._treedef.flatten_up_to(state)
    for i, x in zip(self._which, fn([leaves[i] for i in self._which])):
      leaves[i] = x
    return self._treedef.unflatten(leaves)

  def to_pipeline(self, state: Any) -> Any:
    """A state in layer order (initialised or restored) -> the trainer's (donated)."""
    return self._apply(self._to_pipeline, state)

  def to_layers(self, state: Any) -> Any:
    """The trainer's state -> a copy in layer order, what a checkpoint holds."""
    return self._apply(self._to_layers, state)
