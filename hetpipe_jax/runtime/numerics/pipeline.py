"""The numerics of one virtual worker: its k stages on their devices, and the tensors between them.

The engine says which task runs (:mod:`hetpipe_jax.core.schedule`) and which weight version it uses
(:mod:`hetpipe_jax.core.versions`); this adapter runs it: a forward takes its input (the minibatch at
stage 0, else the previous stage's activation, moved by the transport) and keeps its output for the next
stage; a backward takes the next stage's input gradient (moved back), applies its update and keeps the
gradient for the previous stage; the last stage's forward computes the loss.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax

from hetpipe_jax.core.comm import Comm
from hetpipe_jax.core.schedule import FWD, Task
from hetpipe_jax.errors import ProtocolError
from hetpipe_jax.runtime.numerics.stage import Stage, put_arrays


class PipelineNumerics:
  """Runs the tasks of virtual worker ``vw`` on ``stages`` (one per device, pipeline order).

  Args:
    vw: the virtual worker's index.
    stages: its stages.
    comm: moves activations and gradients between the stages' devices.
  """

  def __init__(self, vw: int, stages: Sequence[Stage], comm: Comm):
    self.vw, self.stages, self._comm = vw, list(stages), comm
    self._inputs: dict[tuple[int, int], Any] = {}  # (stage, mb) -> input of that stage's next task
    self._labels: dict[int, Any] = {}
    self._losses: dict[int, Any] = {}  # mb -> loss (device scalar), until its wave is pushed

  def checkpoint_state(self) -> dict[str, Any]:
    """The tensors between stages and every stage's state, for a checkpoint."""
    return {"inputs": dict(self._inputs), "labels": dict(self._labels), "losses": dict(self._losses),
            "stages": [stage.checkpoint_state() for stage in self.stages]}

  def restore_checkpoint_state(self, state: dict[str, Any]) -> None:
    """Puts back what :meth:`checkpoint_state` returned."""
    self._inputs = {(j, mb): put_arrays(x, self.stages[j].device) for (j, mb), x in state["inputs"].items()}
    self._labels = {mb: put_arrays(y, self.stages[-1].device) for mb, y in state["labels"].items()}
    self._losses = {mb: put_arrays(x, self.stages[-1].device) for mb, x in state["losses"].items()}
    for stage, stage_state in zip(self.stages, state["stages"]):
      stage.restore_checkpoint_state(stage_state)

  def drop(self) -> None:
    """The virtual worker failed: its tensors in flight and its stages' open accumulators are gone."""
    self._inputs, self._labels, self._losses = {}, {}, {}
    for stage in self.stages:
      stage.drop()

  def rejoin(self, params: Sequence[Any] | None) -> None:
    """A replacement: every stage <- the global weights of its units and a fresh local optimizer."""
    if params is None:
      raise ProtocolError(f"VW {self.vw} rejoined from a server without weights")
    for stage in self.stages:
      stage.restart(params[stage.first:stage.last])

  def inject(self, mb: int, x: Any, labels: Any) -> None:
    self._inputs[(0, mb)] = jax.device_put(x, self.stages[0].device)
    self._labels[mb] = jax.device_put(labels, self.stages[-1].device)

  def run(self, task: Task) -> Any:
    """Dispatches ``task`` (asynchronously); returns the arrays that are ready when it is done."""
    j, mb = task.stage, task.mb
    stage = self.stages[j]
    if task.kind == FWD:
      x = self._inputs.pop((j, mb))
      if j > 0:  # the activation comes from the previous stage's device
        x = self._comm.move(x, (self.vw, j - 1), (self.vw, j))
      out = stage.forward(mb, x, self._labels.pop(mb) if stage.is_last else None)
      if stage.is_last:
        self._losses[mb] = out
      else:
        self._inputs[(j + 1, mb)] = out
      return out
    g = None if stage.is_last else self._comm.move(self._inputs.pop((j + 1, mb)), (self.vw, j + 1), (self.vw, j))
    gx = stage.backward(mb, g)
    if j > 0:
      self._inputs[(j, mb)] = gx
    return stage.params

  def take_wave(self, wave: int) -> tuple[dict[int, Any], list[Any]]:
    """The wave's summed update of every unit (what a push sends) and its minibatches' losses."""
    updates = {}
    for stage in self.stages:
      for unit, update in zip(range(stage.first, stage.last), stage.take_wave(wave)):
        updates[unit] = update
    nm = self.stages[0].nm
    losses = [self._losses.pop(p, None) for p in range(wave * nm + 1, (wave + 1) * nm + 1)]
    return updates, losses

  def take_skipped(self, wave: int) -> int:
    """How many of the pushed wave's minibatch updates fp16 skipped, summed over the stages."""
    return sum(stage.take_skipped(wave) for stage in self.stages)

  def rebase(self, params: Sequence[Any] | None, open_updates: Sequence[int]) -> list[int]:
    """Every stage <- global weights of its units + its open wave accumulators; returns what each added."""
    del open_updates  # the stages count what they really add back, so a lost update shows in the trace
    if params is None:
      raise ProtocolError(f"VW {self.vw} pulled from a server without weights")
    return [stage.rebase(params[stage.first:stage.last]) for stage in self.stages]

  def warm_up(self, x: Any, labels: Any) -> None:
    """Compiles every stage program on a minibatch shaped like ``x`` before the clock starts."""
    for stage in self.stages:
      x = stage.warm_up(x, jax.device_put(labels, stage.device) if stage.is_last else None)
