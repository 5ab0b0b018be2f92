"""Executors: how long a task takes and whether its numerics really run. The protocol is the engine's.

* ``virtual``: a discrete-event loop on a virtual clock. A task starts (and its numerics are dispatched)
  when its device is free in virtual time and ends ``cost(task)`` later. Every task due at time t
  finishes (in start order) before any task starts at t, so the same seed gives the same schedule and
  the same numbers, bit for bit. Time is the emulated cluster's.
* ``wall``: real concurrency. One host thread per device runs its tasks one at a time: dispatch, wait for
  the result, optionally sleep until the emulated duration ``cost(task) * time_scale`` has passed (so the
  emulated speeds, not CPU noise, shape the schedule). Time is seconds since the start.
"""

from __future__ import annotations

import heapq
import itertools
import threading
import time
from typing import Callable

import jax

from hetpipe_jax.engine import Engine
from hetpipe_jax.pipeline import Task

CostFn = Callable[[Task], float]
EXECUTORS = ("virtual", "wall")


def run_virtual(engine: Engine, cost: CostFn) -> float:
  """Runs ``engine`` to the end on a virtual clock; returns the virtual time at the end."""
  heap: list = []
  seq = itertools.count()
  t = 0.0
  engine.begin(t)
  while True:
    for task in engine.startable():
      engine.start(task, t)
      heapq.heappush(heap, (t + cost(task), next(seq), task))
    if not heap:
      break
    t, _, task = heapq.heappop(heap)
    engine.finish(task, t)
    while heap and heap[0][0] == t:  # finish everything due at t before choosing what starts next
      engine.finish(heapq.heappop(heap)[2], t)
  if not engine.done:
    raise RuntimeError("virtual executor stalled before every minibatch completed (a schedule bug)")
  return t


def run_wall(engine: Engine, cost: CostFn | None = None, time_scale: float = 1.0) -> float:
  """Runs ``engine`` with one thread per device; returns the wall-clock seconds taken.

  Args:
    engine: the engine.
    cost: emulated task durations; when given, every task lasts at least ``cost(task) * time_scale``.
    time_scale: real seconds per emulated second.
  """
  lock = threading.Lock()
  wakeups = {key: threading.Condition(lock) for key in engine.devices()}
  errors: list[BaseException] = []
  t_start = time.perf_counter()
  now = lambda: time.perf_counter() - t_start

  def notify(all_devices: bool = False) -> None:
    for key in (wakeups if all_devices else engine.devices_with_work()):
      wakeups[key].notify()

  def device_loop(key: tuple[int, int]) -> None:
    try:
      while True:
        with lock:
          while True:
            if errors or engine.done:
              return
            task = engine.take(*key)
            if task is not None:
              engine.start(task, now())
              break
            wakeups[key].wait()
        jax.block_until_ready(task.out)
        if cost is not None:
          remaining = task.t0 + cost(task) * time_scale - now()
          if remaining > 0:
            time.sleep(remaining)
        with lock:
          engine.finish(task, now())
          notify(all_devices=engine.done)
    except BaseException as e:  # pylint: disable=broad-except
      with lock:
        errors.append(e)
        notify(all_devices=True)

  with lock:
    engine.begin(now())
  threads = [threading.Thread(target=device_loop, args=(key,), name=f"vw{key[0]}-stage{key[1]}",
                              daemon=True) for key in engine.devices()]
  for th in threads:
    th.start()
  for th in threads:
    th.join()
  if errors:
    raise errors[0]
  if not engine.done:
    raise RuntimeError("wall executor stopped before every minibatch completed (a schedule bug)")
  return now()
