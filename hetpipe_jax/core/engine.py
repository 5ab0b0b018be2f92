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
minibatch of one of its ``failures`` waves, or when dispatching its task raises. It leaves: the server drops it
from the global clock, its updates not pushed yet are dropped, the tasks it had running finish on their devices
unrecorded, and the trace says ``leave`` (with what was dropped). With ``rejoin`` a
replacement joins on the same devices as soon as the global clock of the live ones has reached the
failed one's clock (at once if it was the slowest; a replacement entering lower would push wave numbers
that the global weights already hold): it takes the current global clock as its clock, pulls the global
weights (``join`` + ``pull`` in the trace) and runs the waves from there.

Not thread-safe by itself: the ``wall`` executor calls it under one lock.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple, cast

from hetpipe_jax.core import schedule as schedule_lib
from hetpipe_jax.core import versions as versions_lib
from hetpipe_jax.core import wsp
from hetpipe_jax.core.comm import Comm, InstantComm, StagedComm
from hetpipe_jax.core.schedule import FWD, Task
from hetpipe_jax.core.server import Server, Snapshot
from hetpipe_jax.core.trace import Trace
from hetpipe_jax.core.versions import Version
from hetpipe_jax.core.worker import Progress, VirtualWorker
from hetpipe_jax.errors import ProtocolError

BatchFn = Callable[[int, int], tuple[Any, Any]]  # (vw, mb) -> (x, labels)
WaveFn = Callable[[int, int, float, list], None]  # (vw, wave, t, losses of the wave) -> None
Device = tuple[int, int]  # (virtual worker, stage)


class EngineState(NamedTuple):
  """Everything the engine and its virtual workers hold between events: plain Python values (the numerics
  and the server keep their own). The engine holds one and a checkpoint saves it whole, so a field added
  here is saved and restored with no other edit. Its containers change in place as the run goes.

  Attributes:
    workers: per virtual worker, its :class:`~hetpipe_jax.core.worker.Progress` (its ``progress``).
    running: device -> (start, version) of the task it runs.
    candidates: devices that may have become able to start a task.
    pulling: vw -> gated minibatch whose pull is on its way.
    pulled: vw -> gated minibatch whose pull has arrived.
    waiting_since: vw -> when its gate was found closed.
    stage_wait: vw -> (gated minibatch, stages not rebased yet) while a staged pull lands.
    failures: vw -> the waves of the faults not injected yet.
    zombies: devices still running a task of a failed virtual worker.
    generation: per vw, how many times it failed: pushes and pulls of an older generation are void.
    awaiting_join: failed virtual workers whose replacement joins once the global clock allows.
  """

  workers: tuple[Progress, ...]
  running: dict[Device, tuple[float, Version]]
  candidates: set[Device]
  pulling: dict[int, int]
  pulled: dict[int, int]
  waiting_since: dict[int, float]
  stage_wait: dict[int, tuple[int, set[int]]]
  failures: dict[int, set[int]]
  zombies: set[Device]
  generation: list[int]
  awaiting_join: set[int]


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

  Attributes:
    state: everything that changes between events (:class:`EngineState`): what a checkpoint saves, and
      :meth:`restore` puts back.
  """

  def __init__(self, vws: Sequence[VirtualWorker], server: Server, trace: Trace,
               batches: BatchFn | None = None, on_wave: WaveFn | None = None, comm: Comm | None = None,
               failures: Mapping[int, Sequence[int]] | None = None, rejoin: bool = False):
    self.vws, self.server, self.trace = list(vws), server, trace
    self._batches, self._on_wave = batches, on_wave
    self.comm = comm or InstantComm()
    self._rejoin = rejoin
    self._glob_lists: dict[int, tuple[Sequence[int], list[int]]] = {}  # id(glob) -> (glob, as a list)
    self._seq_only = trace.version == 2  # tasks and pulls name their global base by its seq (O(1) each)
    self._staged: StagedComm | None = cast(StagedComm, self.comm) if self.comm.staged else None
    if self._staged and any(vw.stages for vw in self.vws):
      raise ProtocolError("staged push and pull transfers are a timing model without numerics (the sim "
                          "executor); this run computes")
    self.state = EngineState(
        workers=tuple(vw.progress for vw in self.vws), running={}, candidates=set(), pulling={}, pulled={},
        waiting_since={}, stage_wait={}, failures={i: set(waves) for i, waves in (failures or {}).items()},
        zombies=set(), generation=[0] * len(self.vws), awaiting_join=set())

  def generation(self, vw: int) -> int:
    """How many times virtual worker ``vw`` has failed (work of an older generation is void)."""
    return self.state.generation[vw]

  @property
  def done(self) -> bool:
    return all(vw.done for vw in self.vws)

  def restore(self, state: EngineState) -> None:
    """Continues from ``state`` (a checkpoint's copy of :attr:`state`): the engine and its virtual workers
    hold it from now on."""
    if len(state.workers) != len(self.vws):
      raise ProtocolError(f"an engine state of {len(state.workers)} virtual workers restored into an engine "
                          f"of {len(self.vws)}")
    self.state = state
    for vw, progress in zip(self.vws, state.workers):
      vw.progress = progress
    self._glob_lists.clear()

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
    state, pick = self.state, schedule_lib.pick
    workers, running, staged = state.workers, state.running, state.stage_wait
    for device in sorted(state.candidates):
      progress = workers[device[0]]
      task = None
      if device not in running and progress.live:  # else busy (maybe with a failed VW's task), or gone
        task = pick(progress.pipeline, device[1], self._stage_rule(*device, allow) if staged else allow)
      if task is None:
        idle.append(device)
      else:
        tasks.append(task)
    state.candidates.difference_update(idle)
    return tasks

  def _stage_rule(self, i: int, j: int, allow: Callable[[Task], bool] | None) -> Callable[[Task], bool] | None:
    """``allow``, and (staged pulls) no forward of the gated minibatch or a later one at a stage whose part
    of the pull has not landed."""
    wait = self.state.stage_wait.get(i)
    if wait is None or j not in wait[1]:
      return allow
    gated = wait[0]
    return lambda task: (task.kind != FWD or task.mb < gated) and (allow is None or allow(task))

  def stop_injecting(self) -> None:
    """No virtual worker injects another minibatch; those in flight complete (the run then drains: a
    shorter run, complete in itself, whose last wave may be unfinished and so not pushed). Finishing the
    begun wave instead could stall: a wave's last minibatch is gated, and the virtual workers it would
    wait for have stopped too."""
    for progress in self.state.workers:
      progress.total_mbs = min(progress.total_mbs, progress.pipeline.next_mb - 1)  # injected so far

  def wake(self, vw: int, stage: int) -> None:
    """Something an ``allow`` of :meth:`startable` depends on changed for this device (e.g. an input
    landed): consider it again."""
    self.state.candidates.add((vw, stage))

  def start(self, task: Task, t: float) -> Any:
    """Starts ``task`` at ``t``; returns what to wait on for its numerics (None without numerics)."""
    i, j, kind, mb = task
    vw, state = self.vws[i], self.state
    progress = vw.progress
    progress.pipeline = schedule_lib.start(progress.pipeline, task)
    device = (i, j)
    state.candidates.discard(device)
    if kind == FWD:
      progress.versions, version = versions_lib.forward(progress.versions, j, mb)
    else:  # the update is applied as the backward starts
      progress.versions, version = versions_lib.backward(progress.versions, j, mb, vw.nm, vw.weight_mode,
                                                             vw.accumulate)
    state.running[device] = (t, version)
    try:
      return vw.numerics.run(task)
    except ProtocolError:
      raise  # a bug in the runtime, not a failing virtual worker
    except Exception as e:  # pylint: disable=broad-except  # the virtual worker fails, the others go on
      if not self._rejoin and not any(other.live for other in self.vws if other is not vw):
        raise
      self._fail(vw, t, f"{type(e).__name__}: {e}")
      return None

  def finish(self, task: Task, t: float) -> None:
    """``task`` ended at ``t``: trace it, ready its successor, complete, push, inject."""
    i, j, kind, mb = task  # its device, and the neighbours its successor or a freed window may use
    device = (i, j)
    vw, state = self.vws[i], self.state
    progress, candidates, zombies = vw.progress, state.candidates, state.zombies
    if zombies and device in zombies:  # a failed virtual worker's last task: its device is free
      zombies.discard(device)
      del state.running[device]
      candidates.add(device)
      return
    t0, (own, glob, seq) = state.running.pop(device)
    if self._seq_only:
      self.trace.emit(ev=kind, vw=i, stage=j, mb=mb, t0=t0, t1=t, own=own, seq=seq)
    else:
      self.trace.emit(ev=kind, vw=i, stage=j, mb=mb, t0=t0, t1=t, own=own, glob=self._glob_list(glob))
    pipeline, completed = schedule_lib.finish(progress.pipeline, task, vw.schedule)
    progress.pipeline = pipeline
    candidates.add(device)
    if j > 0:
      candidates.add((i, j - 1))
    if j + 1 < len(pipeline.busy):
      candidates.add((i, j + 1))
    if self._staged and kind != FWD and wsp.is_wave_end(mb, vw.nm):  # this stage's part is final
      self._staged.push_stage((i, state.generation[i], wsp.wave_of(mb, vw.nm)), i, j, t)
    if not completed:
      return
    self.trace.emit(ev="complete", vw=i, mb=mb, t=t)
    if wsp.is_wave_end(mb, vw.nm):
      wave = wsp.wave_of(mb, vw.nm)
      progress.versions = versions_lib.close_wave(progress.versions, wave, vw.nm, vw.index)
      updates, losses = vw.numerics.take_wave(wave)
      skipped = vw.numerics.take_skipped(wave)
      gen = state.generation[vw.index]
      landed = lambda t_done: self._push(vw, wave, updates, losses, t_done, skipped) \
          if self.state.generation[vw.index] == gen else None
      if self._staged:
        self._staged.push_staged((vw.index, gen, wave), t, landed)
      else:
        self.comm.push(vw.index, wave, t, landed)
    self._inject(vw, t)

  def _glob_list(self, glob: Sequence[int]) -> list[int]:
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
    movable = {vw.index, *self.state.awaiting_join}
    if wsp.c_global(clock) != global_before:
      movable.update(self.state.waiting_since)
    self._join_waiting(t)
    self._inject_all(t, movable)

  def _inject_all(self, t: float, only: set[int] | None = None) -> None:
    """Retries the injections of every virtual worker (of those in ``only``), in index order."""
    for vw in self.vws if only is None else [self.vws[i] for i in sorted(only)]:
      self._inject(vw, t)

  def _inject(self, vw: VirtualWorker, t: float) -> None:
    """Injects while the window allows; a gated minibatch first passes the gate and pulls."""
    i, progress, state = vw.index, vw.progress, self.state
    while progress.live and schedule_lib.can_inject(progress.pipeline, vw.nm, progress.total_mbs, vw.schedule,
                                                    vw.window):
      mb = progress.pipeline.next_mb
      if (mb - 1) % vw.nm == 0 and wsp.wave_of(mb, vw.nm) in state.failures.get(i, ()):
        state.failures[i].discard(wsp.wave_of(mb, vw.nm))  # each injected fault fires once
        return self._fail(vw, t, f"fault injected at wave {wsp.wave_of(mb, vw.nm)}")
      if wsp.is_gated(mb, vw.nm) and state.pulled.get(i) != mb:
        if state.pulling.get(i) == mb or self.server.clock.c_local[i] < wsp.wave_of(mb, vw.nm):
          return  # the pull is on its way, or this VW's own last push has not landed yet
        snapshot = self.server.try_pull(i)
        if snapshot is None:
          state.waiting_since.setdefault(i, t)
          return
        if i in state.waiting_since:
          self.trace.emit(ev="wait", vw=i, t0=state.waiting_since.pop(i), t1=t)
        state.pulling[i] = mb
        gen = state.generation[i]
        if self._staged:
          state.stage_wait[i] = (mb, set(range(vw.k)))
          self._staged.pull_staged(i, t, lambda stage, t_done, mb=mb, snapshot=snapshot, gen=gen: self._stage_arrived(
              vw, mb, snapshot, stage, t_done) if self.state.generation[i] == gen else None)
          return
        self.comm.pull(i, t, lambda t_done, mb=mb, snapshot=snapshot, gen=gen: self._pull_arrived(
            vw, mb, snapshot, t_done) if self.state.generation[i] == gen else None)
        continue  # an instant pull has injected mb already
      x, labels = self._batches(i, mb) if self._batches is not None else (None, None)
      progress.pipeline, _ = schedule_lib.inject(progress.pipeline, vw.schedule)
      vw.numerics.inject(mb, x, labels)
      state.candidates.add((i, 0))
      self.trace.emit(ev="inject", vw=i, mb=mb, t=t)

  def _pull_arrived(self, vw: VirtualWorker, mb: int, snapshot: Snapshot, t: float) -> None:
    state, progress = self.state, vw.progress
    del state.pulling[vw.index]
    state.pulled[vw.index] = mb
    added = vw.numerics.rebase(snapshot.params, versions_lib.open_updates(progress.versions))
    progress.versions = versions_lib.rebase(progress.versions, snapshot.waves, vw.index, vw.nm, added, snapshot.seq)
    self._emit_pull(vw.index, t, snapshot)
    self._inject(vw, t)

  def _stage_arrived(self, vw: VirtualWorker, mb: int, snapshot: Snapshot, stage: int, t: float) -> None:
    """Staged pull: ``stage``'s part of the snapshot landed; it rebases; stage 0's lets ``mb`` in."""
    i, state, progress = vw.index, self.state, vw.progress
    added = versions_lib.open_updates(progress.versions)[stage]
    progress.versions = versions_lib.rebase_stage(progress.versions, stage, snapshot.waves, i, vw.nm, added,
                                                  snapshot.seq)
    self._emit_pull(i, t, snapshot, stage=stage)
    waiting = state.stage_wait[i][1]
    waiting.discard(stage)
    if not waiting:
      del state.stage_wait[i]
    state.candidates.add((i, stage))
    if stage == 0:
      del state.pulling[i]
      state.pulled[i] = mb
      self._inject(vw, t)

  # --- membership ------------------------------------------------------------------------------------

  def _fail(self, vw: VirtualWorker, t: float, reason: str) -> None:
    """``vw`` failed at ``t``: it leaves (and a replacement joins, with ``rejoin``)."""
    i = vw.index
    dropped = sum(versions_lib.open_updates(vw.versions))
    in_flight = vw.pipeline.next_mb - 1 - vw.pipeline.completed
    state = self.state
    state.zombies.update(dev for dev in state.running if dev[0] == i)
    state.generation[i] += 1
    vw.numerics.drop()
    clock = self.server.leave(i)
    vw.progress.live = False
    for book in (state.pulling, state.pulled, state.waiting_since, state.stage_wait):
      book.pop(i, None)
    self.trace.emit(ev="leave", vw=i, t=t, pushed=clock.c_local[i], dropped_updates=dropped,
                    dropped_minibatches=in_flight, reason=reason)
    if self._rejoin:
      self.state.awaiting_join.add(i)
      self._join_waiting(t)
    self._inject_all(t)  # the global clock may have moved: gates may open

  def _join_waiting(self, t: float) -> None:
    """Replacements join once the live virtual workers' global clock reached the failed ones' clocks."""
    awaiting = self.state.awaiting_join
    for i in sorted(awaiting):
      clock = self.server.clock
      if wsp.c_global(clock) >= clock.c_local[i]:
        awaiting.discard(i)
        self._join(self.vws[i], t)

  def _join(self, vw: VirtualWorker, t: float) -> None:
    """A replacement for ``vw`` joins at the current global clock and pulls the global weights."""
    i = vw.index
    c = self.server.join(i).c_local[i]
    snapshot = self.server.try_pull(i)
    if snapshot is None:  # c_local = c_global: the gate is open
      raise ProtocolError(f"VW {i} joined at clock {c} but the gate stayed closed")
    progress = vw.progress
    progress.pipeline = schedule_lib.init(vw.k, i)._replace(next_mb=c * vw.nm + 1, completed=c * vw.nm)
    progress.versions = versions_lib.rebase(versions_lib.init(vw.k, len(self.vws)), snapshot.waves, i, vw.nm,
                                            [0] * vw.k, snapshot.seq)
    vw.numerics.rejoin(snapshot.params)
    progress.live = True
    self.state.candidates.update((i, j) for j in range(vw.k))
    self.trace.emit(ev="join", vw=i, t=t, clock=c)
    self._emit_pull(i, t, snapshot)

  def _emit_pull(self, i: int, t: float, snapshot: Snapshot, **extra: int) -> None:
    """The trace's ``pull`` of VW ``i`` (``extra``: its stage, for a staged pull)."""
    if self._seq_only:
      self.trace.emit(ev="pull", vw=i, t=t, seq=snapshot.seq, **extra)
    else:
      self.trace.emit(ev="pull", vw=i, t=t, glob=list(snapshot.waves), **extra)

