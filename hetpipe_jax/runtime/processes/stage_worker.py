"""One stage of a virtual worker in a ``multiprocess`` run (:mod:`hetpipe_jax.runtime.processes`): the
thread that executes its channel's commands (:data:`hetpipe_jax.runtime.transport.protocol.STAGE_OPS`) on its local
device, in order."""

from __future__ import annotations

import os
import signal
import threading
import time
from typing import Any

import jax

from hetpipe_jax.core.schedule import FWD
from hetpipe_jax.data import MinibatchStreams
from hetpipe_jax.errors import ProtocolError
from hetpipe_jax.runtime.numerics.ps import nonfinite_units
from hetpipe_jax.runtime.numerics.stage import Stage
from hetpipe_jax.runtime.processes.channels import Wiring, command_loop
from hetpipe_jax.runtime.transport import protocol
from hetpipe_jax.runtime.transport.mailbox import (
  collect,
  deliver,
  receive_tree,
  send_tree,
  unflatten_units,
  update_arrays,
)
from hetpipe_jax.runtime.transport.node import PeerGone

INPUTS = {"a": "activation", "g": "gradient"}  # a stage's input kinds (by their letter) -> message kinds

class StageWorker:
  """Executes the commands of one stage of one virtual worker in this process, in order.

  A forward or backward that raises reports the error (its virtual worker then fails and leaves; this
  process goes on); any other failure ends the process. Activation and gradient tags carry the virtual
  worker's generation (bumped when it fails), so a replacement never takes a tensor of the failed one.

  Args:
    wiring: this process's node and mailbox, where every stage and shard runs.
    vw, stage: which stage.
    stage_obj: the stage (on a local device).
    nm: the virtual worker's Nm.
    streams: the minibatch source (every process draws the same minibatches from the same seed).
    inputs: the (shape, dtype) of each array of what this stage receives: ``"a"``, the activation from the
      previous stage (none for stage 0), ``"g"``, the gradient of its output from the next (none for the
      last stage; in fp16 with the scale it is at).
      Activations and gradients between processes go without a notice (:meth:`Node.send_direct`): the
      receiver knows their shapes, and the Nm window bounds how many are in flight, so the sender holds
      its last Nm + 1 offers per stream.
  """

  def __init__(self, wiring: Wiring, vw: int, stage: int, stage_obj: Stage, nm: int, streams: MinibatchStreams,
               inputs: dict[str, list[tuple[Any, Any]]]):
    node, owners, shard_owners, mailbox = wiring
    self.node, self.vw, self.j, self.stage, self.nm = node, vw, stage, stage_obj, nm
    self._owners, self._shards, self._streams, self._mailbox = owners, shard_owners, streams, mailbox
    self._inputs = inputs
    self._treedefs = [jax.tree.structure(p) for p in stage_obj.params]  # one per unit
    self._gen = 0  # the virtual worker's generation: bumped when it fails
    self._held: dict[tuple[str, int], Any] = {}  # (kind, mb) -> an input taken for a checkpoint, not used yet
    handle = protocol.dispatcher(protocol.STAGE_OPS, {
                FWD: lambda c: self._task(self._forward, c["mb"]),
                "bwd": lambda c: self._task(self._backward, c["mb"]),
                "take": lambda c: self._take(c["wave"], c["check"]),
                "rebase": lambda c: self._rebase(c["n"], c["expect"]),
                "drop": lambda c: self._drop(), "restart": lambda c: self._restart(c["n"]),
                "snapshot": self._snapshot, "restore": lambda c: self._restore(c["n"]),
                "die": lambda c: os.kill(os.getpid(), signal.SIGKILL)})  # an injected crash
    self.thread = threading.Thread(target=command_loop, args=(node, f"{vw}.{stage}", handle, f"VW {vw} stage {stage}"),
                                   name=f"vw{vw}-stage{stage}", daemon=True)

  def _by_owner(self) -> dict[int, list[int]]:
    """The shard owner of each of this stage's units: owner process -> units, in unit order."""
    out: dict[int, list[int]] = {}
    for unit in range(self.stage.first, self.stage.last):
      out.setdefault(self._shards[unit], []).append(unit)
    return out

  def _tag(self, kind: str, stage: int, mb: int) -> str:
    return protocol.tag(INPUTS[kind], vw=self.vw, gen=self._gen, stage=stage, mb=mb)

  def _send(self, stage: int, kind: str, mb: int, arrays: list[Any]) -> None:
    """Sends activation (kind "a") or gradient ("g") of ``mb`` to ``stage`` of this virtual worker."""
    deliver(self.node, self._mailbox, self._owners[(self.vw, stage)], self._tag(kind, stage, mb),
            self.stage.on_lead(arrays), stream=f"{kind}{self.vw}.{stage}", hold=self.nm + 1)

  def _receive(self, stage: int, kind: str, mb: int) -> Any:
    if (kind, mb) in self._held:  # taken for a checkpoint
      return jax.device_put(self._held.pop((kind, mb)), self.stage.device)
    arrays = collect(self.node, self._mailbox, self._owners[(self.vw, stage)], self._tag(kind, self.j, mb),
                     specs=self._inputs[kind])
    return jax.device_put(arrays[0] if kind == "a" else self.stage.gradient_from(arrays), self.stage.device)

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
    self._send(self.j + 1, "a", mb, [out])
    jax.block_until_ready(out)
    return {}

  def _backward(self, mb: int) -> dict:
    g = None if self.stage.is_last else self._receive(self.j + 1, "g", mb)
    gx = self.stage.backward(mb, g)
    if self.j > 0:
      self._send(self.j - 1, "g", mb, self.stage.gradient_arrays(gx))
    jax.block_until_ready(self.stage.params)
    return {}

  def _take(self, wave: int, check: bool) -> dict:
    """Closes ``wave``: sends each unit's summed update to the process that owns its shard, with which of
    those units' updates are not finite (checked here, so that the owner applies in one pass); reports them
    (with ``check``) and how many of the wave's updates fp16 skipped here."""
    stage = self.stage
    update = stage.take_wave(wave)
    bad, skipped = {stage.first + u for u in nonfinite_units(update)}, stage.take_skipped(wave)
    update = stage.on_lead(update)  # (a split stage's update gathered: an owner keeps whole units)
    for owner, units in self._by_owner().items():
      deliver(self.node, self._mailbox, owner, protocol.tag("update", vw=self.vw, stage=self.j, wave=wave),
              update_arrays(update, stage.first, units, bad, skipped, stage.lead))
    return {"nonfinite": sorted(bad) if check else [], "skipped": skipped}

  def _pull(self, n: int) -> tuple[Any, ...]:
    """Pull ``n``: the global weights of this stage's units, from their owners."""
    params: dict[int, Any] = {}
    for owner, units in self._by_owner().items():
      leaves = collect(self.node, self._mailbox, owner, protocol.tag("pull", vw=self.vw, stage=self.j, n=n))
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
    send_tree(self.node, self._mailbox, 0, protocol.tag("stage_state", vw=self.vw, stage=self.j, n=cmd["n"]),
              self.stage.on_lead({"stage": self.stage.checkpoint_state(), "held": dict(self._held),
                                  "gen": self._gen}))
    return {}

  def _restore(self, n: int) -> dict:
    """A resumed run: the state process 0 sends (what :meth:`_snapshot` sent)."""
    state = receive_tree(self.node, self._mailbox, 0, protocol.tag("stage_restore", vw=self.vw, stage=self.j, n=n))
    self.stage.restore_checkpoint_state(state["stage"])
    self._held, self._gen = dict(state["held"]), state["gen"]
    return {}
