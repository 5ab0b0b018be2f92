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
import itertools
import json
import os
import signal
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import numpy as np

from hetpipe_jax.core import wsp
from hetpipe_jax.core.schedule import FWD, Task, successor
from hetpipe_jax.core.server import Snapshot
from hetpipe_jax.data import MinibatchStreams
from hetpipe_jax.errors import NonFiniteUpdate, ProtocolError, RunStopped, TaskFailed
from hetpipe_jax.plan.layout import Layout
from hetpipe_jax.runtime import checkpoint
from hetpipe_jax.runtime.distributed import POLL_S, Node, PeerGone
from hetpipe_jax.runtime.ps import ParameterServer, nonfinite_units
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

  def take(self, key: str, timeout_s: float, node: Node | None = None) -> Any:
    """The value put under ``key``; with ``node``, gives up once the job cannot go on (process 0's verdict,
    :attr:`Node.fatal`: the thread that would put it may be waiting for a process that is gone) or, in a
    recoverable job, once it is stopping.

    Raises:
      TimeoutError: after ``timeout_s``.
      RunStopped: when the job cannot go on.
      PeerGone: when the job is stopping.
    """
    deadline = time.monotonic() + timeout_s
    with self._cond:
      while key not in self._items:
        if node is not None and node.fatal:
          raise RunStopped(node.fatal)
        if node is not None and node.recoverable and node.stopping():
          raise PeerGone(node.process, " (the job is stopping)")
        left = deadline - time.monotonic()
        if left <= 0:
          raise TimeoutError(f"no {key} within {timeout_s:g} s")
        self._cond.wait(min(left, POLL_S))
      return self._items.pop(key)


def deliver(node: Node, mailbox: Mailbox, dst: int, tag: str, arrays: list[Any]) -> None:
  """Sends ``arrays`` to process ``dst`` under ``tag`` (through the mailbox when ``dst`` is this process)."""
  if dst == node.process:
    mailbox.put(tag, arrays)
  else:
    node.send(dst, tag, arrays)


def collect(node: Node, mailbox: Mailbox, src: int, tag: str) -> list[Any]:
  """The arrays process ``src`` delivered under ``tag``."""
  return mailbox.take(tag, TIMEOUT_S, node) if src == node.process else node.recv(src, tag, TIMEOUT_S)


class JobStopped(Exception):
  """Raised by a command that found why the job must stop (e.g. a non-finite update): its channel ends
  and process 0 stops the job with this message."""


def send_tree(node: Node, mailbox: Mailbox, dst: int, tag: str, tree: Any) -> None:
  """Sends any tree of plain values and arrays (a checkpoint's part) to process ``dst`` under ``tag``."""
  skeleton, arrays = checkpoint.split(tree)
  leaves = [np.frombuffer(skeleton, np.uint8)] + [arrays[str(i)] for i in range(len(arrays))]
  deliver(node, mailbox, dst, tag, [jax.device_put(x, node.device) for x in leaves])


def receive_tree(node: Node, mailbox: Mailbox, src: int, tag: str) -> Any:
  """The tree process ``src`` sent with :func:`send_tree` (its arrays as numpy)."""
  skeleton, *arrays = collect(node, mailbox, src, tag)
  return checkpoint.join(np.asarray(skeleton).tobytes(), {str(i): np.asarray(a) for i, a in enumerate(arrays)})


def unflatten_units(treedefs: Sequence[Any], leaves: Sequence[Any]) -> list[Any]:
  """Splits the leaves of several units, flattened one after another, back into one tree per unit."""
  out, leaves = [], list(leaves)
  for treedef in treedefs:
    out.append(jax.tree.unflatten(treedef, leaves[:treedef.num_leaves]))
    leaves = leaves[treedef.num_leaves:]
  return out


def command_loop(node: Node, channel: str, handle, what: str) -> None:
  """Executes the commands of ``channel`` (``cmd/<channel>/<seq>``) in order with ``handle(cmd) -> reply``
  until a stop command, reporting under ``done/<channel>/<seq>`` the commands that ask for a report.

  A command that waited for a process that is gone (:class:`PeerGone`, outside a task) or found why the
  job must stop (:class:`JobStopped`) leaves this channel unable to go on: it tells process 0 why (which
  stops the job in one line) and ends the channel. Any other failure ends this process at once (the
  others follow, or go on without it)."""
  seq, cmd = 0, {}
  try:
    while True:
      cmd = json.loads(node.get(f"cmd/{channel}/{seq}", IDLE_S))
      if cmd["op"] == "stop":
        return
      reply = handle(cmd)
      if cmd.get("report", True):
        node.put(f"done/{channel}/{seq}", json.dumps(reply))
      seq += 1
  except JobStopped as e:
    node.publish_fatal(str(e))
  except PeerGone as e:
    node.publish_fatal(f"{e}, so {what} (process {node.process}) could not finish its {cmd.get('op')} command "
                       f"{json.dumps(cmd)}: the job cannot go on consistently; resume from the newest checkpoint "
                       "(--resume)")
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
    TaskFailed: when the command raised in its process, or its process is gone (a task: its virtual
      worker fails).
    RunStopped: when the job cannot go on (:attr:`Node.fatal`: e.g. a process gone with PS shards).
  """
  channel = pending.channel
  node = channel.node
  deadline = time.monotonic() + TIMEOUT_S
  while True:
    if node.fatal:
      raise RunStopped(node.fatal)
    if channel.process in node.dead:
      raise TaskFailed(f"{channel.what}: process {channel.process} is gone", final=True)
    try:
      report = json.loads(node.get(pending.key, POLL_S if node.recoverable else TIMEOUT_S))
      break
    except TimeoutError:
      if time.monotonic() >= deadline:
        raise ProtocolError(f"no report from process {channel.process} ({channel.what}, {pending.key!r}) "
                            f"within {TIMEOUT_S:g} s: that process hung or is gone") from None
  if pending.then is not None:
    pending.then(report)
  if "error" in report:
    raise TaskFailed(f"{channel.what} (process {channel.process}): {report['error']}", report.get("final", False))
  return report


class StageWorker:
  """Executes the commands of one stage of one virtual worker in this process, in order.

  A forward or backward that raises reports the error (its virtual worker then fails and leaves; this
  process goes on); any other failure ends the process. Activation and gradient tags carry the virtual
  worker's generation (bumped when it fails), so a replacement never takes a tensor of the failed one.

  Args:
    node: this process's node.
    vw, stage: which stage.
    stage_obj: the stage (on a local device).
    nm: the virtual worker's Nm.
    owners: (virtual worker, stage) -> process, for every stage of the job.
    shard_owners: the process of every unit's PS shard.
    streams: the minibatch source (every process draws the same minibatches from the same seed).
    mailbox: tensors between this process's stages.
  """

  def __init__(self, node: Node, vw: int, stage: int, stage_obj: Stage, nm: int,
               owners: dict[tuple[int, int], int], shard_owners: Sequence[int], streams: MinibatchStreams,
               mailbox: Mailbox):
    self.node, self.vw, self.j, self.stage, self.nm = node, vw, stage, stage_obj, nm
    self._owners, self._shards, self._streams, self._mailbox = owners, shard_owners, streams, mailbox
    self._treedefs = [jax.tree.structure(p) for p in stage_obj.params]  # one per unit
    self._gen = 0  # the virtual worker's generation: bumped when it fails
    self._held: dict[tuple[str, int], Any] = {}  # (kind, mb) -> an input taken for a checkpoint, not used yet
    handlers = {FWD: lambda c: self._task(self._forward, c["mb"]),
                "bwd": lambda c: self._task(self._backward, c["mb"]),
                "take": lambda c: self._take(c["wave"], c["check"]),
                "rebase": lambda c: self._rebase(c["n"], c["expect"]),
                "drop": lambda c: self._drop(), "restart": lambda c: self._restart(c["n"]),
                "snapshot": self._snapshot, "restore": lambda c: self._restore(c["n"]),
                "die": lambda c: os.kill(os.getpid(), signal.SIGKILL)}  # an injected crash
    self.thread = threading.Thread(
        target=command_loop, args=(node, f"{vw}.{stage}", lambda c: handlers[c["op"]](c), f"VW {vw} stage {stage}"),
        name=f"vw{vw}-stage{stage}", daemon=True)

  def _by_owner(self) -> dict[int, list[int]]:
    """The shard owner of each of this stage's units: owner process -> units, in unit order."""
    out: dict[int, list[int]] = {}
    for unit in range(self.stage.first, self.stage.last):
      out.setdefault(self._shards[unit], []).append(unit)
    return out

  def _tag(self, kind: str, stage: int, mb: int) -> str:
    return f"{kind}{self.vw}g{self._gen}.{stage}.{mb}"

  def _send(self, stage: int, kind: str, mb: int, x: Any) -> None:
    """Sends activation (kind "a") or gradient ("g") of ``mb`` to ``stage`` of this virtual worker."""
    deliver(self.node, self._mailbox, self._owners[(self.vw, stage)], self._tag(kind, stage, mb), [x])

  def _receive(self, stage: int, kind: str, mb: int) -> Any:
    if (kind, mb) in self._held:  # taken for a checkpoint
      return jax.device_put(self._held.pop((kind, mb)), self.stage.device)
    (x,) = collect(self.node, self._mailbox, self._owners[(self.vw, stage)], self._tag(kind, self.j, mb))
    return jax.device_put(x, self.stage.device)

  def _task(self, task, mb: int) -> dict:
    """Runs a task; its report says how long it took on this process's clock (``busy``, seconds), or
    the error it raised."""
    t = time.perf_counter()
    try:
      report = task(mb)
    except ProtocolError:
      raise  # a bug: the job ends
    except PeerGone as e:  # another stage's process is gone: so is this virtual worker, for good
      return {"error": str(e), "final": True}
    except Exception as e:  # pylint: disable=broad-except  # the virtual worker fails, the others go on
      return {"error": f"{type(e).__name__}: {e}"}
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

  def _take(self, wave: int, check: bool) -> dict:
    """Closes ``wave``: sends each unit's summed update to the process that owns its shard; with
    ``check``, reports the units whose update is not finite."""
    update = self.stage.take_wave(wave)
    for owner, units in self._by_owner().items():
      leaves = jax.tree.leaves(tuple(update[u - self.stage.first] for u in units))
      deliver(self.node, self._mailbox, owner, f"u{self.vw}.{self.j}.{wave}", leaves)
    return {"nonfinite": [self.stage.first + u for u in nonfinite_units(update)] if check else []}

  def _pull(self, n: int) -> tuple[Any, ...]:
    """Pull ``n``: the global weights of this stage's units, from their owners."""
    params: dict[int, Any] = {}
    for owner, units in self._by_owner().items():
      leaves = collect(self.node, self._mailbox, owner, f"p{self.vw}.{self.j}.{n}")
      params.update(zip(units, unflatten_units([self._treedefs[u - self.stage.first] for u in units], leaves)))
    return tuple(params[u] for u in sorted(params))

  def _rebase(self, n: int, expect: int) -> dict:
    """Pull ``n`` plus the open accumulators (the ``expect`` local updates the engine counted: anything
    else is a lost or extra update).

    Raises:
      ProtocolError: when the stage added back another number of updates than the engine counted.
    """
    added = self.stage.rebase(self._pull(n))
    if added != expect:
      raise ProtocolError(f"VW {self.vw} stage {self.j} added back {added} local updates at pull {n}; the "
                          f"engine counted {expect}")
    return {"added": added}

  def _drop(self) -> dict:
    """The virtual worker failed: what its forwards kept, its open accumulators and inputs are gone."""
    self.stage.drop()
    self._held.clear()
    self._gen += 1
    return {}

  def _restart(self, n: int) -> dict:
    """A replacement: pull ``n``'s global weights and a fresh local optimizer."""
    self.stage.restart(self._pull(n))
    return {}

  def _snapshot(self, cmd: dict) -> dict:
    """For a checkpoint (every task drained): takes the inputs sent to this stage but not used yet
    (``inbound``: [kind, mb] pairs), then sends the stage's state to process 0."""
    for kind, mb in cmd["inbound"]:
      self._held[(kind, mb)] = self._receive(self.j - 1 if kind == "a" else self.j + 1, kind, mb)
    send_tree(self.node, self._mailbox, 0, f"s{self.vw}.{self.j}.{cmd['n']}",
              {"stage": self.stage.checkpoint_state(), "held": dict(self._held), "gen": self._gen})
    return {}

  def _restore(self, n: int) -> dict:
    """A resumed run: the state process 0 sends (what :meth:`_snapshot` sent)."""
    state = receive_tree(self.node, self._mailbox, 0, f"r{self.vw}.{self.j}.{n}")
    self.stage.restore_checkpoint_state(state["stage"])
    self._held, self._gen = dict(state["held"]), state["gen"]
    return {}


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
    handlers = {"apply": self._apply, "serve": self._serve, "gather": self._gather, "sync": lambda c: None,
                "leave": lambda c: self.ps.leave(c["vw"]), "join": lambda c: self.ps.join(c["vw"]),
                "snapshot": lambda c: send_tree(node, mailbox, 0, f"S{me}.{c['n']}", self.ps.checkpoint_state()),
                "restore": lambda c: self.ps.restore_checkpoint_state(
                    receive_tree(node, mailbox, 0, f"R{me}.{c['n']}"))}

    def handle(cmd: dict) -> dict:
      handlers[cmd["op"]](cmd)
      return {}

    self.thread = threading.Thread(target=command_loop, daemon=True, name=f"ps{me}",
                                   args=(node, f"ps{me}", handle, f"PS shards of process {me}"))

  def _stage_units(self, vw: int) -> list[tuple[int, list[int]]]:
    """(stage, its units that live here) for every stage of ``vw`` that holds any."""
    cuts, out = self._cuts[vw], []
    for j in range(len(cuts) - 1):
      units = [u for u in range(cuts[j], cuts[j + 1]) if u in self.units]
      if units:
        out.append((j, units))
    return out

  def _apply(self, cmd: dict) -> None:
    """Applies wave ``cmd["wave"]`` of VW ``cmd["vw"]``, received from its stages; with ``drop`` (a unit
    of the wave, maybe elsewhere, was not finite) only counts it."""
    vw, wave = cmd["vw"], cmd["wave"]
    updates = {}
    for j, units in self._stage_units(vw):
      leaves = collect(self.node, self._mailbox, self._owners[(vw, j)], f"u{vw}.{j}.{wave}")
      local = [self.units.index(u) for u in units]
      updates.update(zip(local, unflatten_units([self._treedefs[i] for i in local], leaves)))
    if cmd.get("drop"):
      self.ps.skip(vw, wave, cmd["drop"])
      return
    try:
      self.ps.push(vw, wave, updates)
    except NonFiniteUpdate as e:  # refused (on_nonfinite="stop"): process 0 stops the job, naming it
      units = [self.units[i] for i in e.units]
      raise JobStopped(str(NonFiniteUpdate(vw, wave, units, e.clock).with_stages(self._cuts[vw]))) from None

  def _serve(self, cmd: dict) -> None:
    vw, j, n = cmd["vw"], cmd["stage"], cmd["n"]
    units = dict(self._stage_units(vw))[j]
    params = self.ps.params  # a copy: the next apply donates the server's own buffers, maybe before the pull
    leaves = jax.tree.leaves(tuple(params[self.units.index(u)] for u in units))
    deliver(self.node, self._mailbox, self._owners[(vw, j)], f"p{vw}.{j}.{n}", leaves)

  def _gather(self, cmd: dict) -> None:
    deliver(self.node, self._mailbox, 0, f"w{self.node.process}.{cmd['n']}", jax.tree.leaves(self.ps.params))


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
      leaves = collect(self.node, self._mailbox, p, f"w{p}.{n}")
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
    shards = {p: receive_tree(self.node, self._mailbox, p, f"S{p}.{n}") for p in self._channels}
    return {"clock": self._clock, "dropped": dict(self.dropped), "shards": shards}

  def restore_checkpoint_state(self, state: dict[str, Any]) -> None:
    """Puts back what :meth:`checkpoint_state` returned (each owner restores before any later command)."""
    self._clock, self.dropped = state["clock"], dict(state["dropped"])
    n = next(self._tags)
    for p, channel in self._channels.items():
      channel.post(op="restore", n=n, report=False)
      send_tree(self.node, self._mailbox, p, f"R{p}.{n}", state["shards"][p])


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
    mailbox: process 0's mailbox.
    check_finite: the stages report the units whose wave update is not finite (for
      ``on_nonfinite="skip"``: then closing a wave waits for their reports).
  """

  def __init__(self, node: Node, vw: int, cuts: Sequence[int], nm: int, owners: dict[tuple[int, int], int],
               shard_owners: Sequence[int], channels: dict[int, Channel], mailbox: Mailbox,
               check_finite: bool = False):
    self.node, self.vw, self.cuts, self.nm, self._check = node, vw, list(cuts), nm, check_finite
    self.k = len(cuts) - 1
    self._stages = [Channel(node, f"{vw}.{j}", owners[(vw, j)], f"VW {vw} stage {j}") for j in range(self.k)]
    self._shard_owners, self._ps, self._mailbox = list(shard_owners), channels, mailbox
    self._tags = itertools.count()  # tags of pulls, restarts, snapshots and restores
    self._losses: dict[int, np.float32] = {}  # minibatch -> its loss, from the last stage's forward report
    self._owners = owners
    self.generation = 0  # bumped when the virtual worker fails (its stages bump theirs in the same order)
    self._inbound: set[tuple[int, str, int]] = set()  # (stage, kind, mb): sent to that stage, not used yet
    self.records: dict[tuple[int, str, int, int], dict] = {}  # (generation, kind, stage, mb) -> its record

  @property
  def stages(self) -> Sequence[Any]:
    return ()  # they live in the node processes

  def inject(self, mb: int, x: Any, labels: Any) -> None:
    del mb, x, labels  # stage 0's process draws minibatch mb itself (same seed, same streams)

  def run(self, task: Task) -> Pending:
    j, gen = task.stage, self.generation
    self._inbound.discard((j, "a" if task.kind == FWD else "g", task.mb))
    pending = self._stages[j].post(op=task.kind, mb=task.mb)
    pending.then = lambda report: self._reported(task, report, gen)
    return pending

  def _reported(self, task: Task, report: dict, gen: int) -> None:
    if "error" in report or gen != self.generation:
      return  # failed (wait raises), or a failed generation's task: unrecorded
    if "loss" in report:
      self._losses[task.mb] = np.float32(report["loss"])
    j, nxt = task.stage, successor(task, self.k)
    if nxt is not None and nxt[0] != j:  # its output now waits at that stage
      self._inbound.add((nxt[0], "a" if nxt[1] == FWD else "g", task.mb))
    self.records[(gen, task.kind, j, task.mb)] = {"process": self._owners[(self.vw, j)], "busy": report["busy"]}

  def take_wave(self, wave: int) -> tuple[dict[int, Any], list[Any]]:
    """Closes ``wave`` in every stage (their updates go to the shard owners, see :class:`ShardedServer`);
    returns the units whose update is not finite (only with ``check_finite``: it waits for the stages'
    reports) and the wave's losses (every forward of the wave has been reported)."""
    posted = [channel.post(op="take", wave=wave, check=self._check, report=self._check) for channel in self._stages]
    bad = sorted(u for pending in posted for u in wait(pending)["nonfinite"]) if self._check else []
    first = wave * self.nm + 1
    return dict.fromkeys(bad), [self._losses.pop(mb) for mb in range(first, first + self.nm)]

  def _serve(self, n: int) -> None:
    """Has the owners send every stage its units' global weights as pull ``n``."""
    for j in range(self.k):
      for owner in sorted({self._shard_owners[u] for u in range(self.cuts[j], self.cuts[j + 1])}):
        self._ps[owner].post(op="serve", vw=self.vw, stage=j, n=n, report=False)

  def rebase(self, params: Sequence[Any] | None, open_updates: Sequence[int]) -> list[int]:
    """Every stage <- its units' global weights, served by their owners, + its open accumulators.

    Posted, not waited for: each owner serves in its command order (so exactly the snapshot's waves, see
    :class:`ShardedServer`), and each stage rebases in its own, after every task the engine started on it
    before and before every task it starts after, which is where the engine's weight versions put the pull.
    Each stage checks that it added back the ``open_updates`` the engine counted (else the job stops).
    """
    del params  # the owners serve the weights
    n = next(self._tags)
    self._serve(n)
    for j in range(self.k):
      self._stages[j].post(op="rebase", n=n, expect=open_updates[j], report=False)
    return list(open_updates)

  def drop(self) -> None:
    """The virtual worker failed: each stage, after the tasks it was running, forgets what it held."""
    self.generation += 1
    self._losses.clear()
    self._inbound.clear()
    for channel in self._stages:
      channel.post(op="drop", report=False)

  def rejoin(self, params: Sequence[Any] | None) -> None:
    """A replacement: every stage <- its units' global weights (served by the owners), a fresh optimizer."""
    del params  # the owners serve the weights
    n = next(self._tags)
    self._serve(n)
    for channel in self._stages:
      channel.post(op="restart", n=n, report=False)

  def crash(self) -> bool:
    """An injected fault kills the processes that run this virtual worker (SIGKILL), when they run no
    other virtual worker and no PS shard and are not process 0 (else: False, it fails in software). First
    every push posted so far is applied (no update in flight dies with them); then the processes stop
    beating, process 0's watch declares them gone, and the next task posted there fails."""
    mine = {channel.process for channel in self._stages}
    others = {p for (vw, _), p in self._owners.items() if vw != self.vw} | set(self._shard_owners) | {0}
    if mine & others:
      return False
    for pending in [channel.post(op="sync") for channel in self._ps.values()]:
      wait(pending)
    for channel in self._stages:
      channel.post(op="die", report=False)
    return True

  def checkpoint_state(self) -> dict[str, Any]:
    """Every stage's state and the tensors between stages (each stage takes those sent to it), with the
    controller's own books, for a checkpoint taken with nothing running."""
    n = next(self._tags)
    for j, channel in enumerate(self._stages):
      inbound = sorted([kind, mb] for stage, kind, mb in self._inbound if stage == j)
      channel.post(op="snapshot", n=n, inbound=inbound, report=False)
    stages = [receive_tree(self.node, self._mailbox, channel.process, f"s{self.vw}.{j}.{n}")
              for j, channel in enumerate(self._stages)]
    self._inbound.clear()  # the stages hold them now
    return {"stages": stages, "losses": dict(self._losses), "generation": self.generation,
            "records": dict(self.records)}

  def restore_checkpoint_state(self, state: dict[str, Any]) -> None:
    """Puts back what :meth:`checkpoint_state` returned (each stage restores before any later command)."""
    self._losses, self.generation, self.records = dict(state["losses"]), state["generation"], dict(state["records"])
    n = next(self._tags)
    for j, channel in enumerate(self._stages):
      channel.post(op="restore", n=n, report=False)
      send_tree(self.node, self._mailbox, channel.process, f"r{self.vw}.{j}.{n}", state["stages"][j])

  def stop(self) -> None:
    for channel in self._stages:
      channel.post(op="stop")


def merge_records(events: list[dict[str, Any]], numerics: Sequence[RemoteNumerics]) -> list[dict[str, Any]]:
  """The job's one trace: the engine's events in their causal order, each task event joined by identity
  (virtual worker, generation, stage, minibatch, kind) with what the process that ran it recorded:
  ``process`` and ``busy`` (seconds it worked on the task, on that process's own clock). A virtual
  worker's generation is how many times it left before the event. Changes ``events`` in place."""
  generation = [0] * len(numerics)
  for event in events:
    if event["ev"] == "leave":
      generation[event["vw"]] += 1
    elif event["ev"] in (FWD, "bwd"):
      event.update(numerics[event["vw"]].records[(generation[event["vw"]], event["ev"], event["stage"], event["mb"])])
  return events
