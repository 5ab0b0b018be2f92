"""One stage of a virtual worker in a decentralised ``multiprocess`` run
(:mod:`hetpipe_jax.runtime.processes.decentral`): a loop that runs the stage's tasks by the pure schedule where
the stage lives, with no command from anyone.

The loop holds the virtual worker's :class:`~hetpipe_jax.core.schedule.PipelineState` and
:class:`~hetpipe_jax.core.versions.VersionBook` and touches only its own stage's part of them: a task
becomes ready when its input arrives (:func:`~hetpipe_jax.core.schedule.arrive`), the schedule picks among
the ready ones (:func:`~hetpipe_jax.core.schedule.pick`), and a finished task frees the device
(:func:`~hetpipe_jax.core.schedule.release`) and sends its output to the stage that runs its successor.
Weight versions follow the same pure functions as the engine's, stage by stage (as the ``sim`` executor's
staged pulls do): a backward applies its update, the stage closes its part of a wave after its own last
backward of it, and a pull rebases the stage when it lands; a forward of a gated minibatch or a later one
waits for that pull.

Stage 0 also injects: while the Nm window (and the schedule) allow, it draws the next minibatch, and before
a gated one it asks the clock for the pull (``request``) and waits for it to land. When a stage closes its
part of a wave it sends its units' summed update, with each unit's non-finite flag, to every copy of their
PS shards (primary and backup): the copies tell the clock once they hold it (``have``), and the clock
counts the push once every live copy does.

A pull comes from the live copy of each group of units (those with the same primary): the primary, or once
it is gone its backup, which kept what it served. A process of the stage's own virtual worker that is gone
ends the stage: its virtual worker leaves (the clock says so under ``left/<vw>``), or, if every copy of
some PS shard is gone, the job stops.

Inputs arrive on threads of their own, one per stream (activations from the previous stage, gradients from
the next, pulls from the shards' copies), each asking for its next messages ahead and offering
each to the stage as it lands (:class:`~hetpipe_jax.runtime.processes.decentral.Actor`): the thread that brings an
input runs the tasks it allows, unless another thread is running the stage's tasks already, in which case
that one takes it up next. No thread wakes another between a message's arrival and the task it allows.
"""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from absl import logging

from hetpipe_jax.core import schedule as schedule_lib
from hetpipe_jax.core import versions as versions_lib
from hetpipe_jax.core import wsp
from hetpipe_jax.core.schedule import BWD, FWD, Task
from hetpipe_jax.errors import ProtocolError
from hetpipe_jax.runtime.numerics.ps import nonfinite_units
from hetpipe_jax.runtime.numerics.stage import Stage
from hetpipe_jax.runtime.processes.decentral import Actor, Context, Spec, run_thread, stream
from hetpipe_jax.runtime.transport import protocol
from hetpipe_jax.runtime.transport.mailbox import deliver, expect, unflatten_units, update_arrays
from hetpipe_jax.runtime.transport.node import PeerGone

HOLD_PS = 3  # offers held per update and pull stream: the protocol lets at most 3 be unpulled


def control_width(num_units: int) -> int:
  """Entries of a control message: operation, field, one non-finite flag per unit, then (``have``) the fp16
  skipped count of each unit's stage."""
  return 2 + 2 * num_units


class StageLoop:
  """Stage ``j`` of virtual worker ``vw`` in this process (see the module docstring).

  Args:
    ctx: this process's context.
    vw, j: which stage.
    stage: its numerics, on its local device.
    inputs: the (shape, dtype) of each array of what it receives: ``"a"``, the previous stage's activation
      (none for stage 0), ``"g"``, the next stage's gradient (none for the last stage; in fp16 with the
      scale it is at).
  """

  def __init__(self, ctx: Context, vw: int, j: int, stage: Stage, inputs: dict[str, list[Spec]]):
    self.ctx, self.vw, self.j, self.stage, self._inputs = ctx, vw, j, stage, inputs
    shape = ctx.layout.vws[vw]
    self.k, self.nm, self.window = shape.k, shape.nm, shape.window
    self.total = ctx.waves * self.nm
    self.pulls = max(ctx.waves - 1, 0)  # pull n is for gated minibatch (n + 2) * Nm
    self._treedefs = [jax.tree.structure(p) for p in stage.params]
    self._actor = Actor(ctx, self._step)
    self._done = 0  # backwards run here
    self._held: dict[tuple[str, int], list[Any]] = {}  # (kind, mb) -> an input that arrived, not used yet
    self._state = schedule_lib.init(self.k, vw)
    self._book = versions_lib.init(self.k, ctx.layout.num_vws)
    self._rebased = -1  # the last pull applied
    self.left = False  # its virtual worker left (a process of one of its stages is gone)
    self._requested = -1  # stage 0: the last pull asked for
    self._task = threading.Lock()  # held while a task runs (see :meth:`halt`)
    self.thread = threading.Thread(target=self._main, name=f"vw{vw}-stage{j}", daemon=True)

  # --- inputs ----------------------------------------------------------------------------------------

  def _start_streams(self) -> None:
    ctx, vw, j = self.ctx, self.vw, self.j
    mbs = range(1, self.total + 1)
    if j > 0:
      prev = ctx.owners[(vw, j - 1)]
      stream(self._actor, f"a{vw}.{j}", mbs, lambda mb: expect(
          ctx.node, ctx.mailbox, prev, protocol.tag("activation", vw=vw, gen=0, stage=j, mb=mb), self._inputs["a"]))
    if j < self.k - 1:
      nxt = ctx.owners[(vw, j + 1)]
      stream(self._actor, f"g{vw}.{j}", mbs, lambda mb: expect(
          ctx.node, ctx.mailbox, nxt, protocol.tag("gradient", vw=vw, gen=0, stage=j, mb=mb), self._inputs["g"]))
    if self.pulls:
      stream(self._actor, f"p{vw}.{j}", range(self.pulls), self._expect_pull)

  def _expect_pull(self, n: int) -> Callable[[], tuple[tuple[int, ...], tuple[int, ...], tuple[Any, ...]]]:
    """Asks for pull ``n`` from the live copy of each group of this stage's units (those with the same
    primary): their global weights and the waves the snapshot holds and the virtual workers that had left;
    returns what waits for it. A copy found gone while it is waited for is replaced by the other one (which
    kept what it served)."""
    ctx, vw, j = self.ctx, self.vw, self.j
    n_vws = ctx.layout.num_vws

    def ask(primary: int, units: list[int], src: int) -> Callable[[], list[Any]]:
      return expect(ctx.node, ctx.mailbox, src, protocol.tag("served", vw=vw, stage=j, n=n, primary=primary),
                    [*ctx.leaf_specs(units), ((2 * n_vws,), np.int32)])

    groups = ctx.owner_units(self.stage.first, self.stage.last)
    asked = {primary: (src := ctx.serving(primary), ask(primary, units, src)) for primary, units in groups.items()}

    def wait() -> tuple[tuple[int, ...], tuple[int, ...], tuple[Any, ...]]:
      params: dict[int, Any] = {}
      for primary, units in groups.items():
        src, waiting = asked[primary]
        what = f"pull {n} of VW {vw} stage {j}"
        try:
          *leaves, glob = ctx.wait_unless_gone(src, what, waiting)
        except PeerGone:
          backup = ctx.backup_of[primary]
          if src != primary or backup is None:
            raise  # every copy is gone: the job cannot go on
          ctx.gone.add(primary)  # (its transfer server went away: it is gone)
          *leaves, glob = ctx.wait_unless_gone(backup, what, ask(primary, units, backup))  # which kept it
        params.update(zip(units, unflatten_units([self._treedefs[u - self.stage.first] for u in units], leaves)))
      glob = [int(g) for g in np.asarray(glob)]
      left = tuple(v for v in range(n_vws) if glob[n_vws + v])
      return tuple(glob[:n_vws]), left, tuple(params[u] for u in sorted(params))

    return wait

  def _arrived(self, item: tuple[str, Any, Any]) -> None:
    name, key, value = item
    kind = name[0]
    if isinstance(value, PeerGone):  # this virtual worker is gone (the clock learns it from process 0)
      reason = self.ctx.fatal_loss(value.process)
      if reason is not None:  # every copy of some PS shard was there: the job cannot go on
        self.ctx.node.publish_fatal(reason)
      self.left = True
      return None
    if kind == "p":
      return self._rebase(key, *value)
    self._held[(kind, key)] = value
    self._state = schedule_lib.arrive(self._state, Task(self.vw, self.j, FWD if kind == "a" else BWD, key),
                                      self.ctx.schedule)
    return None

  def _rebase(self, n: int, glob: tuple[int, ...], left: tuple[int, ...], params: tuple[Any, ...]) -> None:
    """Pull ``n`` landed: the stage's weights <- the global ones + its open accumulators (exactly the local
    updates its versions count: anything else is a lost or extra update)."""
    expect = versions_lib.open_updates(self._book)[self.j]
    added = self.stage.rebase(params)
    if added != expect:
      raise ProtocolError(f"VW {self.vw} stage {self.j} added back {added} local updates at pull {n}; its "
                          f"versions count {expect}")
    self._book = versions_lib.rebase_stage(self._book, self.j, glob, self.vw, self.nm, added)
    self._rebased = n
    self.ctx.emit("t", ev="pull", vw=self.vw, glob=list(glob), stage=self.j, **({"left": list(left)} if left else {}))

  # --- the loop --------------------------------------------------------------------------------------

  def _allow(self, task: Task) -> bool:
    """A forward of the next pull's gated minibatch or a later one waits for that pull."""
    return task.kind != FWD or task.mb < (self._rebased + 3) * self.nm or self._rebased + 1 >= self.pulls

  def _main(self) -> None:
    def body() -> None:
      self._start_streams()
      self._actor.run()
    run_thread(self.ctx, f"VW {self.vw} stage {self.j}", body)

  def _step(self, items: list[tuple[str, Any, Any]]) -> bool:
    """Takes what arrived, runs every task the schedule allows now; True once every task has run here."""
    for item in items:
      self._arrived(item)
    while not self.left:
      if self.j == 0:
        self._inject()
        if self.left:  # (an injected failure)
          break
      task = schedule_lib.pick(self._state, self.j, self._allow)
      if task is None:  # done once every task ran
        return self._done == self.total
      with self._task:
        if self.left:
          break
        if task.kind == FWD:
          self._forward(task)
        else:
          self._backward(task)
          self._done += 1
    return True  # its virtual worker left: what it still held is dropped, and the thread ends

  def halt(self) -> None:
    """Its virtual worker left, and the run goes on in a part that restarts this stage's compiled numerics: no task
    starts here any more, and one running now ends first."""
    self.left = True
    with self._task:
      pass

  def _inject(self) -> None:
    """Stage 0: injects while the window and the schedule allow; a gated minibatch waits for its pull."""
    ctx, nm = self.ctx, self.nm
    while schedule_lib.can_inject(self._state, nm, self.total, ctx.schedule, self.window):
      mb = self._state.next_mb
      if self.vw in ctx.failures and mb == ctx.failures[self.vw] * nm + 1:
        self._fail(ctx.failures[self.vw])
        return
      if wsp.is_gated(mb, nm) and self._rebased < mb // nm - 2:
        n = mb // nm - 2
        if self._requested < n:
          self._request(n)
          self._requested = n
        return
      self._state, _ = schedule_lib.inject(self._state, ctx.schedule)
      ctx.emit("t", ev="inject", vw=self.vw, mb=mb)

  def _request(self, n: int) -> None:
    """Asks the clock for pull ``n`` (control message ``n`` of this virtual worker)."""
    self._control(n, "request", n=n)

  def _control(self, seq: int, op: str, **fields: int) -> None:
    ctx = self.ctx
    message = protocol.encode(protocol.CONTROL_OPS, op, control_width(ctx.num_units), (), **fields)
    deliver(ctx.node, ctx.mailbox, ctx.clock, protocol.tag("control", vw=self.vw, seq=seq),
            [jax.device_put(message, ctx.node.device)], stream=f"c{self.vw}", hold=HOLD_PS)

  def _fail(self, wave: int) -> None:
    """Stage 0 reached the fault injected at ``wave`` (docs/PROTOCOL.md section 3.8): where that can be real
    (:meth:`Context.dies_for`) this process is killed (SIGKILL; its loss is found like any other), else the clock
    is told (control message after the last request: the virtual worker leaves) and this stage ends."""
    ctx = self.ctx
    if ctx.dies_for(self.vw):
      logging.info("fail: VW %d reached its injected failure at wave %d; killing this process", self.vw, wave)
      ctx.trace.flush()
      os.kill(os.getpid(), signal.SIGKILL)
    self._control(self._requested + 1, "fail", wave=wave)
    self.left = True

  def _event(self, task: Task, t0: float, busy: float, version: versions_lib.Version, **extra) -> None:
    ctx = self.ctx
    ctx.pad(task, t0)
    self._state, completed = schedule_lib.release(self._state, task)
    ctx.emit("t1", ev=task.kind, vw=self.vw, stage=self.j, mb=task.mb, t0=t0, own=version.own,
             glob=list(version.glob), busy=busy, **extra)
    if completed:
      ctx.emit("t", ev="complete", vw=self.vw, mb=task.mb)

  def _send(self, stage: int, kind: str, mb: int, arrays: list[Any]) -> None:
    ctx = self.ctx
    deliver(ctx.node, ctx.mailbox, ctx.owners[(self.vw, stage)],
            protocol.tag("activation" if kind == "a" else "gradient", vw=self.vw, gen=0, stage=stage, mb=mb),
            self.stage.on_lead(arrays), stream=f"{kind}{self.vw}.{stage}", hold=self.nm + 1)

  def _forward(self, task: Task) -> None:
    ctx, stage, mb = self.ctx, self.stage, task.mb
    t0 = ctx.now()
    self._state = schedule_lib.start(self._state, task)
    self._book, version = versions_lib.forward(self._book, self.j, mb)
    if self.j == 0:
      x = jax.device_put(ctx.streams(self.vw, mb)[0], stage.device)
    else:
      x = jax.device_put(self._held.pop(("a", mb))[0], stage.device)
    labels = jax.device_put(ctx.streams(self.vw, mb)[1], stage.device) if stage.is_last else None
    out = jax.block_until_ready(stage.forward(mb, x, labels))
    busy = ctx.now() - t0
    if stage.is_last:
      self._event(task, t0, busy, version, loss=float(out))
      self._state = schedule_lib.arrive(self._state, Task(self.vw, self.j, BWD, mb), ctx.schedule)
    else:
      self._event(task, t0, busy, version)
      self._send(self.j + 1, "a", mb, [out])

  def _backward(self, task: Task) -> None:
    ctx, stage, mb, j = self.ctx, self.stage, task.mb, self.j
    t0 = ctx.now()
    self._state = schedule_lib.start(self._state, task)
    self._book, version = versions_lib.backward(self._book, j, mb, self.nm, ctx.weight_mode, stage.k)
    g = None if stage.is_last else jax.device_put(stage.gradient_from(self._held.pop(("g", mb))), stage.device)
    gx = stage.backward(mb, g)
    jax.block_until_ready((gx, stage.params))
    self._event(task, t0, ctx.now() - t0, version)
    if j > 0:
      self._send(j - 1, "g", mb, stage.gradient_arrays(gx))  # first: closing the wave is off its path
    if wsp.is_wave_end(mb, self.nm):
      self._close_wave(wsp.wave_of(mb, self.nm))

  def _close_wave(self, wave: int) -> None:
    """This stage's part of the wave is final: sends every copy of its units' shards their summed update,
    each unit's non-finite flag and how many of the wave's updates fp16 skipped here."""
    ctx, stage = self.ctx, self.stage
    self._book = versions_lib.close_stage_wave(self._book, self.j, wave, self.nm, self.vw)
    update = stage.take_wave(wave)
    bad, skipped = {stage.first + u for u in nonfinite_units(update)}, stage.take_skipped(wave)
    update = stage.on_lead(update)  # (a split stage's update gathered: a shard's copies keep whole units)
    for holder, units in ctx.holders(stage.first, stage.last).items():
      deliver(ctx.node, ctx.mailbox, holder, protocol.tag("update", vw=self.vw, stage=self.j, wave=wave),
              update_arrays(update, stage.first, units, bad, skipped, ctx.node.device),
              stream=f"u{self.vw}.{self.j}", hold=HOLD_PS)
