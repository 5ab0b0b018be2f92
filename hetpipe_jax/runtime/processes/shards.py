"""The PS shards of a ``multiprocess`` run (:mod:`hetpipe_jax.runtime.processes`): the primary and backup copies a
process holds (:class:`ShardFollower`, on the server :func:`copies_server` builds)."""

from __future__ import annotations

import collections
import itertools
import threading
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import numpy as np

from hetpipe_jax.runtime.numerics.ps import ParameterServer
from hetpipe_jax.runtime.processes.decentral import Actor, Context, run_thread, stream
from hetpipe_jax.runtime.processes.stage_loop import control_width
from hetpipe_jax.runtime.transport import protocol
from hetpipe_jax.runtime.transport.mailbox import deliver, expect, unflatten_units
from hetpipe_jax.runtime.transport.node import PeerGone


def stage_units(cuts: Sequence[int], units: Sequence[int]) -> list[tuple[int, list[int]]]:
  """(stage, its units among ``units``) for every stage of a virtual worker cut at ``cuts`` that holds any
  (what an owner of ``units`` exchanges with each stage)."""
  out = []
  for j in range(len(cuts) - 1):
    mine = [u for u in range(cuts[j], cuts[j + 1]) if u in units]
    if mine:
      out.append((j, mine))
  return out


FOLLOW_AHEAD = 2  # order entries a copy asks for ahead (the clock sends as many stops after the first)
KEEP_SERVED = 3  # pulls a backup keeps of each virtual worker (those a stage may still wait for)


def copies_server(ctx: Context, params: Sequence[Any], tx) -> ParameterServer:
  """The server of the PS copies this process holds (:meth:`Context.held_units`), from ``params`` (every unit's),
  its apply compiled for the pushes' dtype."""
  ps = ParameterServer([params[u] for u in ctx.held_units(ctx.node.process)], ctx.layout.num_vws, ctx.d, tx,
                       update_dtype=ctx.push_dtype)  # one rule everywhere
  ps.warm_up()
  return ps


class ShardFollower:
  """The copies of PS shards this process holds in a decentralised run (:mod:`hetpipe_jax.runtime.processes.decentral`):
  those whose primary it is and those it backs up, their global weights and optax state, applied, served
  and gathered in the one order the clock sends (:class:`~hetpipe_jax.runtime.processes.clock.ClockService`).

  Every stage sends each copy of its units' shards its part of every wave's update (with their non-finite
  flags and fp16 skipped count); once all parts of a wave are here, this process tells the clock (``have``,
  with the flags and counts). The clock orders the apply once every live copy has, so a push whose sender
  dies on the way is applied everywhere or nowhere. A serve sends each stage the units whose primary is this
  process, or whose primary is gone (the order's ``lost``); the backup of a live primary keeps what it would
  have sent, and sends it once the order says the primary is lost (the stage may still wait for it).

  Args:
    ctx: this process's context.
    params: the initial global weights of every unit (those held here are kept).
    tx: the apply rule (:class:`~hetpipe_jax.runtime.numerics.ps.ParameterServer`).
    ps: the copies' server as an earlier part of the run compiled it, for the same units and rule (None: build one).
  """

  def __init__(self, ctx: Context, params: Sequence[Any], tx, ps: ParameterServer | None = None):
    me = ctx.node.process
    self.ctx, self.units = ctx, ctx.held_units(me)
    if ps is None:
      self.ps = copies_server(ctx, params, tx)
    else:
      self.ps = ps
      ps.restart([params[u] for u in self.units], ctx.layout.num_vws)
    self._treedefs = [jax.tree.structure(params[u]) for u in self.units]
    self._actor = Actor(ctx, self._step)
    self._lost: set[int] = set()  # processes the order said were lost
    self._left: set[int] = set()  # virtual workers the order said had left
    self._parts: dict[tuple[int, int], dict[int, list[Any]]] = {}  # (vw, wave) -> stage -> its part
    self._served: dict[int, collections.deque] = collections.defaultdict(lambda: collections.deque(maxlen=KEEP_SERVED))
    self._stopped = False  # the order said stop
    self.thread = threading.Thread(target=self._main, daemon=True, name=f"ps{me}")

  def _main(self) -> None:
    run_thread(self.ctx, f"the PS shards of process {self.ctx.node.process}", self._run)

  def _stage_units(self, vw: int) -> list[tuple[int, list[int]]]:
    return stage_units(self.ctx.layout.cuts[vw], self.units)

  def _run(self) -> None:
    ctx, me = self.ctx, self.ctx.node.process
    for vw in range(ctx.layout.num_vws):
      for j, units in self._stage_units(vw):
        specs = [*ctx.push_specs(units), ((len(units) + 1,), np.int32)]  # (flags, then the skipped count)
        stream(self._actor, f"u{vw}.{j}", range(ctx.waves), lambda wave, vw=vw, j=j, specs=specs: expect(
            ctx.node, ctx.mailbox, ctx.owners[(vw, j)], protocol.tag("update", vw=vw, stage=j, wave=wave), specs))
    width = protocol.order_width(ctx.layout.num_vws)
    stream(self._actor, "o", itertools.takewhile(lambda _: not self._stopped, itertools.count()), lambda seq: expect(
        ctx.node, ctx.mailbox, ctx.clock, protocol.tag("order", process=me, seq=seq), [((width,), np.int32)]),
        depth=FOLLOW_AHEAD)
    self._actor.run()

  def _step(self, items) -> bool:
    """Takes what arrived; True once the order says stop."""
    for name, key, value in items:
      if isinstance(value, PeerGone):
        continue  # a stage's process is gone: its virtual worker leaves (the clock says so in the order)
      if name != "o":
        self._part(int(name[1:].split(".")[0]), int(name.split(".")[1]), key, value)
      elif self._follow(np.asarray(value[0])):
        return True
    return False

  def _part(self, vw: int, j: int, wave: int, leaves: list[Any]) -> None:
    """Stage ``j``'s part of wave ``wave``: once every part is here, tells the clock (with every unit's
    non-finite flag and the fp16 skipped count of its stage)."""
    if vw in self._left:
      return
    parts = self._parts.setdefault((vw, wave), {})
    parts[j] = leaves
    stages = self._stage_units(vw)
    if len(parts) < len(stages):
      return
    ctx = self.ctx
    flags, skipped = np.zeros(ctx.num_units, np.int32), np.zeros(ctx.num_units, np.int32)
    for j, units in stages:
      tail = np.asarray(parts[j][-1])
      flags[units], skipped[units] = tail[:-1], tail[-1]
    message = protocol.encode(protocol.CONTROL_OPS, "have", control_width(ctx.num_units),
                              [*flags.tolist(), *skipped.tolist()], wave=wave)
    deliver(ctx.node, ctx.mailbox, ctx.clock, protocol.tag("have", vw=vw, process=ctx.node.process, wave=wave),
            [jax.device_put(message, ctx.node.device)], stream=f"h{vw}", hold=ctx.waves)

  def _follow(self, message: np.ndarray) -> bool:
    """Order entry ``message``; True for the stop."""
    op, f, tail = protocol.decode(protocol.ORDER_OPS, message)
    if op == protocol.STOP:  # (the clock sends one for each entry asked for ahead: the stream then ends)
      self._stopped = True
      return True
    if op == "apply":
      self._apply(f["vw"], f["wave"], bool(f["drop"]))
    elif op == "serve":
      self._serve(f["vw"], f["n"], np.array(tail[:2 * self.ctx.layout.num_vws], np.int32))
    elif op == "gather":
      ctx, me = self.ctx, self.ctx.node.process
      applied = jax.device_put(np.array(list(self.ps.clock.c_local), np.int32), ctx.node.device)
      deliver(ctx.node, ctx.mailbox, 0, protocol.tag("weights", process=me, n=f["n"]),
              [*jax.tree.leaves(self.ps.params), applied])
    elif op == "leave":
      self._left.add(f["vw"])
      for key in [key for key in self._parts if key[0] == f["vw"]]:
        del self._parts[key]
    else:  # lost: this process serves the primaries it backs up, and sends what it kept
      self._lost.add(f["process"])
      for vw, served in self._served.items():
        for n, params, glob in served:
          self._send(vw, n, params, glob, only=f["process"])
    return False

  def _apply(self, vw: int, wave: int, drop: bool) -> None:
    """Applies the wave's update (every part is here: this process said so before the clock ordered it);
    with ``drop`` (a unit of the wave, maybe elsewhere, was not finite) only counts it."""
    parts = self._parts.pop((vw, wave))
    if drop:
      self.ps.skip(vw, wave, [])
      return
    updates = {}
    for j, units in self._stage_units(vw):
      local = [self.units.index(u) for u in units]
      updates.update(zip(local, unflatten_units([self._treedefs[i] for i in local], parts[j][:-1])))
    self.ps.push(vw, wave, updates, nonfinite=[])  # (the stages checked: one pass)

  def _serves(self, primary: int) -> bool:
    """Whether this process serves ``primary``'s shards now (at this point of the order)."""
    me = self.ctx.node.process
    return primary == me or (primary in self._lost and self.ctx.backup_of[primary] == me)

  def _serve(self, vw: int, n: int, glob: np.ndarray) -> None:
    ctx, me = self.ctx, self.ctx.node.process
    params = dict(zip(self.units, self.ps.params))  # a copy: the next apply donates the server's own buffers
    glob = jax.device_put(glob, ctx.node.device)
    self._send(vw, n, params, glob)
    backed = {u: tree for u, tree in params.items()
              if ctx.shard_owners[u] != me and ctx.shard_owners[u] not in self._lost}
    if backed:
      self._served[vw].append((n, backed, glob))  # what the primaries sent, should they be lost

  def _send(self, vw: int, n: int, params: Mapping[int, Any], glob: Any, only: int | None = None) -> None:
    """Sends every stage of ``vw`` pull ``n`` of the units this process serves (``params``: unit -> its
    weights; ``only``: of those whose primary is ``only``)."""
    ctx = self.ctx
    for j in range(ctx.layout.vws[vw].k):
      if vw in self._left or ctx.owners[(vw, j)] in self._lost:
        continue  # (nobody waits for it)
      for primary, group in ctx.owner_units(ctx.layout.cuts[vw][j], ctx.layout.cuts[vw][j + 1]).items():
        if (only is not None and primary != only) or not self._serves(primary):
          continue
        leaves = jax.tree.leaves(tuple(params[u] for u in group))
        deliver(ctx.node, ctx.mailbox, ctx.owners[(vw, j)],
                protocol.tag("served", vw=vw, stage=j, n=n, primary=primary), [*leaves, glob],
                stream=f"q{vw}.{j}.{primary}", hold=KEEP_SERVED)
