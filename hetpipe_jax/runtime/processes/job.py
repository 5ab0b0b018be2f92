"""One process's part of a decentralised ``multiprocess`` run (:mod:`hetpipe_jax.runtime.processes.decentral`): the
loops of the stages on its node, the PS shards it owns, the clock if it holds it; at the end its trace part,
and on process 0 every part and the gathered weights.

Every process builds the same :class:`~hetpipe_jax.runtime.processes.build.Job` (the same seed gives the same
initial weights everywhere), compiles its stages, connects, meets the others at the start barrier (its
clock's zero), runs its threads to the end, and meets them again; then each sends process 0 its trace
part (one message, after training), and process 0 collects the weights the clock had gathered from every
live copy of every shard, checks that the copies agree bit for bit, and adds to the trace how many waves
each copy applied (``applied`` lines).
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import threading
import time
from collections.abc import Callable
from typing import Any, NoReturn

import jax
import numpy as np
from absl import logging

from hetpipe_jax.core.schedule import Task
from hetpipe_jax.core.trace import Trace, read_whole_lines
from hetpipe_jax.errors import LostAtStart, ProtocolError, RunStopped
from hetpipe_jax.runtime.numerics.mixed import compute_dtype
from hetpipe_jax.runtime.numerics.ps import ParameterServer
from hetpipe_jax.runtime.numerics.stage import Stage
from hetpipe_jax.runtime.processes.build import Job, build_stage, nodes_of, process_of
from hetpipe_jax.runtime.processes.clock import GATHERS_KEY, ClockService
from hetpipe_jax.runtime.processes.decentral import LEFT_KEY, Context
from hetpipe_jax.runtime.processes.shards import ShardFollower, copies_server
from hetpipe_jax.runtime.processes.stage_loop import StageLoop
from hetpipe_jax.runtime.transport import protocol
from hetpipe_jax.runtime.transport.mailbox import TIMEOUT_S, Mailbox, collect, deliver, unflatten_units
from hetpipe_jax.runtime.transport.node import DEAD_AFTER_S, POLL_S, Node, PeerGone


@dataclasses.dataclass(frozen=True)
class Options:
  """How the run goes beyond its :class:`~hetpipe_jax.runtime.processes.build.Job`.

  Attributes:
    waves / schedule / eval_every / on_nonfinite: as in the run's configuration.
    cost / time_scale: a task's emulated seconds and the padding (0: none).
    part_path: where this process writes its trace part as it goes (None: kept in memory only).
    slow: this process's slowdowns, (factor, start, end) on its clock (:attr:`Context.slow`).
    origin: a later part of a run (one layout after another in the same processes): when its first part started,
      on this process's ``perf_counter``; the slowdowns count from it (None: this run is the first part).
    failures: injected faults, virtual worker -> the wave at which it fails (:attr:`Context.failures`);
      ``replaced``: failed virtual workers are replaced (:attr:`Context.replaced`).
    evals: (waves run before this part, the run's waves): the clock orders a gather where the run's global clock
      reaches an evaluation tick ((0, waves): this run is all of it).
    trace_before: a part of a run that continues one trace: its times are seconds since the run's first part
      started (``origin``) plus ``trace_before``; None: since this part's start barrier.
  """

  waves: int
  schedule: str
  eval_every: int
  on_nonfinite: str
  cost: Callable[[Task], float] | None
  time_scale: float
  part_path: str | None
  slow: tuple[tuple[float, float, float], ...] = ()
  origin: float | None = None
  failures: tuple[tuple[int, int], ...] = ()
  replaced: bool = False
  evals: tuple[int, int] = (0, 0)
  trace_before: float | None = None


@dataclasses.dataclass
class Outcome:
  """What process 0 has at the end: every process's trace part (of one that was gone before it could send its
  part, what its file held up to its last whole line), the gathered global weights (in gather order; the last is
  the final weights), the seconds from the start barrier until training ended (the clock had ordered every push;
  gathering the weights and the parts after it is not training), and the processes that were gone."""

  parts: list[list[dict[str, Any]]]
  gathers: list[tuple[Any, ...]]
  seconds: float
  missing: list[int]


def backups(num_processes: int) -> list[int | None]:
  """The process that backs up each process's primary PS shards: the next one (none in a job of one)."""
  return [(p + 1) % num_processes if num_processes > 1 else None for p in range(num_processes)]


Built = dict[tuple[Any, ...], Any]  # compiled stages (with their inputs' specs) and PS copies, by what they hold


class DecentralJob:
  """This process's part of a decentralised run (see the module docstring). ``built``: what earlier parts of the run
  compiled; ``stranded``: their threads that still wait inside the transport (a virtual worker left)."""

  def __init__(self, node: Node, job: Job, options: Options, built: Built | None = None,
               stranded: list[threading.Thread] | None = None):
    self.node, self.job, self.options = node, job, options
    self.built = {} if built is None else built
    self.stranded = [] if stranded is None else stranded
    nodes = nodes_of(job.cluster)
    owners = process_of(job.layout, nodes)
    shard_owners = [nodes.index(n) for n in job.shard_nodes]
    specs = [[(leaf.shape, leaf.dtype) for leaf in jax.tree.leaves(p)] for p in job.init_params]
    self.trace = Trace(options.part_path, line_buffered=True)  # what a run that died leaves is merged too
    self.ctx = Context(node, Mailbox(), job.layout, owners, shard_owners, backups(node.num_processes), 0,
                       options.waves, job.d, options.schedule, job.weight_mode, specs, job.streams, options.cost,
                       options.time_scale, self.trace, push_dtype=compute_dtype(job.precision), slow=options.slow,
                       failures=dict(options.failures), replaced=options.replaced)
    self.threads: list[tuple[threading.Thread, int | None]] = []  # (thread, its virtual worker, if a stage)
    self._left_behind: list[threading.Thread] = []
    self._loops: list[StageLoop] = []  # this process's stages

  def start(self) -> None:
    """Builds and compiles this process's threads, meets every other process, starts the threads.

    Raises:
      LostAtStart: when a process is gone before the clocks start.
    """
    ctx, job, me = self.ctx, self.job, self.node.process
    if ctx.held_units(me):
      self.threads.append((ShardFollower(ctx, job.init_params, job.ps_tx, self._server()).thread, None))
    x0, y0 = job.streams(0, 1)
    for (i, j), process in sorted(ctx.owners.items()):
      if process == me:
        self._loops.append(StageLoop(ctx, i, j, *self._stage(i, j, x0, y0, True)))
        self.threads.append((self._loops[-1].thread, i))
    if me == ctx.clock:
      first, run_waves = self.options.evals
      clock = ClockService(ctx, self.options.eval_every, self.options.on_nonfinite, first, run_waves or ctx.waves)
      self.threads.append((clock.thread, None))
    try:
      self.node.connect_all()
      self.node.meet(self.node.scoped("hetpipe_jax/ready"), 600)  # every stage compiled and connected: clocks start
    except PeerGone as e:  # (a recoverable job) nothing of this part ran: the run stops here
      raise LostAtStart(e.process) from None
    ctx.t_start = time.perf_counter()
    if self.options.trace_before is not None:
      origin = ctx.t_start if self.options.origin is None else self.options.origin
      ctx.trace_shift = ctx.t_start - origin + self.options.trace_before
    if self.options.origin is not None:  # the slowdowns count from the run's start
      shift = ctx.t_start - self.options.origin
      ctx.slow = tuple((factor, start - shift, end - shift) for factor, start, end in ctx.slow)
    ctx.watch()
    for thread, _ in self.threads:
      thread.start()

  def compile(self) -> None:
    """Compiles this process's stages and PS copies of this job into :attr:`built`, starting nothing and touching
    nothing already there (a part of the run prepared while another trains)."""
    ctx, me = self.ctx, self.node.process
    if ctx.held_units(me):
      self._server()
    x0, y0 = self.job.streams(0, 1)
    for (i, j), process in sorted(ctx.owners.items()):
      if process == me:
        self._stage(i, j, x0, y0, False)

  def _server(self) -> ParameterServer | None:
    """The server of this process's PS copies, compiled: one of :attr:`built` for the same units (its
    :class:`ShardFollower` restarts it from this job's weights), else a new one, kept there; None for a rule of
    the run's own (its follower compiles it afresh)."""
    if self.job.ps_tx is not None:
      return None
    key = ("ps", tuple(self.ctx.held_units(self.node.process)), self.ctx.d, str(self.ctx.push_dtype))
    if key not in self.built:
      self.built[key] = copies_server(self.ctx, self.job.init_params, None)
    return self.built[key]

  def _stage(self, i: int, j: int, x0, y0, restart: bool) -> tuple[Stage, dict[str, list[tuple[Any, Any]]]]:
    """Stage j of virtual worker i, compiled: one of :attr:`built` when it holds the same units on the same GPUs
    with the same Nm (restarted from this job's weights when ``restart``), else a new one (kept there)."""
    vw = self.job.layout.vws[i]
    key = (i, j, vw.stage_units(j), vw.nm, tuple(g.index for g in vw.stage_gpus(j)))
    if key not in self.built:
      self.built[key] = build_stage(self.job, i, j, x0, y0)
    elif restart:
      units = vw.stage_units(j)
      self.built[key][0].restart(self.job.init_params[units.start:units.stop])
    return self.built[key]

  def _stopping(self) -> bool:
    node = self.node
    return bool(self.ctx.stopped or node.fatal) or (node.recoverable and node.stopping())

  def _join(self) -> bool:
    """Waits for this process's threads; False when the job stopped early. The threads of a virtual worker
    that left may wait for good (for a process that is gone): they are left behind."""
    node = self.node
    for thread, vw in self.threads:
      while thread.is_alive():
        thread.join(POLL_S)
        if self._stopping():
          return False
        if vw is not None and node.try_get(node.scoped(LEFT_KEY.format(vw=vw))) is not None:
          self._left_behind.append(thread)
          break
    return not self._stopping()

  def finish(self, last: bool = True) -> Outcome | None:
    """Runs to the end; returns process 0's :class:`Outcome` (None on the other processes). Not ``last`` (a part of
    a run another part follows, in the same processes): the node stays open.

    A process other than 0 whose threads still wait inside the transport (the job stopped early, or a
    virtual worker left) closes and ends at once (``os._exit``: Python's teardown would abort under those
    threads; the launcher goes by process 0); process 0 closes once every other one has, and lets its
    own such waits fail with their senders gone.

    Raises:
      RunStopped: on process 0, when the job stopped early (e.g. a non-finite update with
        ``on_nonfinite="stop"``, or lost PS shards), saying why.
    """
    node, ctx = self.node, self.ctx
    if not self._join():
      self._stop()
    seconds = ctx.now()  # process 0: the clock has ordered every push (training is over)
    if node.process == 0:
      gathers = self._gathers()
    ctx.over.set()
    self.trace.close()
    if node.process != 0:
      # (never an empty array: a process with no stage has no event, and a pull of 0 bytes never completes)
      text = "".join(json.dumps(ev, separators=(",", ":")) + "\n" for ev in self.trace.events) or "\n"
      deliver(node, ctx.mailbox, 0, protocol.tag("trace_part", process=node.process),
              [jax.device_put(np.frombuffer(text.encode(), np.uint8), node.device)])
      self._end(last)
      return None
    parts, missing = [self.trace.events], []
    for p in range(1, node.num_processes):  # each sends its part once its threads are done
      try:
        (data,) = collect(node, ctx.mailbox, p, protocol.tag("trace_part", process=p))
        parts.append([json.loads(line) for line in np.asarray(data).tobytes().decode().splitlines() if line])
      except PeerGone:
        missing.append(p)
        parts.append(self._left_behind_part(p))
    outcome = Outcome(parts, gathers, seconds, missing)
    self._end(last)
    return outcome

  def _end(self, last: bool) -> None:
    """Closes after the run's last part; after another, keeps what still waits inside the transport for then."""
    if last:
      self._close()
      return
    self.stranded.extend(t for t in self._left_behind + self.ctx.inputs if t.is_alive())
    for loop in self._loops:  # (the next part restarts their compiled stages)
      if loop.thread in self._left_behind:
        loop.halt()

  def _left_behind_part(self, process: int) -> list[dict[str, Any]]:
    """What a process that is gone wrote of its trace part before it died, up to its last whole line (its file
    beside this process's; none when the run keeps no trace file, or the file is on another host)."""
    if self.options.part_path is None:
      return []
    events = read_whole_lines(f"{self.options.part_path.rsplit('.part', 1)[0]}.part{process}")
    logging.info("trace: process %d is gone; %d events of its part were read back from its file", process,
                 len(events))
    return events

  def _close(self) -> None:
    """Closes; a process other than 0 with a thread still waiting inside the transport (a VW left: what it
    waits for will not come) ends at once; process 0, after every other, gives such threads 2 s for their
    waits to fail with their senders gone."""
    self.node.close()
    waiting = [t for t in self._left_behind + self.ctx.inputs + self.stranded if t.is_alive()]
    if waiting and self.node.process != 0:
      self._exit()
    deadline = time.monotonic() + 2.0
    for thread in waiting:
      thread.join(max(deadline - time.monotonic(), 0.0))

  def _exit(self) -> NoReturn:
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)

  def _stop(self) -> NoReturn:
    node = self.node
    self.trace.close()
    if node.process != 0:
      node.close()
      self._exit()
    deadline = time.monotonic() + DEAD_AFTER_S + 5 * POLL_S
    while not node.fatal and time.monotonic() < deadline:  # the verdict comes within the watch's delay
      time.sleep(POLL_S)
    node.stop_job()  # every wait for another process gives up
    node.close()
    for thread, _ in self.threads:  # their senders are gone: their waits fail and the threads end
      thread.join(2.0)
    raise RunStopped(node.fatal or (self.ctx.stopped or ["the job stopped early"])[0])

  def _gathers(self) -> list[tuple[Any, ...]]:
    """Process 0: every gather the clock ordered, each the global weights of every unit, from every copy not
    gone (the copies of a unit must agree bit for bit); then, in the trace, how many waves of each virtual
    worker each copy had applied at the last gather (``applied``).

    Raises:
      ProtocolError: when two copies of a shard differ.
    """
    ctx, node = self.ctx, self.node
    treedefs = [jax.tree.structure(p) for p in self.job.init_params]
    out, applied = [], {}
    count = int(node.get(node.scoped(GATHERS_KEY), TIMEOUT_S))
    for n in range(count):
      params: list[Any] = [None] * ctx.num_units
      for p in ctx.copy_holders():
        if p in node.dead:
          continue
        units = ctx.held_units(p)
        try:
          *leaves, clock = collect(node, ctx.mailbox, p, protocol.tag("weights", process=p, n=n))
        except PeerGone:
          continue  # gone since: its copies are elsewhere
        if n == count - 1:  # the copies that are there at the end
          applied[p] = [int(c) for c in np.asarray(clock)]
        for u, tree in zip(units, unflatten_units([treedefs[u] for u in units], leaves)):
          if params[u] is None:
            params[u] = tree
          elif not all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(params[u]), jax.tree.leaves(tree))):
            raise ProtocolError(f"gather {n}: the copy of unit {u}'s PS shard in process {p} differs from the "
                                f"one in process {ctx.copies(u)[0]}")
      out.append(tuple(params))
    for p, counts in sorted(applied.items()):
      for vw, waves in enumerate(counts):
        ctx.emit("t", ev="applied", vw=vw, owner=p, units=ctx.held_units(p), waves=waves,
                 primary=[u for u in ctx.held_units(p) if ctx.shard_owners[u] == p])
    return out
