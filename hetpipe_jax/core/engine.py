"""The event-driven core that every executor drives: pipeline schedule + WSP push/gate/pull + trace.

An executor only answers two questions: *when* does a task start and end (wall clock, or a virtual clock
from a cost model), and does it block on the numerics. Everything else happens here, written once:

* ``startable()``: for every free device, the task its pipeline schedule picks next;
* ``start(task, t)``: record the weight version the task uses and dispatch its numerics;
* ``finish(task, t)``: write the task's trace line, ready its successor, complete minibatches in order,
  push a finished wave to the PS, then retry every virtual worker's next injection: the Nm window, the
  WSP gate (c_local - c_global <= D), the pull and rebase.

Pushes and pulls go through a ``Comm``: :class:`InstantComm` (the default) completes them at once; the
``sim`` executor's network model completes them when their transfers have crossed the links. A push is
applied (and its trace line written) when it completes; a gated injection waits for its own virtual
worker's last push to be applied, then for the gate, then for the pull to arrive.

Not thread-safe by itself: the ``wall`` executor calls it under one lock.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

from hetpipe_jax.core import wsp
from hetpipe_jax.core.pipeline import Task, VirtualWorker
from hetpipe_jax.runtime.ps import ParameterServer
from hetpipe_jax.core.trace import Trace

BatchFn = Callable[[int, int], tuple[Any, Any]]  # (vw, mb) -> (x, labels)
WaveFn = Callable[[int, int, float, list], None]  # (vw, wave, t, losses of the wave) -> None
Done = Callable[[float], None]  # called with the time a push or pull completed


class InstantComm:
  """Pushes and pulls that take no time."""

  def push(self, vw: VirtualWorker, wave: int, t: float, done: Done) -> None:
    del vw, wave
    done(t)

  def pull(self, vw: VirtualWorker, t: float, done: Done) -> None:
    del vw
    done(t)


class Engine:
  """Runs N virtual workers against one parameter server.

  Args:
    vws: the virtual workers.
    ps: the parameter server (holds the clocks and D).
    trace: where events go; the caller has written the meta line.
    batches: minibatch source, called at injection (not needed without numerics).
    on_wave: called after every push with the wave's losses (device scalars).
    comm: how long pushes and pulls take (default: no time).
  """

  def __init__(self, vws: Sequence[VirtualWorker], ps: ParameterServer, trace: Trace,
               batches: BatchFn | None = None, on_wave: WaveFn | None = None, comm=None):
    self.vws, self.ps, self.trace = list(vws), ps, trace
    self._batches, self._on_wave = batches, on_wave
    self.comm = comm or InstantComm()
    self._pulling: dict[int, int] = {}  # vw -> gated minibatch whose pull is on its way
    self._pulled: dict[int, int] = {}  # vw -> gated minibatch whose pull has arrived
    self._changed = True  # whether a task may have become startable

  @property
  def done(self) -> bool:
    return all(vw.done for vw in self.vws)

  def devices(self) -> list[tuple[int, int]]:
    return [(vw.index, j) for vw in self.vws for j in range(vw.k)]

  def begin(self, t: float = 0.0) -> None:
    """Injects every virtual worker's first window."""
    self._inject_all(t)

  def startable(self) -> list[Task]:
    """One task for every free device that has one ready, in device order."""
    if not self._changed:  # nothing finished or was injected since the last call
      return []
    self._changed = False
    tasks = []
    for vw in self.vws:
      for j in range(vw.k):
        task = vw.pop_task(j)
        if task is not None:
          tasks.append(task)
    return tasks

  def start(self, task: Task, t: float) -> None:
    task.t0 = t
    self.vws[task.vw].run(task)

  def finish(self, task: Task, t: float) -> None:
    self._changed = True
    vw = self.vws[task.vw]
    self.trace.emit(ev=task.kind, vw=task.vw, stage=task.stage, mb=task.mb, t0=task.t0, t1=t,
                    own=task.version.own, glob=list(task.version.glob))
    if not vw.finish(task):
      return
    self.trace.emit(ev="complete", vw=vw.index, mb=task.mb, t=t)
    if wsp.is_wave_end(task.mb, vw.nm):
      wave = wsp.wave_of(task.mb, vw.nm)
      updates = vw.take_wave(wave)
      self.comm.push(vw, wave, t, lambda t_done: self._push(vw, wave, updates, t_done))
    self._inject(vw, t)

  def _push(self, vw: VirtualWorker, wave: int, updates, t: float) -> None:
    clock = self.ps.push(vw.index, wave, updates)
    self.trace.emit(ev="push", vw=vw.index, wave=wave, t=t, shards=self.ps.num_shards,
                    gap=wsp.clock_gap(clock, vw.index))
    if self._on_wave is not None:
      first = wave * vw.nm + 1
      self._on_wave(vw.index, wave, t, [vw.losses.pop(p, None) for p in range(first, first + vw.nm)])
    self._inject_all(t)  # a push can open gates, this virtual worker's own included

  def _inject_all(self, t: float) -> None:
    for vw in self.vws:
      self._inject(vw, t)

  def _inject(self, vw: VirtualWorker, t: float) -> None:
    """Injects while the window allows; a gated minibatch first passes the gate and pulls."""
    i = vw.index
    while vw.can_inject():
      mb = vw.next_mb
      if wsp.is_gated(mb, vw.nm) and self._pulled.get(i) != mb:
        if self._pulling.get(i) == mb or self.ps.clock.c_local[i] < wsp.wave_of(mb, vw.nm):
          return  # the pull is on its way, or this VW's own last push has not landed yet
        snapshot = self.ps.pull(i, block=False)
        if snapshot is None:
          if vw.waiting_since is None:
            vw.waiting_since = t
          return
        if vw.waiting_since is not None:
          self.trace.emit(ev="wait", vw=i, t0=vw.waiting_since, t1=t)
          vw.waiting_since = None
        self._pulling[i] = mb
        self.comm.pull(vw, t, lambda t_done: self._pull_arrived(vw, mb, snapshot, t_done))
        continue  # an instant pull has injected mb already
      x, labels = self._batches(i, mb) if vw.stages is not None else (None, None)
      vw.inject(x, labels)
      self._changed = True
      self.trace.emit(ev="inject", vw=i, mb=mb, t=t)

  def _pull_arrived(self, vw: VirtualWorker, mb: int, snapshot, t: float) -> None:
    del self._pulling[vw.index]
    self._pulled[vw.index] = mb
    vw.rebase(snapshot.params, snapshot.waves)
    self.trace.emit(ev="pull", vw=vw.index, t=t, glob=list(snapshot.waves))
    self._inject(vw, t)
