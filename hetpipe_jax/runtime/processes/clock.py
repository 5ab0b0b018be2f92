"""The WSP clock of a decentralised ``multiprocess`` run (:mod:`hetpipe_jax.runtime.processes.decentral`): one service,
in process 0 (which hosts the coordination service: its loss ends the job anyway), that counts pushes,
opens gates and orders what the copies of the PS shards do.

Every process that holds a copy of PS shards (a primary or a backup) tells it, for each virtual worker in
wave order, once it holds every part of the wave's update it applies (``have``, with the non-finite flag of
every unit and the fp16 skipped count of its stage, for the ``push`` line); stage 0 of each virtual worker
asks for each gated pull (``request``)
(:data:`~hetpipe_jax.runtime.transport.protocol.CONTROL_OPS`). Once every live copy holds a wave, the clock ticks
(:func:`hetpipe_jax.core.wsp.push`), writes the trace's ``push`` line and appends an ``apply`` to the one order
that every copy follows (:data:`~hetpipe_jax.runtime.transport.protocol.ORDER_OPS`), and, when the global clock
reaches an evaluation tick, a ``gather``. A request is granted once the virtual worker's own push of the
wave before it has ticked and its gate is open (:func:`hetpipe_jax.core.wsp.gate_open`; the trace's
``wait`` line when it was closed): the clock appends a ``serve`` that holds the waves of the snapshot, and
each copy sends the stages the units it serves. Because every copy applies and serves in that one order,
pull n holds exactly those waves however long the applies take, at the primary and at the backup alike.

A process that is gone: the order says so (``lost``: the backups of its primary shards serve them from then
on, and send what they kept of the pulls a stage may still wait for), every virtual worker with a stage
there leaves (``leave``), and the clock stops waiting for that process's copies. A wave that some live copy
does not hold when its virtual worker leaves is never applied anywhere; one that every live copy holds is
applied by all. When every copy of some shard is gone, the job stops.

A pushed wave with a non-finite unit is counted and dropped at every copy (``on_nonfinite="skip"``), or
stops the job naming it (``"stop"``).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

import jax
import numpy as np

from hetpipe_jax.core import wsp
from hetpipe_jax.errors import NonFiniteUpdate
from hetpipe_jax.runtime.numerics.metrics import eval_due
from hetpipe_jax.runtime.processes.decentral import LEFT_KEY, Actor, Context, run_thread, stream
from hetpipe_jax.runtime.processes.shards import FOLLOW_AHEAD
from hetpipe_jax.runtime.processes.stage_loop import control_width
from hetpipe_jax.runtime.transport import protocol
from hetpipe_jax.runtime.transport.mailbox import deliver, expect
from hetpipe_jax.runtime.transport.node import PeerGone

GATHERS_KEY = "clock/gathers"  # how many gathers the clock ordered (process 0 collects them at the end)


class ClockService:
  """The clock (see the module docstring).

  Args:
    ctx: this process's context.
    eval_every: order a gather every this many global clock ticks (and at the end), as
      :class:`~hetpipe_jax.runtime.numerics.metrics.WaveMetrics` snapshots.
    on_nonfinite: "skip" or "stop".
    first / run_waves: the waves run before this part of the run, and the run's: the evaluation ticks are the
      run's (a final gather follows the last push in any case).
  """

  def __init__(self, ctx: Context, eval_every: int, on_nonfinite: str, first: int = 0, run_waves: int = 0):
    self.ctx, self._eval_every, self._on_nonfinite = ctx, eval_every, on_nonfinite
    self._first, self._run_waves = first, run_waves or ctx.waves
    self.n = ctx.layout.num_vws
    self._clock = wsp.init(self.n)
    self._holders = ctx.copy_holders()
    self._width = protocol.order_width(self.n)
    self._hold = 2 * self.n * ctx.waves + ctx.waves + 2 * self.n + 8  # every entry a run can have: all stay offered
    self._seq = 0  # entries of the order so far
    self._gathers = 0
    self._global = 0  # the global clock at the last evaluation check
    self._actor = Actor(ctx, self._step)
    self._left: set[int] = set()  # virtual workers that left
    self._stopped = False  # the job cannot go on
    self._gone: set[int] = set()  # processes found gone
    # (vw, wave) -> the copies that hold it, every unit's non-finite flag, the fp16 skipped count of its stage
    self._have: dict[tuple[int, int], tuple[set[int], np.ndarray, np.ndarray]] = {}
    self._pending: dict[int, tuple[int, float, bool]] = {}  # vw -> (pull n, asked at, found closed)
    self.thread = threading.Thread(target=self._main, name="clock", daemon=True)

  def _main(self) -> None:
    run_thread(self.ctx, "the clock", self._run)

  def _run(self) -> None:
    ctx = self.ctx
    width = control_width(ctx.num_units)
    spec = [((width,), np.int32)]
    pulls = max(ctx.waves - 1, 0)
    for vw in range(self.n):
      src = ctx.owners[(vw, 0)]
      requests = pulls + int(vw in ctx.failures)  # (an injected failure comes after its last request)
      stream(self._actor, f"r{vw}", range(requests), lambda n, vw=vw, src=src: expect(
          ctx.node, ctx.mailbox, src, protocol.tag("control", vw=vw, seq=n), spec))
      for p in self._holders:
        stream(self._actor, f"h{vw}.{p}", range(ctx.waves), lambda wave, vw=vw, p=p: expect(
            ctx.node, ctx.mailbox, p, protocol.tag("have", vw=vw, process=p, wave=wave), spec))
    ctx.on_gone.append(lambda p: self._actor.offer(("lost", p, None)))
    self._actor.run()
    if self._stopped:
      return  # a non-finite update, every copy of some shard lost, or no virtual worker left

    self._order("gather", n=self._gathers)  # the final weights
    for _ in range(1 + FOLLOW_AHEAD):  # the copies ask for entries ahead: those after the stop are stops too
      self._order(protocol.STOP)
    ctx.node.put(ctx.node.scoped(GATHERS_KEY), str(self._gathers + 1))

  def _finished(self) -> bool:
    """Every virtual worker still in has pushed every wave."""
    return all(v in self._left or c == self.ctx.waves for v, c in enumerate(self._clock.c_local))

  def _step(self, items) -> bool:
    """Works off what arrived; True once every push is in (or the job stops)."""
    if not self._work(items):
      self._stopped = True
      return True
    return self._finished()

  def _work(self, items) -> bool:
    """Works off what arrived; False when the job stops."""
    for name, key, value in items:
      if name == "lost" or isinstance(value, PeerGone):
        if not self._lost(key if name == "lost" else value.process):
          return False
        continue
      vw = int(name[1:].split(".")[0])
      if vw in self._left:
        continue  # what came from or for a virtual worker that left: dropped with it
      op, fields, tail = protocol.decode(protocol.CONTROL_OPS, np.asarray(value[0]))
      if op == "have":
        u = self.ctx.num_units
        copies, flags, skipped = self._have.setdefault(
            (vw, fields["wave"]), (set(), np.zeros(u, np.int32), np.zeros(u, np.int32)))
        copies.add(int(name.split(".")[1]))
        flags |= np.array(tail[:u], np.int32)
        np.maximum(skipped, np.array(tail[u:2 * u], np.int32), out=skipped)  # (0 where a copy holds no unit)
        if not self._tick(vw):
          return False
      elif op == "fail":
        self._leave(vw, f"fault injected at wave {fields['wave']}")
        if not self._went_on(f"VW {vw} failed (an injected fault)"):
          return False
      else:
        self._pending[vw] = (fields["n"], self.ctx.now(), False)
        self._grant(vw)
    return True

  def _tick(self, vw: int) -> bool:
    """Counts every wave of ``vw`` that every live copy holds, in order; False when that stops the job."""
    while (vw, c := self._clock.c_local[vw]) in self._have:
      copies, flags, skipped = self._have[(vw, c)]
      if not set(self._holders) - self._gone <= copies:
        return True
      del self._have[(vw, c)]
      stage_skipped = sum(int(skipped[first]) for first in self.ctx.layout.cuts[vw][:-1])  # (one unit per stage)
      if not self._push(vw, c, [int(u) for u in np.flatnonzero(flags)], stage_skipped):
        return False
    return True

  def _lost(self, p: int) -> bool:
    """Process ``p`` is gone: the order says so, every virtual worker with a stage there leaves, and the
    others go on under WSP over the live ones; False when the job cannot go on (every copy of some shard
    was there)."""
    ctx = self.ctx
    if p in self._gone:
      return True
    self._gone.add(p)
    reason = ctx.fatal_loss(p)
    if reason is not None:
      ctx.node.publish_fatal(reason)
      return False
    self._order("lost", process=p)
    for vw in sorted({vw for (vw, _), q in ctx.owners.items() if q == p} - self._left):
      self._leave(vw, f"process {p} is gone")
    return self._went_on(f"process {p} is gone, and every virtual worker had left or had a stage there")

  def _went_on(self, why: str) -> bool:
    """After virtual workers left: False (the job stops, saying ``why``) when none is left, else the waves that
    waited for copies that are gone count now, and gates that waited for those that left open."""
    if len(self._left) == self.n:
      self.ctx.node.publish_fatal(f"{why}: no virtual worker is left to go on")
      return False
    for vw in range(self.n):  # waves that waited for the copies there may count now
      if vw not in self._left and not self._tick(vw):
        return False
    for other in sorted(self._pending):  # the global clock may have moved: closed gates may open
      self._grant(other)
    return True

  def _leave(self, vw: int, reason: str) -> None:
    """``vw`` leaves: its clock no longer counts, its pull is never granted, the copies drop what it sent
    that was not applied; every process may stop waiting for its stages (``left/<vw>``)."""
    ctx = self.ctx
    self._clock = wsp.leave(self._clock, vw)
    self._left.add(vw)
    self._pending.pop(vw, None)
    for key in [key for key in self._have if key[0] == vw]:
      del self._have[key]
    ctx.emit("t", ev="leave", vw=vw, pushed=self._clock.c_local[vw], reason=reason)
    self._order("leave", vw=vw)
    ctx.node.put(ctx.node.scoped(LEFT_KEY.format(vw=vw)), reason)

  def _order(self, op: str, tail: Sequence[int] = (), **fields: int) -> None:
    """Appends an entry to the order every copy of the shards follows."""
    ctx = self.ctx
    message = protocol.encode(protocol.ORDER_OPS, op, self._width, tail, **fields)
    for holder in self._holders:
      if holder not in self._gone:
        deliver(ctx.node, ctx.mailbox, holder, protocol.tag("order", process=holder, seq=self._seq),
                [jax.device_put(message, ctx.node.device)], stream="order", hold=self._hold)
    self._seq += 1

  def _push(self, vw: int, wave: int, bad: Sequence[int], skipped: int) -> bool:
    """Counts the push (``skipped``: how many of its updates fp16 skipped); False when it stops the job (a
    non-finite update, ``on_nonfinite="stop"``)."""
    ctx = self.ctx
    before = wsp.c_global(self._clock)
    self._clock = wsp.push(self._clock, vw, wave)
    if bad and self._on_nonfinite == "stop":
      error = NonFiniteUpdate(vw, wave, list(bad), before).with_stages(ctx.layout.cuts[vw])
      ctx.node.publish_fatal(str(error))  # process 0 stops the job with it
      return False
    extra = {"dropped": "nonfinite", "units": list(bad)} if bad else {}
    if skipped:  # fp16 loss-scale overflows (docs/PROTOCOL.md section 3.10)
      extra["skipped"] = skipped
    ctx.emit("t", ev="push", vw=vw, wave=wave, shards=ctx.num_units, gap=wsp.clock_gap(self._clock, vw), **extra)
    self._order("apply", vw=vw, wave=wave, drop=int(bool(bad)))
    now = wsp.c_global(self._clock)
    if now > self._global:
      if eval_due(self._first + now, self._eval_every, self._run_waves):
        self._order("gather", n=self._gathers)
        self._gathers += 1
      self._global = now
    for other in sorted(self._pending):  # the global clock may have moved: closed gates may open
      self._grant(other)
    return True

  def _grant(self, vw: int) -> None:
    """Grants ``vw``'s pending pull n once its own push of wave n has ticked and its gate is open."""
    ctx = self.ctx
    n, asked, closed = self._pending[vw]
    if self._clock.c_local[vw] <= n:
      return  # its own wave n is not counted yet (its copies have not all said so)
    if not wsp.gate_open(self._clock, vw, ctx.d):
      self._pending[vw] = (n, asked, True)
      return
    del self._pending[vw]
    if closed:
      ctx.emit("t1", ev="wait", vw=vw, t0=asked)
    left = [int(v in self._left) for v in range(self.n)]  # (the leaves that may have opened the gate)
    self._order("serve", [*self._clock.c_local, *left], vw=vw, n=n)
