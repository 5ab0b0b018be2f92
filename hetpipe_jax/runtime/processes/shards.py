"""The PS shards of a ``multiprocess`` run (:mod:`hetpipe_jax.runtime.processes`): the thread of a process
that owns some (:class:`ShardWorker`, its channel's commands :data:`hetpipe_jax.runtime.transport.protocol.SHARD_OPS`)
and process 0's parameter server that keeps the WSP clocks and posts to them (:class:`ShardedServer`) in a
central run; the primary and backup copies a process holds in a decentralised one (:class:`ShardFollower`)."""

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
from hetpipe_jax.runtime.numerics.ps import ParameterServer
from hetpipe_jax.runtime.processes.channels import Channel, Wiring, command_loop, wait
from hetpipe_jax.runtime.processes.decentral import Actor, Context, run_thread, stream
from hetpipe_jax.runtime.processes.stage_loop import control_width
from hetpipe_jax.runtime.transport import protocol
from hetpipe_jax.runtime.transport.mailbox import (
  JobStopped,
  Mailbox,
  collect,
  deliver,
  expect,
  receive_tree,
  send_tree,
  unflatten_units,
)
from hetpipe_jax.runtime.transport.node import Node, PeerGone


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
    wiring: this process's node and mailbox, where every stage runs.
    units: the units whose shards live here.
    params: their initial global weights.
    cuts: each virtual worker's unit boundaries.
    num_vws, d, tx, update_dtype: as for :class:`~hetpipe_jax.runtime.numerics.ps.ParameterServer`.
  """

  def __init__(self, wiring: Wiring, units: Sequence[int], params: Sequence[Any], cuts: Sequence[Sequence[int]],
               num_vws: int, d: int, tx, update_dtype: Any = None):
    node, owners, mailbox = wiring.node, wiring.owners, wiring.mailbox
    self.node, self.units, self._owners, self._cuts, self._mailbox = node, list(units), owners, cuts, mailbox
    # the same apply rule as in one process, compiled for the pushes' dtype (16 bits in mixed precision)
    self.ps = ParameterServer(params, num_vws, d, tx, update_dtype=update_dtype)
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
      nonfinite += [i for i, bad in zip(local, np.asarray(flags)) if bad]  # (its stage checked them; the
      # flags' last entry, its fp16 skipped count, reaches the engine in the stage's report)
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
      applied = jax.device_put(np.array(self.ps.clock.c_local, np.int32), ctx.node.device)
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
