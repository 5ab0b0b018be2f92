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
``wall`` run these loops, ``multiprocess`` runs :func:`run_wall` in process 0, whose ``wait`` waits for each
task's process to report (:mod:`hetpipe_jax.runtime.multiprocess`), and ``sim`` has its own event loop
over simulated links (:mod:`hetpipe_jax.sim`).
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
from hetpipe_jax.errors import ProtocolError, TaskFailed

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


def run_wall(engine: Engine, cost: CostFn | None = None, time_scale: float = 1.0,
             wait: Callable[[Any], Any] = jax.block_until_ready, resume: VirtualClock | None = None,
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
    wait: blocks until a started task's numerics are done, given what ``engine.start`` returned (default:
      its arrays are ready; the ``multiprocess`` executor waits for the task's process to report). A
      :class:`~hetpipe_jax.errors.TaskFailed` it raises fails the task's virtual worker (the others go on).
    resume: continue a checkpointed run: its clock restarts at ``resume.t`` (no task was running then).
    between: once a checkpoint is due, no task starts until every running one has finished; then it is
      saved (a consistent cut with nothing in flight on any device) and dispatching goes on.
  """
  lock = threading.Lock()
  keys = engine.devices()
  handed: dict[tuple[int, int], queue.SimpleQueue] = {key: queue.SimpleQueue() for key in keys}  # None: look up
  running: dict[tuple[int, int], tuple[Task, float, Any] | None] = dict.fromkeys(keys)  # (task, t0, out)
  errors: list[BaseException] = []
  t_start = time.perf_counter() - (resume.t if resume is not None else 0.0)
  now = lambda: time.perf_counter() - t_start
  draining = [False]  # a checkpoint is due: start nothing until every device is idle

  def wake_all() -> None:  # under the lock: every thread looks whether the run is over
    for box in handed.values():
      box.put(None)

  def dispatch() -> None:  # under the lock
    if between is not None and (draining[0] or between.due()):
      draining[0] = True
      if any(r is not None for r in running.values()):
        return  # the last device to finish saves the checkpoint
      between.save(VirtualClock(now()))
      draining[0] = False
    for task in engine.startable():
      t0 = now()
      key = (task.vw, task.stage)
      running[key] = started = (task, t0, engine.start(task, t0))
      handed[key].put(started)
    if engine.done:
      wake_all()

  def device_loop(key: tuple[int, int]) -> None:
    try:
      box = handed[key]
      while True:
        started = box.get()
        if started is None:
          with lock:
            if errors or engine.done:
              return
          continue
        task, t0, out = started
        failed = None
        try:
          wait(out)
        except TaskFailed as e:  # where it ran: its virtual worker fails, the others go on
          failed = e
        if cost is not None and failed is None:
          remaining = t0 + cost(task) * time_scale - now()
          if remaining > 0:
            time.sleep(remaining)
        with lock:
          if errors:
            return
          running[key] = None
          if failed is None:
            engine.finish(task, now())
          else:
            engine.task_failed(task, now(), failed)
          dispatch()
    except BaseException as e:  # pylint: disable=broad-except
      with lock:
        errors.append(e)
        wake_all()

  with lock:
    if resume is None:
      engine.begin(now())
    dispatch()
  threads = [threading.Thread(target=device_loop, args=(key,), name=f"vw{key[0]}-stage{key[1]}",
                              daemon=True) for key in keys]
  for th in threads:
    th.start()
  for th in threads:
    th.join()
  if errors:
    raise errors[0]
  if not engine.done:
    raise ProtocolError("wall executor stopped before every minibatch completed (a schedule bug)")
  return now()
