"""The ``sim`` executor: the engine's schedule and WSP protocol on a cost model, without numerics.

Same :class:`~hetpipe_jax.engine.Engine` as the other executors (virtual workers without stages, a
clock-only parameter server), on a discrete-event clock where

* a task first receives its input (the activation from the previous stage, or the gradient from the next)
  as a *flow* over the links between the two GPUs, then computes for its roofline time (with
  ``overlap_transfers``: the input leaves as soon as it is produced and travels while the receiving device
  works on other tasks, as a GPU's copy engines allow; a device starts, among its ready tasks, the first
  by its schedule whose input has landed);
* a push sends every stage's summed update of each unit to the node of that unit's PS shard, a pull
  brings them back; the push is applied (the clock ticks) when its last flow lands;
* links are shared resources: a node's PCIe (inside a node) and each node's network egress and ingress
  (between nodes). Concurrent flows share a resource equally; a flow moves at the rate of its most
  contended resource (a fluid model), after the link's latency. Rates are recomputed whenever a flow
  starts or ends.

The engine (:mod:`hetpipe_jax.core.engine`) drives the schedule and the WSP protocol on this clock;
:mod:`hetpipe_jax.sim.simulate` puts them together.
"""

from __future__ import annotations

import dataclasses
import heapq
import itertools
from collections.abc import Callable, Sequence
from typing import Any

from hetpipe_jax.cluster import Cluster
from hetpipe_jax.core.comm import Done, StageId
from hetpipe_jax.core.engine import Engine
from hetpipe_jax.core.schedule import Task, successor
from hetpipe_jax.cost.profile import UnitProfile
from hetpipe_jax.errors import ProtocolError
from hetpipe_jax.plan.costmodel import CostModel
from hetpipe_jax.plan.layout import Layout
from hetpipe_jax.precision import byte_scale

EPS = 1e-12


@dataclasses.dataclass(eq=False)
class _Flow:
  remaining: float  # bytes
  resources: tuple
  done: Callable[[float], None]
  rate: float = 0.0


class Simulator:
  """Timers and flows on one clock."""

  def __init__(self, cluster: Cluster, overlap_transfers: bool = False):
    self.cluster, self.overlap = cluster, overlap_transfers
    self._arrived: set[tuple] = set()  # overlap: inputs that landed, their tasks not started yet
    self.t = 0.0
    self._timers: list = []
    self._seq = itertools.count()
    self._flows: list[_Flow] = []
    self._capacity: dict[tuple, float] = {}
    for node in {g.node for g in cluster.gpus}:
      self._capacity[("pcie", node)] = cluster.intra_node.bytes_per_s
      self._capacity[("out", node)] = cluster.inter_node.bytes_per_s
      self._capacity[("in", node)] = cluster.inter_node.bytes_per_s
    self._on: dict[tuple, set[_Flow]] = {r: set() for r in self._capacity}  # flows on each resource
    self._dirty: set[tuple] = set()  # resources whose load changed since rates were last computed

  def at(self, t: float, fn: Callable[[float], None]) -> None:
    heapq.heappush(self._timers, (t, next(self._seq), fn))

  def send(self, src_node: int, dst_node: int, num_bytes: float, done: Done) -> None:
    """Moves ``num_bytes`` between nodes (or over a node's PCIe when equal); calls ``done(t)``."""
    if src_node == dst_node:
      link, resources = self.cluster.intra_node, (("pcie", src_node),)
    else:
      link, resources = self.cluster.inter_node, (("out", src_node), ("in", dst_node))
    self.at(self.t + link.latency_s, lambda t: self._start_flow(_Flow(num_bytes, resources, done)))

  def _start_flow(self, flow: _Flow) -> None:
    self._flows.append(flow)
    for r in flow.resources:
      self._on[r].add(flow)
    self._dirty.update(flow.resources)

  def _rates(self, resources) -> None:
    """Recomputes the rates of the flows that share any of ``resources`` (their load changed)."""
    for f in {f for r in resources for f in self._on[r]}:
      f.rate = min(self._capacity[r] / len(self._on[r]) for r in f.resources)

  def run(self, engine: Engine, cost: CostModel) -> float:
    """Runs ``engine`` to the end; returns the simulated seconds."""
    engine.begin(self.t)
    while True:
      allow = (lambda task: self._input_landed(engine, cost, task)) if self.overlap else None
      for task in engine.startable(allow):
        self._start_task(engine, cost, task)
      if self._dirty:
        self._rates(self._dirty)
        self._dirty = set()
      t_flow = min((self.t + f.remaining / f.rate for f in self._flows), default=float("inf"))
      t_timer = self._timers[0][0] if self._timers else float("inf")
      t_next = min(t_flow, t_timer)
      if t_next == float("inf"):
        break
      for f in self._flows:
        f.remaining -= f.rate * (t_next - self.t)
      self.t = t_next
      landed = [f for f in self._flows if f.remaining <= f.rate * EPS]
      if landed:
        self._flows = [f for f in self._flows if f.remaining > f.rate * EPS]
        for f in landed:
          for r in f.resources:
            self._on[r].discard(f)
          self._dirty.update(f.resources)
        for f in landed:
          f.done(self.t)
      while self._timers and self._timers[0][0] <= self.t:
        heapq.heappop(self._timers)[2](self.t)
    if not engine.done:
      raise ProtocolError("sim executor stalled before every minibatch completed (a schedule bug)")
    return self.t

  def _start_task(self, engine: Engine, cost: CostModel, task: Task) -> None:
    engine.start(task, self.t)
    compute = cost.compute_seconds(task.vw, task.stage, task.kind)
    finish = lambda t: self._finish(engine, cost, task, t)
    transfer = cost.transfer(task.vw, task.stage, task.kind)
    if transfer is None:
      self.at(self.t + compute, finish)
    elif not self.overlap:  # the device receives its input, then computes
      num_bytes, src, dst = transfer
      self.send(src.node, dst.node, num_bytes, lambda t: self.at(t + compute, finish))
    else:  # its input was sent when it was produced, and has landed (``_landed``)
      self._arrived.discard(self._key(engine, task.vw, task.stage, task.kind, task.mb))
      self.at(self.t + compute, finish)

  @staticmethod
  def _key(engine: Engine, vw: int, stage: int, kind: str, mb: int) -> tuple:
    return vw, engine.generation(vw), stage, kind, mb

  def _input_landed(self, engine: Engine, cost: CostModel, task: Task) -> bool:
    """Overlap: a device starts only a task whose input is there (its other ready tasks may be)."""
    return (cost.transfer(task.vw, task.stage, task.kind) is None
            or self._key(engine, task.vw, task.stage, task.kind, task.mb) in self._arrived)

  def _finish(self, engine: Engine, cost: CostModel, task: Task, t: float) -> None:
    """The task is done; with ``overlap``, its output leaves for the next stage at once, travelling while
    that stage's device works on something else."""
    engine.finish(task, t)
    if not self.overlap:
      return
    nxt = successor(task, engine.vws[task.vw].k)
    if nxt is None or nxt[0] == task.stage:  # completed, or the last stage turning round: nothing travels
      return
    stage, kind = nxt
    transfer = cost.transfer(task.vw, stage, kind)
    if transfer is None:
      return
    num_bytes, src, dst = transfer
    key = self._key(engine, task.vw, stage, kind, task.mb)

    def landed(t_landed: float) -> None:
      del t_landed
      self._arrived.add(key)
      engine.wake(task.vw, stage)

    self.send(src.node, dst.node, num_bytes, landed)


class SimComm:
  """Push and pull transfers between each stage's GPU and the nodes of its units' PS shards.

  A push carries the wave's summed update of the stage's units, a pull their global weights. In mixed
  precision (fp16/bf16) the update travels in 16 bits (the profile's fp32 bytes x
  :func:`~hetpipe_jax.precision.byte_scale`) and the pull in fp32: the PS holds the fp32 master weights,
  which the virtual worker's local optimizer keeps updating.
  """

  def __init__(self, sim: Simulator, profiles: Sequence[UnitProfile], layout: Layout,
               shard_nodes: Sequence[int], precision: str = "fp32"):
    self.sim = sim
    self._push_scale = byte_scale(precision)
    self._routes: list[list[tuple[int, int, int]]] = []  # per VW: (gpu node, shard node, bytes)
    for vw in layout.vws:
      per_pair: dict[tuple[int, int], int] = {}
      for _, gpu, units in vw.stages():
        for u in units:
          key = (gpu.node, shard_nodes[u])
          per_pair[key] = per_pair.get(key, 0) + profiles[u].param_bytes
      self._routes.append([(a, b, n) for (a, b), n in sorted(per_pair.items())])

  def _transfer(self, vw: int, done: Done, to_ps: bool) -> None:
    scale = self._push_scale if to_ps else 1.0
    routes = self._routes[vw]
    if not routes:
      done(self.sim.t)
      return
    pending = {"n": len(routes)}

    def one_landed(t: float) -> None:
      pending["n"] -= 1
      if pending["n"] == 0:
        done(t)

    for gpu_node, shard_node, num_bytes in routes:
      src, dst = (gpu_node, shard_node) if to_ps else (shard_node, gpu_node)
      self.sim.send(src, dst, int(num_bytes * scale), one_landed)

  def push(self, vw: int, wave: int, t: float, done: Done) -> None:
    del wave, t
    self._transfer(vw, done, to_ps=True)

  def pull(self, vw: int, t: float, done: Done) -> None:
    del t
    self._transfer(vw, done, to_ps=False)

  def move(self, x: Any, src: StageId, dst: StageId) -> Any:
    """Nothing to move without numerics: stage-to-stage transfers are timed by :meth:`Simulator.run`."""
    del src, dst
    return x
