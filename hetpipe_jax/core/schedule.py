"""Pipeline schedules as data: which task each device of a virtual worker runs next.

docs/PROTOCOL.md section 2: a virtual worker (VW) has k stages on k devices; minibatches p = 1, 2, ... are
injected in order, p only once p - Nm has completed (its backward at stage 0 is done), and complete in
order. Task graph of minibatch p::

  fwd(0,p) -> fwd(1,p) -> ... -> fwd(k-1,p) -> bwd(k-1,p) -> ... -> bwd(0,p) -> complete(p)

Each device runs one task at a time. Which ready task it takes is the *schedule*, an entry of
:data:`SCHEDULES`: a key (the ready task with the smallest key runs first) and an injection rule on top of
the Nm window. Adding a schedule is one entry. Written optax-style: the state is a NamedTuple and every
function is pure::

  state = init(k=2)
  state, mb = inject(state, "1f1b")         # minibatch 1 is ready at stage 0
  task = pick(state, 0)                      # Task(stage=0, kind="fwd", mb=1)
  state = start(state, task)                 # the device is busy
  state, completed = finish(state, task, "1f1b")

Unit-time golden tables (every forward and backward lasting one tick), as :func:`timetable` prints them
for k = 2, Nm = 2 under 1F1B::

  t      0    1    2    3    4    5    6    7
  dev0   F1   F2   .    B1   F3   B2   F4   B3     minibatch 3 waits for 1 to complete (Nm window)
  dev1   .    F1   B1   F2   B2   F3   B3   F4     backward first once B1 is ready at t = 2
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

from hetpipe_jax.errors import ProtocolError

FWD, BWD = "fwd", "bwd"


class Task(NamedTuple):
  """One forward or backward pass of one minibatch on one stage of one virtual worker."""

  vw: int
  stage: int
  kind: str  # "fwd" | "bwd"
  mb: int


class Schedule(NamedTuple):
  """A pipeline schedule.

  Attributes:
    key: ``(kind, mb, seq) -> sortable``: among a device's ready tasks the smallest key runs next;
      ``seq`` counts the moments tasks became ready (FIFO order).
    may_inject: ``(next_mb, completed, nm) -> bool``: an extra condition on injecting ``next_mb`` beyond
      the Nm window (which always applies).
  """

  key: Callable[[str, int, int], tuple]
  may_inject: Callable[[int, int, int], bool]


def _always(next_mb: int, completed: int, nm: int) -> bool:
  del next_mb, completed, nm
  return True


def _after_flush(next_mb: int, completed: int, nm: int) -> bool:
  """GPipe-style flush: a wave's minibatches enter only once every earlier wave has completed."""
  return completed >= (next_mb - 1) // nm * nm


SCHEDULES: dict[str, Schedule] = {
    # backward first, then the lowest minibatch (PipeDream's one-forward-one-backward)
    "1f1b": Schedule(lambda kind, mb, seq: (kind == FWD, mb), _always),
    # in the order tasks became ready
    "fifo": Schedule(lambda kind, mb, seq: (seq,), _always),
    # every forward of a wave before its backwards, and a flush between waves (GPipe)
    "gpipe": Schedule(lambda kind, mb, seq: (kind == BWD, mb), _after_flush),
}


class PipelineState(NamedTuple):
  """Where one virtual worker's pipeline stands.

  Attributes:
    vw: the virtual worker's index.
    next_mb: the next minibatch to inject.
    completed: minibatches completed (in order).
    busy: per stage, the running task or None.
    ready: per stage, the ready tasks as ``(key, task)`` pairs.
    seq: how many tasks have become ready so far (FIFO order).
  """

  vw: int
  next_mb: int
  completed: int
  busy: tuple[Task | None, ...]
  ready: tuple[tuple[tuple[tuple, Task], ...], ...]
  seq: int


def init(k: int, vw: int = 0) -> PipelineState:
  """An empty pipeline of ``k`` stages: nothing injected, every device free."""
  return PipelineState(vw, 1, 0, (None,) * k, ((),) * k, 0)


def can_inject(state: PipelineState, nm: int, total: int, schedule: str, window: int | None = None) -> bool:
  """Whether minibatch ``next_mb`` may enter: it exists, the window allows it, and so does the schedule.

  The window is Nm unless a smaller ``window`` (1 <= window <= Nm) caps the minibatches in flight, so
  that a virtual worker whose memory holds few minibatches' activations can still run waves of Nm (the
  wave stays Nm minibatches; only fewer are in flight at once). (The WSP gate is the engine's business,
  on top of this.)
  """
  mb = state.next_mb
  return (mb <= total and mb - (nm if window is None else window) <= state.completed
          and SCHEDULES[schedule].may_inject(mb, state.completed, nm))


_tuple = tuple.__new__  # builds a NamedTuple without its Python-level __new__ (a third of the cost per task)


def _ready_entry(vw: int, stage: int, kind: str, mb: int, schedule: str, seq: int) -> tuple[tuple, Task]:
  return (SCHEDULES[schedule].key(kind, mb, seq), _tuple(Task, (vw, stage, kind, mb)))


def inject(state: PipelineState, schedule: str) -> tuple[PipelineState, int]:
  """Injects ``next_mb`` (the caller checked :func:`can_inject` and the gate); returns its number."""
  vw, mb, completed, busy, ready, seq = state
  ready = (ready[0] + (_ready_entry(vw, 0, FWD, mb, schedule, seq),),) + ready[1:]
  return _tuple(PipelineState, (vw, mb + 1, completed, busy, ready, seq + 1)), mb


def pick(state: PipelineState, stage: int, allow: Callable[[Task], bool] | None = None) -> Task | None:
  """The task ``stage``'s device runs next, or None if it is busy or has nothing ready (among the ready
  tasks that ``allow`` accepts, when given: a test without side effects, e.g. whether a task's input has
  arrived; it is asked only about the tasks that would come first)."""
  if state.busy[stage] is not None:
    return None
  ready = state.ready[stage]
  # keys are unique among a device's ready tasks, so comparing (key, task) pairs compares keys only
  if allow is None:
    return min(ready)[1] if ready else None
  best = None
  for entry in ready:  # the smallest allowed one (``allow`` is asked only of those that would be smaller)
    if (best is None or entry < best) and allow(entry[1]):
      best = entry
  return None if best is None else best[1]


def start(state: PipelineState, task: Task) -> PipelineState:
  """``task`` (a ready task of a free device) starts: it leaves the ready set and its device is busy."""
  vw, next_mb, completed, busy, ready, seq = state
  j = task.stage
  if busy[j] is not None:
    raise ProtocolError(f"VW {vw} stage {j} started {task} while running {busy[j]}")
  entries = ready[j]
  for at, entry in enumerate(entries):
    if entry[1] == task:
      left = entries[:at] + entries[at + 1:]  # (a task is ready at most once)
      break
  else:
    raise ProtocolError(f"VW {vw}: {task} started but it was not ready")
  return _tuple(PipelineState, (vw, next_mb, completed, busy[:j] + (task,) + busy[j + 1:],
                                ready[:j] + (left,) + ready[j + 1:], seq))


def successor(task: Task, k: int) -> tuple[int, str] | None:
  """(stage, kind) of the task that ``task``'s output feeds in a pipeline of ``k`` stages: the next
  stage's forward, the last stage's own backward (it turns round), the previous stage's backward; None
  after the backward at stage 0 (the minibatch completes)."""
  j = task.stage
  if task.kind == FWD:
    return (j + 1, FWD) if j + 1 < k else (j, BWD)
  return (j - 1, BWD) if j > 0 else None


def finish(state: PipelineState, task: Task, schedule: str) -> tuple[PipelineState, bool]:
  """``task`` is done: its device is free and its successor is ready.

  Returns:
    The new state, and whether ``task`` completed its minibatch (the backward at stage 0).

  Raises:
    ProtocolError: when ``task`` was not running, or a minibatch would complete out of order.
  """
  vw, next_mb, completed, busy, ready, seq = state
  _, j, kind, mb = task
  if busy[j] != task:
    raise ProtocolError(f"VW {vw}: {task} finished but stage {j} was running {busy[j]}")
  busy = busy[:j] + (None,) + busy[j + 1:]
  if kind == FWD:  # its successor (:func:`successor`), inline: the next stage's forward or this stage's backward
    stage, kind = (j + 1, FWD) if j + 1 < len(busy) else (j, BWD)
  elif j > 0:
    stage, kind = j - 1, BWD
  else:  # the backward at stage 0: the minibatch completes
    if mb != completed + 1:
      raise ProtocolError(f"VW {vw}: minibatch {mb} completed before {completed + 1}")
    return _tuple(PipelineState, (vw, next_mb, mb, busy, ready, seq)), True
  ready = ready[:stage] + (ready[stage] + (_ready_entry(vw, stage, kind, mb, schedule, seq),),) + ready[stage + 1:]
  return _tuple(PipelineState, (vw, next_mb, completed, busy, ready, seq + 1)), False


def arrive(state: PipelineState, task: Task, schedule: str) -> PipelineState:
  """``task`` becomes ready at its stage because its input arrived from another process: what :func:`finish`
  does for a successor, on the side that runs it (a stage of a decentralised run holds only its own part)."""
  vw, next_mb, completed, busy, ready, seq = state
  j = task.stage
  ready = ready[:j] + (ready[j] + (_ready_entry(vw, j, task.kind, task.mb, schedule, seq),),) + ready[j + 1:]
  return _tuple(PipelineState, (vw, next_mb, completed, busy, ready, seq + 1))


def release(state: PipelineState, task: Task) -> tuple[PipelineState, bool]:
  """``task`` is done and its device free, its successor readied elsewhere (:func:`arrive`, where it runs):
  :func:`finish` without the successor. Returns the new state and whether ``task`` completed its minibatch.

  Raises:
    ProtocolError: as :func:`finish`.
  """
  vw, next_mb, completed, busy, ready, seq = state
  _, j, kind, mb = task
  if busy[j] != task:
    raise ProtocolError(f"VW {vw}: {task} finished but stage {j} was running {busy[j]}")
  busy = busy[:j] + (None,) + busy[j + 1:]
  done = kind != FWD and j == 0
  if done:
    if mb != completed + 1:
      raise ProtocolError(f"VW {vw}: minibatch {mb} completed before {completed + 1}")
    completed = mb
  return _tuple(PipelineState, (vw, next_mb, completed, busy, ready, seq)), done


def timetable(k: int, nm: int, total: int, schedule: str = "1f1b", bwd_ticks: int = 1,
              window: int | None = None) -> list[list[str]]:
  """The schedule on unit time: per device, what runs at each tick (``F3``, ``B1`` or ``.``).

  Every forward lasts one tick and every backward ``bwd_ticks``; a task ready at tick t can start at t;
  everything due at a tick finishes (in start order, each completion injecting at once) before anything
  starts at it, as the engine on the ``virtual`` executor does.
  The reference for golden tables (``tests/test_schedules.py``), without the engine.
  """
  state = init(k)
  rows: list[list[str]] = [[] for _ in range(k)]
  running: dict[int, tuple[int, Task, int]] = {}  # stage -> (start order, task, ticks left)
  tick = started = 0
  while can_inject(state, nm, total, schedule, window):
    state, _ = inject(state, schedule)
  while state.completed < total:
    for j in range(k):
      task = pick(state, j)
      if task is not None:
        state = start(state, task)
        running[j] = (started, task, 1 if task.kind == FWD else bwd_ticks)
        started += 1
    for j in range(k):
      if j in running:
        order, task, left = running[j]
        rows[j].append(("F" if task.kind == FWD else "B") + str(task.mb))
        running[j] = (order, task, left - 1)
      else:
        rows[j].append(".")
    for _order, task, left in sorted(running.values()):  # due tasks finish in start order
      if left == 0:
        del running[task.stage]
        state, _ = finish(state, task, schedule)
        while can_inject(state, nm, total, schedule, window):  # a completion opens the window at once
          state, _ = inject(state, schedule)
    tick += 1
    if tick > 10 * total * k * (1 + bwd_ticks) + 10:
      raise ProtocolError(f"schedule {schedule!r} stalled with k={k}, Nm={nm}")
  return rows
