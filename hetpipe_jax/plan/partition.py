"""Heterogeneity- and memory-aware partitioning of a model over one virtual worker's GPUs.

docs/PROTOCOL.md section 4 (our reading of the paper, made exact): choose contiguous stages, one per GPU, and
the order of the GPUs in the pipeline, to minimise the slowest stage, where a stage's time is its units'
forward + backward time on its GPU type plus receiving its boundary tensors over the links to its
neighbours (:func:`hetpipe_jax.cost.transfer.stage_seconds`), subject to every stage fitting its GPU's
memory (:func:`hetpipe_jax.cost.memory.stage_memory_bytes`). The DP's vectorised matrices are built from
those same definitions: the memory formula applied to each unit, then prefix sums; the receive time at
every cut position (:func:`hetpipe_jax.cost.transfer.receive_seconds_by_position`).

Algorithm: for a fixed device order, a DP over (stage, last unit) is exact for a chain of L units:
``best[j][e] = min_s max(best[j-1][s], T_j(s, e))``, vectorised over (s, e), O(k L^2). The order is
searched without enumerating orders: GPUs of one (type, node) signature are interchangeable, and a
stage's time depends on its neighbours only through the receive time from each, which depends on the
two signatures (in practice: same node or not), a "receive class". An exact DP from the pipeline's end
has the state (count vector c of the GPUs placed so far, per signature; signature b of the stage that
starts at cut s; the class of the activation it receives; s); its value is the smallest bottleneck of
that stage and all after it. A step picks the next signature a (with a GPU left) and the stage's end
cut e, which fixes the stage's gradient class: the stage is finalised, as its time is then known. For
S signatures of multiplicities m_i and K receive classes (K <= 2 with one link inside and one between
nodes) there are prod(m_i + 1) x S x K x (L + 1) states, each step O(K L^2) with the successors of one
gradient class merged first: O(prod(m_i + 1) S K^2 L^2) time (vectorised over count vectors and cuts),
against k!/prod(m_i!) orders for the enumeration. Entries above the best of a few fixed orders are
pruned. The order is then rebuilt forwards: the first signature, in order of first appearance, whose
prefix still reaches the optimum, and the fixed-order DP's cuts (first minimal index) -- the choice the
depth-first enumeration of orders made. 16 GPUs of 8 signatures x 2 (16!/2^8 orders): 3^8 count vectors;
16 distinct signatures: 2^16 (seconds, not minutes).
Nm is picked by ``nm_policy``: ``max_fit`` (the largest Nm <= ``nm_max`` that fits), ``best`` (the
largest modelled throughput min(1/bottleneck, Nm/latency), ties to the smaller Nm), ``speed`` (waves sized
to each virtual worker's speed, relative to the others: :mod:`~hetpipe_jax.plan.waves`; a virtual worker
alone gets its ``max_fit``), or a given number.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from hetpipe_jax.cluster import Cluster, Gpu, format_bytes
from hetpipe_jax.cost.context import DEFAULT_COSTS, CostContext, degree_of
from hetpipe_jax.cost.memory import kept, memory_bytes, stage_memory_bytes
from hetpipe_jax.cost.roofline import unit_seconds
from hetpipe_jax.cost.transfer import receive_seconds_by_position, split_allreduce_seconds, stage_neighbours
from hetpipe_jax.cost.unit import UnitProfile
from hetpipe_jax.errors import ConfigError
from hetpipe_jax.plan.vw_plan import VWPlan, vw_plan
from hetpipe_jax.plan.waves import speed_sized
from hetpipe_jax.recompute import allowed_modes

NM_POLICIES = ("max_fit", "best", "speed")


class _ModeDp:
  """Prefix sums of one recomputation mode's unit costs: memory, and the time on each GPU type (with the
  all-reduces of units split by tensor parallelism, on the cluster's link inside a node)."""

  def __init__(self, mode: str, profiles: Sequence[UnitProfile], nm: int, costs: CostContext, cluster: Cluster):
    self.mode, self.precision = mode, costs.precision
    self.profiles = [u.under(mode) for u in profiles]
    self._reduce = np.array([sum(split_allreduce_seconds(cluster, u, costs.precision)) for u in self.profiles])
    mem = np.array([memory_bytes(u.param_bytes, kept(u, costs), nm, costs) for u in self.profiles], np.float64)
    prefix = np.concatenate([[0.0], np.cumsum(mem)])
    self.memory = prefix[None, :] - prefix[:, None]  # M(s, e): a stage holding units s .. e - 1 (for s <= e)
    transient = np.array([u.transient_bytes for u in self.profiles], np.float64)
    if transient.any():
      self.memory += _range_max(transient) * memory_bytes(0, 0, nm, costs, 1.0)
    self._time: dict[str, np.ndarray] = {}

  def prefix_time(self, gpu: Gpu) -> np.ndarray:
    if gpu.type.name not in self._time:
      t = np.array([sum(unit_seconds(u, gpu.type, self.precision)) for u in self.profiles]) + self._reduce
      self._time[gpu.type.name] = np.concatenate([[0.0], np.cumsum(t)])
    return self._time[gpu.type.name]

  def cost(self, gpu: Gpu, recv_prev: np.ndarray, recv_next: np.ndarray, mem_ratio: bool) -> np.ndarray:
    """T(s, e) under this mode (see :meth:`_Dp.stage_cost`; every cut, valid or not)."""
    if mem_ratio:
      return self.memory / gpu.type.memory_bytes
    p = self.prefix_time(gpu)
    value = p[None, :] - p[:, None]
    value = value + recv_prev[:, None]  # the activation at the first cut s
    value = value + recv_next[None, :]  # the gradient at the last cut e
    return np.where(self.memory <= gpu.type.memory_bytes, value, np.inf)


def _range_max(values: np.ndarray) -> np.ndarray:
  """R(s, e) = max(values[s:e]) (0 for s >= e), an (n + 1, n + 1) array."""
  n = len(values)
  out = np.zeros((n + 1, n + 1))
  for s in range(n):
    out[s, s + 1:] = np.maximum.accumulate(values[s:])
  return out


class _Dp:
  """Prefix sums and vectorised stage-time matrices for one model on one cluster; a stage takes the fastest of
  the recomputation modes ``costs.recompute`` allows (one, or every one for ``auto``) whose memory fits."""

  def __init__(self, cluster: Cluster, profiles: Sequence[UnitProfile], nm: int, costs: CostContext,
               allow_empty: bool):
    self.cluster, self.profiles, self.precision = cluster, profiles, costs.precision
    self.n = len(profiles)
    self.costs, self.nm = costs, nm
    self._modes: dict[int, list[_ModeDp]] = {}  # by the tensor-parallel degree of a GPU's type (costs.tp_by_type)
    self._recv_cache: dict[tuple[int | None, int], np.ndarray] = {}
    s = np.arange(self.n + 1)
    self._valid = (s[:, None] <= s[None, :]) if allow_empty else (s[:, None] < s[None, :])

  def modes(self, gpu: Gpu) -> list[_ModeDp]:
    """The allowed recomputation modes' prefix sums for ``gpu``: of the profiles split over its type's degree."""
    degree = degree_of(self.costs, gpu.type.name)
    if degree not in self._modes:
      mine = self.profiles if degree == 1 else [u.split(degree) for u in self.profiles]
      self._modes[degree] = [_ModeDp(m, mine, self.nm, self.costs, self.cluster)
                             for m in allowed_modes(self.costs.recompute)]
    return self._modes[degree]

  def _prefix_time(self, gpu: Gpu) -> np.ndarray:
    """Prefix sums of the units' times on ``gpu`` under the first allowed mode (the least recomputation)."""
    return self.modes(gpu)[0].prefix_time(gpu)

  def recv(self, src: Gpu | None, dst: Gpu) -> np.ndarray:
    """Seconds to receive the boundary tensor at every cut position c (0..n) from ``src``."""
    key = (None if src is None else src.index, dst.index)
    if key not in self._recv_cache:
      self._recv_cache[key] = receive_seconds_by_position(self.cluster, self.profiles, src, dst, self.precision)
    return self._recv_cache[key]

  def stage_cost(self, gpu: Gpu, recv_prev: np.ndarray, recv_next: np.ndarray,
                 mem_ratio: bool = False) -> np.ndarray:
    """T(s, e) of a stage on ``gpu`` for every cut (s, e), given its receive times by cut position: the
    smallest over the allowed recomputation modes.

    Args:
      gpu: the stage's GPU.
      recv_prev / recv_next: seconds to receive the activation (the gradient) at each cut position from
        the previous (next) stage's GPU, as :meth:`recv` returns them.
      mem_ratio: return memory needed / memory available instead of seconds.

    Returns:
      An ``(n + 1, n + 1)`` array: seconds per minibatch (compute + receives, inf where the cut is
      invalid or out of memory), or the memory ratio (inf where invalid).
    """
    values = [mode.cost(gpu, recv_prev, recv_next, mem_ratio) for mode in self.modes(gpu)]
    value = values[0] if len(values) == 1 else np.minimum.reduce(values)
    return np.where(self._valid, value, np.inf)

  def stage_matrix(self, gpus: Sequence[Gpu], j: int, mem_ratio: bool = False) -> np.ndarray:
    """T_j(s, e) for every cut (s, e) of stage j.

    Args:
      gpus: the GPUs in pipeline order (stage j's and its neighbours' matter).
      j: the stage.
      mem_ratio: return memory needed / memory available instead of seconds.

    Returns:
      :meth:`stage_cost` of stage j's GPU with the receive times from its neighbours.
    """
    prev, nxt = stage_neighbours(gpus, j)
    return self.stage_cost(gpus[j], self.recv(prev, gpus[j]), self.recv(nxt, gpus[j]), mem_ratio)


def _extend(dp: _Dp, order: Sequence[Gpu], row: np.ndarray | None, j: int, mem_ratio: bool):
  """One step of the fixed-order DP: stage j (its GPU and the next one are in ``order``) is added.

  ``row[s]`` is the smallest bottleneck of stages 0 .. j - 1 ending at cut s (None before stage 0).
  Returns (row after stage j, the argmin cut s for every end e: the first minimal index).
  """
  if row is None:
    row = np.where(np.arange(dp.n + 1) == 0, 0.0, np.inf)
  cand = np.maximum(row[:, None], dp.stage_matrix(order, j, mem_ratio))
  return cand.min(axis=0), cand.argmin(axis=0)


def _ordered(dp: _Dp, order: Sequence[Gpu], mem_ratio: bool = False) -> tuple[float, list[Gpu], list[int]]:
  """The best cuts for a fixed order, O(k L^2): (value, order, cuts)."""
  row, args = np.where(np.arange(dp.n + 1) == 0, 0.0, np.inf), []
  for j in range(len(order)):
    row, arg = _extend(dp, order, row, j, mem_ratio)
    args.append(arg)
  return float(row[dp.n]), list(order), _backtrack(args, dp.n)


def _backtrack(args: list[np.ndarray], n: int) -> list[int]:
  cuts, e = [n], n
  for arg in args[::-1]:
    e = int(arg[e])
    cuts.append(e)
  return cuts[::-1]


class _Signatures:
  """The GPUs grouped by (type, node) signature, with the receive-time classes between signatures.

  GPUs of one signature are interchangeable: same compute, memory and links. What stage b receives from
  its neighbour a depends on the signatures only; ``recv[b]`` lists the distinct receive-time arrays
  of b (in practice two: from a GPU on the same node, and from another node) and ``cls[a, b]`` is the
  index of the one from a.
  """

  def __init__(self, dp: _Dp, gpus: Sequence[Gpu]):
    self.members = list(_signature_groups(gpus).values())
    self.count = np.array([len(m) for m in self.members], np.int64)
    num = len(self.members)
    self.recv: list[list[np.ndarray]] = [[] for _ in range(num)]
    self.cls = np.full((num, num), -1, np.int64)
    for b, dst in enumerate(self.members):
      for a, src in enumerate(self.members):
        if a == b and len(dst) < 2:
          continue
        arr = dp.recv(src[1] if a == b else src[0], dst[0])
        same = [i for i, r in enumerate(self.recv[b]) if np.array_equal(r, arr)]
        if not same:
          self.recv[b].append(arr)
        self.cls[a, b] = same[0] if same else len(self.recv[b]) - 1
    self.classes = max(1, max(len(r) for r in self.recv))
    self.stride = np.concatenate([[1], np.cumprod(self.count + 1)[:-1]]).astype(np.int64)


class _SuffixTable:
  """The exact DP over (GPUs used, last signature, its receive class, cut), from the pipeline's end.

  ``value(c, b, k, s)``: the smallest bottleneck of the stages from one on signature b, starting at cut s
  and receiving its activation with class k, to the end, when the GPUs of count vector c (b's included)
  are the ones placed so far. Entries above ``bound`` are inf (they cannot be part of a plan at most as
  slow as a known one).
  """

  def __init__(self, dp: _Dp, sig: _Signatures, mem_ratio: bool, bound: float):
    self.dp, self.sig, self.mem_ratio, self.bound = dp, sig, mem_ratio, bound
    num, n1 = len(sig.members), dp.n + 1
    codes = np.arange(int(np.prod(sig.count + 1)), dtype=np.int64)
    vecs = (codes[:, None] // sig.stride[None, :]) % (sig.count + 1)[None, :]
    self.size = vecs.sum(axis=1)
    # rank[b, code]: the row of count vector ``code`` among those of its size that hold signature b.
    self.rank = np.zeros((num, codes.size), np.int64)
    self.values: dict[tuple[int, int], np.ndarray] = {}  # (size, b) -> (rows, receive class, cut)
    self._pairs: dict[tuple[int, int, int], tuple] = {}
    k = int(sig.count.sum())
    for t in range(k, 0, -1):
      layer = codes[self.size == t]
      for b in range(num):
        mine = layer[vecs[layer, b] >= 1]
        self.rank[b, mine] = np.arange(mine.size)
        if t == k:
          last = np.full((mine.size, n1), np.inf)
          last[:, dp.n] = 0.0  # the last stage ends at the last cut and has no successor
          nexts = [(None, last)]
        else:
          nexts = self._successors(t, mine, vecs[mine], b)
        values = np.full((mine.size, sig.classes, n1), np.inf)
        for kin in range(len(sig.recv[b])):
          for kout, succ in nexts:
            np.minimum(values[:, kin], self._min_max(b, kin, kout, succ), out=values[:, kin])
        values[values > bound] = np.inf
        self.values[t, b] = values

  def _successors(self, t: int, mine: np.ndarray, vec: np.ndarray, b: int) -> list:
    """For stage b at count vectors ``mine`` of size t: per class of the gradient it receives, the best
    suffix value from each end cut (over the signatures that can follow it)."""
    sig, n1 = self.sig, self.dp.n + 1
    nexts: dict[int, np.ndarray] = {}
    for a in range(len(sig.members)):
      ok = vec[:, a] < sig.count[a]
      if not ok.any():
        continue
      kout, kin = int(sig.cls[a, b]), int(sig.cls[b, a])
      succ = nexts.setdefault(kout, np.full((mine.size, n1), np.inf))
      nxt = self.values[t + 1, a][self.rank[a, mine[ok] + sig.stride[a]], kin]
      succ[ok] = np.minimum(succ[ok], nxt)
    return sorted(nexts.items())

  def _min_max(self, b: int, kin: int, kout: int | None, succ: np.ndarray) -> np.ndarray:
    """out[r, s] = min over e of max(T(s, e), succ[r, e]), over the cuts with T(s, e) <= bound."""
    key = (b, kin, -1 if kout is None else kout)
    if key not in self._pairs:
      recv = self.sig.recv[b]
      gpu = self.sig.members[b][0]
      recv_next = self.dp.recv(None, gpu) if kout is None else recv[kout]
      cost = self.dp.stage_cost(gpu, recv[kin], recv_next, self.mem_ratio)
      s, e = np.nonzero(cost <= self.bound)
      starts = np.flatnonzero(np.diff(s, prepend=-1)) if s.size else s
      self._pairs[key] = (s, e, cost[s, e], starts)
    s, e, cost, starts = self._pairs[key]
    out = np.full(succ.shape, np.inf)
    live = np.flatnonzero(np.isfinite(succ).any(axis=1))
    if live.size == 0 or s.size == 0:
      return out
    vals = np.maximum(succ[live[:, None], e[None, :]], cost[None, :])
    out[live[:, None], s[starts][None, :]] = np.minimum.reduceat(vals, starts, axis=1)
    return out

  def value(self, code: int, b: int, kin: int) -> np.ndarray:
    """The suffix values by start cut for count vector ``code`` with stage b pending."""
    return self.values[int(self.size[code]), b][self.rank[b, code], kin]


def search_states(gpus: Sequence[Gpu]) -> int:
  """The size of the order search for ``gpus`` (count vectors x signatures, the module docstring):
  prod(m_i + 1) x S for S (type, node) signatures of multiplicities m_i. The partition's time and memory
  grow with it (about a second at 50,000 states for ResNet-152's 52 units here)."""
  counts = _signature_groups(gpus)
  return math.prod(len(members) + 1 for members in counts.values()) * len(counts)


def _signature_groups(gpus: Sequence[Gpu]) -> dict[tuple, list[Gpu]]:
  """GPUs grouped by (type, node): members of a group are interchangeable in a pipeline order."""
  groups: dict[tuple, list[Gpu]] = {}
  for g in gpus:
    groups.setdefault((g.type.name, g.node), []).append(g)
  return groups


def _bound_orders(dp: _Dp, gpus: Sequence[Gpu]) -> list[list[Gpu]]:
  """A few plausible orders: their best cuts bound the optimum from above (for pruning only)."""
  grouped = [g for members in _signature_groups(gpus).values() for g in members]
  speed = {g.index: float(dp._prefix_time(g)[-1]) for g in gpus}
  by_node_fast = sorted(gpus, key=lambda g: (g.node, speed[g.index], g.index))
  by_node_slow = sorted(gpus, key=lambda g: (g.node, -speed[g.index], g.index))
  return [list(gpus), grouped, by_node_fast, by_node_slow]


def _upper_bound(dp: _Dp, gpus: Sequence[Gpu], mem_ratio: bool) -> float:
  """The best value of a few plausible orders (for pruning only; a tighter bound from a local search
  over swaps cost more than it saved)."""
  return min(_ordered(dp, order, mem_ratio)[0] for order in _bound_orders(dp, gpus))


def _first_pair(dp: _Dp, sig: _Signatures, table: _SuffixTable, mem_ratio: bool):
  """The best value and the first pair of signatures (first two stages) that reaches it, or None."""
  best, first, members = np.inf, None, sig.members
  for b in range(len(members)):
    for a in range(len(members)):
      if a == b and sig.count[b] < 2:
        continue
      order = [members[b][0], members[a][1 if a == b else 0]]
      row, _ = _extend(dp, order, None, 0, mem_ratio)
      succ = table.value(int(sig.stride[b] + sig.stride[a]), a, int(sig.cls[b, a]))
      value = float(np.min(np.maximum(row, succ)))
      if value < best:
        best, first = value, (b, a)
  return best, first


def _search(dp: _Dp, gpus: Sequence[Gpu], ordered: bool,
            mem_ratio: bool = False) -> tuple[float, list[Gpu], list[int]]:
  """Minimises the max over stages of T_j (or of the memory ratio); returns (value, order, cuts).

  (inf, gpus, []) when no partition fits.

  The order chosen is the first optimal one in depth-first order over the signatures (in order of first
  appearance in ``gpus``), and its cuts are the fixed-order DP's (first minimal index): the suffix table
  tells, for every prefix, whether it still reaches the optimum, so the order is built greedily.
  """
  k, n = len(gpus), dp.n
  if ordered or k == 1:
    return _ordered(dp, gpus, mem_ratio)
  sig = _Signatures(dp, gpus)
  num, members = len(sig.members), sig.members
  table = _SuffixTable(dp, sig, mem_ratio, _upper_bound(dp, gpus, mem_ratio))
  best, first = _first_pair(dp, sig, table, mem_ratio)
  if first is None:
    return np.inf, list(gpus), []

  def through(order, row, j, code, a, b):
    """Stage j is added (its successor, of signature a after b, is order[-1]); the best completion."""
    row, arg = _extend(dp, order, row, j, mem_ratio)
    return float(np.min(np.maximum(row, table.value(code, a, int(sig.cls[b, a]))))), row, arg

  b, a = first
  used = np.zeros(num, np.int64)
  used[b] += 1
  used[a] += 1
  order = [members[b][0], members[a][used[a] - 1]]
  code = int(sig.stride[b] + sig.stride[a])
  _, row, arg = through(order, None, 0, code, a, b)
  args, last = [arg], a
  for j in range(1, k - 1):
    for a in range(num):
      if used[a] < sig.count[a]:
        value, row_a, arg = through(order + [members[a][used[a]]], row, j, code + int(sig.stride[a]), a, last)
        if value <= best:
          break
    else:
      raise RuntimeError(f"partition DP: no prefix of length {j + 2} reaches the optimum {best}")
    order.append(members[a][used[a]])
    used[a] += 1
    code, row, last = code + int(sig.stride[a]), row_a, a
    args.append(arg)
  row, arg = _extend(dp, order, row, k - 1, mem_ratio)
  return float(row[n]), order, _backtrack(args + [arg], n)


def partition(cluster: Cluster, profiles: Sequence[UnitProfile], gpus: Sequence[Gpu], nm: int,
              costs: CostContext = DEFAULT_COSTS, ordered: bool = False, allow_empty: bool = False) -> VWPlan:
  """The fastest feasible partition of the model over ``gpus`` at a given Nm.

  Args:
    cluster: the cluster (links between the GPUs).
    profiles: per-unit profiles of the model at the training batch size.
    gpus: the virtual worker's GPUs; their order is searched unless ``ordered``.
    nm: minibatches in flight (memory grows with it).
    costs: what the memory of a stage holds (see stage_memory_bytes), and the precision of its times.
    ordered: keep the GPUs' order (only the cuts are searched).
    allow_empty: let a GPU take no units (it then only relays activations).

  Returns:
    The plan with the smallest bottleneck; its GPUs in the chosen pipeline order.

  Raises:
    ConfigError: for Nm < 1, no GPU, more GPUs than units (without ``allow_empty``), or when no partition
      fits, naming the device, the memory needed and available, and fixes.
  """
  if nm < 1:
    raise ConfigError(f"Nm={nm}; Nm (minibatches in flight) must be >= 1")
  if not gpus:
    raise ConfigError("a virtual worker needs at least one GPU")
  if len(gpus) > len(profiles) and not allow_empty:
    raise ConfigError(f"{len(gpus)} GPUs but the model has only {len(profiles)} units to cut; use at most "
                      f"{len(profiles)} GPUs per virtual worker or allow empty stages")
  dp = _Dp(cluster, profiles, nm, costs, allow_empty)
  value, order, cuts = _search(dp, gpus, ordered)
  if not np.isfinite(value):
    _, order, cuts = _search(dp, gpus, ordered, mem_ratio=True)
    split = lambda u, gpu: u if degree_of(costs, gpu.type.name) == 1 else u.split(degree_of(costs, gpu.type.name))
    needs = [min(stage_memory_bytes([split(u.under(m), order[j]) for u in profiles[cuts[j]:cuts[j + 1]]], nm, costs)
                 for m in allowed_modes(costs.recompute)) for j in range(len(order))]
    j = max(range(len(order)), key=lambda j: needs[j] / order[j].type.memory_bytes)
    need = needs[j]
    raise ConfigError(
        f"no partition of the model over {len(gpus)} GPUs ({', '.join(g.name for g in gpus)}) fits in memory "
        f"with Nm={nm}: the least-loaded cut still needs {format_bytes(need)} on {order[j].name} "
        f"({order[j].type.name}, {format_bytes(order[j].type.memory_bytes)}) for units "
        f"{cuts[j]}..{cuts[j + 1] - 1}; "
        f"use more or larger GPUs per virtual worker, a smaller Nm or batch size"
        f"{'' if costs.recompute in ('full', 'auto') else ', recompute=full or auto'}, or weight_mode=latest")
  return vw_plan(cluster, profiles, order, cuts, nm, costs)


def fitting_plans(cluster: Cluster, profiles: Sequence[UnitProfile], gpus: Sequence[Gpu], nm_max: int | None = None,
                  costs: CostContext = DEFAULT_COSTS, ordered: bool = False,
                  allow_empty: bool = False) -> dict[int, VWPlan]:
  """Nm -> the fastest partition of the model over ``gpus`` at that Nm, for every Nm <= ``nm_max`` that fits.

  Args:
    cluster / profiles / gpus: as for :func:`partition`.
    nm_max: the largest Nm tried; default: the number of GPUs (a full pipeline).
    costs / ordered / allow_empty: as for :func:`partition`.

  Returns:
    The plans, Nm = 1 up to the largest that fits (memory only grows with Nm).

  Raises:
    ConfigError: when even Nm = 1 does not fit (naming what it needs), or for a bad ``nm_max``.
  """
  kwargs = {"costs": costs, "ordered": ordered, "allow_empty": allow_empty}
  nm_max = nm_max or len(gpus)
  if nm_max < 1:
    raise ConfigError(f"nm_max={nm_max}; it must be >= 1")
  plans = {1: partition(cluster, profiles, gpus, 1, **kwargs)}  # raises if nothing fits
  for nm in range(2, nm_max + 1):
    try:
      plans[nm] = partition(cluster, profiles, gpus, nm, **kwargs)
    except ConfigError:
      break  # memory only grows with Nm
  return plans


def plan_virtual_worker(cluster: Cluster, profiles: Sequence[UnitProfile], gpus: Sequence[Gpu],
                        nm_policy: str | int = "max_fit", nm_max: int | None = None,
                        costs: CostContext = DEFAULT_COSTS, ordered: bool = False,
                        allow_empty: bool = False) -> VWPlan:
  """Partitions the model over ``gpus`` and picks Nm (see the module docstring).

  Args:
    cluster / profiles / gpus: as for :func:`partition`.
    nm_policy: "max_fit", "best", "speed" (alone: its max_fit; relative to other virtual workers with
      :func:`hetpipe_jax.plan.allocation.plan_cluster`), or a number (that Nm).
    nm_max: the largest Nm tried; default: the number of GPUs (a full pipeline).
    costs / ordered / allow_empty: as for :func:`partition`.

  Returns:
    The plan at the chosen Nm.

  Raises:
    ConfigError: when even Nm = 1 does not fit, or for a bad policy or ``nm_max``.
  """
  kwargs = {"costs": costs, "ordered": ordered, "allow_empty": allow_empty}
  if isinstance(nm_policy, int):
    return partition(cluster, profiles, gpus, nm_policy, **kwargs)
  if nm_policy not in NM_POLICIES:
    raise ConfigError(f"unknown nm_policy {nm_policy!r}; use {', '.join(NM_POLICIES)} or a number")
  plans = fitting_plans(cluster, profiles, gpus, nm_max, **kwargs)
  if nm_policy == "speed":
    return speed_sized([plans])[0]
  if nm_policy == "max_fit":
    return plans[max(plans)]
  return max(plans.values(), key=lambda p: (p.throughput, -p.nm))
