"""The ``multiprocess`` executor: one process per node, one engine.

Process i holds node i's GPUs (emulated by its CPU devices) and runs the stages placed on them: one
thread per local stage executes that stage's commands in order (a forward, a backward, closing a wave,
a rebase), jitted per device as in one process. Activations and gradients go straight from the process of
one stage to the process of the next through the transport (:mod:`hetpipe_jax.runtime.distributed`);
inside a process they stay local.

Process 0 is also the controller: it runs the single-process :class:`~hetpipe_jax.core.engine.Engine`
(the schedule, the WSP clock, gate, push and pull, the trace: not a second copy) on the ``wall``
executor, whose device threads wait for each task's process to report it done. Its numerics adapter,
:class:`RemoteNumerics`, turns "start this task" into a command for the stage's process; closing a wave
gathers each stage's summed update in process 0, where the parameter server applies it on the host CPU;
a pull sends each stage its units' global weights and the stage reports how many local updates it
added back. Control goes through the coordination service's key-value store
(``cmd/<vw>.<stage>/<seq>`` -> ``done/<vw>.<stage>/<seq>``).

The trace is the controller's: every event is written by the one engine, in the order it happened
there, which is causal by construction (a task is started only after the reports it depends on arrived;
a push is applied before any pull that sees it). Its times are process 0's wall clock.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

from hetpipe_jax.core.schedule import FWD, Task
from hetpipe_jax.data import MinibatchStreams
from hetpipe_jax.errors import ProtocolError
from hetpipe_jax.plan.layout import Layout
from hetpipe_jax.runtime.distributed import Node
from hetpipe_jax.runtime.stage import Stage

TIMEOUT_S = 600.0  # a command or report that takes longer means a lost process


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
               owners: dict[tuple[int, int], int], streams: MinibatchStreams, mailbox: Mailbox):
    self.node, self.vw, self.j, self.stage, self.nm = node, vw, stage, stage_obj, nm
    self._owners, self._streams, self._mailbox = owners, streams, mailbox
    self._losses: dict[int, Any] = {}
    self.thread = threading.Thread(target=self._loop, name=f"vw{vw}-stage{stage}", daemon=True)

  def _send(self, stage: int, kind: str, mb: int, x: Any) -> None:
    """Sends activation (kind "a") or gradient ("g") of ``mb`` to ``stage`` of this virtual worker."""
    key, dst = f"{kind}{self.vw}.{stage}.{mb}", self._owners[(self.vw, stage)]
    if dst == self.node.process:
      self._mailbox.put(key, x)
    else:
      self.node.send(dst, key, [x])

  def _receive(self, stage: int, kind: str, mb: int) -> Any:
    key, src = f"{kind}{self.vw}.{self.j}.{mb}", self._owners[(self.vw, stage)]
    if src == self.node.process:
      x = self._mailbox.take(key, TIMEOUT_S)
    else:
      (x,) = self.node.recv(src, key, TIMEOUT_S)
    return jax.device_put(x, self.stage.device)

  def _forward(self, mb: int) -> dict:
    stage = self.stage
    if self.j == 0:
      x = jax.device_put(self._streams(self.vw, mb)[0], stage.device)
    else:
      x = self._receive(self.j - 1, "a", mb)
    labels = jax.device_put(self._streams(self.vw, mb)[1], stage.device) if stage.is_last else None
    out = stage.forward(mb, x, labels)
    if stage.is_last:
      self._losses[mb] = out
    else:
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
    update = jax.tree.leaves(self.stage.take_wave(wave))
    key = f"u{self.vw}.{self.j}.{wave}"
    if self.node.process == 0:
      self._mailbox.put(key, update)
    else:
      self.node.send(0, key, update)
    first = wave * self.nm + 1
    losses = [float(self._losses.pop(p)) for p in range(first, first + self.nm)] if self.stage.is_last else []
    return {"losses": losses}

  def _rebase(self, n: int, treedef: Any) -> dict:
    key = f"p{self.vw}.{self.j}.{n}"
    leaves = self._mailbox.take(key, TIMEOUT_S) if self.node.process == 0 else self.node.recv(0, key, TIMEOUT_S)
    return {"added": self.stage.rebase(jax.tree.unflatten(treedef, leaves))}

  def _loop(self) -> None:
    treedef = jax.tree.structure(self.stage.params)
    seq = 0
    try:
      while True:
        cmd = json.loads(self.node.get(f"cmd/{self.vw}.{self.j}/{seq}", TIMEOUT_S))
        op = cmd["op"]
        if op == "stop":
          return
        if op == FWD:
          reply = self._forward(cmd["mb"])
        elif op == "bwd":
          reply = self._backward(cmd["mb"])
        elif op == "take":
          reply = self._take(cmd["wave"])
        elif op == "rebase":
          reply = self._rebase(cmd["n"], treedef)
        else:
          raise ProtocolError(f"unknown command {cmd}")
        self.node.put(f"done/{self.vw}.{self.j}/{seq}", json.dumps(reply))
        seq += 1
    except BaseException as e:  # any failure ends this process at once; the others follow
      self.node.abort(f"VW {self.vw} stage {self.j}: {type(e).__name__}: {e}")


class RemoteNumerics:
  """The engine's numerics adapter for one virtual worker whose stages run in node processes.

  Args:
    node: process 0's node.
    vw: the virtual worker.
    k: its stage count.
    cuts: its unit boundaries.
    nm: its Nm.
    mailbox: tensors between process 0's own stages and the controller.
    unit_treedefs: the parameter tree structure of every unit (to rebuild pushed updates).
  """

  def __init__(self, node: Node, vw: int, k: int, cuts: Sequence[int], nm: int,
               owners: dict[tuple[int, int], int], mailbox: Mailbox, unit_treedefs: Sequence[Any]):
    self.node, self.vw, self.k, self.cuts, self.nm = node, vw, k, list(cuts), nm
    self._owners, self._mailbox, self._treedefs = owners, mailbox, unit_treedefs
    self._seq = [0] * k
    self._rebases = 0

  @property
  def stages(self) -> Sequence[Any]:
    return ()  # they live in the node processes

  def _command(self, j: int, **cmd) -> str:
    """Posts a command to stage ``j``; returns the key its report will have."""
    seq = self._seq[j]
    self._seq[j] += 1
    self.node.put(f"cmd/{self.vw}.{j}/{seq}", json.dumps(cmd))
    return f"done/{self.vw}.{j}/{seq}"

  def wait(self, key: str) -> dict:
    """The report of a command (blocks until its stage's process posts it)."""
    return json.loads(self.node.get(key, TIMEOUT_S))

  def inject(self, mb: int, x: Any, labels: Any) -> None:
    del mb, x, labels  # stage 0's process draws minibatch mb itself (same seed, same streams)

  def run(self, task: Task) -> str:
    return self._command(task.stage, op=task.kind, mb=task.mb)

  def take_wave(self, wave: int) -> tuple[dict[int, Any], list[Any]]:
    keys = [self._command(j, op="take", wave=wave) for j in range(self.k)]
    updates: dict[int, Any] = {}
    losses: list[Any] = []
    for j, key in enumerate(keys):
      tag = f"u{self.vw}.{j}.{wave}"
      src = self._owners[(self.vw, j)]
      leaves = self._mailbox.take(tag, TIMEOUT_S) if src == 0 else self.node.recv(src, tag, TIMEOUT_S)
      for unit in range(self.cuts[j], self.cuts[j + 1]):
        count = self._treedefs[unit].num_leaves
        updates[unit] = jax.tree.unflatten(self._treedefs[unit], leaves[:count])
        leaves = leaves[count:]
      losses += [np.float32(x) for x in self.wait(key)["losses"]]
    return updates, losses

  def rebase(self, params: Sequence[Any] | None, open_updates: Sequence[int]) -> list[int]:
    del open_updates  # the stages count what they really add back
    if params is None:
      raise ProtocolError(f"VW {self.vw} pulled from a server without weights")
    n = self._rebases
    self._rebases += 1
    keys = []
    for j in range(self.k):
      leaves = jax.tree.leaves(tuple(params[self.cuts[j]:self.cuts[j + 1]]))
      tag = f"p{self.vw}.{j}.{n}"
      if self._owners[(self.vw, j)] == 0:
        self._mailbox.put(tag, leaves)
      else:
        self.node.send(self._owners[(self.vw, j)], tag, leaves)
      keys.append(self._command(j, op="rebase", n=n))
    return [self.wait(key)["added"] for key in keys]

  def stop(self) -> None:
    for j in range(self.k):
      self._command(j, op="stop")


