"""A decentralised ``multiprocess`` run: every process follows the schedule where it runs, and no process is
the brain (docs/PROTOCOL.md section 11.5).

* Each stage is a loop in its own process (:class:`~hetpipe_jax.runtime.processes.stage_loop.StageLoop`): it starts
  its next task when the task's input has arrived and the pure schedule (:mod:`hetpipe_jax.core.schedule`)
  picks it, keeps its own weight versions (:mod:`hetpipe_jax.core.versions`), and sends its output straight
  to the next stage. Stage 0 of each virtual worker injects under the Nm window itself and asks for the
  pull of a gated minibatch.
* Every PS shard has two copies, its primary and a backup in the next process
  (:class:`~hetpipe_jax.runtime.processes.shards.ShardFollower`). The WSP clock is a service in process 0, which
  hosts the coordination service (:class:`~hetpipe_jax.runtime.processes.clock.ClockService`): it counts a wave once
  every live copy holds it, opens the gates (:mod:`hetpipe_jax.core.wsp`), and puts every apply, serve,
  gather and loss into one order that every copy follows, so a pull holds exactly the waves its snapshot
  counts and a push in flight when a process dies is applied everywhere or nowhere.
* Control messages are small int32 arrays (:data:`~hetpipe_jax.runtime.transport.protocol.CONTROL_OPS`,
  :data:`~hetpipe_jax.runtime.transport.protocol.ORDER_OPS`) moved like activations: no key-value operation while
  the run trains. Each input stream of a stage or the clock has a thread that pulls its messages in order.
* Each process writes its own trace part; at the end they merge into one trace by causal keys
  (:mod:`hetpipe_jax.core.merge`), never by comparing the clocks of different processes.

Process 0 hosts the coordination service and the clock, runs the stages of its node, and at the end checks
the copies against each other, merges the trace parts and evaluates the gathered weights; no task passes
through it. Losing any other process lets the others go on.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from hetpipe_jax.core.schedule import Task
from hetpipe_jax.core.trace import Trace
from hetpipe_jax.data import MinibatchStreams
from hetpipe_jax.errors import RunStopped
from hetpipe_jax.plan.layout import Layout
from hetpipe_jax.runtime.transport.mailbox import Mailbox
from hetpipe_jax.runtime.transport.node import POLL_S, Node, PeerGone

Spec = tuple[tuple[int, ...], Any]  # (shape, dtype) of an array a receiver expects
LEFT_KEY = "left/{vw}"  # set by the clock once a virtual worker has left (its threads may wait for good)


@dataclasses.dataclass
class Context:
  """What the threads of one process of a decentralised run share.

  Attributes:
    node / mailbox: this process's node and its mailbox (arrays between its own threads).
    layout: the run's layout; ``owners``: (virtual worker, stage) -> process; ``shard_owners``: the process
      of every unit's PS shard (its primary); ``backup_of``: per process, the process that holds a backup of
      its primary shards (None: no backup, a job of one process); ``clock``: the clock service's process
      (process 0, whose loss ends the job anyway).
    waves / d / schedule / weight_mode: as in the run's configuration.
    unit_specs: per unit, the (shape, dtype) of each of its weight leaves.
    streams: every virtual worker's minibatches (the same in every process).
    cost / time_scale: a task's emulated seconds, and real seconds per emulated second (0: no padding).
    trace: this process's trace part; ``t_start``: its clock's zero (when it left the start barrier);
      ``trace_shift``: seconds added to every time the trace says (a part of a run that continues one trace).
    push_dtype: the dtype a wave's update travels in to the shards (mixed precision: 16 bits; None: the
      weights' own).
    slow: injected slowdowns of this process, (factor, start, end): a task it starts between ``start`` and ``end``
      seconds of its clock lasts ``factor`` times as long (:meth:`pad` sleeps the rest).
    failures: injected faults (``--fail``), virtual worker -> the wave at which it fails (its first one);
      ``replaced``: failed virtual workers are replaced (``--rejoin``), so a failure stays in software (its
      replacement runs on its devices).
  """

  node: Node
  mailbox: Mailbox
  layout: Layout
  owners: dict[tuple[int, int], int]
  shard_owners: Sequence[int]
  backup_of: Sequence[int | None]
  clock: int
  waves: int
  d: int
  schedule: str
  weight_mode: str
  unit_specs: Sequence[Sequence[Spec]]
  streams: MinibatchStreams
  cost: Callable[[Task], float] | None
  time_scale: float
  trace: Trace
  t_start: float = 0.0
  trace_shift: float = 0.0
  push_dtype: Any = None
  slow: tuple[tuple[float, float, float], ...] = ()
  failures: dict[int, int] = dataclasses.field(default_factory=dict)
  replaced: bool = False
  stopped: list[str] = dataclasses.field(default_factory=list)  # why threads ended early
  inputs: list[threading.Thread] = dataclasses.field(default_factory=list)  # the input streams' threads
  gone: set[int] = dataclasses.field(default_factory=set)  # processes found gone (see :meth:`watch`)
  over: threading.Event = dataclasses.field(default_factory=threading.Event)  # this process's part has ended
  on_gone: list[Callable[[int], None]] = dataclasses.field(default_factory=list)  # told of each process gone
  _lock: threading.Lock = dataclasses.field(default_factory=threading.Lock)

  @property
  def num_units(self) -> int:
    return len(self.shard_owners)

  def now(self) -> float:
    """Seconds on this process's clock since it left the start barrier."""
    return time.perf_counter() - self.t_start

  def emit(self, stamp: str, **event) -> None:
    """Writes ``event`` to this process's trace part, naming the process, with its field ``stamp`` set to
    now (taken under one lock, so the part's times never go back); its ``t0``, if any, is a time of :meth:`now`."""
    if self.trace_shift and "t0" in event:
      event["t0"] += self.trace_shift
    with self._lock:
      self.trace.emit(**event, **{stamp: self.now() + self.trace_shift}, process=self.node.process)

  def pad(self, task: Task, t0: float) -> None:
    """Sleeps until ``task``, started at ``t0``, has lasted its emulated duration x ``time_scale``, then, in an
    injected slowdown (``slow``), until it has lasted ``factor`` times that."""
    if self.cost is not None and self.time_scale > 0:
      remaining = t0 + self.cost(task) * self.time_scale - self.now()
      if remaining > 0:
        time.sleep(remaining)
    factor = max([f for f, start, end in self.slow if start <= t0 < end], default=1.0)
    if factor > 1:
      time.sleep((factor - 1) * (self.now() - t0))

  def owner_units(self, first: int, last: int) -> dict[int, list[int]]:
    """The shard owner of each unit in ``[first, last)``: owner process -> units, in unit order."""
    out: dict[int, list[int]] = {}
    for unit in range(first, last):
      out.setdefault(self.shard_owners[unit], []).append(unit)
    return out

  def copies(self, unit: int) -> list[int]:
    """The processes that hold a copy of ``unit``'s shard: its primary, then its backup (if any)."""
    primary = self.shard_owners[unit]
    backup = self.backup_of[primary]
    return [primary] if backup is None else [primary, backup]

  def holders(self, first: int, last: int) -> dict[int, list[int]]:
    """Every process not known gone that holds a copy of a unit in ``[first, last)``: process -> those units."""
    out: dict[int, list[int]] = {}
    for unit in range(first, last):
      for p in self.copies(unit):
        if p not in self.gone:
          out.setdefault(p, []).append(unit)
    return dict(sorted(out.items()))

  def held_units(self, p: int) -> list[int]:
    """The units of which process ``p`` holds a copy (primary or backup)."""
    return [u for u in range(self.num_units) if p in self.copies(u)]

  def serving(self, primary: int) -> int:
    """The process that serves the pulls of ``primary``'s shards: it, or once it is known gone its backup."""
    backup = self.backup_of[primary]
    return backup if primary in self.gone and backup is not None else primary

  def fatal_loss(self, p: int) -> str | None:
    """Why the job cannot go on without process ``p`` and those already gone (every copy of some PS shard was
    there, or the clock), or None (only the virtual workers with a stage there leave)."""
    gone = self.gone | self.node.dead | {p}
    units = [u for u in range(self.num_units) if set(self.copies(u)) <= gone]
    if units:
      where = "" if len(self.copies(units[0])) == 1 else " and the processes of their backups"
      return (f"process {p} is gone{where}, and with it every copy of the PS shards of units {units}: the "
              "global weights are lost; resume from the newest checkpoint (--checkpoint_dir with --resume), or "
              "keep the shards off nodes that may fail (--placement)")
    if p == self.clock:
      return f"process {p} is gone, and with it the WSP clock: the job cannot go on"
    return None

  def dies_for(self, vw: int) -> bool:
    """Whether an injected failure of ``vw`` kills the process of its stage 0 for real: that process runs no other
    virtual worker's stage, is not the clock's, and its loss leaves a copy of every PS shard; and the virtual worker
    is not to be replaced."""
    p = self.owners[(vw, 0)]
    others = {v for (v, _), q in self.owners.items() if q == p} - {vw}
    return not self.replaced and p != self.clock and not others and self.fatal_loss(p) is None

  def watch(self) -> None:
    """Starts a thread that adds to :attr:`gone` every process declared gone (by process 0: a key-value look
    per process every ``POLL_S``, off every task's path; free in process 0), or found gone by a thread of
    this process, and calls every function of :attr:`on_gone` with it once."""

    def loop() -> None:
      told: set[int] = set()
      while not self.over.is_set():
        for p in range(self.node.num_processes):
          if p != self.node.process and p not in told and (p in self.gone or self.node.declared_dead(p)):
            self.gone.add(p)  # (a thread may have found it gone first: a pull from it failed)
            told.add(p)
            for on_gone in self.on_gone:
              on_gone(p)
        time.sleep(POLL_S)

    threading.Thread(target=loop, name="watch-gone", daemon=True).start()

  def wait_unless_gone(self, src: int, what: str, wait: Callable[[], Any]) -> Any:
    """``wait()`` (what :func:`~hetpipe_jax.runtime.transport.mailbox.expect` returned for a message from
    ``src``), given up with :class:`PeerGone` once ``src`` is declared gone (:meth:`Node.pull_unless_gone`): a
    pull from a process that died may block for good."""
    return wait() if src == self.node.process else self.node.pull_unless_gone(src, what, wait)

  def copy_holders(self) -> list[int]:
    """Every process that holds a copy (primary or backup) of some unit's PS shard."""
    return sorted({p for u in range(self.num_units) for p in self.copies(u)})

  def leaf_specs(self, units: Sequence[int]) -> list[Spec]:
    return [spec for u in units for spec in self.unit_specs[u]]

  def push_specs(self, units: Sequence[int]) -> list[Spec]:
    """The (shape, dtype) of each leaf of a pushed update of ``units``."""
    return [(shape, self.push_dtype or dtype) for shape, dtype in self.leaf_specs(units)]

  def check_job(self) -> None:
    """Raises RunStopped when the job cannot go on (another process said why), PeerGone when it stops."""
    if self.node.fatal:
      raise RunStopped(self.node.fatal)
    if self.node.recoverable and self.node.stopping():
      raise PeerGone(self.node.process, " (the job is stopping)")


class Actor:
  """State that one thread at a time works on, fed by input threads (:func:`stream`): whichever thread brings
  an input does the work it allows, so no thread has to wake up between a message's arrival and that work.

  ``step(items)`` takes the inputs that arrived (``(name, key, value)`` each), does everything they allow, and
  returns True once the actor is finished. :meth:`run` (the actor's own thread) makes the first step and
  waits until it is finished, raising what a step or an input thread raised, or why the job stopped.
  """

  def __init__(self, ctx: Context, step: Callable[[list[tuple[str, Any, Any]]], bool]):
    self.ctx, self._step = ctx, step
    self._lock = threading.Lock()
    self._inbox: list[tuple[str, Any, Any]] = []
    self._busy = True  # a thread is stepping (the first step is :meth:`run`'s)
    self._finished = threading.Event()
    self._error: BaseException | None = None

  def offer(self, item: tuple[str, Any, Any]) -> None:
    """An input arrived (any thread): it is worked off now, by this thread unless another is stepping."""
    with self._lock:
      self._inbox.append(item)
      if self._busy:
        return
      self._busy = True
    self._work()

  @property
  def finished(self) -> bool:
    return self._finished.is_set()

  def fail(self, error: BaseException) -> None:
    """An input thread failed: so does the actor."""
    with self._lock:
      self._error = self._error or error
    self._finished.set()

  def _work(self) -> None:
    try:
      while not self._finished.is_set():
        with self._lock:
          items, self._inbox = self._inbox, []
        if self._step(items):
          self._finished.set()
          return
        with self._lock:
          if not self._inbox:
            self._busy = False
            return
    except BaseException as e:  # pylint: disable=broad-except  # raised by run()
      self.fail(e)

  def run(self) -> None:
    """The first step, then waits until the actor is finished (checking every ``POLL_S`` that the job can
    still go on)."""
    self._work()
    while not self._finished.wait(POLL_S):
      self.ctx.check_job()
    if self._error is not None:
      raise self._error


def stream(actor: Actor, name: str, keys: Iterable[Any], expect: Callable[[Any], Callable[[], Any]],
           depth: int = 2) -> None:
  """Starts a thread that receives the messages of ``keys`` in order and offers each to ``actor`` as
  ``(name, key, value)``: ``expect(key)`` asks for one at once and returns what waits for it, and the thread
  keeps the next ``depth`` asked for ahead (so a message's request is at its sender before it is offered).
  When the sender is gone the stream ends, offering ``(name, None, PeerGone)``."""

  def loop() -> None:
    try:
      ahead = iter(keys)
      pending = collections.deque((key, expect(key)) for key in itertools.islice(ahead, depth))
      while pending:
        key, wait = pending.popleft()
        for nxt in itertools.islice(ahead, 1):
          pending.append((nxt, expect(nxt)))
        actor.offer((name, key, wait()))
    except PeerGone as e:  # its sender is gone: the actor decides what that means
      actor.offer((name, None, e))
    except BaseException as e:  # pylint: disable=broad-except  # raised by the actor's run()
      actor.fail(e)

  thread = threading.Thread(target=loop, name=name, daemon=True)
  actor.ctx.inputs.append(thread)
  thread.start()


def run_thread(ctx: Context, what: str, body: Callable[[], None]) -> None:
  """Runs a thread's ``body``. When the job stops (another process said why), it just ends; a lost peer
  tells process 0 why the job cannot go on; any other failure ends this process at once (a bug, or a stage
  that cannot compute: the others follow)."""
  try:
    body()
  except RunStopped as e:
    ctx.stopped.append(str(e))
  except PeerGone as e:
    ctx.stopped.append(f"{e}, so {what} (process {ctx.node.process}) cannot go on")
    ctx.node.publish_fatal(ctx.stopped[-1])
  except BaseException as e:  # pylint: disable=broad-except
    ctx.node.abort(f"{what}: {type(e).__name__}: {e}")
