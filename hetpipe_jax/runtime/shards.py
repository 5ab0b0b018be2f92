"""The PS shards of a ``multiprocess`` run (:mod:`hetpipe_jax.runtime.multiprocess`): the thread of a process
that owns some (:class:`ShardWorker`, its channel's commands :data:`hetpipe_jax.runtime.protocol.SHARD_OPS`),
and process 0's parameter server that keeps the WSP clocks and posts to them (:class:`ShardedServer`)."""

from __future__ import annotations

import collections
import itertools
import threading
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import numpy as np

from hetpipe_jax.core import wsp
from hetpipe_jax.core.server import Snapshot
from hetpipe_jax.errors import NonFiniteUpdate
from hetpipe_jax.runtime import protocol
from hetpipe_jax.runtime.channels import Channel, command_loop, wait
from hetpipe_jax.runtime.decentral import Context, run_thread
from hetpipe_jax.runtime.distributed import Node
from hetpipe_jax.runtime.mailbox import (
  JobStopped,
  Mailbox,
  collect,
  deliver,
  expect,
  receive_tree,
  send_tree,
  unflatten_units,
)
from hetpipe_jax.runtime.ps import ParameterServer


def stage_units(cuts: Sequence[int], units: Sequence[int]) -> list[tuple[int, list[int]]]:
  """(stage, its units among ``units``) for every stage of a virtual worker cut at ``cuts`` that holds any
  (what an owner of ``units`` exchanges with each stage)."""
  out = []
  for j in range(len(cuts) - 1):
    mine = [u for u in range(cuts[j], cuts[j + 1]) if u in units]
    if mine:
      out.append((j, mine))
  return out


class ShardWorker:
  """The PS shards this process owns: their global weights and optax state, applied and served in the
  order the controller posts (channel ``ps<process>``).

  Args:
    node: this process's node.
    units: the units whose shards live here.
    params: their initial global weights.
    num_vws, d, tx: as for :class:`~hetpipe_jax.runtime.ps.ParameterServer`.
    owners: (virtual worker, stage) -> process; ``cuts``: each virtual worker's unit boundaries.
    mailbox: tensors between this process's threads.
  """

  def __init__(self, node: Node, units: Sequence[int], params: Sequence[Any], num_vws: int, d: int,
               tx, owners: dict[tuple[int, int], int], cuts: Sequence[Sequence[int]], mailbox: Mailbox):
    self.node, self.units, self._owners, self._cuts, self._mailbox = node, list(units), owners, cuts, mailbox
    self.ps = ParameterServer(params, num_vws, d, tx)  # the same apply rule as in one process
    self.ps.warm_up()
    self._treedefs = [jax.tree.structure(p) for p in params]
    me = node.process
    def state(c: dict) -> None:
      send_tree(node, mailbox, 0, protocol.tag("shard_state", process=me, n=c["n"]), self.ps.checkpoint_state())

    def restore(c: dict) -> None:
      self.ps.restore_checkpoint_state(receive_tree(node, mailbox, 0, protocol.tag("shard_restore", process=me,
                                                                                    n=c["n"])))
    dispatch = protocol.dispatcher(protocol.SHARD_OPS, {
        "apply": self._apply, "serve": self._serve, "gather": self._gather, "sync": lambda c: None,
        "leave": lambda c: self.ps.leave(c["vw"]), "join": lambda c: self.ps.join(c["vw"]), "snapshot": state,
        "restore": restore})

    def handle(cmd: dict) -> dict:
      dispatch(cmd)
      return {}

    self.thread = threading.Thread(target=command_loop, daemon=True, name=f"ps{me}",
                                   args=(node, f"ps{me}", handle, f"PS shards of process {me}"))

  def _stage_units(self, vw: int) -> list[tuple[int, list[int]]]:
    return stage_units(self._cuts[vw], self.units)

  def _apply(self, cmd: dict) -> None:
    """Applies wave ``cmd["wave"]`` of VW ``cmd["vw"]``, received from its stages; with ``drop`` (a unit
    of the wave, maybe elsewhere, was not finite) only counts it."""
    vw, wave = cmd["vw"], cmd["wave"]
    updates, nonfinite = {}, []
    for j, units in self._stage_units(vw):
      *leaves, flags = collect(self.node, self._mailbox, self._owners[(vw, j)],
                               protocol.tag("update", vw=vw, stage=j, wave=wave))
      local = [self.units.index(u) for u in units]
      updates.update(zip(local, unflatten_units([self._treedefs[i] for i in local], leaves)))
      nonfinite += [i for i, bad in zip(local, np.asarray(flags)) if bad]  # (its stage checked them)
    if cmd.get("drop"):
      self.ps.skip(vw, wave, cmd["drop"])
      return
    try:
      self.ps.push(vw, wave, updates, nonfinite)
    except NonFiniteUpdate as e:  # refused (on_nonfinite="stop"): process 0 stops the job, naming it
      units = [self.units[i] for i in e.units]
      raise JobStopped(str(NonFiniteUpdate(vw, wave, units, e.clock).with_stages(self._cuts[vw]))) from None

  def _serve(self, cmd: dict) -> None:
    vw, j, n = cmd["vw"], cmd["stage"], cmd["n"]
    units = dict(self._stage_units(vw))[j]
    params = self.ps.params  # a copy: the next apply donates the server's own buffers, maybe before the pull
    leaves = jax.tree.leaves(tuple(params[self.units.index(u)] for u in units))
    deliver(self.node, self._mailbox, self._owners[(vw, j)], protocol.tag("pull", vw=vw, stage=j, n=n), leaves)

  def _gather(self, cmd: dict) -> None:
    deliver(self.node, self._mailbox, 0, protocol.tag("weights", process=self.node.process, n=cmd["n"]),
            jax.tree.leaves(self.ps.params))


class ShardedServer:
  """The controller's parameter server: the WSP clocks here, the weights in the shard owners' processes.

  A push ticks the clock and posts an apply to every owner (each receives its units' summed updates
  straight from the stages) at once, without waiting: an owner executes its commands in the order posted,
  so a pull's serve, posted later, sees exactly the waves its snapshot's clock counts, however long the
  applies take. Leaving and joining are posted the same way. A command that fails ends its process, and
  with it the job.

  Args:
    node: process 0's node.
    num_vws, d: as for :class:`~hetpipe_jax.core.server.ClockServer`.
    shard_owners: the process of every unit's shard.
    channels: process -> its PS command channel (shared with :class:`RemoteNumerics`).
    mailbox: process 0's mailbox.
    unit_treedefs: the parameter tree structure of every unit.

  A non-finite update: with ``on_nonfinite="stop"`` the owner that receives it ends the job (naming it);
  with "skip" the stages report the units whose update is not finite (:class:`RemoteNumerics`) and the
  push of such a wave is posted to every owner as a drop (the clock ticks, no weight changes), recorded
  in ``dropped``.
  """

  def __init__(self, node: Node, num_vws: int, d: int, shard_owners: Sequence[int], channels: dict[int, Channel],
               mailbox: Mailbox, unit_treedefs: Sequence[Any]):
    self.node, self.d, self.num_shards = node, d, len(shard_owners)
    self._owners, self._channels, self._mailbox, self._treedefs = list(shard_owners), channels, mailbox, unit_treedefs
    self._clock = wsp.init(num_vws)
    self._tags = itertools.count()  # tags of gathers, snapshots and restores
    self.dropped: dict[tuple[int, int], list[int]] = {}

  @property
  def clock(self) -> wsp.ClockState:
    return self._clock

  def _post_all(self, **cmd) -> None:
    for channel in self._channels.values():
      channel.post(**cmd, report=False)

  def push(self, vw: int, wave: int, updates: Mapping[int, Any]) -> wsp.ClockState:
    """Counts the wave and posts its apply. ``updates`` holds only the units whose update is not finite
    (the updates themselves travel from the stages to the owners): with any, the wave is dropped
    (``on_nonfinite="skip"``: :class:`RemoteNumerics` then reports them)."""
    clock = wsp.push(self._clock, vw, wave)  # raises before anything is applied
    bad = sorted(updates)
    if bad:
      self.dropped[(vw, wave)] = bad
    self._post_all(op="apply", vw=vw, wave=wave, drop=bad)
    self._clock = clock
    return clock

  def try_pull(self, vw: int) -> Snapshot | None:
    if not wsp.gate_open(self._clock, vw, self.d):
      return None
    return Snapshot(None, self._clock.c_local)

  def leave(self, vw: int) -> wsp.ClockState:
    self._clock = wsp.leave(self._clock, vw)
    self._post_all(op="leave", vw=vw)
    return self._clock

  def join(self, vw: int) -> wsp.ClockState:
    self._clock = wsp.join(self._clock, vw)
    self._post_all(op="join", vw=vw)
    return self._clock

  @property
  def params(self) -> tuple[Any, ...]:
    """Every unit's global weights, gathered into process 0 (for evaluation), after every push so far."""
    n = next(self._tags)
    keys = {p: channel.post(op="gather", n=n) for p, channel in self._channels.items()}
    params: list[Any] = [None] * self.num_shards
    for p, key in keys.items():
      leaves = collect(self.node, self._mailbox, p, protocol.tag("weights", process=p, n=n))
      wait(key)
      units = [u for u, owner in enumerate(self._owners) if owner == p]
      for u, tree in zip(units, unflatten_units([self._treedefs[u] for u in units], leaves)):
        params[u] = tree
    return tuple(params)

  def checkpoint_state(self) -> dict[str, Any]:
    """The clocks here and every owner's shards (weights, optax state, its clocks), for a checkpoint taken
    with nothing running: each owner snapshots after every command posted before."""
    n = next(self._tags)
    for channel in self._channels.values():
      channel.post(op="snapshot", n=n, report=False)
    shards = {p: receive_tree(self.node, self._mailbox, p, protocol.tag("shard_state", process=p, n=n))
              for p in self._channels}
    return {"clock": self._clock, "dropped": dict(self.dropped), "shards": shards}

  def restore_checkpoint_state(self, state: dict[str, Any]) -> None:
    """Puts back what :meth:`checkpoint_state` returned (each owner restores before any later command)."""
    self._clock, self.dropped = state["clock"], dict(state["dropped"])
    n = next(self._tags)
    for p, channel in self._channels.items():
      channel.post(op="restore", n=n, report=False)
      send_tree(self.node, self._mailbox, p, protocol.tag("shard_restore", process=p, n=n), state["shards"][p])


FOLLOW_AHEAD = 2  # order entries an owner asks for ahead (the clock sends as many stops after the first)


class ShardFollower:
  """The PS shards this process owns in a decentralised run (:mod:`hetpipe_jax.runtime.decentral`): their
  global weights and optax state, applied, served and gathered in the one order the clock sends
  (:class:`~hetpipe_jax.runtime.clock.ClockService`), every entry pulled in turn by this thread.

  Args:
    ctx: this process's context.
    units: the units whose shards live here; ``params``: their initial global weights.
    tx: the apply rule (:class:`~hetpipe_jax.runtime.ps.ParameterServer`).
  """

  def __init__(self, ctx: Context, units: Sequence[int], params: Sequence[Any], tx):
    self.ctx, self.units = ctx, list(units)
    self.ps = ParameterServer(params, ctx.layout.num_vws, ctx.d, tx)  # the same apply rule as in one process
    self.ps.warm_up()
    self._treedefs = [jax.tree.structure(p) for p in params]
    self.thread = threading.Thread(target=self._main, daemon=True, name=f"ps{ctx.node.process}")

  def _main(self) -> None:
    run_thread(self.ctx, f"the PS shards of process {self.ctx.node.process}", self._run)

  def _stage_units(self, vw: int) -> list[tuple[int, list[int]]]:
    return stage_units(self.ctx.layout.cuts[vw], self.units)

  def _expect_update(self, vw: int, j: int, units: list[int], wave: int) -> None:
    ctx = self.ctx
    if wave < ctx.waves:
      self._updates[(vw, j)] = expect(ctx.node, ctx.mailbox, ctx.owners[(vw, j)],
                                      protocol.tag("update", vw=vw, stage=j, wave=wave), ctx.leaf_specs(units))

  def _run(self) -> None:
    ctx, me = self.ctx, self.ctx.node.process
    self._updates: dict[tuple[int, int], Any] = {}  # (vw, stage) -> what waits for its next wave's update
    for vw in range(ctx.layout.num_vws):
      for j, units in self._stage_units(vw):
        self._expect_update(vw, j, units, 0)
    order = lambda seq: expect(ctx.node, ctx.mailbox, ctx.clock, protocol.tag("order", process=me, seq=seq),
                               [((protocol.ORDER_WIDTH,), np.int32)])
    ahead = collections.deque(order(seq) for seq in range(FOLLOW_AHEAD))  # asked for before the clock sends them
    for seq in itertools.count(FOLLOW_AHEAD):
      (message,) = ahead.popleft()()
      ahead.append(order(seq))
      op, f, _ = protocol.decode(protocol.ORDER_OPS, np.asarray(message))
      if op == protocol.STOP:
        return
      if op == "apply":
        self._apply(f["vw"], f["wave"], bool(f["drop"]))
      elif op == "serve":
        self._serve(f["vw"], f["n"])
      else:
        leaves = jax.tree.leaves(self.ps.params)
        deliver(ctx.node, ctx.mailbox, 0, protocol.tag("weights", process=me, n=f["n"]), leaves)

  def _apply(self, vw: int, wave: int, drop: bool) -> None:
    """Applies the wave's updates from the stages that hold units here (with ``drop``: a unit of the wave,
    maybe elsewhere, was not finite; the wave only counts)."""
    updates = {}
    for j, units in self._stage_units(vw):
      leaves = self._updates.pop((vw, j))()
      self._expect_update(vw, j, units, wave + 1)
      local = [self.units.index(u) for u in units]
      updates.update(zip(local, unflatten_units([self._treedefs[i] for i in local], leaves)))
    if drop:
      self.ps.skip(vw, wave, [])
    else:
      self.ps.push(vw, wave, updates, nonfinite=[])  # (the stages checked: one pass)

  def _serve(self, vw: int, n: int) -> None:
    ctx = self.ctx
    params = self.ps.params  # a copy: the next apply donates the server's own buffers, maybe before the pull
    for j, units in self._stage_units(vw):
      leaves = jax.tree.leaves(tuple(params[self.units.index(u)] for u in units))
      deliver(ctx.node, ctx.mailbox, ctx.owners[(vw, j)], protocol.tag("pull", vw=vw, stage=j, n=n), leaves,
              stream=f"p{vw}.{j}", hold=2)
