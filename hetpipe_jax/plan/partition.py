"""Heterogeneity- and memory-aware partitioning of a model over one virtual worker's GPUs.

HETPIPE.md section 4 (our reading of the paper, made exact): choose contiguous stages, one per GPU, and
the order of the GPUs in the pipeline, to minimise the slowest stage, where a stage's time is its units'
forward + backward time on its GPU type plus receiving its boundary tensors over the links to its
neighbours (:func:`hetpipe_jax.cost.transfer.stage_seconds`), subject to every stage fitting its GPU's
memory (:func:`hetpipe_jax.cost.memory.stage_memory_bytes`). The DP's vectorised matrices are built from
those same definitions: the memory formula applied to each unit, then prefix sums; the receive time at
every cut position (:func:`hetpipe_jax.cost.transfer.receive_seconds_by_position`).

Algorithm: for a fixed device order, a DP over (stage, last unit) is exact for a chain of L units:
``best[j][e] = min_s max(best[j-1][s], T_j(s, e))``, vectorised over (s, e) with prefix sums, O(k L^2)
per order. Orders are the distinct permutations of the GPUs' (type, node) signatures (GPUs with equal
signatures are interchangeable), enumerated depth-first so orders sharing a prefix share its DP rows:
at most k!/prod(m_i!) orders for multiplicities m_i, in practice far fewer DP rows than orders x k.
Nm is picked by ``nm_policy``: ``max_fit`` (the largest Nm <= ``nm_max`` that fits) or ``best`` (the
largest modelled throughput min(1/bottleneck, Nm/latency), ties to the smaller Nm), or a given number.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from hetpipe_jax.cluster import Cluster, Gpu, format_bytes
from hetpipe_jax.cost.memory import memory_bytes, stage_memory_bytes
from hetpipe_jax.cost.profile import UnitProfile
from hetpipe_jax.cost.transfer import receive_seconds_by_position, stage_neighbours
from hetpipe_jax.errors import ConfigError
from hetpipe_jax.plan.vw_plan import VWPlan, vw_plan

NM_POLICIES = ("max_fit", "best")


class _Dp:
  """Prefix sums and vectorised stage-time matrices for one model on one cluster."""

  def __init__(self, cluster: Cluster, profiles: Sequence[UnitProfile], nm: int, weight_mode: str,
               optimizer_slots: float, precision: str, allow_empty: bool):
    self.cluster, self.profiles, self.precision = cluster, profiles, precision
    self.n = len(profiles)
    mem = np.array([memory_bytes(u.param_bytes, u.kept_bytes, nm, weight_mode, optimizer_slots, precision)
                    for u in profiles], np.float64)
    self._mem = np.concatenate([[0.0], np.cumsum(mem)])
    self._time: dict[str, np.ndarray] = {}
    self._recv_cache: dict[tuple[int | None, int], np.ndarray] = {}
    s = np.arange(self.n + 1)
    self._valid = (s[:, None] <= s[None, :]) if allow_empty else (s[:, None] < s[None, :])

  def _prefix_time(self, gpu: Gpu) -> np.ndarray:
    if gpu.type.name not in self._time:
      t = np.array([sum(u.seconds(gpu.type, self.precision)) for u in self.profiles])
      self._time[gpu.type.name] = np.concatenate([[0.0], np.cumsum(t)])
    return self._time[gpu.type.name]

  def _recv(self, src: Gpu | None, dst: Gpu) -> np.ndarray:
    """Seconds to receive the boundary tensor at every cut position c (0..n) from ``src``."""
    key = (None if src is None else src.index, dst.index)
    if key not in self._recv_cache:
      self._recv_cache[key] = receive_seconds_by_position(self.cluster, self.profiles, src, dst, self.precision)
    return self._recv_cache[key]

  def memory_matrix(self) -> np.ndarray:
    """M(s, e): the memory of a stage holding units s .. e - 1 (meaningful for s <= e)."""
    return self._mem[None, :] - self._mem[:, None]

  def stage_matrix(self, gpus: Sequence[Gpu], j: int, mem_ratio: bool = False) -> np.ndarray:
    """T_j(s, e) for every cut (s, e) of stage j.

    Args:
      gpus: the GPUs in pipeline order (stage j's and its neighbours' matter).
      j: the stage.
      mem_ratio: return memory needed / memory available instead of seconds.

    Returns:
      An ``(n + 1, n + 1)`` array: seconds per minibatch (compute + receives, inf where the cut is
      invalid or out of memory), or the memory ratio (inf where invalid).
    """
    gpu = gpus[j]
    mem = self.memory_matrix()
    if mem_ratio:
      value = mem / gpu.type.memory_bytes
    else:
      prev, nxt = stage_neighbours(gpus, j)
      p = self._prefix_time(gpu)
      value = p[None, :] - p[:, None]
      value = value + self._recv(prev, gpu)[:, None]  # the activation at the first cut s
      value = value + self._recv(nxt, gpu)[None, :]  # the gradient at the last cut e
      value = np.where(mem <= gpu.type.memory_bytes, value, np.inf)
    return np.where(self._valid, value, np.inf)


def _signature_groups(gpus: Sequence[Gpu]) -> dict[tuple, list[Gpu]]:
  """GPUs grouped by (type, node): members of a group are interchangeable in a pipeline order."""
  groups: dict[tuple, list[Gpu]] = {}
  for g in gpus:
    groups.setdefault((g.type.name, g.node), []).append(g)
  return groups


def _search(dp: _Dp, gpus: Sequence[Gpu], ordered: bool, mem_ratio: bool = False):
  """Minimises the max over stages of T_j (or of the memory ratio); returns (value, order, cuts)."""
  k, n = len(gpus), dp.n
  best = {"value": np.inf, "order": None, "cuts": None}

  def finish(order, rows, args):
    if rows[-1][n] < best["value"]:
      cuts, e = [n], n
      for j in range(k - 1, -1, -1):
        e = int(args[j][e])
        cuts.append(e)
      best.update(value=float(rows[-1][n]), order=list(order), cuts=cuts[::-1])

  def extend(order, rows, args, j):
    """Adds stage j (its GPU and the next one are chosen) to the DP rows."""
    prev = rows[-1] if rows else np.where(np.arange(n + 1) == 0, 0.0, np.inf)
    cand = np.maximum(prev[:, None], dp.stage_matrix(order, j, mem_ratio))
    return rows + [cand.min(axis=0)], args + [cand.argmin(axis=0)]

  if ordered:
    rows, args = [], []
    for j in range(k):
      rows, args = extend(gpus, rows, args, j)
    finish(gpus, rows, args)
  else:
    groups = _signature_groups(gpus)
    counts = dict.fromkeys(groups, 0)

    def rec(order, rows, args):
      # Stage len(order)-2 can be finalised once its successor is chosen.
      if len(order) == k:
        rows, args = extend(order, rows, args, k - 1)
        finish(order, rows, args)
        return
      for key, members in groups.items():
        if counts[key] < len(members):
          counts[key] += 1
          nxt = order + [members[counts[key] - 1]]
          r, a = (rows, args) if len(nxt) < 2 else extend(nxt, rows, args, len(nxt) - 2)
          if not (r and np.isinf(r[-1]).all()):
            rec(nxt, r, a)
          counts[key] -= 1

    rec([], [], [])
  return best["value"], best["order"], best["cuts"]


def partition(cluster: Cluster, profiles: Sequence[UnitProfile], gpus: Sequence[Gpu], nm: int,
              weight_mode: str = "stash", optimizer_slots: float = 0.0, ordered: bool = False,
              allow_empty: bool = False, precision: str = "fp32") -> VWPlan:
  """The fastest feasible partition of the model over ``gpus`` at a given Nm.

  Args:
    cluster: the cluster (links between the GPUs).
    profiles: per-unit profiles of the model at the training batch size.
    gpus: the virtual worker's GPUs; their order is searched unless ``ordered``.
    nm: minibatches in flight (memory grows with it).
    weight_mode / optimizer_slots: what the memory of a stage holds (see stage_memory_bytes).
    ordered: keep the GPUs' order (only the cuts are searched).
    allow_empty: let a GPU take no units (it then only relays activations).
    precision: "fp32" or "fp16".

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
  dp = _Dp(cluster, profiles, nm, weight_mode, optimizer_slots, precision, allow_empty)
  value, order, cuts = _search(dp, gpus, ordered)
  if not np.isfinite(value):
    _, order, cuts = _search(dp, gpus, ordered, mem_ratio=True)
    needs = [stage_memory_bytes(profiles[cuts[j]:cuts[j + 1]], nm, weight_mode, optimizer_slots, precision)
             for j in range(len(order))]
    j = max(range(len(order)), key=lambda j: needs[j] / order[j].type.memory_bytes)
    need = needs[j]
    raise ConfigError(
        f"no partition of the model over {len(gpus)} GPUs ({', '.join(g.name for g in gpus)}) fits in memory "
        f"with Nm={nm}: the least-loaded cut still needs {format_bytes(need)} on {order[j].name} "
        f"({order[j].type.name}, {format_bytes(order[j].type.memory_bytes)}) for units "
        f"{cuts[j]}..{cuts[j + 1] - 1}; "
        "use more or larger GPUs per virtual worker, a smaller Nm or batch size, or weight_mode=latest")
  return vw_plan(cluster, profiles, order, cuts, nm, weight_mode, optimizer_slots, precision)


def plan_virtual_worker(cluster: Cluster, profiles: Sequence[UnitProfile], gpus: Sequence[Gpu],
                        nm_policy: str | int = "max_fit", nm_max: int | None = None,
                        weight_mode: str = "stash", optimizer_slots: float = 0.0, ordered: bool = False,
                        allow_empty: bool = False, precision: str = "fp32") -> VWPlan:
  """Partitions the model over ``gpus`` and picks Nm (see the module docstring).

  Args:
    cluster / profiles / gpus: as for :func:`partition`.
    nm_policy: "max_fit", "best", or a number (that Nm).
    nm_max: the largest Nm tried; default: the number of GPUs (a full pipeline).
    weight_mode / optimizer_slots / ordered / allow_empty / precision: as for :func:`partition`.

  Returns:
    The plan at the chosen Nm.

  Raises:
    ConfigError: when even Nm = 1 does not fit, or for a bad policy or ``nm_max``.
  """
  kwargs = {"weight_mode": weight_mode, "optimizer_slots": optimizer_slots, "ordered": ordered,
            "allow_empty": allow_empty, "precision": precision}
  if isinstance(nm_policy, int):
    return partition(cluster, profiles, gpus, nm_policy, **kwargs)
  if nm_policy not in NM_POLICIES:
    raise ConfigError(f"unknown nm_policy {nm_policy!r}; use {' or '.join(NM_POLICIES)} or a number")
  nm_max = nm_max or len(gpus)
  if nm_max < 1:
    raise ConfigError(f"nm_max={nm_max}; it must be >= 1")
  plans = [partition(cluster, profiles, gpus, 1, **kwargs)]  # raises if nothing fits
  for nm in range(2, nm_max + 1):
    try:
      plans.append(partition(cluster, profiles, gpus, nm, **kwargs))
    except ConfigError:
      break  # memory only grows with Nm
  if nm_policy == "max_fit":
    return plans[-1]
  return max(plans, key=lambda p: (p.throughput, -p.nm))

