"""The WSP clock of a decentralised ``multiprocess`` run (:mod:`hetpipe_jax.runtime.decentral`): one service,
in the process of a PS shard's owner, that counts pushes, opens gates and orders what the owners do.

Stage 0 of each virtual worker sends it, in order, the push of wave 0, the request of pull 0, the push of
wave 1, ... (:data:`~hetpipe_jax.runtime.protocol.CONTROL_OPS`; one input thread per virtual worker). For
a push the clock ticks (:func:`hetpipe_jax.core.wsp.push`), writes the trace's ``push`` line and appends an
``apply`` to the one order that every shard owner follows (:data:`~hetpipe_jax.runtime.protocol.ORDER_OPS`),
and, when the global clock reaches an evaluation tick, a ``gather``. For a request it grants the pull once
the gate is open (:func:`hetpipe_jax.core.wsp.gate_open`; the trace's ``wait`` line when it was closed):
it appends a ``serve`` to the order and sends every stage of the virtual worker the waves the snapshot
holds. Because each owner applies and serves in that one order, pull n holds exactly those waves however
long the applies take, with no owner waiting for another.

A pushed wave with a non-finite unit (the flags came with the push) is counted and dropped at every owner
(``on_nonfinite="skip"``), or stops the job naming it (``"stop"``).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence

import jax
import numpy as np

from hetpipe_jax.core import wsp
from hetpipe_jax.errors import NonFiniteUpdate
from hetpipe_jax.runtime import protocol
from hetpipe_jax.runtime.decentral import LEFT_KEY, Actor, Context, run_thread, stream
from hetpipe_jax.runtime.distributed import POLL_S, PeerGone
from hetpipe_jax.runtime.mailbox import deliver, expect
from hetpipe_jax.runtime.metrics import eval_due
from hetpipe_jax.runtime.shards import FOLLOW_AHEAD
from hetpipe_jax.runtime.stage_loop import HOLD_PS, control_width

GATHERS_KEY = "clock/gathers"  # how many gathers the clock ordered (process 0 collects them at the end)


class ClockService:
  """The clock (see the module docstring).

  Args:
    ctx: this process's context.
    eval_every: order a gather every this many global clock ticks (and at the end), as
      :class:`~hetpipe_jax.runtime.metrics.WaveMetrics` snapshots.
    on_nonfinite: "skip" or "stop".
  """

  def __init__(self, ctx: Context, eval_every: int, on_nonfinite: str):
    self.ctx, self._eval_every, self._on_nonfinite = ctx, eval_every, on_nonfinite
    self.n = ctx.layout.num_vws
    self._clock = wsp.init(self.n)
    self._owners = sorted(set(ctx.shard_owners))
    self._seq = 0  # entries of the order so far
    self._gathers = 0
    self._global = 0  # the global clock at the last evaluation check
    self._actor = Actor(ctx, self._step)
    self._left: set[int] = set()  # virtual workers that left
    self._gone: set[int] = set()  # processes found gone
    self._granted = [0] * self.n  # pulls granted per virtual worker
    self._pending: dict[int, tuple[int, float, bool]] = {}  # vw -> (pull n, asked at, found closed)
    self.thread = threading.Thread(target=self._main, name="clock", daemon=True)

  def _main(self) -> None:
    run_thread(self.ctx, "the clock", self._run)

  def _run(self) -> None:
    ctx = self.ctx
    width = control_width(ctx.num_units)
    for vw in range(self.n):
      src = ctx.owners[(vw, 0)]
      stream(self._actor, f"c{vw}", range(2 * ctx.waves - 1), lambda seq, vw=vw, src=src: expect(
          ctx.node, ctx.mailbox, src, protocol.tag("control", vw=vw, seq=seq), [((width,), np.int32)]))
    threading.Thread(target=self._watch, name="clock-watch", daemon=True).start()
    self._actor.run()
    if not self._finished():
      return  # stopped (a non-finite update, or lost PS shards)
    self._order("gather", n=self._gathers)  # the final weights
    for _ in range(1 + FOLLOW_AHEAD):  # the owners ask for entries ahead: those after the stop are stops too
      self._order(protocol.STOP)
    ctx.node.put(GATHERS_KEY, str(self._gathers + 1))

  def _watch(self) -> None:
    """Offers the clock every process that process 0 declares gone (a key-value look per process every
    ``POLL_S``, off every task's path)."""
    node, seen = self.ctx.node, set()
    while not self._actor.finished:
      for p in range(node.num_processes):
        if p != node.process and p not in seen and node.declared_dead(p):
          seen.add(p)
          self._actor.offer(("lost", p, None))
      time.sleep(POLL_S)

  def _finished(self) -> bool:
    """Every virtual worker still in has pushed every wave."""
    return all(v in self._left or c == self.ctx.waves for v, c in enumerate(self._clock.c_local))

  def _step(self, items) -> bool:
    """Works off what arrived; True once every push is in (or the job stops)."""
    for name, key, value in items:
      if name == "lost" or isinstance(value, PeerGone):
        if not self._lost(key if name == "lost" else value.process):
          return True
        continue
      vw = int(name[1:])
      if vw in self._left:
        continue  # what a virtual worker sent before it was found gone: dropped with it
      op, fields, tail = protocol.decode(protocol.CONTROL_OPS, np.asarray(value[0]))
      if op == "push":
        if not self._push(vw, fields["wave"], [u for u, flag in enumerate(tail[:self.ctx.num_units]) if flag]):
          return True
      else:
        self._pending[vw] = (fields["n"], self.ctx.now(), False)
        self._grant(vw)
    return self._finished()

  def _lost(self, p: int) -> bool:
    """Process ``p`` is gone: every virtual worker with a stage there leaves, and the others go on under
    WSP over the live ones; False when the job cannot go on (``p`` held PS shards)."""
    ctx = self.ctx
    if p in self._gone:
      return True
    self._gone.add(p)
    reason = ctx.fatal_loss(p)
    if reason is not None:
      ctx.node.publish_fatal(reason)
      return False
    for vw in sorted({vw for (vw, _), q in ctx.owners.items() if q == p} - self._left):
      self._leave(vw, f"process {p} is gone")
    if len(self._left) == self.n:
      ctx.node.publish_fatal(f"process {p} is gone, and every virtual worker had left or had a stage there: no "
                             "virtual worker is left to go on")
      return False
    for other in sorted(self._pending):  # the global clock may have moved: closed gates may open
      self._grant(other)
    return True

  def _leave(self, vw: int, reason: str) -> None:
    """``vw`` leaves: its clock no longer counts, its pull is never granted; its stages still running are
    told (a grant of no waves), and every process may stop waiting for them (``left/<vw>``)."""
    ctx = self.ctx
    self._clock = wsp.leave(self._clock, vw)
    self._left.add(vw)
    self._pending.pop(vw, None)
    ctx.emit("t", ev="leave", vw=vw, pushed=self._clock.c_local[vw], reason=reason)
    ctx.node.put(LEFT_KEY.format(vw=vw), reason)
    left = jax.device_put(np.full(2 * self.n, -1, np.int32), ctx.node.device)
    for j in range(ctx.layout.vws[vw].k):
      if ctx.owners[(vw, j)] not in self._gone:
        deliver(ctx.node, ctx.mailbox, ctx.owners[(vw, j)], protocol.tag("grant", vw=vw, stage=j,
                                                                         n=self._granted[vw]),
                [left], stream=f"n{vw}.{j}", hold=HOLD_PS)

  def _order(self, op: str, **fields: int) -> None:
    """Appends an entry to the order every shard owner follows."""
    ctx = self.ctx
    message = protocol.encode(protocol.ORDER_OPS, op, protocol.ORDER_WIDTH, (), **fields)
    for owner in self._owners:
      deliver(ctx.node, ctx.mailbox, owner, protocol.tag("order", process=owner, seq=self._seq),
              [jax.device_put(message, ctx.node.device)], stream="order", hold=2 * self.n + 2 + FOLLOW_AHEAD)
    self._seq += 1

  def _push(self, vw: int, wave: int, bad: Sequence[int]) -> bool:
    """Counts the push; False when it stops the job (a non-finite update, ``on_nonfinite="stop"``)."""
    ctx = self.ctx
    before = wsp.c_global(self._clock)
    self._clock = wsp.push(self._clock, vw, wave)
    if bad and self._on_nonfinite == "stop":
      error = NonFiniteUpdate(vw, wave, list(bad), before).with_stages(ctx.layout.cuts[vw])
      ctx.node.publish_fatal(str(error))  # process 0 stops the job with it
      return False
    extra = {"dropped": "nonfinite", "units": list(bad)} if bad else {}
    ctx.emit("t", ev="push", vw=vw, wave=wave, shards=ctx.num_units, gap=wsp.clock_gap(self._clock, vw), **extra)
    self._order("apply", vw=vw, wave=wave, drop=int(bool(bad)))
    now = wsp.c_global(self._clock)
    if now > self._global:
      if eval_due(now, self._eval_every, ctx.waves):
        self._order("gather", n=self._gathers)
        self._gathers += 1
      self._global = now
    for other in sorted(self._pending):  # the global clock may have moved: closed gates may open
      self._grant(other)
    return True

  def _grant(self, vw: int) -> None:
    """Grants ``vw``'s pending pull if its gate is open now."""
    ctx = self.ctx
    n, asked, closed = self._pending[vw]
    if not wsp.gate_open(self._clock, vw, ctx.d):
      self._pending[vw] = (n, asked, True)
      return
    del self._pending[vw]
    self._granted[vw] += 1
    if closed:
      ctx.emit("t1", ev="wait", vw=vw, t0=asked)
    self._order("serve", vw=vw, n=n)
    left = [int(v in self._left) for v in range(self.n)]  # (the leaves that may have opened the gate)
    glob = jax.device_put(np.array([*self._clock.c_local, *left], np.int32), ctx.node.device)
    for j in range(ctx.layout.vws[vw].k):
      deliver(ctx.node, ctx.mailbox, ctx.owners[(vw, j)], protocol.tag("grant", vw=vw, stage=j, n=n), [glob],
              stream=f"n{vw}.{j}", hold=HOLD_PS)
