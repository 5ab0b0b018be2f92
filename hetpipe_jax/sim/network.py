"""The ``sim`` executor: the engine's schedule and WSP protocol on a cost model, without numerics.

Same :class:`~hetpipe_jax.core.engine.Engine` as the other executors (virtual workers without stages, a
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
  contended resource (a fluid model), after the link's latency. Rates are recomputed where a flow started or
  ended: for the flows that cross a resource whose load changed (every flow when a link's bandwidth or a
  striped flow's far ends changed), the same doubles as re-sharing every flow.

The engine (:mod:`hetpipe_jax.core.engine`) drives the schedule and the WSP protocol on this clock;
:mod:`hetpipe_jax.sim.simulate` puts them together.
"""

from __future__ import annotations

import dataclasses
import functools
import gc
import heapq
import itertools
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from hetpipe_jax.cluster import Cluster
from hetpipe_jax.core.comm import Done, StageId
from hetpipe_jax.core.engine import Engine
from hetpipe_jax.core.schedule import FWD, Task, successor
from hetpipe_jax.cost.profile import UnitProfile
from hetpipe_jax.errors import ProtocolError
from hetpipe_jax.plan.costmodel import CostModel
from hetpipe_jax.plan.layout import Layout
from hetpipe_jax.plan.placement import STRIPED
from hetpipe_jax.precision import byte_scale
from hetpipe_jax.sim.noise import Realisation

EPS = 1e-12
SKIP = 1e-9  # a flow due this much later than now cannot land now (1,000 x EPS: rounding cannot bridge it)


POINT, STRIPE_OUT, STRIPE_IN = 0, 1, 2  # a flow between two nodes, or striped from / to every other node
ARRAYS_FROM, SCALARS_BELOW = 48, 16  # flows in flight: held as array rows from this many, as objects below that
LOCAL_FROM = 512  # rows in flight from which a re-share looks for the rows it changes (fewer: all cost less)
Receive = tuple[float, int, int]  # what a task receives before it computes: (bytes, from node, to node)
Onward = tuple[int, str, float, int, int]  # where a task's output goes: (stage, kind, bytes, from node, to node)
Reduce = tuple[float, int]  # a split stage's all-reduces after its compute: (bytes on its node's link, the node)
TaskCosts = tuple[float, "Receive | None", "Onward | None", "Reduce | None"]  # (compute seconds, ...)


# A striped flow's far ends, shared by every striped flow of one direction: every node's far resource (as a tuple and
# as an array), and the one of the flow's own node, which it does not cross (memory O(nodes), not O(nodes^2)).
Far = tuple[tuple[int, ...], np.ndarray, int]


def _charge_far(load: list[int], far: Far, sign: int) -> None:
  """Adds (``sign`` 1) or takes away (-1) a striped flow's subflow on each far end of ``far`` to ``load`` (flows as
  objects; as rows: :meth:`_ArrayFlows._charge_far`)."""
  every, _, own = far
  for r in every:
    load[r] += sign
  load[own] -= sign


@dataclasses.dataclass(eq=False, slots=True)
class _Flow:
  done: Callable[[float], None] | None  # called when it lands; None: a task's input (``arrival``) landed
  seq: int  # flows landing together are finished in the order they started
  kind: int  # POINT, STRIPE_OUT or STRIPE_IN
  ends: tuple[int, int]  # POINT: its two resources (the same one twice over PCIe); striped: its node's
  #                        egress (out) or ingress (in) resource, and the node's position
  resources: tuple[int, ...]  # the resources its subflows cross while it moves ...
  counts: tuple[int, ...]  # ... and how many subflows cross each (a striped flow: its own node's end only) ...
  far: Far | None = None  # ... and a striped flow's far ends: one subflow on each other node's
  remaining: float = 0.0  # bytes left (before it starts: to move), and the rate (bytes/s) while held as an object
  rate: float = 1.0  # (_ScalarFlows)
  slot: int = -1  # its row while held in the arrays (_ArrayFlows)
  arrival: tuple[int, int, int, str, int] | None = None  # overlap: the task whose input it is (Simulator._finish)


Timer = Callable[[float], None] | Task | _Flow  # what :class:`_Timers` runs


@dataclasses.dataclass(frozen=True)
class _Links:
  """The shared resources: their capacities (bytes/s, by index) and, by node position, each node's egress
  and ingress resource."""

  capacity: tuple[float, ...]
  out: tuple[int, ...]
  in_: tuple[int, ...]


class _ScalarFlows:
  """Flows in flight as objects (``remaining`` and ``rate`` on each): O(flows) Python work per event, the
  cheapest while few are in flight. The same arithmetic as :class:`_ArrayFlows`, operation for operation
  (IEEE doubles either way), so the two give the same results bit for bit."""

  def __init__(self, links: _Links, flows: Sequence[_Flow] = (), load: Sequence[int] | None = None):
    self._links = links
    self.flows = list(flows)
    self._load = [0] * len(links.capacity) if load is None else list(load)  # subflows on each resource
    self.striped = sum(f.kind != POINT for f in self.flows)
    self.count = len(self.flows)

  def add(self, flow: _Flow, num_bytes: float) -> None:
    flow.remaining = float(num_bytes)
    self.flows.append(flow)
    self.count += 1
    load = self._load
    for r, c in zip(flow.resources, flow.counts):
      load[r] += c
    if flow.far is not None:
      _charge_far(load, flow.far, 1)
    self.striped += flow.kind != POINT

  def rates(self) -> None:
    """Every flow's rate: the equal share of its most contended resource (a striped flow: N - 1 times the
    smallest share among its subflows' resources)."""
    capacity, load = self._links.capacity, self._load
    far_low: dict[int, tuple[int, float, float]] = {}  # striped kind -> (lowest far position, its share, next)
    for f in self.flows:
      kind, (a, b) = f.kind, f.ends
      if kind == POINT:  # (x if x <= y else y: min's value, without the call)
        share_a, share_b = capacity[a] / (load[a] or 1), capacity[b] / (load[b] or 1)
        f.rate = share_a if share_a <= share_b else share_b
        continue
      low = far_low.get(kind)
      if low is None:  # the smallest share among the far ends (and the next smallest, for the node itself)
        far = self._links.in_ if kind == STRIPE_OUT else self._links.out
        share = [capacity[r] / (load[r] or 1) for r in far]
        first = min(range(len(share)), key=share.__getitem__)
        second = min((p for p in range(len(share)) if p != first), key=share.__getitem__)
        low = far_low[kind] = (first, share[first], share[second])
      far_min = low[2] if b == low[0] else low[1]
      f.rate = (len(self._links.out) - 1) * min(capacity[a] / (load[a] or 1), far_min)

  def next_end(self, t: float) -> float:
    return min([t + f.remaining / f.rate for f in self.flows])

  def relink(self, links: _Links) -> None:
    """The links' new capacities (rates follow at the next :meth:`rates`)."""
    self._links = links

  def advance(self, dt: float) -> None:
    for f in self.flows:
      f.remaining -= f.rate * dt

  def land(self) -> list[_Flow]:
    """Removes and returns the flows that have landed (within EPS of their time), in the order they started."""
    landed, moving = [], []
    for f in self.flows:
      (landed if f.remaining <= f.rate * EPS else moving).append(f)
    if not landed:
      return landed
    self.flows = moving
    self.count = len(moving)
    landed.sort(key=_seq)
    load = self._load
    for f in landed:
      for r, c in zip(f.resources, f.counts):
        load[r] -= c
      if f.far is not None:
        _charge_far(load, f.far, -1)
      self.striped -= f.kind != POINT
    return landed

  def loads(self) -> list[int]:
    return list(self._load)


class _ArrayFlows:
  """Flows in flight as the first ``count`` rows of arrays (remaining bytes, rate, kind and ends; a flow that lands
  hands its row to one from the end), so advancing the clock costs a few array operations over the flows in flight.
  Re-sharing the links recomputes only the rows that cross a resource whose load changed since the last time (a
  point flow's two ends; a direction's striped flows when its far ends' smallest shares did), every row when a
  capacity or a striped flow's far ends changed: the rates of :meth:`_ScalarFlows.rates`, bit for bit, computed
  only where they can have changed."""

  def __init__(self, links: _Links, flows: Sequence[_Flow], load: Sequence[int]):
    self._links = links
    self._capacity = np.array(links.capacity)
    self._out, self._in = np.array(links.out, np.int64), np.array(links.in_, np.int64)
    n = max(64, 2 * len(flows))
    self._remaining, self._rate = np.zeros(n), np.ones(n)
    self._kind = np.zeros(n, np.int8)
    self._ends = np.zeros((n, 2), np.int64)
    self._flows: list[_Flow] = []  # row -> its flow, for the ``count`` rows in flight
    self._load = np.array(load, np.int64)  # subflows on each resource (and on the far ends, those pending)
    self._far_pending: dict[int, list] = {}  # id of a direction's far ends -> [them as an array, subflows to add]
    self._share = np.zeros(len(links.capacity))  # each resource's share at the last :meth:`rates`
    self._far_low: dict[int, tuple[int, float, float]] = {}  # striped kind -> (lowest far position, its share, next)
    self._changed: list[int] = []  # resources whose load changed since the last :meth:`rates` (repeats allowed)
    self._every = True  # every row to re-share at the next :meth:`rates`
    self.striped = self.count = 0
    for f in flows:
      self._put(f, f.remaining)
      self._rate[f.slot] = f.rate

  _COLUMNS = ("_remaining", "_rate", "_kind", "_ends")  # the arrays that hold a row each

  def _grow(self, rows: int) -> None:
    """Room for at least ``rows`` rows (twice as many as before, or more)."""
    n = max(rows, 2 * len(self._remaining))
    for name in self._COLUMNS:
      old = getattr(self, name)
      new = np.ones((n, *old.shape[1:]), old.dtype)
      new[:self.count] = old[:self.count]
      setattr(self, name, new)

  def _put(self, flow: _Flow, num_bytes: float) -> None:
    if self.count == len(self._remaining):
      self._grow(self.count + 1)
    flow.slot = row = self.count
    self._remaining[row] = num_bytes
    self._ends[row] = flow.ends
    self._kind[row] = flow.kind
    self._flows.append(flow)
    self.count += 1
    self.striped += flow.kind != POINT

  def add(self, flow: _Flow, num_bytes: float) -> None:
    self._put(flow, num_bytes)
    for r, c in zip(flow.resources, flow.counts):  # (one or two: scalar updates cost less than an indexed one)
      self._load[r] += c
    self._changed.extend(flow.resources)
    if flow.far is not None:
      self._charge_far(flow.far, 1)

  def _charge_far(self, far: Far, sign: int) -> None:
    """:func:`_charge_far`, its far ends' part held back until the loads are read (:meth:`_settle`): the striped
    flows that start or land at one instant charge each direction's N far ends once, not once each."""
    _, as_array, own = far
    self._load[own] -= sign
    self._changed.append(own)
    pending = self._far_pending.get(id(as_array))
    if pending is None:
      self._far_pending[id(as_array)] = [as_array, sign]
    else:
      pending[1] += sign

  def _settle(self) -> None:
    """The far ends' pending subflows added to the loads (every node's link changed: every row is re-shared)."""
    for as_array, count in self._far_pending.values():
      if count:
        self._load[as_array] += count
        self._every = True
    self._far_pending.clear()

  def add_all(self, group: Sequence[tuple[float, _Flow]]) -> None:
    """:meth:`add` of each (bytes, flow) of ``group`` in turn, their rows and loads written at once."""
    first = self.count
    if first + len(group) > len(self._remaining):
      self._grow(first + len(group))
    rows = slice(first, first + len(group))
    self._remaining[rows] = [num_bytes for num_bytes, _ in group]
    self._ends[rows] = [flow.ends for _, flow in group]
    self._kind[rows] = [flow.kind for _, flow in group]
    resources, counts = [], []
    for row, (_, flow) in enumerate(group, first):
      flow.slot = row
      self._flows.append(flow)
      resources.extend(flow.resources)
      counts.extend(flow.counts)
      if flow.far is not None:
        self._charge_far(flow.far, 1)
      self.striped += flow.kind != POINT
    self.count += len(group)
    np.add.at(self._load, resources, counts)
    self._changed.extend(resources)

  def rates(self) -> None:
    """:meth:`_ScalarFlows.rates`, for the rows that cross a resource whose load changed (every row after a
    capacity or a striped flow's far ends changed, or when most resources did)."""
    if self._far_pending:
      self._settle()
    share, n = self._share, self.count
    if self._every or n < LOCAL_FROM or 4 * len(self._changed) >= len(share):
      share[:] = self._capacity / np.maximum(self._load, 1)
      rows: slice | np.ndarray = slice(0, n)
      self._far_low.clear()  # (:meth:`_share_rows` finds them again)
    else:
      changed = np.array(self._changed, np.int64)
      share[changed] = self._capacity[changed] / np.maximum(self._load[changed], 1)
      hit = np.zeros(len(share), bool)
      hit[changed] = True
      ends = self._ends[:n]
      touched = hit[ends[:, 0]] | hit[ends[:, 1]]  # (a striped row's second end is its node's position: a
      #                                             spurious hit re-computes the same rate)
      for kind, far in ((STRIPE_OUT, self._in), (STRIPE_IN, self._out)):
        low = self._far_low.get(kind)  # (None: no striped flow of this direction in flight)
        if low is not None and hit[far].any():
          self._far_low[kind] = self._lowest(kind)
          if self._far_low[kind] != low:
            touched |= self._kind[:n] == kind
      rows = touched.nonzero()[0]
    self._every = False
    self._changed.clear()
    self._rate[rows] = self._share_rows(rows)

  def _lowest(self, kind: int) -> tuple[int, float, float]:
    """The smallest share among the far ends of ``kind``'s striped flows: (its node's position, it, the next)."""
    far_share = self._share[self._in if kind == STRIPE_OUT else self._out]
    lowest = np.argsort(far_share, kind="stable")[:2]
    return int(lowest[0]), float(far_share[lowest[0]]), float(far_share[lowest[-1]])

  def _share_rows(self, rows: slice | np.ndarray) -> np.ndarray:
    """The rates of ``rows`` from the resources' shares."""
    share, ends = self._share, self._ends[rows]
    rate = np.minimum(share[ends[:, 0]], share[ends[:, 1]])
    if self.striped:
      kinds = self._kind[rows]
      for kind in (STRIPE_OUT, STRIPE_IN):
        sel = (kinds == kind).nonzero()[0]
        if len(sel):
          found = self._far_low.get(kind)
          if found is None:
            found = self._far_low[kind] = self._lowest(kind)
          first, low, second = found
          far_min = np.where(ends[sel, 1] == first, second, low)
          rate[sel] = (len(self._out) - 1) * np.minimum(share[ends[sel, 0]], far_min)
    return rate

  def relink(self, links: _Links) -> None:
    """:meth:`_ScalarFlows.relink`."""
    self._links = links
    self._capacity = np.array(links.capacity)
    self._every = True

  def next_end(self, t: float) -> float:
    n = self.count  # (t + the smallest time left: the smallest of t + each, rounding being monotonic)
    return t + float((self._remaining[:n] / self._rate[:n]).min())

  def advance(self, dt: float) -> None:
    n = self.count
    self._remaining[:n] -= self._rate[:n] * dt

  def land(self) -> list[_Flow]:
    """:meth:`_ScalarFlows.land`."""
    n = self.count
    rows = (self._remaining[:n] <= self._rate[:n] * EPS).nonzero()[0]
    if not len(rows):
      return []
    landed = sorted([self._flows[row] for row in rows.tolist()], key=_seq)
    resources = [r for f in landed for r in f.resources]
    if len(landed) < _ADD_ALL_FROM:  # (few: scalar updates cost less than indexed ones)
      for f in landed:
        for r, c in zip(f.resources, f.counts):
          self._load[r] -= c
    else:  # (flows land hundreds at once at scale)
      np.subtract.at(self._load, resources, [c for f in landed for c in f.counts])
    self._changed.extend(resources)
    for f in landed:
      if f.far is not None:
        self._charge_far(f.far, -1)
        self.striped -= 1
    self._close(rows)
    return landed

  def _close(self, rows: np.ndarray) -> None:
    """Frees ``rows`` (ascending): the rows in flight after them move into those before the new end."""
    n, left = self.count, self.count - len(rows)
    if len(rows) < _ADD_ALL_FROM:  # (few: the last row into each, from the highest down, by scalar copies)
      remaining, rate, kind, ends, flows = self._remaining, self._rate, self._kind, self._ends, self._flows
      for row in reversed(rows.tolist()):
        n -= 1
        if row != n:  # (a row above every landed one still to free: in flight)
          remaining[row], rate[row], kind[row], ends[row] = remaining[n], rate[n], kind[n], ends[n]
          flows[row] = flow = flows[n]
          flow.slot = row
      del flows[left:]
      self.count = left
      return
    holes = rows[:np.searchsorted(rows, left)]
    if len(holes):
      keep = np.ones(n - left, bool)
      keep[rows[len(holes):] - left] = False
      movers = keep.nonzero()[0] + left
      for name in self._COLUMNS:
        array = getattr(self, name)
        array[holes] = array[movers]
      flows = self._flows
      for hole, mover in zip(holes.tolist(), movers.tolist()):
        flows[hole] = flow = flows[mover]
        flow.slot = hole
    del self._flows[left:]
    self.count = left

  def loads(self) -> list[int]:
    self._settle()
    return self._load.tolist()

  def as_objects(self) -> list[_Flow]:
    """The flows in flight, their remaining bytes and rates written back onto them (exactly: doubles)."""
    for row, f in enumerate(self._flows):
      f.remaining, f.rate = float(self._remaining[row]), float(self._rate[row])
    return list(self._flows)


class _Timers:
  """Timers, run by time and, at one time, in the order they were set (what a heap of (time, seq, fn) gives),
  held as one list per distinct time and a heap of the distinct times. Replicated virtual workers set many
  timers for the same instant (a 4,096-GPU run: about 190 per distinct time), so setting one is a dict lookup
  and an append, and running one a step of a list, where a heap of them all cost O(log timers) tuple
  comparisons each way (4% of a 4,096-GPU simulation under cProfile; 520 -> 170 ns a timer in a heap of 3,000).

  A timer is ``fn(t)``; or a :class:`Task` whose compute ends then, which ``task_done(task, t)`` finishes; or a
  :class:`_Flow` whose latency has passed, which ``flow_start(flow, t)`` starts. Most timers are the last two: set
  as themselves, they make no callable of their own, which would be read cold when it runs."""

  __slots__ = ("at", "times", "count", "task_done", "flow_start")

  def __init__(self, flow_start: Callable[[_Flow, float], None]):
    self.at: dict[float, list[Timer]] = {}  # time -> its timers, in the order set
    self.times: list[float] = []  # a heap of the times in ``at``
    self.count = 0  # timers set and not run
    self.task_done: Callable[[Task, float], None] | None = None  # (set by the run whose tasks these are)
    self.flow_start = flow_start

  def push(self, t: float, fn: Timer) -> None:
    self.count += 1
    bucket = self.at.get(t)
    if bucket is None:
      self.at[t] = [fn]
      heapq.heappush(self.times, t)
    else:
      bucket.append(fn)

  def run_until(self, t: float) -> None:
    """Runs every timer due by ``t`` (the first time due: nothing sets one earlier), those they set for ``t``
    too, in order; each is called with ``t``."""
    times, at, task_done, flow_start = self.times, self.at, self.task_done, self.flow_start
    while times and times[0] <= t:
      bucket = at.pop(heapq.heappop(times))
      self.count -= len(bucket)
      for fn in bucket:  # (one set for the same time meanwhile goes to a new list: it runs after these)
        kind = fn.__class__
        if kind is Task:
          task_done(fn, t)  # type: ignore[misc]  # (set by the run that sets tasks)
        elif kind is _Flow:
          flow_start(fn, t)  # type: ignore[arg-type]
        else:
          fn(t)  # type: ignore[operator]  # (neither: a callable)


_ADD_ALL_FROM = 8  # flows started or landed together that are written as rows at once (fewer: one by one costs less)


def _seq(flow: _Flow) -> int:
  return flow.seq


class Simulator:
  """Timers and flows on one clock.

  Few flows in flight are objects (:class:`_ScalarFlows`); from :data:`ARRAYS_FROM` of them on they are
  rows of arrays (:class:`_ArrayFlows`: advancing the clock and re-sharing the links cost a few array
  operations per event, however many flows are in flight), and objects again below
  :data:`SCALARS_BELOW`. Both compute the same doubles the same way, so which holds them changes no
  result. A *striped* flow (a push to, or a pull from, PS shards striped over all N nodes) is N - 1 equal
  subflows between its node and every other node, moving at the pace of the slowest: each subflow counts
  on its node's link and on the far node's, and the flow's rate is N - 1 times the smallest share among
  them (one flow, not N - 1).
  """

  def __init__(self, cluster: Cluster, overlap_transfers: bool = False, noise: Realisation | None = None,
               start: float = 0.0):
    self.cluster, self.overlap, self.noise = cluster, overlap_transfers, noise
    self._arrived: set[tuple] = set()  # overlap: inputs that landed, their tasks not started yet
    self.t = start  # (a run that continues another: the noise's clock and the trace's times go on from there)
    # under noise, each (vw, stage)'s compute seconds as profiled and as timed (what its kernels' timers measure)
    self.meter: dict[tuple[int, int], list[float]] = {}
    self._timers = _Timers(self._start_flow)
    self._flow_seq = itertools.count()
    nodes = sorted({g.node for g in cluster.gpus})
    self._resource = {}  # ("pcie" | "out" | "in", node) -> index
    capacity = []
    for node in nodes:
      for kind, link in (("pcie", cluster.intra_node), ("out", cluster.inter_node), ("in", cluster.inter_node)):
        self._resource[(kind, node)] = len(capacity)
        capacity.append(float(link.bytes_per_s))
    self._nodes = nodes
    self._links = _Links(tuple(capacity), tuple(self._resource[("out", n)] for n in nodes),
                         tuple(self._resource[("in", n)] for n in nodes))
    self._flows: _ScalarFlows | _ArrayFlows = _ScalarFlows(self._links)
    self._point_shape: dict[tuple[int, int], tuple] = {}  # (src, dst) -> (latency, ends, resources, counts)
    self._striped_shape: dict[tuple[int, bool], tuple] = {}  # (node, outbound) -> (ends, resources, counts, far)
    self._far: dict[bool, tuple[tuple[int, ...], np.ndarray]] = {}  # outbound -> every node's far end
    self._position = {node: pos for pos, node in enumerate(nodes)}
    self._dirty = False  # the load changed since rates were last computed
    # per vw, per 2 x stage + (kind is a backward): what :meth:`_task` says, or None before it is asked (lists, not a
    # dict keyed by (vw, stage, kind): no key built and hashed, one object fewer read per lookup; set by :meth:`_run`)
    self._tasks: list[list[TaskCosts | None]] = []
    # under noise that moves links: each node's next change of bandwidth, a timer that keeps no run alive
    self._base = self._links.capacity
    self._passive = len(nodes) if noise is not None and noise.links_vary else 0
    for node in nodes[:self._passive]:
      self._relink(node, start)

  def at(self, t: float, fn: Timer) -> None:
    """Calls ``fn(t)`` at ``t`` (now or later: an earlier time is refused)."""
    if t < self.t:
      raise ProtocolError(f"a timer set for t={t!r}, before the simulator's clock t={self.t!r}")
    self._timers.push(t, fn)

  def _relink(self, node: int, t: float) -> None:
    """``node``'s network link at the bandwidth the noise gives it at ``t``, and its next change scheduled: one
    *passive* timer per node at any time (inf when none comes), which keeps no run alive (:meth:`run` and
    :meth:`drain` end when nothing else is left)."""
    assert self.noise is not None
    factor = self.noise.link_factor(node, t)
    capacity = list(self._links.capacity)
    for kind in ("out", "in"):
      r = self._resource[(kind, node)]
      capacity[r] = self._base[r] * factor
    if tuple(capacity) != self._links.capacity:
      self._links = dataclasses.replace(self._links, capacity=tuple(capacity))
      self._flows.relink(self._links)
      self._dirty = True
    self._timers.push(self.noise.next_link_change(node, t), functools.partial(self._relink, node))

  def send(self, src_node: int, dst_node: int, num_bytes: float, done: Done) -> None:
    """Moves ``num_bytes`` between nodes (or over a node's PCIe when equal); calls ``done(t)``."""
    latency, flow = self.point_flow(src_node, dst_node, done)
    flow.remaining = num_bytes
    self._timers.push(self.t + latency, flow)

  def send_all(self, sends: Sequence[tuple[float, float, _Flow]]) -> None:
    """Starts each (latency, bytes, flow) of ``sends`` (:meth:`point_flow`, :meth:`striped_flow`) after its latency:
    what :meth:`send` and :meth:`send_striped` do for each in turn, with one timer for each run of them that
    leaves after the same latency (those timers would have run one after another)."""
    first = 0
    while first < len(sends):
      latency, end = sends[first][0], first + 1
      while end < len(sends) and sends[end][0] == latency:
        end += 1
      group = [(num_bytes, flow) for _, num_bytes, flow in sends[first:end]]
      self._timers.push(self.t + latency, functools.partial(self._start_flows, group))
      first = end

  def point_flow(self, src_node: int, dst_node: int, done: Done | None) -> tuple[float, _Flow]:
    """A flow between two nodes (or over a node's PCIe when equal) that calls ``done(t)`` when it lands, and the
    latency before it moves (:meth:`send_all` starts it)."""
    shape = self._point_shape.get((src_node, dst_node))
    if shape is None:  # the same for every flow between these nodes
      if src_node == dst_node:
        link = self.cluster.intra_node
        ends = (self._resource[("pcie", src_node)],) * 2
      else:
        link = self.cluster.inter_node
        ends = (self._resource[("out", src_node)], self._resource[("in", dst_node)])
      resources = tuple(dict.fromkeys(ends))
      shape = self._point_shape[(src_node, dst_node)] = (link.latency_s, ends, resources, (1,) * len(resources))
    latency, ends, resources, counts = shape
    return latency, _Flow(done, next(self._flow_seq), POINT, ends, resources, counts)

  def send_striped(self, node: int, num_bytes: float, outbound: bool, done: Done) -> None:
    """Moves ``num_bytes`` from ``node`` spread evenly over every other node (``outbound``), or from every
    other node to ``node``; calls ``done(t)`` when the last byte lands."""
    latency, flow = self.striped_flow(node, outbound, done)
    flow.remaining = num_bytes
    self.at(self.t + latency, flow)

  def striped_flow(self, node: int, outbound: bool, done: Done) -> tuple[float, _Flow]:
    """:meth:`point_flow` of a striped transfer (:meth:`send_striped`)."""
    key = (node, outbound)
    if key not in self._striped_shape:  # the same for every striped flow of this node and direction
      pos = self._position[node]
      if len(self._nodes) < 2:
        raise ProtocolError(f"a striped transfer needs another node than node {node}")
      near, far = (self._links.out, self._links.in_) if outbound else (self._links.in_, self._links.out)
      if outbound not in self._far:
        self._far[outbound] = (far, np.array(far, np.int64))
      self._striped_shape[key] = ((near[pos], pos), (near[pos],), (len(self._nodes) - 1,),
                                  (*self._far[outbound], far[pos]))
    ends, resources, counts, far_ends = self._striped_shape[key]
    return self.cluster.inter_node.latency_s, _Flow(done, next(self._flow_seq), STRIPE_OUT if outbound else STRIPE_IN,
                                                    ends, resources, counts, far_ends)

  def _start_flow(self, flow: _Flow, t: float) -> None:
    """``flow`` starts to move its bytes (``remaining``)."""
    del t
    flows = self._flows
    flows.add(flow, flow.remaining)
    if isinstance(flows, _ScalarFlows) and flows.count >= ARRAYS_FROM:
      self._flows = _ArrayFlows(self._links, flows.flows, flows.loads())
    self._dirty = True

  def _start_flows(self, group: list[tuple[float, _Flow]], t: float) -> None:
    """:meth:`_start_flow` of each (bytes, flow) of ``group`` in turn (many at once while flows are rows)."""
    for k, (num_bytes, flow) in enumerate(group):
      if isinstance(self._flows, _ArrayFlows) and len(group) - k >= _ADD_ALL_FROM:
        self._flows.add_all(group[k:])
        self._dirty = True
        return
      flow.remaining = num_bytes
      self._start_flow(flow, t)

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
    self._timers.task_done = functools.partial(self._finish, engine, cost)
    self._tasks = [[None] * (2 * vw.k) for vw in engine.vws]
    engine.begin(self.t)
    allow = self._input_test(engine, cost) if self.overlap else None
    timers, inf, passive = self._timers, float("inf"), self._passive
    times, run_until = timers.times, timers.run_until
    startable, start_task = engine.startable, self._start_task
    arrived = self._arrived
    while True:
      for task in startable(allow):
        start_task(engine, cost, task)
      flows = self._flows
      moving = flows.count
      if self._dirty:
        if moving:
          flows.rates()
        self._dirty = False
      t_flow = flows.next_end(self.t) if moving else inf
      t_timer = times[0] if timers.count > passive or (moving and timers.count) else inf
      t_next = t_flow if t_flow <= t_timer else t_timer
      if t_next == inf:
        break
      if moving:
        flows.advance(t_next - self.t)
      self.t = t_next
      # a flow lands within EPS of its time; none can when the next one is more than SKIP away (most
      # events are a task's end): the same result without scanning the flows
      landed = flows.land() if moving and t_flow - t_next <= SKIP else None
      if landed:
        self._dirty = True
        if isinstance(flows, _ArrayFlows) and flows.count < SCALARS_BELOW:
          self._flows = _ScalarFlows(self._links, flows.as_objects(), flows.loads())
        for f in landed:
          done = f.done
          if done is None:  # a task's input (overlap): its device may start it
            arrived.add(f.arrival)  # type: ignore[arg-type]  # (an input's flow has its arrival)
            engine.wake(f.arrival[0], f.arrival[2])  # type: ignore[index]
          else:
            done(t_next)
      run_until(t_next)  # (nothing but this loop moves the clock)
      if stop is not None and stop():
        engine.stop_injecting()
        stop = None
    if not engine.done:
      raise ProtocolError("sim executor stalled before every minibatch completed (a schedule bug)")
    return self.t

  def drain(self) -> float:
    """Runs timers and flows until none is left, without an engine: the peers of
    :mod:`hetpipe_jax.baselines` drive their tasks by timers and flows of their own. The same clock and
    the same sharing of links as :meth:`run`. Returns the time of the last event."""
    timers, inf, passive = self._timers, float("inf"), self._passive
    times = timers.times
    while True:
      flows = self._flows
      moving = flows.count
      if self._dirty:
        if moving:
          flows.rates()
        self._dirty = False
      t_flow = flows.next_end(self.t) if moving else inf
      t_next = min(t_flow, times[0] if timers.count > passive or (moving and timers.count) else inf)
      if t_next == inf:
        return self.t
      if moving:
        flows.advance(t_next - self.t)
      self.t = t_next
      landed = flows.land() if moving and t_flow - t_next <= SKIP else None
      if landed:
        self._dirty = True
        if isinstance(flows, _ArrayFlows) and flows.count < SCALARS_BELOW:
          self._flows = _ScalarFlows(self._links, flows.as_objects(), flows.loads())
        for f in landed:
          f.done(t_next)  # type: ignore[misc]  # (no engine, no task inputs: every flow has its ``done``)
      timers.run_until(t_next)

  def _task(self, engine: Engine, cost: CostModel, vw: int, stage: int, kind: str) -> TaskCosts:
    """What the simulator needs of a (vw, stage, kind) task, looked up once: (compute seconds, what it
    receives before it computes as (bytes, from node, to node) or None, and with ``overlap`` where its
    output goes as (stage, kind, bytes, from node, to node) or None)."""
    costs, slot = self._tasks[vw], 2 * stage + (kind != FWD)
    found = costs[slot]
    if found is None:
      transfer = cost.transfer(vw, stage, kind)
      receive: Receive | None = None if transfer is None else (transfer[0], transfer[1].node, transfer[2].node)
      out: Onward | None = None
      nxt = successor(Task(vw, stage, kind, 0), engine.vws[vw].k) if self.overlap else None
      if nxt is not None and nxt[0] != stage:  # (completed, or the last stage turning round: nothing travels)
        onward = cost.transfer(vw, *nxt)
        out = None if onward is None else (nxt[0], nxt[1], onward[0], onward[1].node, onward[2].node)
      flow = cost.allreduce_flow(vw, stage, kind)
      found = ((cost.compute_seconds(vw, stage, kind), receive, out, None) if flow is None else
               (flow[0], receive, out, (flow[1], flow[2])))
      costs[slot] = found
    return found

  def _start_task(self, engine: Engine, cost: CostModel, task: Task) -> None:
    engine.start(task, self.t)
    vw, stage, kind, mb = task
    found = self._tasks[vw][2 * stage + (kind != FWD)] or self._task(engine, cost, vw, stage, kind)
    compute, receive, _, reduce = found
    if self.noise is not None:  # this task's draw of the GPUs' variance, at its start
      timed = compute * self.noise.task_factor(cost.stage_gpus(vw, stage), self.t)
      meter = self.meter.setdefault((vw, stage), [0.0, 0.0])
      meter[0] += compute
      meter[1] += timed
      compute = timed
    if receive is not None and self.overlap:  # its input was sent when it was produced and has landed (:meth:`_run`)
      self._arrived.discard((vw, engine.generation(vw), stage, kind, mb))
    if reduce is None and (receive is None or self.overlap):  # it computes now, then :meth:`_finish` (the timers')
      self._timers.push(self.t + compute, task)
      return
    finish = functools.partial(self._finish, engine, cost, task)
    if reduce is not None:  # a split stage: its all-reduces cross its node's link once it has computed
      finish = functools.partial(self._reduce, reduce, finish)
    if receive is not None and not self.overlap:  # the device receives its input, then computes
      self.send(receive[1], receive[2], receive[0], functools.partial(self._compute, compute, finish))
      return
    self._timers.push(self.t + compute, finish)

  def _reduce(self, reduce: Reduce, finish: Callable[[float], None], t: float) -> None:
    """A split stage's task computed by ``t``: its all-reduces' bytes cross its node's link, then ``finish``."""
    del t
    self.send(reduce[1], reduce[1], reduce[0], finish)

  def _compute(self, seconds: float, finish: Callable[[float], None], t: float) -> None:
    """A task's input landed at ``t``: it computes for ``seconds``, then ``finish``."""
    self._timers.push(t + seconds, finish)

  def _input_test(self, engine: Engine, cost: CostModel) -> Callable[[Task], bool]:
    """Overlap: a device starts only a task whose input is there (its other ready tasks may be). The
    test, as one function (it runs for every ready task it is asked about)."""
    tasks, generation, arrived, lookup = self._tasks, engine.generation, self._arrived, self._task

    def landed(task: Task) -> bool:
      vw, stage, kind, mb = task
      found = tasks[vw][2 * stage + (kind != FWD)] or lookup(engine, cost, vw, stage, kind)
      return found[1] is None or (vw, generation(vw), stage, kind, mb) in arrived
    return landed

  def _finish(self, engine: Engine, cost: CostModel, task: Task, t: float) -> None:
    """The task is done; with ``overlap``, its output leaves for the next stage at once, travelling while
    that stage's device works on something else."""
    engine.finish(task, t)
    if not self.overlap:
      return
    vw, stage, kind, mb = task
    out = (self._tasks[vw][2 * stage + (kind != FWD)] or self._task(engine, cost, vw, stage, kind))[2]
    if out is None:
      return
    stage, kind, num_bytes, src, dst = out  # (the generation after the task's end: it may have failed its VW)
    latency, flow = self.point_flow(src, dst, None)  # (:meth:`send`, landing in :meth:`_run`: into ``_arrived``)
    flow.remaining, flow.arrival = num_bytes, (vw, engine.generation(vw), stage, kind, mb)
    self._timers.push(self.t + latency, flow)


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

    sends = []  # (latency, bytes, flow)
    for gpu_node, shard_node, num_bytes in routes:
      if shard_node == STRIPED:
        latency, flow = self.sim.striped_flow(gpu_node, to_ps, one_landed)
        sends.append((latency, num_bytes * scale, flow))
        continue
      src, dst = (gpu_node, shard_node) if to_ps else (shard_node, gpu_node)
      latency, flow = self.sim.point_flow(src, dst, one_landed)
      sends.append((latency, int(num_bytes * scale), flow))
    self.sim.send_all(sends)

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
