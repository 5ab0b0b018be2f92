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
import gc
import heapq
import itertools
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from hetpipe_jax.cluster import Cluster
from hetpipe_jax.core.comm import Done, StageId
from hetpipe_jax.core.engine import Engine
from hetpipe_jax.core.schedule import Task, successor
from hetpipe_jax.cost.profile import UnitProfile
from hetpipe_jax.errors import ProtocolError
from hetpipe_jax.plan.costmodel import CostModel
from hetpipe_jax.plan.layout import Layout
from hetpipe_jax.plan.placement import STRIPED
from hetpipe_jax.precision import byte_scale

EPS = 1e-12
SKIP = 1e-9  # a flow due this much later than now cannot land now (1,000 x EPS: rounding cannot bridge it)


POINT, STRIPE_OUT, STRIPE_IN = 0, 1, 2  # a flow between two nodes, or striped from / to every other node


@dataclasses.dataclass(eq=False)
class _Flow:
  done: Callable[[float], None]
  seq: int  # flows landing together are finished in the order they started
  kind: int  # POINT, STRIPE_OUT or STRIPE_IN
  ends: tuple[int, int]  # POINT: its two resources (the same one twice over PCIe); striped: its node's
  #                        egress (out) or ingress (in) resource, and the node's position
  load: tuple[Any, Any]  # (resources, subflows on each) while it moves: tuples, or arrays when striped
  slot: int = -1  # its row in the simulator's flow arrays


class Simulator:
  """Timers and flows on one clock.

  Flows in flight are rows of arrays (remaining bytes, rate, kind and ends; a free row holds inf bytes at
  rate 1), so advancing the clock and re-sharing the links cost a few array operations per event, however
  many flows are in flight. A *striped* flow (a push to, or a pull from, PS shards striped over all N nodes)
  is N - 1 equal subflows between its node and every other node, moving at the pace of the slowest: each
  subflow counts on its node's link and on the far node's, and the flow's rate is N - 1 times the smallest
  share among them (one row, not N - 1).
  """

  def __init__(self, cluster: Cluster, overlap_transfers: bool = False):
    self.cluster, self.overlap = cluster, overlap_transfers
    self._arrived: set[tuple] = set()  # overlap: inputs that landed, their tasks not started yet
    self.t = 0.0
    self._timers: list = []
    self._seq = itertools.count()
    self._flow_seq = itertools.count()
    nodes = sorted({g.node for g in cluster.gpus})
    self._resource = {}  # ("pcie" | "out" | "in", node) -> index
    capacity = []
    for node in nodes:
      for kind, link in (("pcie", cluster.intra_node), ("out", cluster.inter_node), ("in", cluster.inter_node)):
        self._resource[(kind, node)] = len(capacity)
        capacity.append(link.bytes_per_s)
    self._capacity = np.array(capacity)
    self._load = np.zeros(len(capacity), np.int64)  # subflows on each resource
    self._nodes = nodes
    self._out = np.array([self._resource[("out", n)] for n in nodes])  # by node position
    self._in = np.array([self._resource[("in", n)] for n in nodes])
    self._flows: dict[int, _Flow] = {}  # slot -> flow
    self._remaining = np.full(0, np.inf)
    self._rate = np.ones(0)
    self._kind = np.zeros(0, np.int8)
    self._ends = np.zeros((0, 2), np.int64)
    self._free: list[int] = []
    self._striped = 0  # striped flows in flight
    self._striped_shape: dict[tuple[int, bool], tuple] = {}  # (node, outbound) -> (ends, load)
    self._dirty = False  # the load changed since rates were last computed

  def at(self, t: float, fn: Callable[[float], None]) -> None:
    heapq.heappush(self._timers, (t, next(self._seq), fn))

  def send(self, src_node: int, dst_node: int, num_bytes: float, done: Done) -> None:
    """Moves ``num_bytes`` between nodes (or over a node's PCIe when equal); calls ``done(t)``."""
    if src_node == dst_node:
      link = self.cluster.intra_node
      resources = (self._resource[("pcie", src_node)],) * 2
    else:
      link = self.cluster.inter_node
      resources = (self._resource[("out", src_node)], self._resource[("in", dst_node)])
    flow = _Flow(done, next(self._flow_seq), POINT, resources, (tuple(set(resources)), (1,) * len(set(resources))))
    self.at(self.t + link.latency_s, lambda t: self._start_flow(num_bytes, flow))

  def send_striped(self, node: int, num_bytes: float, outbound: bool, done: Done) -> None:
    """Moves ``num_bytes`` from ``node`` spread evenly over every other node (``outbound``), or from every
    other node to ``node``; calls ``done(t)`` when the last byte lands."""
    key = (node, outbound)
    if key not in self._striped_shape:  # the same for every striped flow of this node and direction
      pos = self._nodes.index(node)
      others = [i for i in range(len(self._nodes)) if i != pos]
      if not others:
        raise ProtocolError(f"a striped transfer needs another node than node {node}")
      near, far = (self._out, self._in) if outbound else (self._in, self._out)
      load = (np.concatenate([[near[pos]], far[others]]), np.array([len(others)] + [1] * len(others)))
      self._striped_shape[key] = ((int(near[pos]), pos), load)
    ends, load = self._striped_shape[key]
    flow = _Flow(done, next(self._flow_seq), STRIPE_OUT if outbound else STRIPE_IN, ends, load)
    self.at(self.t + self.cluster.inter_node.latency_s, lambda t: self._start_flow(num_bytes, flow))

  def _start_flow(self, num_bytes: float, flow: _Flow) -> None:
    if not self._free:  # twice the rows
      n = len(self._remaining)
      grow = max(n, 64)
      self._remaining = np.concatenate([self._remaining, np.full(grow, np.inf)])
      self._rate = np.concatenate([self._rate, np.ones(grow)])
      self._ends = np.concatenate([self._ends, np.zeros((grow, 2), np.int64)])
      self._kind = np.concatenate([self._kind, np.zeros(grow, np.int8)])
      self._free = list(range(n + grow - 1, n - 1, -1))
    flow.slot = self._free.pop()
    self._remaining[flow.slot] = num_bytes
    self._ends[flow.slot] = flow.ends
    self._kind[flow.slot] = flow.kind
    self._flows[flow.slot] = flow
    if flow.kind == POINT:  # one or two resources: scalar updates cost less than an indexed one
      for r in flow.load[0]:
        self._load[r] += 1
    else:
      self._load[flow.load[0]] += flow.load[1]
    self._striped += flow.kind != POINT
    self._dirty = True

  def _rates(self) -> None:
    """Every flow's rate: the equal share of its most contended resource (a striped flow: N - 1 times the
    smallest share among its subflows' resources)."""
    share = self._capacity / np.maximum(self._load, 1)
    rate = np.minimum(share[self._ends[:, 0]], share[self._ends[:, 1]])
    if self._striped:
      for kind, far in ((STRIPE_OUT, self._in), (STRIPE_IN, self._out)):
        rows = np.flatnonzero(self._kind == kind)
        if not len(rows):
          continue
        far_share = share[far]
        lowest = np.argsort(far_share, kind="stable")[:2]  # the smallest far share, and the next one
        pos = self._ends[rows, 1]
        far_min = np.where(pos == lowest[0], far_share[lowest[-1]], far_share[lowest[0]])
        rate[rows] = (len(self._nodes) - 1) * np.minimum(share[self._ends[rows, 0]], far_min)
    self._rate = np.where(np.isinf(self._remaining), 1.0, rate)

  def run(self, engine: Engine, cost: CostModel, stop: Callable[[], bool] | None = None) -> float:
    """Runs ``engine`` to the end; returns the simulated seconds. ``stop``: asked after every event;
    once it says yes, no virtual worker injects another minibatch (:meth:`Engine.stop_injecting`).

    Python's cyclic garbage collector is paused meanwhile: the run allocates millions of small objects
    that live on (trace events) and creates no garbage cycles worth collecting early, and each full
    collection would scan them all again (half the host time at 1,024 GPUs)."""
    collecting = gc.isenabled()
    gc.disable()
    try:
      return self._run(engine, cost, stop)
    finally:
      if collecting:
        gc.enable()

  def _run(self, engine: Engine, cost: CostModel, stop: Callable[[], bool] | None) -> float:
    engine.begin(self.t)
    allow = self._input_test(engine, cost) if self.overlap else None
    while True:
      for task in engine.startable(allow):
        self._start_task(engine, cost, task)
      if self._dirty:
        self._rates()
        self._dirty = False
      t_flow = float((self.t + self._remaining / self._rate).min()) if self._flows else float("inf")
      t_timer = self._timers[0][0] if self._timers else float("inf")
      t_next = min(t_flow, t_timer)
      if t_next == float("inf"):
        break
      if self._flows:
        self._remaining -= self._rate * (t_next - self.t)
      self.t = t_next
      # a flow lands within EPS of its time; none can when the next one is more than SKIP away (most
      # events are a task's end): the same result without scanning the flows
      near = self._flows and t_flow - t_next <= SKIP
      slots: list[int] = np.flatnonzero(self._remaining <= self._rate * EPS).tolist() if near else []
      if slots:
        landed = sorted((self._flows.pop(slot) for slot in slots), key=lambda f: f.seq)
        for f in landed:
          self._remaining[f.slot], self._rate[f.slot], self._kind[f.slot] = np.inf, 1.0, POINT
          self._free.append(f.slot)
          if f.kind == POINT:
            for r in f.load[0]:
              self._load[r] -= 1
          else:
            self._load[f.load[0]] -= f.load[1]
          self._striped -= f.kind != POINT
        self._dirty = True
        for f in landed:
          f.done(self.t)
      while self._timers and self._timers[0][0] <= self.t:
        heapq.heappop(self._timers)[2](self.t)
      if stop is not None and stop():
        engine.stop_injecting()
        stop = None
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

  def _input_test(self, engine: Engine, cost: CostModel) -> Callable[[Task], bool]:
    """Overlap: a device starts only a task whose input is there (its other ready tasks may be). The
    test, as one function (it runs for every ready task at every event: no further calls inside)."""
    transfer, generation, arrived = cost.transfer, engine.generation, self._arrived

    def landed(task: Task) -> bool:
      vw, stage, kind = task.vw, task.stage, task.kind
      return transfer(vw, stage, kind) is None or (vw, generation(vw), stage, kind, task.mb) in arrived
    return landed

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
  """Push and pull transfers between each stage's GPU and the nodes of its units' PS shards (a striped
  shard: 1/N over its own node's PCIe, the rest as one striped flow over the network).

  A push carries the wave's summed update of the stage's units, a pull their global weights. In mixed
  precision (fp16/bf16) the update travels in 16 bits (the profile's fp32 bytes x
  :func:`~hetpipe_jax.precision.byte_scale`) and the pull in fp32: the PS holds the fp32 master weights,
  which the virtual worker's local optimizer keeps updating.

  Whole (default): a virtual worker's push leaves when its wave completes and its pull lands when every
  stage's part has; ``staged``: each stage's part moves on its own (:meth:`push_stage`,
  :meth:`push_staged`, :meth:`pull_staged`; the engine's side in :mod:`hetpipe_jax.core.engine`).
  """

  def __init__(self, sim: Simulator, profiles: Sequence[UnitProfile], layout: Layout,
               shard_nodes: Sequence[int], precision: str = "fp32", staged: bool = False):
    self.sim, self.staged = sim, staged
    self._push_scale = byte_scale(precision)
    num_nodes = len({g.node for g in sim.cluster.gpus})

    def routes(stages) -> list[tuple[int, int, float]]:  # (gpu node, shard node or STRIPED, bytes)
      per_pair: dict[tuple[int, int], float] = {}
      for _, gpu, units in stages:
        for u in units:
          num_bytes = profiles[u].param_bytes
          if shard_nodes[u] == STRIPED:
            per_pair[(gpu.node, gpu.node)] = per_pair.get((gpu.node, gpu.node), 0) + num_bytes / num_nodes
            if num_nodes > 1:
              key = (gpu.node, STRIPED)
              per_pair[key] = per_pair.get(key, 0) + num_bytes * (num_nodes - 1) / num_nodes
          else:
            key = (gpu.node, shard_nodes[u])
            per_pair[key] = per_pair.get(key, 0) + num_bytes
      return [(a, b, n) for (a, b), n in sorted(per_pair.items())]

    self._routes = [routes(vw.stages()) for vw in layout.vws]  # per VW
    self._stage_routes = [[routes([stage]) for stage in vw.stages()] for vw in layout.vws] if staged else []
    self._pushes: dict[Any, list] = {}  # staged: push key -> [stages not landed, last landing, done or None]

  def _transfer(self, vw: int, done: Done, to_ps: bool, routes: list | None = None) -> None:
    scale = self._push_scale if to_ps else 1.0
    routes = self._routes[vw] if routes is None else routes
    if not routes:
      done(self.sim.t)
      return
    pending = {"n": len(routes)}

    def one_landed(t: float) -> None:
      pending["n"] -= 1
      if pending["n"] == 0:
        done(t)

    for gpu_node, shard_node, num_bytes in routes:
      if shard_node == STRIPED:
        self.sim.send_striped(gpu_node, num_bytes * scale, to_ps, one_landed)
        continue
      src, dst = (gpu_node, shard_node) if to_ps else (shard_node, gpu_node)
      self.sim.send(src, dst, int(num_bytes * scale), one_landed)

  def push(self, vw: int, wave: int, t: float, done: Done) -> None:
    del wave, t
    self._transfer(vw, done, to_ps=True)

  def pull(self, vw: int, t: float, done: Done) -> None:
    del t
    self._transfer(vw, done, to_ps=False)

  # staged (``staged=True``, see :mod:`hetpipe_jax.core.engine`): each stage's part moves on its own

  def push_stage(self, key: Any, vw: int, stage: int, t: float) -> None:
    """Stage ``stage``'s part of push ``key`` (a wave of ``vw``) is final at ``t``: it leaves now."""
    del t
    entry = self._pushes.setdefault(key, [len(self._stage_routes[vw]), 0.0, None])

    def landed(t_landed: float) -> None:
      entry[0] -= 1
      entry[1] = max(entry[1], t_landed)
      if entry[0] == 0 and entry[2] is not None:
        del self._pushes[key]
        entry[2](entry[1])
    self._transfer(vw, landed, True, self._stage_routes[vw][stage])

  def push_staged(self, key: Any, t: float, done: Done) -> None:
    """Push ``key`` is complete (every stage's part has left): ``done(t_landed)`` once every part landed."""
    entry = self._pushes[key]
    if entry[0] == 0:
      del self._pushes[key]
      done(max(entry[1], t))
    else:
      entry[2] = done

  def pull_staged(self, vw: int, t: float, done: Callable[[int, float], None]) -> None:
    """Brings the global weights to ``vw``'s stages, each part on its own: ``done(stage, t_arrived)``."""
    del t
    for stage, routes in enumerate(self._stage_routes[vw]):
      self._transfer(vw, lambda t_done, stage=stage: done(stage, t_done), False, routes)

  def move(self, x: Any, src: StageId, dst: StageId) -> Any:
    """Nothing to move without numerics: stage-to-stage transfers are timed by :meth:`Simulator.run`."""
    del src, dst
    return x
