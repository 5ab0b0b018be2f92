"""Process 0's side of the virtual workers of a ``multiprocess`` run (:mod:`hetpipe_jax.runtime.processes`):
the engine's numerics adapter that turns its tasks into commands for the stages' processes
(:class:`RemoteNumerics`), where every stage runs (:func:`process_of`), and the one trace joined with every
process's records of its tasks (:func:`merge_records`)."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

import numpy as np

from hetpipe_jax.core.schedule import FWD, Task, successor
from hetpipe_jax.plan.layout import Layout
from hetpipe_jax.runtime.processes.channels import Channel, Pending, Wiring, wait
from hetpipe_jax.runtime.transport import protocol
from hetpipe_jax.runtime.transport.mailbox import receive_tree, send_tree


def process_of(layout: Layout, nodes: Sequence[int]) -> dict[tuple[int, int], int]:
  """(virtual worker, stage) -> the process of the node that holds its GPU (process i = ``nodes[i]``)."""
  index = {node: i for i, node in enumerate(nodes)}
  return {(i, j): index[gpu.node] for i, vw in enumerate(layout.vws) for j, gpu in enumerate(vw.gpus)}


class RemoteNumerics:
  """The engine's numerics adapter for one virtual worker whose stages run in node processes.

  Args:
    wiring: process 0's node and mailbox, where every stage and shard runs.
    vw: the virtual worker.
    cuts: its unit boundaries.
    nm: its Nm.
    channels: process -> its PS command channel (shared with :class:`ShardedServer`).
    check_finite: the stages report the units whose wave update is not finite (for
      ``on_nonfinite="skip"``: then closing a wave waits for their reports).
    scaled: the stages train in fp16 (dynamic loss scaling): closing a wave waits for their reports of how
      many of its updates they skipped.
  """

  def __init__(self, wiring: Wiring, vw: int, cuts: Sequence[int], nm: int, channels: dict[int, Channel], *,
               check_finite: bool = False, scaled: bool = False):
    node, owners, shard_owners, mailbox = wiring
    self.node, self.vw, self.cuts, self.nm, self._check, self._scaled = node, vw, list(cuts), nm, check_finite, scaled
    self._skipped: dict[int, int] = {}  # fp16: wave -> how many of its updates the stages skipped, until read
    self.k = len(cuts) - 1
    self._stages = [Channel(node, f"{vw}.{j}", owners[(vw, j)], f"VW {vw} stage {j}", protocol.STAGE_OPS)
                    for j in range(self.k)]
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
    reports, as it does in fp16 for their skipped counts) and the wave's losses (every forward of the wave
    has been reported)."""
    report = self._check or self._scaled
    posted = [channel.post(op="take", wave=wave, check=self._check, report=report) for channel in self._stages]
    reports = [wait(pending) for pending in posted] if report else []
    bad = sorted(u for r in reports for u in r["nonfinite"])
    if self._scaled:
      self._skipped[wave] = sum(r["skipped"] for r in reports)
    first = wave * self.nm + 1
    return dict.fromkeys(bad), [self._losses.pop(mb) for mb in range(first, first + self.nm)]

  def take_skipped(self, wave: int) -> int:
    """How many of the pushed wave's minibatch updates fp16 skipped, summed over the stages (0 in bf16 and
    fp32)."""
    return self._skipped.pop(wave, 0)

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
    stages = [receive_tree(self.node, self._mailbox, channel.process,
                           protocol.tag("stage_state", vw=self.vw, stage=j, n=n))
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
      send_tree(self.node, self._mailbox, channel.process, protocol.tag("stage_restore", vw=self.vw, stage=j, n=n),
                state["stages"][j])

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
