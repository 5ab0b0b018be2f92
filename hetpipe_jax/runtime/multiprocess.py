"""The ``multiprocess`` executor: one process per node, one engine.

Process i holds node i's GPUs (emulated by its CPU devices) and runs the stages placed on them: one
thread per local stage executes that stage's commands in order (a forward, a backward, closing a wave,
a rebase), jitted per device as in one process. Activations and gradients go straight from the process of
one stage to the process of the next through the transport (:mod:`hetpipe_jax.runtime.distributed`);
inside a process they stay local.

Process 0 is also the controller: it runs the single-process :class:`~hetpipe_jax.core.engine.Engine`
(the schedule, the WSP clock, gate, push and pull, the trace: not a second copy) on the ``wall``
executor, whose device threads wait for each task's process to report it done. Its numerics adapter,
:class:`RemoteNumerics`, turns "start this task" into a command for the stage's process, and its server,
:class:`ShardedServer`, keeps the WSP clocks while the weights live in the processes that own their PS
shards (:class:`ShardWorker`, host CPU, placed by ``--placement``). Closing a wave sends each stage's
summed update straight to the owners of its units' shards, which apply it; a pull has the owners send
each stage its units' global weights, and the stage adds its open accumulators back. Control goes
through the coordination service's key-value store (``cmd/<channel>/<seq>``, reports under
``done/<channel>/<seq>``); each channel (a stage, a process's shards) executes its commands in the order
posted, which is what orders pushes, pulls and tasks: pushes and pulls are posted without waiting.

The trace: every process records its own tasks (which process ran it, and ``busy``: how long it worked
on it, on that process's clock) and reports them; the engine writes every event in the order it happened
there, which is causal by construction (a task is started only after the reports it depends on arrived;
a push is posted before any pull that sees it, and its owners apply it before they serve that pull; a
gate opens before the injection it allows). At the end, :func:`merge_records` joins each task event with
its process's record by identity, never by timestamps: the clocks of different hosts are not compared.
Event times are process 0's wall clock.
"""

from __future__ import annotations

import dataclasses
import json
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import numpy as np

from hetpipe_jax.core import wsp
from hetpipe_jax.core.schedule import FWD, Task
from hetpipe_jax.core.server import Snapshot
from hetpipe_jax.data import MinibatchStreams
from hetpipe_jax.errors import ProtocolError
from hetpipe_jax.plan.layout import Layout
from hetpipe_jax.runtime.distributed import Node
from hetpipe_jax.runtime.ps import ParameterServer
from hetpipe_jax.runtime.stage import Stage

TIMEOUT_S = 60.0  # a report or a tensor that takes longer means a hung or lost process: the job ends
IDLE_S = 3600.0  # how long a stage or shard may wait for its next command


def process_of(layout: Layout, nodes: Sequence[int]) -> dict[tuple[int, int], int]:
  """(virtual worker, stage) -> the process of the node that holds its GPU (process i = ``nodes[i]``)."""
  index = {node: i for i, node in enumerate(nodes)}
  return {(i, j): index[gpu.node] for i, vw in enumerate(layout.vws) for j, gpu in enumerate(vw.gpus)}


class Mailbox:
  """Tensors between stages of one process (the transport is for other processes)."""

  def __init__(self):
    self._items: dict[str, Any] = {}
    self._cond = threading.Condition()

  def put(self, key: str, value: Any) -> None:
    with self._cond:
      self._items[key] = value
      self._cond.notify_all()

  def take(self, key: str, timeout_s: float) -> Any:
    with self._cond:
      if not self._cond.wait_for(lambda: key in self._items, timeout_s):
        raise TimeoutError(f"no {key} within {timeout_s:g} s")
      return self._items.pop(key)


def deliver(node: Node, mailbox: Mailbox, dst: int, tag: str, arrays: list[Any]) -> None:
  """Sends ``arrays`` to process ``dst`` under ``tag`` (through the mailbox when ``dst`` is this process)."""
  if dst == node.process:
    mailbox.put(tag, arrays)
  else:
    node.send(dst, tag, arrays)


def collect(node: Node, mailbox: Mailbox, src: int, tag: str) -> list[Any]:
  """The arrays process ``src`` delivered under ``tag``."""
  return mailbox.take(tag, TIMEOUT_S) if src == node.process else node.recv(src, tag, TIMEOUT_S)


def command_loop(node: Node, channel: str, handle, what: str) -> None:
  """Executes the commands of ``channel`` (``cmd/<channel>/<seq>``) in order with ``handle(cmd) -> reply``
  until a stop command, reporting under ``done/<channel>/<seq>`` the commands that ask for a report; any
  failure ends this process at once (the others follow)."""
  seq = 0
  try:
    while True:
      cmd = json.loads(node.get(f"cmd/{channel}/{seq}", IDLE_S))
      if cmd["op"] == "stop":
        return
      reply = handle(cmd)
      if cmd.get("report", True):
        node.put(f"done/{channel}/{seq}", json.dumps(reply))
      seq += 1
  except BaseException as e:  # pylint: disable=broad-except
    node.abort(f"{what}: {type(e).__name__}: {e}")


class Channel:
  """The controller's end of one command channel: posts commands, which its process executes in the order
  posted; a command posted with ``report=False`` is not reported (its effects are ordered by the channel:
  a failure ends its process, and with it the job).

  Args:
    node: process 0's node.
    name: the channel (``<vw>.<stage>`` or ``ps<process>``).
    process: the process that executes its commands.
    what: what executes them, for error messages (e.g. "VW 0 stage 1").
  """

  def __init__(self, node: Node, name: str, process: int, what: str):
    self.node, self.name, self.process, self.what, self._seq = node, name, process, what, 0

  def post(self, **cmd) -> Pending:
    """Posts a command; returns its pending report (for :func:`wait`)."""
    seq = self._seq
    self._seq += 1
    self.node.put(f"cmd/{self.name}/{seq}", json.dumps(cmd))
    return Pending(self, f"done/{self.name}/{seq}")


@dataclasses.dataclass
class Pending:
  """A posted command's report to come; ``then(report)`` runs when :func:`wait` gets it."""

  channel: Channel
  key: str
  then: Callable[[dict], None] | None = None


def wait(pending: Pending) -> dict:
  """The report of a posted command (blocks until its process posts it).

  Raises:
    ProtocolError: naming the process, when no report comes within the timeout (it hung or is gone).
  """
  channel = pending.channel
  try:
    report = json.loads(channel.node.get(pending.key, TIMEOUT_S))
  except TimeoutError:
    raise ProtocolError(f"no report from process {channel.process} ({channel.what}, {pending.key!r}) within "
                        f"{TIMEOUT_S:g} s: that process hung or is gone") from None
  if pending.then is not None:
    pending.then(report)
  return report


class StageWorker:
  """Executes the commands of one stage of one virtual worker in this process, in order.

  Args:
    node: this process's node.
    vw, stage: which stage.
    stage_obj: the stage (on a local device).
    nm: the virtual worker's Nm.
    owners: (virtual worker, stage) -> process, for every stage of the job.
    streams: the minibatch source (every process draws the same minibatches from the same seed).
    mailbox: tensors between this process's stages.
  """

  def __init__(self, node: Node, vw: int, stage: int, stage_obj: Stage, nm: int,
               owners: dict[tuple[int, int], int], shard_owners: Sequence[int], streams: MinibatchStreams,
               mailbox: Mailbox):
    self.node, self.vw, self.j, self.stage, self.nm = node, vw, stage, stage_obj, nm
    self._owners, self._shards, self._streams, self._mailbox = owners, shard_owners, streams, mailbox
    self._treedefs = [jax.tree.structure(p) for p in stage_obj.params]  # one per unit
    handlers = {FWD: lambda c: self._timed(self._forward, c["mb"]),
                "bwd": lambda c: self._timed(self._backward, c["mb"]),
                "take": lambda c: self._take(c["wave"]), "rebase": lambda c: self._rebase(c["n"], c["expect"])}
    self.thread = threading.Thread(
        target=command_loop, args=(node, f"{vw}.{stage}", lambda c: handlers[c["op"]](c), f"VW {vw} stage {stage}"),
        name=f"vw{vw}-stage{stage}", daemon=True)

  def _by_owner(self) -> dict[int, list[int]]:
    """The shard owner of each of this stage's units: owner process -> units, in unit order."""
    out: dict[int, list[int]] = {}
    for unit in range(self.stage.first, self.stage.last):
      out.setdefault(self._shards[unit], []).append(unit)
    return out

  def _send(self, stage: int, kind: str, mb: int, x: Any) -> None:
    """Sends activation (kind "a") or gradient ("g") of ``mb`` to ``stage`` of this virtual worker."""
    deliver(self.node, self._mailbox, self._owners[(self.vw, stage)], f"{kind}{self.vw}.{stage}.{mb}", [x])

  def _receive(self, stage: int, kind: str, mb: int) -> Any:
    (x,) = collect(self.node, self._mailbox, self._owners[(self.vw, stage)], f"{kind}{self.vw}.{self.j}.{mb}")
    return jax.device_put(x, self.stage.device)

  @staticmethod
  def _timed(task, mb: int) -> dict:
    """Runs a task and adds to its report how long it took on this process's clock (``busy``, seconds)."""
    t = time.perf_counter()
    report = task(mb)
    report["busy"] = time.perf_counter() - t
    return report

  def _forward(self, mb: int) -> dict:
    stage = self.stage
    if self.j == 0:
      x = jax.device_put(self._streams(self.vw, mb)[0], stage.device)
    else:
      x = self._receive(self.j - 1, "a", mb)
    labels = jax.device_put(self._streams(self.vw, mb)[1], stage.device) if stage.is_last else None
    out = stage.forward(mb, x, labels)
    if stage.is_last:
      return {"loss": float(out)}  # the controller keeps each wave's losses
    self._send(self.j + 1, "a", mb, out)
    jax.block_until_ready(out)
    return {}

  def _backward(self, mb: int) -> dict:
    g = None if self.stage.is_last else self._receive(self.j + 1, "g", mb)
    gx = self.stage.backward(mb, g)
    if self.j > 0:
      self._send(self.j - 1, "g", mb, gx)
    jax.block_until_ready(self.stage.params)
    return {}

  def _take(self, wave: int) -> dict:
    """Closes ``wave``: sends each unit's summed update to the process that owns its shard."""
    update = self.stage.take_wave(wave)
    for owner, units in self._by_owner().items():
      leaves = jax.tree.leaves(tuple(update[u - self.stage.first] for u in units))
      deliver(self.node, self._mailbox, owner, f"u{self.vw}.{self.j}.{wave}", leaves)
    return {}

  def _rebase(self, n: int, expect: int) -> dict:
    """Pull: the global weights of this stage's units from their owners, plus the open accumulators (the
    ``expect`` local updates the engine counted: anything else is a lost or extra update).

    Raises:
      ProtocolError: when the stage added back another number of updates than the engine counted.
    """
    params: dict[int, Any] = {}
    for owner, units in self._by_owner().items():
      leaves = collect(self.node, self._mailbox, owner, f"p{self.vw}.{self.j}.{n}")
      for u in units:  # in unit order, as the owner flattened them
        treedef = self._treedefs[u - self.stage.first]
        params[u] = jax.tree.unflatten(treedef, leaves[:treedef.num_leaves])
        leaves = leaves[treedef.num_leaves:]
    added = self.stage.rebase(tuple(params[u] for u in sorted(params)))
    if added != expect:
      raise ProtocolError(f"VW {self.vw} stage {self.j} added back {added} local updates at pull {n}; the "
                          f"engine counted {expect}")
    return {"added": added}


class ShardWorker:
  """The PS shards this process owns: their global weights and optax state, applied and served in the
  order the controller posts (channel ``ps<process>``).

  Args:
    node: this process's node.
    units: the units whose shards live here.
    params: their initial global weights.
    layout_owners: (virtual worker, stage) -> process; ``cuts``: each virtual worker's unit boundaries.
  """

  def __init__(self, node: Node, units: Sequence[int], params: Sequence[Any], num_vws: int, d: int,
               tx, owners: dict[tuple[int, int], int], cuts: Sequence[Sequence[int]], mailbox: Mailbox):
    self.node, self.units, self._owners, self._cuts, self._mailbox = node, list(units), owners, cuts, mailbox
    self.ps = ParameterServer(params, num_vws, d, tx)  # the same apply rule as in one process
    self.ps.warm_up()
    self._treedefs = [jax.tree.structure(p) for p in params]
    handlers = {"apply": self._apply, "serve": self._serve, "gather": self._gather}
    self.thread = threading.Thread(target=command_loop, daemon=True, name=f"ps{node.process}",
                                   args=(node, f"ps{node.process}", lambda c: handlers[c["op"]](c),
                                         f"PS shards of process {node.process}"))

  def _stage_units(self, vw: int) -> list[tuple[int, list[int]]]:
    """(stage, its units that live here) for every stage of ``vw`` that holds any."""
    cuts, out = self._cuts[vw], []
    for j in range(len(cuts) - 1):
      units = [u for u in range(cuts[j], cuts[j + 1]) if u in self.units]
      if units:
        out.append((j, units))
    return out

  def _apply(self, cmd: dict) -> dict:
    vw, wave = cmd["vw"], cmd["wave"]
    updates = {}
    for j, units in self._stage_units(vw):
      leaves = collect(self.node, self._mailbox, self._owners[(vw, j)], f"u{vw}.{j}.{wave}")
      for u in units:
        treedef = self._treedefs[self.units.index(u)]
        updates[self.units.index(u)] = jax.tree.unflatten(treedef, leaves[:treedef.num_leaves])
        leaves = leaves[treedef.num_leaves:]
    self.ps.push(vw, wave, updates)
    return {}

  def _serve(self, cmd: dict) -> dict:
    vw, j, n = cmd["vw"], cmd["stage"], cmd["n"]
    units = dict(self._stage_units(vw))[j]
    params = self.ps.params  # a copy: the next apply donates the server's own buffers, maybe before the pull
    leaves = jax.tree.leaves(tuple(params[self.units.index(u)] for u in units))
    deliver(self.node, self._mailbox, self._owners[(vw, j)], f"p{vw}.{j}.{n}", leaves)
    return {}

  def _gather(self, cmd: dict) -> dict:
    deliver(self.node, self._mailbox, 0, f"w{self.node.process}.{cmd['n']}", jax.tree.leaves(self.ps.params))
    return {}


class ShardedServer:
  """The controller's parameter server: the WSP clocks here, the weights in the shard owners' processes.

  A push ticks the clock and posts an apply to every owner (each receives its units' summed updates
  straight from the stages) at once, without waiting: an owner executes its commands in the order posted,
  so a pull's serve, posted later, sees exactly the waves its snapshot's clock counts, however long the
  applies take. A command that fails ends its process, and with it the job.

  Args:
    node: process 0's node.
    num_vws, d: as for :class:`~hetpipe_jax.core.server.ClockServer`.
    shard_owners: the process of every unit's shard.
    channels: process -> its PS command channel (shared with :class:`RemoteNumerics`).
    mailbox: process 0's mailbox.
    unit_treedefs: the parameter tree structure of every unit.
  """

  def __init__(self, node: Node, num_vws: int, d: int, shard_owners: Sequence[int], channels: dict[int, Channel],
               mailbox: Mailbox, unit_treedefs: Sequence[Any]):
    self.node, self.d, self.num_shards = node, d, len(shard_owners)
    self._owners, self._channels, self._mailbox, self._treedefs = list(shard_owners), channels, mailbox, unit_treedefs
    self._clock = wsp.init(num_vws)
    self._gathers = 0
    self.dropped: dict[tuple[int, int], list[int]] = {}  # owners stop the job on a non-finite update

  @property
  def clock(self) -> wsp.ClockState:
    return self._clock

  def push(self, vw: int, wave: int, updates: Mapping[int, Any]) -> wsp.ClockState:
    del updates  # they travel from the stages to the owners
    clock = wsp.push(self._clock, vw, wave)  # raises before anything is applied
    for channel in self._channels.values():
      channel.post(op="apply", vw=vw, wave=wave, report=False)
    self._clock = clock
    return clock

  def try_pull(self, vw: int) -> Snapshot | None:
    if not wsp.gate_open(self._clock, vw, self.d):
      return None
    return Snapshot(None, self._clock.c_local)

  def leave(self, vw: int) -> wsp.ClockState:
    raise ProtocolError(f"VW {vw} cannot leave a multiprocess run in this version (membership is "
                        "single-process)")

  def join(self, vw: int) -> wsp.ClockState:
    raise ProtocolError(f"VW {vw} cannot join a multiprocess run in this version")

  @property
  def params(self) -> tuple[Any, ...]:
    """Every unit's global weights, gathered into process 0 (for evaluation), after every push so far."""
    n = self._gathers
    self._gathers += 1
    keys = {p: channel.post(op="gather", n=n) for p, channel in self._channels.items()}
    params: list[Any] = [None] * self.num_shards
    for p, key in keys.items():
      leaves = collect(self.node, self._mailbox, p, f"w{p}.{n}")
      wait(key)
      for u in (u for u, owner in enumerate(self._owners) if owner == p):
        params[u] = jax.tree.unflatten(self._treedefs[u], leaves[:self._treedefs[u].num_leaves])
        leaves = leaves[self._treedefs[u].num_leaves:]
    return tuple(params)


class RemoteNumerics:
  """The engine's numerics adapter for one virtual worker whose stages run in node processes.

  Args:
    node: process 0's node.
    vw: the virtual worker.
    cuts: its unit boundaries.
    nm: its Nm.
    owners: (virtual worker, stage) -> the process that runs it.
    shard_owners: the process of every unit's shard.
    channels: process -> its PS command channel (shared with :class:`ShardedServer`).
  """

  def __init__(self, node: Node, vw: int, cuts: Sequence[int], nm: int, owners: dict[tuple[int, int], int],
               shard_owners: Sequence[int], channels: dict[int, Channel]):
    self.node, self.vw, self.cuts, self.nm = node, vw, list(cuts), nm
    self.k = len(cuts) - 1
    self._stages = [Channel(node, f"{vw}.{j}", owners[(vw, j)], f"VW {vw} stage {j}") for j in range(self.k)]
    self._shard_owners, self._ps = list(shard_owners), channels
    self._rebases = 0
    self._losses: dict[int, np.float32] = {}  # minibatch -> its loss, from the last stage's forward report
    self._owners = owners
    self.records: dict[tuple[str, int, int], dict] = {}  # (kind, stage, mb) -> what its process recorded

  @property
  def stages(self) -> Sequence[Any]:
    return ()  # they live in the node processes

  def inject(self, mb: int, x: Any, labels: Any) -> None:
    del mb, x, labels  # stage 0's process draws minibatch mb itself (same seed, same streams)

  def run(self, task: Task) -> Pending:
    pending = self._stages[task.stage].post(op=task.kind, mb=task.mb)
    pending.then = lambda report: self._reported(task, report)
    return pending

  def _reported(self, task: Task, report: dict) -> None:
    if "loss" in report:
      self._losses[task.mb] = np.float32(report["loss"])
    self.records[(task.kind, task.stage, task.mb)] = {"process": self._owners[(self.vw, task.stage)],
                                                      "busy": report["busy"]}

  def take_wave(self, wave: int) -> tuple[dict[int, Any], list[Any]]:
    """Closes ``wave`` in every stage (their updates go to the shard owners, unreported: see
    :class:`ShardedServer`); returns its losses (every forward of the wave has been reported)."""
    for channel in self._stages:
      channel.post(op="take", wave=wave, report=False)
    first = wave * self.nm + 1
    return {}, [self._losses.pop(mb) for mb in range(first, first + self.nm)]

  def rebase(self, params: Sequence[Any] | None, open_updates: Sequence[int]) -> list[int]:
    """Every stage <- its units' global weights, served by their owners, + its open accumulators.

    Posted, not waited for: each owner serves in its command order (so exactly the snapshot's waves, see
    :class:`ShardedServer`), and each stage rebases in its own, after every task the engine started on it
    before and before every task it starts after, which is where the engine's weight versions put the pull.
    Each stage checks that it added back the ``open_updates`` the engine counted (else the job stops).
    """
    del params  # the owners serve the weights
    n = self._rebases
    self._rebases += 1
    for j in range(self.k):
      for owner in sorted({self._shard_owners[u] for u in range(self.cuts[j], self.cuts[j + 1])}):
        self._ps[owner].post(op="serve", vw=self.vw, stage=j, n=n, report=False)
      self._stages[j].post(op="rebase", n=n, expect=open_updates[j], report=False)
    return list(open_updates)

  def drop(self) -> None:
    raise ProtocolError(f"VW {self.vw} cannot fail over in a multiprocess run in this version")

  def rejoin(self, params: Sequence[Any] | None) -> None:
    raise ProtocolError(f"VW {self.vw} cannot rejoin a multiprocess run in this version")

  def stop(self) -> None:
    for channel in self._stages:
      channel.post(op="stop")


def merge_records(events: list[dict[str, Any]], numerics: Sequence[RemoteNumerics]) -> list[dict[str, Any]]:
  """The job's one trace: the engine's events in their causal order, each task event joined by identity
  (virtual worker, stage, minibatch, kind) with what the process that ran it recorded: ``process`` and
  ``busy`` (seconds it worked on the task, on that process's own clock). Changes ``events`` in place."""
  for event in events:
    if event["ev"] in (FWD, "bwd"):
      event.update(numerics[event["vw"]].records[(event["ev"], event["stage"], event["mb"])])
  return events

