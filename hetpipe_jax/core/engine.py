"""The event-driven core that every executor drives: pipeline schedule + WSP push/gate/pull + trace.

An executor only answers two questions: *when* does a task start and end (wall clock, or a virtual clock
from a cost model), and does it block on the numerics. Everything else happens here, written once:

* ``startable()``: for every free device, the task its pipeline schedule picks next (devices with nothing
  to start are dropped from the candidates until an event can give them something);
* ``start(task, t)``: the device is busy; record the weight version the task uses; dispatch its numerics;
* ``finish(task, t)``: write the task's trace line, ready its successor, complete minibatches in order,
  push a finished wave to the PS, then retry every virtual worker's next injection: the Nm window, the
  WSP gate (c_local - c_global <= D), the pull and rebase.

Where a push goes: the engine hands it to the :class:`~hetpipe_jax.core.comm.Comm`, which delivers it
(at once, or when the simulated transfer lands); then the server applies it (``server.push``) and the
trace's push line is written. A gated injection waits for its own virtual worker's last push to be
applied, then for the gate (``server.try_pull``), then for the pull to arrive through the Comm.

A Comm whose ``staged`` is True (the ``sim`` executor's ``--staged_ps`` model) moves each stage's part on
its own: a stage's part of a wave's push leaves as soon as that stage's last backward of the wave has
ended (the push is applied, as always, when every part has landed), and the pull arrives stage by stage:
a stage rebases when its part lands, the gated injection waits for stage 0's part only, and at every
other stage the forwards of the gated minibatch and those after it wait for that stage's part. The same
guarantees hold: one snapshot, taken when the gate opens, reaches every stage before any forward that
needs it. Staged transfers are a timing model: the engine refuses them with numerics.

Membership (docs/PROTOCOL.md section 3.8): a virtual worker *fails* when a fault is injected at the first
minibatch of one of its ``failures`` waves (where the numerics can crash for real, e.g. kill the
processes that run it, the failure is then found like a real one), when dispatching its task raises, or
when its task fails where it runs (:meth:`Engine.task_failed`). It leaves: the server
drops it from the global clock, its updates not pushed yet are dropped, the tasks it had running finish
on their devices unrecorded, and the trace says ``leave`` (with what was dropped). With ``rejoin`` a
replacement joins on the same devices as soon as the global clock of the live ones has reached the
failed one's clock (at once if it was the slowest; a replacement entering lower would push wave numbers
that the global weights already hold): it takes the current global clock as its clock, pulls the global
weights (``join`` + ``pull`` in the trace) and runs the waves from there.

Not thread-safe by itself: the ``wall`` executor calls it under one lock.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, cast

from hetpipe_jax.core import schedule as schedule_lib
from hetpipe_jax.core import versions as versions_lib
from hetpipe_jax.core import wsp
from hetpipe_jax.core.comm import Comm, InstantComm, StagedComm
from hetpipe_jax.core.schedule import FWD, Task
from hetpipe_jax.core.server import Server, Snapshot
from hetpipe_jax.core.trace import Trace
from hetpipe_jax.core.versions import Version
from hetpipe_jax.core.worker import VirtualWorker
from hetpipe_jax.errors import ProtocolError, TaskFailed

BatchFn = Callable[[int, int], tuple[Any, Any]]  # (vw, mb) -> (x, labels)
WaveFn = Callable[[int, int, float, list], None]  # (vw, wave, t, losses of the wave) -> None


class Engine:
  """Runs N virtual workers against one parameter server.

  Args:
    vws: the virtual workers.
    server: the parameter server (holds the clocks and D).
    trace: where events go; the caller has written the meta line.
    batches: minibatch source, called at injection (None without numerics).
    on_wave: called after every push with the wave's losses.
    comm: how pushes and pulls travel (default: instantly); one whose ``staged`` is True (a
      :class:`~hetpipe_jax.core.comm.StagedComm`) moves each stage's part on its own (see above).
    failures: fault injection: virtual worker -> the waves at whose first minibatch it fails.
    rejoin: a failed virtual worker is replaced at once (else it stays out).
  """

  def __init__(self, vws: Sequence[VirtualWorker], server: Server, trace: Trace,
               batches: BatchFn | None = None, on_wave: WaveFn | None = None, comm: Comm | None = None,
               failures: Mapping[int, Sequence[int]] | None = None, rejoin: bool = False):
    self.vws, self.server, self.trace = list(vws), server, trace
    self._batches, self._on_wave = batches, on_wave
    self.comm = comm or InstantComm()
    self._failures = {i: set(waves) for i, waves in (failures or {}).items()}  # faults not injected yet
    self._rejoin = rejoin
    self._zombies: set[tuple[int, int]] = set()  # devices still running a task of a failed virtual worker
    self._generation = [0] * len(self.vws)  # bumped when a virtual worker fails: late pushes/pulls are void
    self._awaiting_join: set[int] = set()  # failed, a replacement joins once the global clock allows
    self._running: dict[tuple[int, int], tuple[float, Version]] = {}  # device -> (start, version)
    self._glob_lists: dict[int, tuple[tuple[int, ...], list[int]]] = {}  # id(glob) -> (glob, as a list)
    self._candidates: set[tuple[int, int]] = set()  # devices that may have become able to start a task
    self._pulling: dict[int, int] = {}  # vw -> gated minibatch whose pull is on its way
    self._pulled: dict[int, int] = {}  # vw -> gated minibatch whose pull has arrived
    self._waiting_since: dict[int, float] = {}  # vw -> when its gate was found closed
    self._staged: StagedComm | None = cast(StagedComm, self.comm) if self.comm.staged else None
    if self._staged and any(vw.stages for vw in self.vws):
      raise ProtocolError("staged push and pull transfers are a timing model without numerics (the sim "
                          "executor); this run computes")
    self._stage_wait: dict[int, tuple[int, set[int]]] = {}  # vw -> (gated minibatch, stages not rebased yet)

  def generation(self, vw: int) -> int:
    """How many times virtual worker ``vw`` has failed (work of an older generation is void)."""
    return self._generation[vw]

  @property
  def done(self) -> bool:
    return all(vw.done for vw in self.vws)

  def host_state(self) -> dict[str, Any]:
    """Everything the engine and its virtual workers hold between events (plain Python values; the
    numerics and the server keep their own), for a checkpoint."""
    return {"pipelines": [vw.pipeline for vw in self.vws], "versions": [vw.versions for vw in self.vws],
            "running": dict(self._running), "candidates": set(self._candidates), "pulling": dict(self._pulling),
            "pulled": dict(self._pulled), "waiting_since": dict(self._waiting_since),
            "live": [vw.live for vw in self.vws], "failures": {i: set(w) for i, w in self._failures.items()},
            "zombies": set(self._zombies), "generation": list(self._generation),
            "awaiting_join": set(self._awaiting_join)}  # (staged pulls are sim-only: no checkpoints)

  def restore_host_state(self, state: dict[str, Any]) -> None:
    """Puts back what :meth:`host_state` returned."""
    for vw, pipeline, versions in zip(self.vws, state["pipelines"], state["versions"]):
      vw.pipeline, vw.versions = pipeline, versions
    self._running, self._candidates = dict(state["running"]), set(state["candidates"])
    self._pulling, self._pulled = dict(state["pulling"]), dict(state["pulled"])
    self._waiting_since = dict(state["waiting_since"])
    for vw, live in zip(self.vws, state["live"]):
      vw.live = live
    self._failures = {i: set(w) for i, w in state["failures"].items()}
    self._zombies, self._generation = set(state["zombies"]), list(state["generation"])
    self._awaiting_join = set(state["awaiting_join"])

  def devices(self) -> list[tuple[int, int]]:
    """Every (virtual worker, stage) device."""
    return [(vw.index, j) for vw in self.vws for j in range(vw.k)]

  def begin(self, t: float = 0.0) -> None:
    """Injects every virtual worker's first window."""
    self._inject_all(t)

  def startable(self, allow: Callable[[Task], bool] | None = None) -> list[Task]:
    """One task for every free device that has one ready, in device order; with ``allow``, only among
    the ready tasks it accepts (a device passed over this way is considered again after :meth:`wake`).

    A device with nothing to start leaves the candidates: only an event that adds it back (a task of its
    virtual worker finishing next to it, an injection, a wake, a rejoin) can give it something."""
    tasks, idle = [], []
    vws, running, pick = self.vws, self._running, schedule_lib.pick
    for device in sorted(self._candidates):
      vw = vws[device[0]]
      task = None
      if device not in running and vw.live:  # else busy (maybe with a failed VW's task), or gone
        task = pick(vw.pipeline, device[1], self._stage_rule(*device, allow) if self._stage_wait else allow)
      if task is None:
        idle.append(device)
      else:
        tasks.append(task)
    self._candidates.difference_update(idle)
    return tasks

  def _stage_rule(self, i: int, j: int, allow: Callable[[Task], bool] | None) -> Callable[[Task], bool] | None:
    """``allow``, and (staged pulls) no forward of the gated minibatch or a later one at a stage whose part
    of the pull has not landed."""
    wait = self._stage_wait.get(i)
    if wait is None or j not in wait[1]:
      return allow
    gated = wait[0]
    return lambda task: (task.kind != FWD or task.mb < gated) and (allow is None or allow(task))

  def stop_injecting(self) -> None:
    """No virtual worker injects another minibatch; those in flight complete (the run then drains: a
    shorter run, complete in itself, whose last wave may be unfinished and so not pushed). Finishing the
    begun wave instead could stall: a wave's last minibatch is gated, and the virtual workers it would
    wait for have stopped too."""
    for vw in self.vws:
      vw.total_mbs = min(vw.total_mbs, vw.pipeline.next_mb - 1)  # injected so far

  def wake(self, vw: int, stage: int) -> None:
    """Something an ``allow`` of :meth:`startable` depends on changed for this device (e.g. an input
    landed): consider it again."""
    self._candidates.add((vw, stage))

  def start(self, task: Task, t: float) -> Any:
    """Starts ``task`` at ``t``; returns what to wait on for its numerics (None without numerics)."""
    i, j, kind, mb = task
    vw = self.vws[i]
    vw.pipeline = schedule_lib.start(vw.pipeline, task)
    device = (i, j)
    self._candidates.discard(device)
    if kind == FWD:
      vw.versions, version = versions_lib.forward(vw.versions, j, mb)
    else:  # the update is applied as the backward starts
      vw.versions, version = versions_lib.backward(vw.versions, j, mb, vw.nm, vw.weight_mode)
    self._running[device] = (t, version)
    try:
      return vw.numerics.run(task)
    except ProtocolError:
      raise  # a bug in the runtime, not a failing virtual worker
    except Exception as e:  # pylint: disable=broad-except  # the virtual worker fails, the others go on
      if not self._rejoin and not any(other.live for other in self.vws if other is not vw):
        raise
      self._fail(vw, t, f"{type(e).__name__}: {e}")
      return None

  def task_failed(self, task: Task, t: float, error: TaskFailed) -> None:
    """``task``'s numerics failed after it started (an executor learns it when it waits for them): its
    virtual worker fails as if dispatching had raised (for good when ``error.final``: nothing can run where
    it ran), and the task ends unrecorded.

    Raises:
      TaskFailed: when it was the last live virtual worker and none will replace it.
    """
    vw = self.vws[task.vw]
    if (task.vw, task.stage) not in self._zombies:
      if (error.final or not self._rejoin) and not any(other.live for other in self.vws if other is not vw):
        raise TaskFailed(f"{error}; no virtual worker is left to go on", error.final)
      self._fail(vw, t, str(error), final=error.final)
    self.finish(task, t)  # a failed virtual worker's task: it just frees its device

  def finish(self, task: Task, t: float) -> None:
    """``task`` ended at ``t``: trace it, ready its successor, complete, push, inject."""
    i, j, kind, mb = task  # its device, and the neighbours its successor or a freed window may use
    device = (i, j)
    vw = self.vws[i]
    candidates = self._candidates
    if self._zombies and device in self._zombies:  # a failed virtual worker's last task: its device is free
      self._zombies.discard(device)
      del self._running[device]
      candidates.add(device)
      return
    t0, (own, glob) = self._running.pop(device)
    self.trace.emit(ev=kind, vw=i, stage=j, mb=mb, t0=t0, t1=t, own=own, glob=self._glob_list(glob))
    pipeline, completed = schedule_lib.finish(vw.pipeline, task, vw.schedule)
    vw.pipeline = pipeline
    candidates.add(device)
    if j > 0:
      candidates.add((i, j - 1))
    if j + 1 < len(pipeline.busy):
      candidates.add((i, j + 1))
    if self._staged and kind != FWD and wsp.is_wave_end(mb, vw.nm):  # this stage's part is final
      self._staged.push_stage((i, self._generation[i], wsp.wave_of(mb, vw.nm)), i, j, t)
    if not completed:
      return
    self.trace.emit(ev="complete", vw=i, mb=mb, t=t)
    if wsp.is_wave_end(mb, vw.nm):
      wave = wsp.wave_of(mb, vw.nm)
      vw.versions = versions_lib.close_wave(vw.versions, wave, vw.nm, vw.index)
      updates, losses = vw.numerics.take_wave(wave)
      skipped = vw.numerics.take_skipped(wave)
      gen = self._generation[vw.index]
      landed = lambda t_done: self._push(vw, wave, updates, losses, t_done, skipped) \
          if self._generation[vw.index] == gen else None
      if self._staged:
        self._staged.push_staged((vw.index, gen, wave), t, landed)
      else:
        self.comm.push(vw.index, wave, t, landed)
    self._inject(vw, t)

  def _glob_list(self, glob: tuple[int, ...]) -> list[int]:
    """``glob`` as the list a task event carries: one list per version's tuple, shared by the events of
    every task that used it (copying N entries per task was a tenth of the host time at 1,024 GPUs; trace
    events are records, never modified)."""
    cached = self._glob_lists.get(id(glob))
    if cached is None or cached[0] is not glob:  # (an id is reused only after its tuple is gone)
      cached = self._glob_lists[id(glob)] = (glob, list(glob))
    return cached[1]

  def _push(self, vw: VirtualWorker, wave: int, updates: dict[int, Any], losses: list, t: float,
            skipped: int = 0) -> None:
    global_before = wsp.c_global(self.server.clock)
    clock = self.server.push(vw.index, wave, updates)
    dropped = self.server.dropped.get((vw.index, wave))
    extra = {} if dropped is None else {"dropped": "nonfinite", "units": dropped}  # clock ticked, not applied
    if skipped:  # fp16 loss-scale overflows: minibatch updates a stage skipped (docs/PROTOCOL.md)
      extra["skipped"] = skipped
    self.trace.emit(ev="push", vw=vw.index, wave=wave, t=t, shards=self.server.num_shards,
                    gap=wsp.clock_gap(clock, vw.index), **extra)
    if self._on_wave is not None:
      self._on_wave(vw.index, wave, t, losses)
    # A push can open gates: this virtual worker's own (its push landed), those waiting at a closed gate
    # if the global clock moved, and those that join now. Every other one stopped at its window or a pull
    # on its way, which only its own completion or pull arrival moves on: trying them too would change
    # nothing (and cost O(N) each, O(N^2) per wave of all).
    movable = {vw.index, *self._awaiting_join}
    if wsp.c_global(clock) != global_before:
      movable.update(self._waiting_since)
    self._join_waiting(t)
    self._inject_all(t, movable)

  def _inject_all(self, t: float, only: set[int] | None = None) -> None:
    """Retries the injections of every virtual worker (of those in ``only``), in index order."""
    for vw in self.vws if only is None else [self.vws[i] for i in sorted(only)]:
      self._inject(vw, t)

  def _inject(self, vw: VirtualWorker, t: float) -> None:
    """Injects while the window allows; a gated minibatch first passes the gate and pulls."""
    i = vw.index
    while vw.live and schedule_lib.can_inject(vw.pipeline, vw.nm, vw.total_mbs, vw.schedule, vw.window):
      mb = vw.pipeline.next_mb
      if (mb - 1) % vw.nm == 0 and wsp.wave_of(mb, vw.nm) in self._failures.get(i, ()):
        self._failures[i].discard(wsp.wave_of(mb, vw.nm))  # each injected fault fires once
        if not vw.numerics.crash():  # else: a real crash, found as such (its next task fails)
          return self._fail(vw, t, f"fault injected at wave {wsp.wave_of(mb, vw.nm)}")
      if wsp.is_gated(mb, vw.nm) and self._pulled.get(i) != mb:
        if self._pulling.get(i) == mb or self.server.clock.c_local[i] < wsp.wave_of(mb, vw.nm):
          return  # the pull is on its way, or this VW's own last push has not landed yet
        snapshot = self.server.try_pull(i)
        if snapshot is None:
          self._waiting_since.setdefault(i, t)
          return
        if i in self._waiting_since:
          self.trace.emit(ev="wait", vw=i, t0=self._waiting_since.pop(i), t1=t)
        self._pulling[i] = mb
        gen = self._generation[i]
        if self._staged:
          self._stage_wait[i] = (mb, set(range(vw.k)))
          self._staged.pull_staged(i, t, lambda stage, t_done, mb=mb, snapshot=snapshot, gen=gen: self._stage_arrived(
              vw, mb, snapshot, stage, t_done) if self._generation[i] == gen else None)
          return
        self.comm.pull(i, t, lambda t_done, mb=mb, snapshot=snapshot, gen=gen: self._pull_arrived(
            vw, mb, snapshot, t_done) if self._generation[i] == gen else None)
        continue  # an instant pull has injected mb already
      x, labels = self._batches(i, mb) if self._batches is not None else (None, None)
      vw.pipeline, _ = schedule_lib.inject(vw.pipeline, vw.schedule)
      vw.numerics.inject(mb, x, labels)
      self._candidates.add((i, 0))
      self.trace.emit(ev="inject", vw=i, mb=mb, t=t)

  def _pull_arrived(self, vw: VirtualWorker, mb: int, snapshot: Snapshot, t: float) -> None:
    del self._pulling[vw.index]
    self._pulled[vw.index] = mb
    added = vw.numerics.rebase(snapshot.params, versions_lib.open_updates(vw.versions))
    vw.versions = versions_lib.rebase(vw.versions, snapshot.waves, vw.index, vw.nm, added)
    self.trace.emit(ev="pull", vw=vw.index, t=t, glob=list(snapshot.waves))
    self._inject(vw, t)

  def _stage_arrived(self, vw: VirtualWorker, mb: int, snapshot: Snapshot, stage: int, t: float) -> None:
    """Staged pull: ``stage``'s part of the snapshot landed; it rebases; stage 0's lets ``mb`` in."""
    i = vw.index
    added = versions_lib.open_updates(vw.versions)[stage]
    vw.versions = versions_lib.rebase_stage(vw.versions, stage, snapshot.waves, i, vw.nm, added)
    self.trace.emit(ev="pull", vw=i, t=t, glob=list(snapshot.waves), stage=stage)
    waiting = self._stage_wait[i][1]
    waiting.discard(stage)
    if not waiting:
      del self._stage_wait[i]
    self._candidates.add((i, stage))
    if stage == 0:
      del self._pulling[i]
      self._pulled[i] = mb
      self._inject(vw, t)

  # --- membership ------------------------------------------------------------------------------------

  def _fail(self, vw: VirtualWorker, t: float, reason: str, final: bool = False) -> None:
    """``vw`` failed at ``t``: it leaves (and a replacement joins, with ``rejoin``, unless ``final``)."""
    i = vw.index
    dropped = sum(versions_lib.open_updates(vw.versions))
    in_flight = vw.pipeline.next_mb - 1 - vw.pipeline.completed
    self._zombies.update(dev for dev in self._running if dev[0] == i)
    self._generation[i] += 1
    vw.numerics.drop()
    clock = self.server.leave(i)
    vw.live = False
    for book in (self._pulling, self._pulled, self._waiting_since, self._stage_wait):
      book.pop(i, None)
    self.trace.emit(ev="leave", vw=i, t=t, pushed=clock.c_local[i], dropped_updates=dropped,
                    dropped_minibatches=in_flight, reason=reason)
    if self._rejoin and not final:
      self._awaiting_join.add(i)
      self._join_waiting(t)
    self._inject_all(t)  # the global clock may have moved: gates may open

  def _join_waiting(self, t: float) -> None:
    """Replacements join once the live virtual workers' global clock reached the failed ones' clocks."""
    for i in sorted(self._awaiting_join):
      clock = self.server.clock
      if wsp.c_global(clock) >= clock.c_local[i]:
        self._awaiting_join.discard(i)
        self._join(self.vws[i], t)

  def _join(self, vw: VirtualWorker, t: float) -> None:
    """A replacement for ``vw`` joins at the current global clock and pulls the global weights."""
    i = vw.index
    c = self.server.join(i).c_local[i]
    snapshot = self.server.try_pull(i)
    if snapshot is None:  # c_local = c_global: the gate is open
      raise ProtocolError(f"VW {i} joined at clock {c} but the gate stayed closed")
    vw.pipeline = schedule_lib.init(vw.k, i)._replace(next_mb=c * vw.nm + 1, completed=c * vw.nm)
    vw.versions = versions_lib.rebase(versions_lib.init(vw.k, len(self.vws)), snapshot.waves, i, vw.nm,
                                      [0] * vw.k)
    vw.numerics.rejoin(snapshot.params)
    vw.live = True
    self._candidates.update((i, j) for j in range(vw.k))
    self.trace.emit(ev="join", vw=i, t=t, clock=c)
    self.trace.emit(ev="pull", vw=i, t=t, glob=list(snapshot.waves))

