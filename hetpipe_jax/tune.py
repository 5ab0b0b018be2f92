"""The auto-tuner: the fastest configuration of a model on a cluster, searched with the planner and the
``sim`` executor (issue 11).

A configuration is a grouping of the cluster's GPUs into virtual workers, each virtual worker's GPU order,
cuts and Nm, the clock distance bound D, the PS shard placement, whether stage-to-stage transfers
overlap computation, and whether each stage's part of a push and a pull moves on its own (staged PS
transfers). The search, in three rounds:

1. **Plan** every grouping: NP, ED, HD, and general ones (ED with m GPUs of every type per virtual worker,
   every node split into s virtual workers, HD's node pairs split into p virtual workers). Each virtual
   worker is partitioned (exactly, :mod:`hetpipe_jax.plan.partition`) at every Nm that fits its memory;
   alike virtual workers share one partition. Nm per virtual worker is then chosen three ways: the same
   Nm for all, the planner's ``max_fit``, and *sized to speed* (a faster virtual worker does more
   minibatches per wave, so that the waves of all take about as long: under WSP the long-run wave rate of
   every virtual worker is the slowest one's). Each choice gets the WSP-aware modelled rate:
   ``batch x sum_i Nm_i x min_i (T_i / Nm_i)`` for T_i the virtual worker's modelled minibatches/s.
2. **Screen** the best modelled choices (and the best two of every grouping; when staleness matters, a
   few more of every grouping spread over its range of wave sizes) on the simulator at D = 0, on short
   runs: a grouping's best modelled choice in every placement and transfer model, its other choices in the
   two settings that served that one best.
3. **Refine** the fastest few at every D, on runs of full length, and run the fixed policies (NP, ED, HD at
   the planner's max_fit Nm) in every setting too, so that the tuned configuration is at least as fast as
   each of them. The best is the prediction.

Every simulated run's trace passes the WSP checker. Cost: O(groupings x Nm) partitions plus a few dozen
short simulations; the paper testbed takes seconds.
"""

from __future__ import annotations

import bisect
import collections
import concurrent.futures
import contextlib
import dataclasses
import itertools
import multiprocessing
import os
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

from hetpipe_jax.cluster import Cluster, Gpu
from hetpipe_jax.core.check import check_trace
from hetpipe_jax.core.trace import Trace
from hetpipe_jax.cost.profile import UnitProfile
from hetpipe_jax.errors import ConfigError, ProtocolError
from hetpipe_jax.plan.allocation import POLICIES, allocate, hd_pairs, split_pair
from hetpipe_jax.plan.costmodel import ideal_images_per_sec
from hetpipe_jax.plan.layout import Layout
from hetpipe_jax.plan.partition import partition, search_states
from hetpipe_jax.plan.placement import PLACEMENTS
from hetpipe_jax.plan.vw_plan import VWPlan, vw_plan
from hetpipe_jax.sim import SimJob, SimOptions, simulate_fast

Progress = Callable[[str], None]


@dataclasses.dataclass(frozen=True)
class Candidate:
  """One configuration: virtual workers (GPU order, cuts, Nm), D, placement, transfer model."""

  grouping: str
  nm_rule: str
  plans: tuple[VWPlan, ...]
  d: int = 0
  placement: str = "default"
  overlap_transfers: bool = False
  staged_ps: bool = False

  @property
  def layout(self) -> Layout:
    return Layout(tuple(p.layout for p in self.plans))

  @property
  def label(self) -> str:
    transfers = "overlapped" if self.overlap_transfers else "serial"
    windows = self.layout.windows
    window = "" if windows is None else f" window {windows}"
    return (f"{self.grouping}, Nm {self.nm_rule} {[p.nm for p in self.plans]}{window}, D={self.d}, "
            f"{self.placement} placement, {transfers} transfers{', staged PS' if self.staged_ps else ''}")

  @property
  def sim_options(self) -> SimOptions:
    return SimOptions(overlap_transfers=self.overlap_transfers, staged_ps=self.staged_ps)

  def job(self, cluster: Cluster, profiles: Sequence[UnitProfile], waves: int, **kw) -> SimJob:
    """This configuration as a simulation of ``waves`` waves (``kw``: :class:`SimJob`'s other fields,
    ``placement`` included to simulate it elsewhere)."""
    return SimJob(cluster, profiles, self.layout, self.d, waves, **{"placement": self.placement, **kw},
                  options=self.sim_options)

  def modelled_images_per_sec(self, batch_size: int) -> float:
    """The plan's rate under WSP: every virtual worker runs waves at the slowest one's wave rate."""
    return modelled_images_per_sec(self.plans, batch_size)


def modelled_images_per_sec(plans: Sequence[VWPlan], batch_size: int) -> float:
  """``batch x sum_i Nm_i x min_i (T_i / Nm_i)``: the planned rate once WSP holds every virtual worker to
  the slowest wave rate (T_i: virtual worker i's modelled minibatches per second)."""
  waves_per_s = min(p.throughput / p.nm for p in plans)
  return batch_size * waves_per_s * sum(p.nm for p in plans)


def groupings(cluster: Cluster) -> list[tuple[str, list[list[Gpu]]]]:
  """Named groupings of the cluster's GPUs into virtual workers (see the module docstring); those a
  cluster cannot form are left out."""
  out: list[tuple[str, list[list[Gpu]]]] = []
  for policy in POLICIES:
    with contextlib.suppress(ConfigError):  # a cluster the policy cannot split
      out.append((policy, allocate(cluster, policy)))
  by_type: dict[str, list[Gpu]] = collections.defaultdict(list)
  for g in cluster.gpus:
    by_type[g.type.name].append(g)
  counts = {len(gs) for gs in by_type.values()}
  if len(counts) == 1:  # ED with m of every type per virtual worker
    n = counts.pop()
    for m in range(2, n + 1):
      if n % m == 0:
        out.append((f"ED x{m}", [[g for gs in by_type.values() for g in gs[v * m:(v + 1) * m]]
                                 for v in range(n // m)]))
  nodes = [cluster.node_gpus(n) for n in sorted({g.node for g in cluster.gpus})]
  sizes = {len(gs) for gs in nodes}
  for s in range(2, max(sizes) + 1):  # every node split into s virtual workers
    if all(size % s == 0 for size in sizes):
      out.append((f"NP /{s}", [gs[p * (len(gs) // s):(p + 1) * (len(gs) // s)] for gs in nodes
                               for p in range(s)]))
  hd = next((groups for name, groups in out if name == "HD"), None)
  if hd is not None:  # HD's node pairs as one virtual worker, or split finer than HD does
    pairs, odd = hd_pairs(cluster)
    for parts in range(1, max(min(len(a), len(b)) for a, b in pairs) + 1):
      if all(len(a) % parts == 0 and len(b) % parts == 0 for a, b in pairs):
        groups = [g for a, b in pairs for g in split_pair(a, b, parts)] + odd
        if sorted(map(_names, groups)) != sorted(map(_names, hd)):
          out.append((f"HD pairs /{parts}", groups))
  return out


def _names(group: Sequence[Gpu]) -> tuple[str, ...]:
  return tuple(g.name for g in group)


class _Planner:
  """Partitions of virtual workers at every Nm that fits, shared by alike virtual workers."""

  def __init__(self, cluster: Cluster, profiles: Sequence[UnitProfile], nm_max: int, weight_mode: str,
               optimizer_slots: float, precision: str):
    self.cluster, self.profiles, self.nm_max = cluster, profiles, nm_max
    self.kwargs = {"weight_mode": weight_mode, "optimizer_slots": optimizer_slots, "precision": precision}
    self._cache: dict[tuple, dict[int, VWPlan]] = {}
    self.partitions = 0

  @staticmethod
  def _key(gpus: Sequence[Gpu]) -> tuple:
    """Alike virtual workers: the same GPU types, split over nodes the same way."""
    by_node: dict[int, list[str]] = collections.defaultdict(list)
    for g in gpus:
      by_node[g.node].append(g.type.name)
    return tuple(sorted(tuple(sorted(types)) for types in by_node.values()))

  def plans(self, gpus: Sequence[Gpu]) -> dict[int, VWPlan]:
    """Nm -> the fastest partition of ``gpus`` at that Nm, for every Nm <= nm_max that fits."""
    key = self._key(gpus)
    template = self._cache.get(key)
    if template is not None:
      moved = {nm: self._move(p, gpus) for nm, p in template.items()}
      if all(m is not None for m in moved.values()):
        return {nm: m for nm, m in moved.items() if m is not None}
    out = {}
    for nm in range(1, self.nm_max + 1):
      try:
        out[nm] = partition(self.cluster, self.profiles, gpus, nm, **self.kwargs)
        self.partitions += 1
      except ConfigError:
        break  # memory only grows with Nm
    self._cache.setdefault(key, out)
    return out

  def _move(self, plan: VWPlan, gpus: Sequence[Gpu]) -> VWPlan | None:
    """``plan``'s order and cuts on alike GPUs (None when the copy is not exactly as fast)."""
    free = list(gpus)
    node_map: dict[int, int] = {}
    order = []
    for g in plan.gpus:
      match = next((h for h in free if h.type.name == g.type.name and node_map.get(g.node, h.node) == h.node
                    and (g.node in node_map or h.node not in node_map.values())), None)
      if match is None:
        return None
      node_map.setdefault(g.node, match.node)
      free.remove(match)
      order.append(match)
    moved = vw_plan(self.cluster, self.profiles, order, plan.cuts, plan.nm, window=plan.window, **self.kwargs)
    return moved if abs(moved.bottleneck_s - plan.bottleneck_s) <= 1e-12 * plan.bottleneck_s else None


def nm_choices(per_vw: Sequence[dict[int, VWPlan]], k_max: Sequence[int],
               wave_max: int | None = None) -> list[tuple[str, tuple[VWPlan, ...]]]:
  """Nm per virtual worker, three ways (the module docstring): the same for all, the planner's max_fit
  (the largest Nm <= the virtual worker's stage count), sized to speed. With ``wave_max``, sized to speed
  may give a virtual worker waves of up to ``wave_max`` minibatches beyond the Nm its memory holds, with a
  window of the largest Nm that fits. Distinct choices only."""
  out: dict[tuple[int, ...], tuple[str, tuple[VWPlan, ...]]] = {}

  def add(rule: str, nms: Sequence[int]) -> None:
    key = tuple(nms)
    if key not in out:
      out[key] = (rule, tuple(plans[n] for plans, n in zip(per_vw, nms)))

  add("max_fit", [max(n for n in plans if n <= max(k, 1)) for plans, k in zip(per_vw, k_max)])
  for n in sorted(set.intersection(*(set(p) for p in per_vw))):
    add("uniform", [n] * len(per_vw))
  if wave_max is not None:  # waves beyond what fits in flight, with a window of the largest that fits
    per_vw = [{**{n: plans[max(plans)].with_wave(n) for n in range(max(plans) + 1, wave_max + 1)}, **plans}
              for plans in per_vw]
  wave_times = sorted({n / p.throughput for plans in per_vw for n, p in plans.items()})
  for w in wave_times:  # each virtual worker: the most minibatches whose wave lasts at most w
    nms = [max((n for n, p in plans.items() if n / p.throughput <= w * (1 + 1e-9)), default=0) for plans in per_vw]
    if all(nms):
      add("speed-sized", nms)
  return list(out.values())


@dataclasses.dataclass(frozen=True)
class StalenessModel:
  """The staleness-aware estimate of time to accuracy: a run needs ``images0 x (1 + beta x staleness)``
  training images to reach the target, for ``staleness`` the mean count of updates missing from its forward
  passes (:func:`mean_staleness`), so its time to accuracy is that over its images/s. Fitted to real runs by
  :func:`fit_staleness_model` (the convergence study does, and validates it)."""

  images0: float
  beta: float
  target_accuracy: float | None = None

  def images(self, staleness: float) -> float:
    return self.images0 * (1 + self.beta * staleness)

  def seconds(self, images_per_sec: float, staleness: float) -> float:
    return self.images(staleness) / images_per_sec


def fit_staleness_model(points: Sequence[tuple[float, float]], target_accuracy: float | None = None
                        ) -> StalenessModel:
  """Least squares of images to target = a + b x staleness over ``(staleness, images)`` points of real
  runs; images0 = a, beta = b / a (beta = 0 with one point, or when the points all share one staleness).

  Raises:
    ConfigError: without points, or when the fit gives no positive images at zero staleness.
  """
  if not points:
    raise ConfigError("the staleness-aware estimate needs real runs that reached the target accuracy; none "
                      "did: lower the target or train longer")
  xs, ys = [p[0] for p in points], [p[1] for p in points]
  mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
  sxx = sum((x - mx) ** 2 for x in xs)
  b = 0.0 if sxx == 0 else sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx
  a = my - b * mx
  if a <= 0:
    raise ConfigError(f"the staleness fit gives {a:.4g} images at zero staleness (slope {b:.4g} per unit of "
                      "staleness): the runs do not support a staleness-aware estimate; use more or longer runs")
  return StalenessModel(a, b / a, target_accuracy)


def mean_staleness(events: Sequence[dict[str, Any]]) -> float:
  """The mean staleness of a trace's forward passes, counted as asynchronous SGD counts it: the minibatch
  updates of *every* virtual worker that were done when the forward started but are missing from its
  weights. For minibatch p of virtual worker i starting at t: its own missing updates p - 1 - own, plus,
  for every other live virtual worker k, the minibatches k had completed by t minus the Nm_k x glob[k]
  its weights hold. (More virtual workers, larger Nm and larger D all raise it.)"""
  meta = events[0]
  nms = meta["nm"]
  done: list[list[float]] = [[] for _ in nms]  # completion times per virtual worker, in order
  left: set[int] = set()
  for ev in events[1:]:
    if ev["ev"] == "complete":
      done[ev["vw"]].append(ev["t"])
  total = count = 0
  for ev in events[1:]:
    kind = ev["ev"]
    if kind == "leave":
      left.add(ev["vw"])
    elif kind == "join":
      left.discard(ev["vw"])
    elif kind == "fwd":
      i, t = ev["vw"], ev["t0"]
      missing = ev["mb"] - 1 - ev["own"]
      for k, g in enumerate(ev["glob"]):
        if k != i and k not in left:
          missing += max(0, bisect.bisect_right(done[k], t) - nms[k] * g)
      total += missing
      count += 1
  return total / count if count else 0.0


@dataclasses.dataclass(frozen=True)
class Result:
  """A simulated candidate: its images/s, the mean staleness of its trace."""

  candidate: Candidate
  images_per_sec: float
  ideal_images_per_sec: float
  waves: int
  staleness: float = 0.0

  @property
  def efficiency(self) -> float:
    return self.images_per_sec / self.ideal_images_per_sec


def simulate_candidate(cluster: Cluster, profiles: Sequence[UnitProfile], candidate: Candidate, waves: int,
                       batch_size: int, schedule: str = "1f1b", weight_mode: str = "stash",
                       precision: str = "fp32") -> tuple[float, float]:
  """Images per second of ``candidate`` on the ``sim`` executor over ``waves`` waves (as a run's
  ``images_per_second``), simulated in the fast mode (:mod:`hetpipe_jax.sim.steady`: until the waves
  repeat, then extrapolated), and the mean staleness of its simulated trace.

  Raises:
    ProtocolError: when the trace breaks a WSP guarantee.
  """
  trace = Trace()
  seconds, _, _, _ = simulate_fast(candidate.job(cluster, profiles, waves, schedule=schedule,
                                                 weight_mode=weight_mode, precision=precision), trace)
  violations = check_trace(trace.events)
  if violations:
    raise ProtocolError(f"tuner candidate {candidate.label}: {violations[0]}")
  return batch_size * waves * sum(candidate.layout.nms) / seconds, mean_staleness(trace.events)


def tune(cluster: Cluster, profiles: Sequence[UnitProfile], batch_size: int, *, waves: int = 50,
         ds: Sequence[int] = (0, 4, 32), placements: Sequence[str] = PLACEMENTS,
         transfers: Sequence[bool] = (False, True), staged: Sequence[bool] = (False, True), nm_max: int = 32,
         screen: int = 16, refine: int = 6,
         weight_mode: str = "stash", optimizer_slots: float = 0.0, precision: str = "fp32",
         schedule: str = "1f1b", max_states: int = 100_000, max_stages: int | None = None,
         windows: bool = True, staleness_model: StalenessModel | None = None, front: int | None = None,
         progress: Progress | None = None, workers: int | None = None) -> dict[str, Any]:
  """Searches configurations of ``profiles``' model on ``cluster`` (the module docstring).

  Args:
    cluster / profiles / batch_size: the model at its batch size on the cluster.
    waves: waves per virtual worker of the refining (and predicting) runs; screening runs half as many.
    ds / placements / transfers / staged: the D values, placements, transfer models (overlapped or not)
      and PS transfer models (staged or not) searched.
    nm_max: the largest Nm tried.
    screen / refine: how many modelled choices are screened, and how many screened ones refined.
    weight_mode / optimizer_slots / precision / schedule: as for a run.
    max_states: groupings with a virtual worker whose order search is larger than this are skipped
      (:func:`hetpipe_jax.plan.partition.search_states`; 16 GPUs of 16 distinct (type, node) pairs have
      about a million).
    max_stages: groupings with a larger virtual worker are skipped (e.g. a small model trained on the
      tuned configuration's clock has only so many units to cut).
    windows: Nm sized to speed may exceed what a virtual worker's memory holds in flight, up to
      ``nm_max``, with a window (:func:`nm_choices`).
    staleness_model: rank by its predicted time to accuracy (fastest first) instead of by images/s.
    front: also screen up to this many of every grouping's Nm choices, spread evenly over its modelled
      rates (fewer minibatches per wave: fewer images/s but less staleness), so that the results hold the
      trade-off between images/s and staleness and not only the fastest choices (None: 6 with a
      ``staleness_model``, else 0).
    progress: called with a line at every step.
    workers: processes that simulate candidates at once (None: one per CPU core; 1: this process only).
      The results are the same for any count.

  Returns:
    ``{"best": Result, "results": [Result] fastest first (every simulated run), "planned": count of
    modelled choices, "partitions": count, "seconds": host seconds}``.

  Raises:
    ConfigError: when no grouping of the cluster fits the model.
  """
  t0 = time.perf_counter()
  say = progress or (lambda _: None)
  if waves < 2:
    raise ConfigError(f"waves={waves}; the tuner needs at least 2 waves per virtual worker")
  planner = _Planner(cluster, profiles, nm_max, weight_mode, optimizer_slots, precision)
  choices: list[Candidate] = []
  for name, groups in groupings(cluster):
    if any(len(g) > min(len(profiles), max_stages or len(profiles)) for g in groups):
      continue
    states = max(search_states(g) for g in groups)
    if states > max_states:
      say(f"skipped {name}: a virtual worker's order search has {states:,} states (at most {max_states:,})")
      continue
    try:
      per_vw = [planner.plans(g) for g in groups]
    except ConfigError:
      continue  # a virtual worker that no partition fits
    if any(not p for p in per_vw):
      continue
    found = nm_choices(per_vw, [len(g) for g in groups], nm_max if windows else None)
    choices += [Candidate(name, rule, plans) for rule, plans in found]
    say(f"planned {name}: {len(groups)} virtual workers, {len(found)} Nm choices "
        f"({time.perf_counter() - t0:.1f} s)")
  if not choices:
    raise ConfigError(f"no grouping of cluster {cluster.name!r} fits the model at Nm = 1; use a cluster with "
                      "more GPU memory or a smaller batch size")
  ranked = sorted(choices, key=lambda c: -c.modelled_images_per_sec(batch_size))
  keep = ranked[:screen]
  front = (6 if staleness_model is not None else 0) if front is None else front
  for name in dict.fromkeys(c.grouping for c in choices):
    mine = [c for c in ranked if c.grouping == name]
    keep += mine[:2] + spread(mine, front)
  keep = list(dict.fromkeys(keep))
  ideal = ideal_images_per_sec(cluster, profiles, batch_size, precision=precision)
  key = lambda r: -r.images_per_sec if staleness_model is None else staleness_model.seconds(r.images_per_sec,
                                                                                           r.staleness)
  short = max(2, waves // 2)
  with _Simulations(workers, (cluster, profiles, batch_size, schedule, weight_mode, precision), ideal) as sims:
    # screen: a grouping's best modelled choice (its first in keep) in every setting, its others in the
    # two settings that served that one best
    firsts = [c for i, c in enumerate(keep) if all(o.grouping != c.grouping for o in keep[:i])]
    every = list(itertools.product(placements, transfers, staged))
    settings: dict[str, list[tuple[str, bool, bool]]] = {}  # grouping -> (placement, overlap, staged), best first
    screened, done = [], 0
    for batch in ([(c, every) for c in firsts], [(c, None) for c in keep if c not in firsts]):
      jobs = [(c, tried or settings[c.grouping][:2]) for c, tried in batch]
      runs = sims.run([(dataclasses.replace(c, d=min(ds), placement=p, overlap_transfers=o, staged_ps=s), short)
                       for c, tried in jobs for p, o, s in tried])
      for c, tried in jobs:
        found = sorted((next(runs) for _ in tried), key=key)
        settings.setdefault(c.grouping, [(r.candidate.placement, r.candidate.overlap_transfers,
                                          r.candidate.staged_ps) for r in found])
        screened += found
        done += 1
        say(f"screened {done}/{len(keep)}: {c.grouping} Nm {[p.nm for p in c.plans]} "
            f"best {found[0].images_per_sec:.1f} images/s ({time.perf_counter() - t0:.1f} s)")
    screened.sort(key=key)
    refined: dict[Candidate, Result] = {}
    top = screened[:refine]
    runs = sims.run([(dataclasses.replace(r.candidate, d=d), waves) for r in top for d in ds])
    for i, _ in enumerate(top):
      found = [next(runs) for _ in ds]
      refined.update((r.candidate, r) for r in found)
      say(f"refined {i + 1}/{len(top)}: {found[0].candidate.grouping} "
          f"{max(r.images_per_sec for r in found):.1f} images/s ({time.perf_counter() - t0:.1f} s)")
    # the fixed policies as the planner runs them (NP, ED, HD at max_fit), in every setting: the tuned
    # configuration is then at least as fast as each of them
    fixed = [c for c in choices if c.grouping in POLICIES and c.nm_rule == "max_fit"]
    todo = [[s for s in (dataclasses.replace(c, d=d, placement=p, overlap_transfers=o, staged_ps=st)
                         for p, o, st, d in itertools.product(placements, transfers, staged, ds))
             if s not in refined]
            for c in fixed]
    runs = sims.run([(s, waves) for group in todo for s in group])
    for c, group in zip(fixed, todo):
      refined.update((s, next(runs)) for s in group)
      say(f"ran the fixed policy {c.grouping} in every setting ({time.perf_counter() - t0:.1f} s)")
  results = sorted(refined.values(), key=key)
  return {"best": results[0], "results": results + screened[refine:], "planned": len(choices),
          "partitions": planner.partitions, "seconds": time.perf_counter() - t0}


def spread(items: Sequence[Any], n: int) -> list[Any]:
  """``n`` of ``items`` evenly spaced from the first to the last (all of them when there are at most n)."""
  if len(items) <= n:
    return list(items)
  if n <= 1:
    return list(items[:n])
  return [items[round(i * (len(items) - 1) / (n - 1))] for i in range(n)]


def pareto_front(results: Iterable[Result]) -> list[Result]:
  """The results no other is both faster and less stale than, least stale first (one per staleness): the
  trade-off between images/s and mean staleness the tuner found."""
  front: list[Result] = []
  for r in sorted(results, key=lambda r: (r.staleness, -r.images_per_sec)):
    if not front or r.images_per_sec > front[-1].images_per_sec:
      front.append(r)
  return front


_SIM_ARGS: tuple = ()  # a worker process's (cluster, profiles, batch_size, schedule, weight_mode, precision)


def _init_worker(args: tuple) -> None:
  global _SIM_ARGS
  _SIM_ARGS = args


def _simulate_job(job: tuple[Candidate, int], args: tuple = ()) -> tuple[float, float]:
  cluster, profiles, batch_size, schedule, weight_mode, precision = args or _SIM_ARGS
  candidate, waves = job
  return simulate_candidate(cluster, profiles, candidate, waves, batch_size, schedule, weight_mode, precision)


class _Simulations:
  """The tuner's simulations, on ``workers`` processes (None: one per CPU core) when more than one:
  each a deterministic function of its candidate, so the results do not depend on how many run at once."""

  def __init__(self, workers: int | None, args: tuple, ideal: float):
    self.workers = (os.cpu_count() or 1) if workers is None else workers
    self.args, self.ideal = args, ideal
    self.pool: concurrent.futures.ProcessPoolExecutor | None = None

  def __enter__(self) -> _Simulations:
    if self.workers > 1:
      self.pool = concurrent.futures.ProcessPoolExecutor(
          self.workers, mp_context=multiprocessing.get_context("spawn"), initializer=_init_worker,
          initargs=(self.args,))
    return self

  def __exit__(self, *exc) -> None:
    if self.pool is not None:
      self.pool.shutdown(cancel_futures=True)

  def run(self, jobs: list[tuple[Candidate, int]]) -> Iterator[Result]:
    """The results of ``jobs`` (candidate, waves) in order, each as soon as it and those before it are in."""
    if self.pool is None or len(jobs) < 2:
      outs: Iterable[tuple[float, float]] = (_simulate_job(job, self.args) for job in jobs)
    else:
      outs = self.pool.map(_simulate_job, jobs)
    return (Result(c, ips, self.ideal, w, staleness) for (c, w), (ips, staleness) in zip(jobs, outs))


def replicate(candidate: Candidate, cluster: Cluster, profiles: Sequence[UnitProfile], *, nm_max: int = 16,
              weight_mode: str = "stash", optimizer_slots: float = 0.0, precision: str = "fp32") -> Candidate:
  """``candidate`` (tuned on a smaller cluster) on ``cluster``: its grouping formed there, every virtual
  worker given the GPU order, cuts and Nm of an alike one of ``candidate`` (the same GPU types, split over
  nodes the same way), and the same D, placement and transfer model. Alike virtual workers are planned
  once: O(virtual workers) after that (weak scaling of a tuned configuration).

  Raises:
    ConfigError: when ``cluster`` cannot form the grouping, or forms a virtual worker unlike every one of
      ``candidate``.
  """
  formed = dict(groupings(cluster))
  if candidate.grouping not in formed:
    raise ConfigError(f"grouping {candidate.grouping!r} cannot be formed on cluster {cluster.name!r}; it "
                      f"forms {', '.join(formed)}")
  templates = {_Planner._key(p.gpus): p for p in candidate.plans}
  planner = _Planner(cluster, profiles, nm_max, weight_mode, optimizer_slots, precision)
  plans = []
  for gpus in formed[candidate.grouping]:
    template = templates.get(_Planner._key(gpus))
    if template is None:
      raise ConfigError(f"virtual worker {', '.join(g.name for g in gpus)} of grouping {candidate.grouping!r} "
                        f"on {cluster.name!r} is like none of the tuned configuration's; tune on a cluster "
                        "with every kind of node")
    moved = planner._move(template, gpus)  # None when the copy would not be as fast: plan it at that Nm
    plans.append(moved or partition(cluster, profiles, gpus, template.in_flight, **planner.kwargs).with_wave(
        template.nm))
  return dataclasses.replace(candidate, plans=tuple(plans))


def candidate_json(candidate: Candidate) -> dict[str, Any]:
  """A candidate's settings as a run takes them: the grouping (GPU indices in pipeline order), cuts, Nm,
  window (most minibatches in flight), D, placement, transfer model."""
  return {"grouping": candidate.grouping, "nm_rule": candidate.nm_rule,
          "policy": [[g.index for g in p.gpus] for p in candidate.plans],
          "cuts": [list(p.cuts) for p in candidate.plans], "nm": [p.nm for p in candidate.plans],
          "window": [p.in_flight for p in candidate.plans],
          "d": candidate.d, "placement": candidate.placement, "overlap_transfers": candidate.overlap_transfers,
          "staged_ps": candidate.staged_ps}


def result_json(result: Result, batch_size: int, staleness_model: StalenessModel | None = None) -> dict[str, Any]:
  """A result as ``tune.json`` holds it: the settings, the predicted images/s and efficiency, the plan's
  modelled images/s, the mean staleness and (with a staleness model) the predicted time to accuracy."""
  out = {**candidate_json(result.candidate), "images_per_sec": result.images_per_sec,
         "efficiency": result.efficiency, "modelled_images_per_sec":
             result.candidate.modelled_images_per_sec(batch_size), "waves": result.waves,
         "mean_staleness": result.staleness}
  if staleness_model is not None:
    out["time_to_accuracy_s"] = staleness_model.seconds(result.images_per_sec, result.staleness)
  return out


def policy_rows(results: Iterable[Result]) -> dict[str, Result]:
  """The first result of every grouping in ``results`` (the best, when they are ranked)."""
  best: dict[str, Result] = {}
  for r in results:
    best.setdefault(r.candidate.grouping, r)
  return best
