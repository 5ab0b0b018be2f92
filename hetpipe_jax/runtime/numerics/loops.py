"""Executors: how long a task takes and whether its numerics really run. The protocol is the engine's.

* ``virtual``: a discrete-event loop on a virtual clock. A task starts (and its numerics are dispatched)
  when its device is free in virtual time and ends ``cost(task)`` later. Every task due at time t
  finishes (in start order) before any task starts at t, so the same seed gives the same schedule and
  the same numbers, bit for bit. Time is the emulated cluster's.
* ``wall``: real concurrency. Tasks are dispatched asynchronously the moment they can start; one host
  thread per device waits for its running task's result, optionally sleeps until the emulated duration
  ``cost(task) * time_scale`` has passed (so the emulated speeds, not CPU noise, shape the schedule), and
  finishes it. Time is seconds since the start.

The executors by name are a registry of the run layer (:mod:`hetpipe_jax.run.executors`): ``virtual`` and
``wall`` run these loops, ``multiprocess`` runs every stage's own loop in its process
(:mod:`hetpipe_jax.runtime.processes`), and ``sim`` has its own event loop over simulated links
(:mod:`hetpipe_jax.sim`).
"""

from __future__ import annotations

import dataclasses
import heapq
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

import jax

from hetpipe_jax.core.engine import Engine
from hetpipe_jax.core.schedule import Task
from hetpipe_jax.errors import ProtocolError

CostFn = Callable[[Task], float]


@dataclasses.dataclass
class VirtualClock:
  """The ``virtual`` executor between two events: the time, the running tasks as ``(end, seq, task)``
  (a heap), and how many tasks have started (the tie-break of equal ends)."""

  t: float = 0.0
  heap: list = dataclasses.field(default_factory=list)
  seq: int = 0


@dataclasses.dataclass(frozen=True)
class Checkpointing:
  """When a checkpoint is due (``due()``), and how to save one at a consistent cut (``save(clock)``)."""

  due: Callable[[], bool]
  save: Callable[[VirtualClock], None]


def run_virtual(engine: Engine, cost: CostFn, resume: VirtualClock | None = None,
                between: Checkpointing | None = None) -> float:
  """Runs ``engine`` to the end on a virtual clock; returns the virtual time at the end.

  Args:
    engine: the engine.
    cost: task durations.
    resume: continue from this clock (the engine restored to the same moment) instead of the start.
    between: checked after the tasks due at each time have finished and before any starts (a consistent
      cut: a checkpoint saved there is resumed with ``resume``).
  """
  clock = resume or VirtualClock()
  heap = clock.heap
  if resume is None:
    engine.begin(clock.t)
  while True:
    for task in engine.startable():
      engine.start(task, clock.t)
      heapq.heappush(heap, (clock.t + cost(task), clock.seq, task))
      clock.seq += 1
    if not heap:
      break
    clock.t, _, task = heapq.heappop(heap)
    engine.finish(task, clock.t)
    while heap and heap[0][0] == clock.t:  # finish everything due at t before choosing what starts next
      engine.finish(heapq.heappop(heap)[2], clock.t)
    if between is not None and between.due():
      between.save(clock)
  t = clock.t
  if not engine.done:
    raise ProtocolError("virtual executor stalled before every minibatch completed (a schedule bug)")
  return t


def run_wall(engine: Engine, cost: CostFn | None = None, time_scale: float = 1.0, resume: VirtualClock | None = None,
             between: Checkpointing | None = None) -> float:
  """Runs ``engine`` with one thread per device; returns the wall-clock seconds taken.

  Whichever thread finishes a task dispatches every task that became startable, on any device, at once
  (so no thread wake-up sits between a task becoming ready and its device starting it), and hands each to
  its device's thread through that thread's own queue (it wakes without waiting for the lock); that thread
  then waits for its task's result and finishes it (under the lock).

  Args:
    engine: the engine.
    cost: emulated task durations; when given, every task lasts at least ``cost(task) * time_scale``.
    time_scale: real seconds per emulated second.
    resume: continue a checkpointed run: its clock restarts at ``resume.t`` (no task was running then).
    between: once a checkpoint is due, no task starts until every running one has finished; then it is
      saved (a consistent cut with nothing in flight on any device) and dispatching goes on.
  """
  return _WallRun(engine, cost, time_scale, between).run(resume)


class _WallRun:
  """One run of :func:`run_wall`: the lock every engine call is made under, one queue and one thread per
  device, and whether a due checkpoint is draining the devices."""

  def __init__(self, engine: Engine, cost: CostFn | None, time_scale: float, between: Checkpointing | None):
    self.engine, self.cost, self.time_scale, self.between = engine, cost, time_scale, between
    self.lock = threading.Lock()
    self.keys = engine.devices()
    self.handed: dict[tuple[int, int], queue.SimpleQueue] = {key: queue.SimpleQueue() for key in self.keys}
    # device -> (task, t0, what engine.start returned) while it runs a task; None: look up (handed)
    self.running: dict[tuple[int, int], tuple[Task, float, Any] | None] = dict.fromkeys(self.keys)
    self.errors: list[BaseException] = []
    self.draining = False  # a checkpoint is due: start nothing until every device is idle
    self.t_start = time.perf_counter()

  def now(self) -> float:
    return time.perf_counter() - self.t_start

  def run(self, resume: VirtualClock | None) -> float:
    """Runs the engine to the end (from ``resume``'s time); returns the wall-clock seconds taken."""
    engine = self.engine
    self.t_start = time.perf_counter() - (resume.t if resume is not None else 0.0)
    with self.lock:
      if resume is None:
        engine.begin(self.now())
      self._dispatch()
    threads = [threading.Thread(target=self._device_loop, args=(key,), name=f"vw{key[0]}-stage{key[1]}",
                                daemon=True) for key in self.keys]
    for th in threads:
      th.start()
    for th in threads:
      th.join()
    if self.errors:
      raise self.errors[0]
    if not engine.done:
      raise ProtocolError("wall executor stopped before every minibatch completed (a schedule bug)")
    return self.now()

  def _wake_all(self) -> None:
    """Under the lock: every device thread looks whether the run is over."""
    for box in self.handed.values():
      box.put(None)

  def _dispatch(self) -> None:
    """Under the lock: starts every task that can start and hands each to its device's thread (once a
    checkpoint is due, none until every device is idle: the last one to finish saves it)."""
    engine, between, running = self.engine, self.between, self.running
    if between is not None and (self.draining or between.due()):
      self.draining = True
      if any(r is not None for r in running.values()):
        return  # the last device to finish saves the checkpoint
      between.save(VirtualClock(self.now()))
      self.draining = False
    for task in engine.startable():
      t0 = self.now()
      key = (task.vw, task.stage)
      running[key] = started = (task, t0, engine.start(task, t0))
      self.handed[key].put(started)
    if engine.done:
      self._wake_all()

  def _device_loop(self, key: tuple[int, int]) -> None:
    """One device's thread: waits for each task handed to it, then finishes it and dispatches."""
    try:
      box = self.handed[key]
      while True:
        started = box.get()
        if started is None:
          with self.lock:
            if self.errors or self.engine.done:
              return
          continue
        if not self._finish(key, *started):
          return
    except BaseException as e:  # pylint: disable=broad-except
      with self.lock:
        self.errors.append(e)
        self._wake_all()

  def _finish(self, key: tuple[int, int], task: Task, t0: float, out: Any) -> bool:
    """Waits for ``task``'s numerics (and its emulated duration), then, under the lock, finishes it and
    dispatches; False when another thread failed (the run is over)."""
    jax.block_until_ready(out)
    if self.cost is not None:
      remaining = t0 + self.cost(task) * self.time_scale - self.now()
      if remaining > 0:
        time.sleep(remaining)
    with self.lock:
      if self.errors:
        return False
      self.running[key] = None
      self.engine.finish(task, self.now())
      self._dispatch()
    return True
