"""Per-wave metrics of a training run: one row per pushed wave, and the global weights to evaluate.

The engine calls :meth:`WaveMetrics.on_wave` after every push. Rows keep the wave's losses as device
scalars (no host sync in the hot path) and the global weights are snapshotted (immutable arrays, no
copy) every ``eval_every`` global clock ticks; :meth:`WaveMetrics.finish` evaluates and resolves them
after the executor stops, so evaluation never perturbs the timing.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from absl import logging

from hetpipe_jax.core import wsp
from hetpipe_jax.core.server import Server


def eval_due(clock: int, eval_every: int, waves: int) -> bool:
  """Whether global clock ``clock``, just reached, is an evaluation tick (every ``eval_every``, and the end)."""
  return clock % eval_every == 0 or clock == waves


class WaveMetrics:
  """Collects ``{"vw", "wave", "step", "time", "train_loss", "global_clock"}`` per pushed wave, and
  ``test_accuracy`` and ``test_loss`` (of the global weights, on the test split) at every evaluation.

  Args:
    ps: the parameter server (its clock decides when to snapshot its ``params``, the global weights).
    nms: Nm of every virtual worker (a wave of VW i is nms[i] steps).
    waves: waves each virtual worker runs.
    eval_every: snapshot the global weights every this many global clock ticks (and at the end).
  """

  def __init__(self, ps: Server, nms: list[int], waves: int, eval_every: int):
    self._ps, self.nms, self._waves, self._eval_every = ps, nms, waves, eval_every
    self.rows: list[dict[str, Any]] = []
    self._snapshots: list[tuple[int, Any]] = []  # (row index, global params) to evaluate after the run
    self._clock = 0  # the last global clock seen
    self._pushed = 0

  def on_wave(self, vw: int, wave: int, t: float, losses: list) -> None:
    """Records a pushed wave; snapshots the global weights when the global clock reaches an eval tick."""
    self._pushed += 1
    clock = wsp.c_global(self._ps.clock)
    self.rows.append({"vw": vw, "wave": wave, "step": (wave + 1) * self.nms[vw], "time": t,
                      "train_loss": losses, "global_clock": clock})
    if clock > self._clock:
      self._clock = clock
      if eval_due(clock, self._eval_every, self._waves):
        self._snapshots.append((len(self.rows) - 1, self._ps.params))  # type: ignore[attr-defined]
        logging.info("global clock %d/%d  t=%.4gs  VW %d wave %d loss %.4f  (%d/%d waves pushed)",
                     clock, self._waves, t, vw, wave, float(np.mean(jax.device_get(losses))),
                     self._pushed, self._waves * len(self.nms))

  def resolve(self, evaluate: Callable[[Any], dict[str, float]]) -> None:
    """Evaluates the snapshots taken so far and resolves the losses to floats (what :meth:`finish` does;
    before a checkpoint, so that it holds numbers, not arrays)."""
    for row_index, params in self._snapshots:
      self.rows[row_index].update(evaluate(params))  # test_accuracy, test_loss
    self._snapshots = []
    pending = [row for row in self.rows if not isinstance(row["train_loss"], float)]
    for row, losses in zip(pending, jax.device_get([row["train_loss"] for row in pending])):
      row["train_loss"] = float(np.mean(losses))

  def checkpoint_state(self, evaluate: Callable[[Any], dict[str, float]]) -> dict[str, Any]:
    """The rows so far (resolved; as JSON text, which keeps their key order), for a checkpoint."""
    self.resolve(evaluate)
    return {"rows": json.dumps(self.rows), "clock": self._clock, "pushed": self._pushed}

  def restore_checkpoint_state(self, state: dict[str, Any]) -> None:
    self.rows = json.loads(state["rows"])
    self._clock, self._pushed, self._snapshots = state["clock"], state["pushed"], []

  def finish(self, final_params, evaluate: Callable[[Any], dict[str, float]]) -> list[dict[str, Any]]:
    """Evaluates every snapshot (and ``final_params`` on the last row), resolves the losses to floats."""
    rows = self.rows
    if not self._snapshots or self._snapshots[-1][0] != len(rows) - 1:
      self._snapshots.append((len(rows) - 1, final_params))
    self.resolve(evaluate)
    return rows


class Replayed:
  """The clocks and gathered weights of a run, as :class:`WaveMetrics` reads a server: ``gathers`` are taken in
  order, one per evaluation tick (a run in parts appends each part's as it ends)."""

  def __init__(self, num_vws: int, gathers: list[Any]):
    self.clock = wsp.init(num_vws)
    self.gathers = gathers
    self._taken = 0

  @property
  def params(self):
    self._taken += 1
    return self.gathers[self._taken - 1]


def replay(metrics: WaveMetrics, server: Replayed, events) -> None:
  """Feeds ``metrics`` a run's pushes from its trace in order (``server`` following its leaves and joins), each
  wave's losses from its last stage's forwards (their ``loss``)."""
  losses = {(ev["vw"], ev["mb"]): ev["loss"] for ev in events if ev["ev"] == "fwd" and "loss" in ev}
  for ev in events:
    if ev["ev"] == "leave":
      server.clock = wsp.leave(server.clock, ev["vw"])
    elif ev["ev"] == "join":
      server.clock = wsp.join(server.clock, ev["vw"], ev["clock"])
    elif ev["ev"] == "push":
      i, wave, nm = ev["vw"], ev["wave"], metrics.nms[ev["vw"]]
      server.clock = wsp.push(server.clock, i, wave)
      mbs = range(wave * nm + 1, (wave + 1) * nm + 1)  # (a loss that died with a process: NaN)
      metrics.on_wave(i, wave, ev["t"], [losses.get((i, mb), float("nan")) for mb in mbs])


def replay_metrics(events, gathers, nms: list[int], waves: int, eval_every: int) -> WaveMetrics:
  """The :class:`WaveMetrics` of a run that did not have them as it went (a decentralised ``multiprocess``
  run): :func:`replay` of its trace, with the weights gathered at every evaluation tick, in order (``gathers``,
  which the clock ordered where :meth:`WaveMetrics.on_wave` snapshots)."""
  server = Replayed(len(nms), list(gathers))
  metrics = WaveMetrics(server, nms, waves, eval_every)  # type: ignore[arg-type]
  replay(metrics, server, events)
  return metrics
