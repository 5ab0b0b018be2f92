"""Checkpointed and ``--rejoin`` runs of the ``multiprocess`` executor, on the decentralised runtime: the run goes in
parts (:mod:`~hetpipe_jax.run.executors.parts`) that continue one trace (docs/PROTOCOL.md section 11.8).

A part ends at every checkpoint (every ``--checkpoint_every`` waves) and, under ``--rejoin``, one wave after each
injected failure; between two parts every virtual worker has pushed every wave before the boundary, and process 0
hands every process the gathered global weights, from which every stage and every copy of the PS shards starts the
next part (the stages' local optimizer state afresh: a PS rule with state of its own is refused). So:

* **a checkpoint** is taken at a boundary, where the run is drained: it holds the global weights, the metrics rows
  so far (evaluated), the clocks, the run's seconds, and how many trace events were written (the trace is written as
  the parts end); every virtual worker drew step x Nm minibatches, so the streams need no state. A resumed job
  hands the weights to every process and goes on with the next part; what the killed job wrote after the
  checkpoint is cut off the trace.
* **a replacement** (``--rejoin``) of a virtual worker that failed in a part joins at the next boundary, at the
  global clock of the live ones then (the trace's ``join`` line), on the same devices; the waves between its frozen
  clock and that one are never run.
* **a lost process** lets the part go on without its virtual workers (section 11.5); the next part needs every
  process, so the job stops at the boundary with one line, after a checkpoint there if the run keeps them: resume
  with every process to go on (the virtual workers that had left join again).

Each part runs its waves from 0 on its own clock; process 0 checks its trace, then writes it into the run's trace
on the run's count (:func:`continue_events`): waves, minibatches, versions and pulled clocks go on from the waves
before it, and its first lines are every virtual worker's pull of the weights it started from (``glob``: the clock
of the boundary), after the ``join`` of each that had left. Times are each process's seconds since the run's first
part started (after a resume, plus the seconds before it).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from typing import Any

import jax

from hetpipe_jax.core import wsp
from hetpipe_jax.core.check import require_wsp
from hetpipe_jax.core.trace import Trace
from hetpipe_jax.errors import ConfigError, LostAtStart, RunStopped
from hetpipe_jax.evaluate import make_evaluator
from hetpipe_jax.run.config import RunConfig
from hetpipe_jax.run.executors.parts import PartAt, Ran, RunPart, hand_out, handed
from hetpipe_jax.run.result import RunResult
from hetpipe_jax.run.session import identity, require_pushes, trained_images
from hetpipe_jax.run.setup import Setup
from hetpipe_jax.runtime.numerics.checkpoint import Checkpointer
from hetpipe_jax.runtime.numerics.metrics import Replayed, WaveMetrics, replay
from hetpipe_jax.runtime.transport.node import Node

START_KEY = "continue/start"  # (scope "resume/") where the run starts: process 0 reads it from a checkpoint
NEXT_KEY = "continue/next"  # (scoped to the part just ended) the next part goes on


def continuing(config: RunConfig) -> bool:
  """Whether the run goes in parts that continue one trace: it keeps checkpoints or replaces failed workers."""
  return bool(config.checkpoint.directory or config.faults.rejoin)


def check(config: RunConfig) -> None:
  """Refuses, in one line, what a run in parts cannot carry across a boundary."""
  c = config
  if c.optim.ps_tx is not None or c.optim.ps_spec != "add":
    raise ConfigError(f"a checkpointed or --rejoin run of the multiprocess executor starts each part from the "
                      f"gathered weights, and the parameter server's rule {c.optim.ps_optimizer!r} keeps state "
                      "that would be lost at every part: give --ps_optimizer=add, or drop the checkpoints and --rejoin")
  if c.faults.failures and not c.faults.rejoin:
    raise ConfigError("a checkpointed run of the multiprocess executor starts every virtual worker at each part, so a "
                      "failed one would be back at the next: give --rejoin with --fail, or drop the checkpoints")


def boundaries(config: RunConfig) -> list[int]:
  """The waves at which the parts end: every checkpoint, one wave after each injected failure (under ``rejoin``:
  its replacement joins there), and the run's end."""
  c, ends = config, {config.waves}
  if c.checkpoint.directory:
    ends |= set(range(c.checkpoint.every, c.waves, c.checkpoint.every))
  if c.faults.rejoin:
    ends |= {wave + 1 for _, wave in c.faults.failures if wave + 1 < c.waves}
  return sorted(ends)


def continue_events(events: Sequence[dict[str, Any]], done: int, nms: Sequence[int]) -> list[dict[str, Any]]:
  """A part's events (its meta line left out) on the run's count: every virtual worker had pushed ``done`` waves
  before it, so waves, minibatches, own updates and the clocks of versions and pulls go on from there."""
  out = []
  for ev in events[1:]:
    ev = dict(ev)
    i = ev["vw"]
    if "mb" in ev:
      ev["mb"] += done * nms[i]
    if "own" in ev:
      ev["own"] += done * nms[i]
    if "glob" in ev:
      ev["glob"] = [g + done for g in ev["glob"]]
    for field in ("wave", "pushed", "waves"):
      if field in ev:
        ev[field] += done
    out.append(ev)
  return out


def boundary_lines(done: int, num_vws: int, left: Sequence[int], t: float) -> list[dict[str, Any]]:
  """The lines a part after the run's first starts with (none for the first): the ``join`` of every virtual worker
  that had left (at the boundary's clock ``done``, the global clock of the live ones there), then every virtual
  worker's pull of the weights the part starts from, which hold ``done`` waves of each (process 0 sent them at
  ``t`` on its clock)."""
  if not done:
    return []
  joins = [{"ev": "join", "vw": i, "clock": done, "t": t, "process": 0} for i in left]
  return joins + [{"ev": "pull", "vw": i, "glob": [done] * num_vws, "t": t, "process": 0} for i in range(num_vws)]


@dataclasses.dataclass
class _Start:
  """Where the run starts (afresh, or from a checkpoint): the waves every virtual worker has done (and drawn the
  minibatches of), the seconds of the run before, and the weights."""

  done: int
  before: float
  params: tuple[Any, ...]


class _Run:
  """Process 0's side: the run's trace, metrics and checkpoints, as the parts end."""

  def __init__(self, setup: Setup, init_params: tuple[Any, ...]):
    c, self.setup = setup.config, setup
    meta = setup.meta_line()
    self.gathers: list[Any] = []
    self.server = Replayed(setup.layout.num_vws, self.gathers)
    self.metrics = WaveMetrics(self.server, setup.layout.nms, c.waves, c.eval_every)  # type: ignore[arg-type]
    self.evaluate = make_evaluator(setup.model, setup.data, jax.local_devices()[0])
    self.checkpointer = (Checkpointer(c.checkpoint.directory, c.checkpoint.every, c.checkpoint.keep,
                                      identity(setup, meta)) if c.checkpoint.directory else None)
    self.resumed_from: int | None = None
    self.start = _Start(0, 0.0, init_params)
    if self.checkpointer is not None and c.checkpoint.resume:
      self.trace = self._resume()
    else:
      self.trace = Trace(c.trace_path)
      self.trace.emit(**meta)

  def _resume(self) -> Trace:
    assert self.checkpointer is not None
    step = self.checkpointer.latest()
    if step is None:
      raise ConfigError(f"resume: no complete checkpoint in {self.checkpointer.directory}; run without resume to "
                        "start afresh")
    state, _ = self.checkpointer.restore(step)
    self.metrics.restore_checkpoint_state(state["metrics"])
    self.server.clock = wsp.restore(tuple(state["c_local"]), frozenset(state["left"]))
    self.start = _Start(step, float(state["before"]), tuple(state["params"]))
    self.resumed_from = step
    assert self.setup.config.trace_path is not None  # CheckpointSpec.validate asks for it
    return Trace.resume(self.setup.config.trace_path, state["trace_events"])

  def add(self, k: int, ran: Ran, done: int, end: int, missing: bool) -> None:
    """Part ``k`` (waves ``done`` to ``end``) ended: checked, written into the run's trace after the pulls (and
    joins) it started with, fed to the metrics; a checkpoint at its end when one is due (or the job stops there)."""
    c, n = self.setup.config, self.setup.layout.num_vws
    require_wsp(ran.events, f"part {k + 1} (waves {done} to {end})")
    first = boundary_lines(done, n, sorted(self.server.clock.left), ran.start + self.start.before)
    events = [ev for ev in continue_events(ran.events, done, self.setup.layout.nms)
              if ev["ev"] != "applied" or end == c.waves]  # (a copy's count at the end of the run)
    self.trace.extend(first + events)
    self.gathers.extend(ran.gathers[:-1])  # (those of the evaluation ticks; the last hands the weights on)
    replay(self.metrics, self.server, first + events)
    if self.checkpointer is not None and end < c.waves and (end % c.checkpoint.every == 0 or missing):
      self._save(end, ran)

  def lost_at_start(self, process: int, done: int, ran: Ran | None) -> str:
    """Why the run stops when ``process`` was lost before the part from wave ``done`` started (``ran``: the part
    before, if any); a checkpoint at ``done`` if the run keeps them and the part before did not save one."""
    if done == 0:  # (no part ran: no checkpoint to resume from, and nothing to keep in one part)
      return f"processes [{process}] were lost before wave 0, as the run started; run again with every process"
    c = self.setup.config
    if self.checkpointer is not None and ran is not None and done % c.checkpoint.every:
      self._save(done, ran)
    return _lost([process], done, self.checkpointer is not None)

  def _save(self, step: int, ran: Ran) -> None:
    assert self.checkpointer is not None
    self.trace.flush()
    times = [ev.get("t1", ev.get("t", 0.0)) for ev in self.trace.events[1:]]
    clock = self.server.clock
    self.checkpointer.save(step, {
        "params": ran.gathers[-1], "metrics": self.metrics.checkpoint_state(self.evaluate),
        "c_local": list(clock.c_local), "left": sorted(clock.left), "trace_events": len(self.trace.events),
        "before": max([ran.end + self.start.before, *times])}, {"run_seconds": ran.end + self.start.before})

  def result(self, init_params, ran: Ran, host_seconds: float) -> RunResult:
    self.trace.close()
    if self.checkpointer is not None:
      self.checkpointer.close()
    require_pushes(self.metrics.rows)
    rows = self.metrics.finish(ran.gathers[-1], self.evaluate)
    events, c = self.trace.events, self.setup.config
    return RunResult(init_params, ran.gathers[-1], events, rows, ran.end + self.start.before, host_seconds,
                     self.setup.virtual_workers(), self.setup.layout.cuts, trained_images(events, c.batch_size),
                     self._stats())

  def _stats(self) -> dict[str, Any] | None:
    ck = self.checkpointer
    return None if ck is None else {"directory": ck.directory, "saved": len(ck.seconds), "seconds": ck.seconds,
                                    "bytes": ck.bytes, "resumed_from": self.resumed_from}


def _part(setup: Setup, done: int, end: int) -> Setup:
  """The part of the run from wave ``done`` to ``end``: its waves, and the failures injected in it (at waves
  counted from its start)."""
  c = setup.config
  failures = [(vw, wave - done) for vw, wave in c.faults.failures if done <= wave < end]
  faults = dataclasses.replace(c.faults, failures=failures)
  return dataclasses.replace(setup, config=dataclasses.replace(c, waves=end - done, faults=faults))


def _lost(missing: Sequence[int], wave: int, checkpointed: bool) -> str:
  """Why the run stops: ``missing`` processes were lost before ``wave`` (a checkpoint there, or not)."""
  return (f"processes {list(missing)} were lost before wave {wave}; the next part needs every process: "
          + ("resume from the checkpoint there (--resume) with every process" if checkpointed
             else "run again, or keep the run in one part (drop --rejoin)"))


def _start(setup: Setup, node: Node, run: _Run | None, init_params: tuple[Any, ...]) -> _Start:
  """Where every process starts: afresh, or where process 0's checkpoint says (which it hands out)."""
  if not setup.config.checkpoint.resume:
    return _Start(0, 0.0, init_params)
  node.scope = "resume/"
  if run is not None:
    s = run.start
    hand_out(node, START_KEY, {"done": s.done, "before": s.before}, s.params)
  else:
    info, params = handed(node, START_KEY)
    s = _Start(info["done"], info["before"], params)
  node.scope = ""
  return s


def run_continued(setup: Setup, node: Node, init_params: tuple[Any, ...], run_part: RunPart) -> RunResult:
  """The run in parts (see the module docstring); process 0 returns the run's result, the others an empty one.

  Raises:
    RunStopped: when a process was lost in a part another follows (after a checkpoint at its end, if the run keeps
      them).
  """
  c, t_host = setup.config, time.perf_counter()
  run = _Run(setup, init_params) if node.process == 0 else None
  start = _start(setup, node, run, init_params)
  params, done = start.params, start.done
  ran: Ran | None = None
  for k, end in enumerate(e for e in boundaries(c) if e > done):
    node.scope = f"part{k}/" if k else ""
    last, taken = end == c.waves, [done * nm for nm in setup.layout.nms]
    try:
      ran = run_part(_part(setup, done, end), params, taken, last, None, PartAt(done, c.waves, start.before))
    except LostAtStart as e:  # nothing of this part ran: the run stops where the last one ended
      if run is None:
        raise
      raise RunStopped(run.lost_at_start(e.process, done, ran)) from None
    if run is not None:
      assert ran is not None
      run.add(k, ran, done, end, bool(ran.missing) and not last)
      if ran.missing and not last:
        raise RunStopped(_lost(ran.missing, end, run.checkpointer is not None))
      if not last:
        hand_out(node, NEXT_KEY, {}, ran.gathers[-1])
    elif not last:
      _, params = handed(node, NEXT_KEY)
    params = ran.gathers[-1] if ran is not None else params
    done = end
  if run is None:
    return RunResult(None, None, [], [], 0.0, 0.0, [], setup.layout.cuts, 0)
  assert ran is not None
  return run.result(init_params, ran, time.perf_counter() - t_host)

