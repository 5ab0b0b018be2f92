"""The search (:func:`tune`), in the three rounds :mod:`hetpipe_jax.tune` describes: plan, screen, refine; and
beside them the peers' grids (:mod:`hetpipe_jax.tune.peers`), ranked with HetPipe's configurations by the same
objective."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Iterator, Sequence
from typing import TypeVar

from hetpipe_jax.cluster import Cluster, Gpu
from hetpipe_jax.cost.batch import BatchProfiles
from hetpipe_jax.cost.profile import UnitProfile
from hetpipe_jax.errors import ConfigError
from hetpipe_jax.plan.allocation import POLICIES
from hetpipe_jax.plan.costmodel import ideal_images_per_sec
from hetpipe_jax.plan.partition import search_states
from hetpipe_jax.plan.tensor_groups import lead_cluster, tp_degrees
from hetpipe_jax.plan.vw_plan import vw_plan
from hetpipe_jax.staleness import StalenessModel
from hetpipe_jax.tune.candidate import Candidate
from hetpipe_jax.tune.groupings import groupings
from hetpipe_jax.tune.options import Progress, RunSetting, SearchSpace, Setting, TuneOptions
from hetpipe_jax.tune.peers import PeerResult, PeerSkip, search_peers
from hetpipe_jax.tune.planner import Planner, nm_choices
from hetpipe_jax.tune.pool import SimContext, Simulations
from hetpipe_jax.tune.result import Result, TuneResult
from hetpipe_jax.tune.statistical import PeerAccuracyModel, fit_peer_accuracy

T = TypeVar("T")
RankKey = Callable[[Result], float]
PeerKey = Callable[[PeerResult], float]


class _Say:
  """The search's progress lines, with the host seconds since it started."""

  def __init__(self, progress: Progress | None):
    self.progress = progress or (lambda _: None)
    self.t0 = time.perf_counter()

  def __call__(self, line: str) -> None:
    self.progress(line)

  @property
  def seconds(self) -> float:
    return time.perf_counter() - self.t0


def tune(cluster: Cluster, profiles: Sequence[UnitProfile] | BatchProfiles, batch_size: int,
         space: SearchSpace | None = None, options: TuneOptions | None = None) -> TuneResult:
  """Searches configurations of ``profiles``' model at ``batch_size`` on ``cluster`` (:mod:`hetpipe_jax.tune`)
  over ``space``, as ``options`` say (None: their defaults); with ``space.peers``, those peers' grids too
  (:mod:`hetpipe_jax.tune.peers`), ranked by the same objective.

  Args:
    cluster: the cluster.
    profiles: the model's unit profiles at ``batch_size``, or at any batch size (the peers need them: a
      :class:`~hetpipe_jax.cost.batch.BatchProfiles`).
    batch_size: examples per minibatch.
    space: what is searched.
    options: how.

  Returns:
    The best configuration and every simulated one, ranked (:class:`~hetpipe_jax.tune.result.TuneResult`).

  Raises:
    ConfigError: when no grouping of the cluster fits the model, or peers are searched without a
      :class:`~hetpipe_jax.cost.batch.BatchProfiles`.
  """
  space = SearchSpace() if space is None else space
  options = TuneOptions() if options is None else options
  say = _Say(options.progress)
  if options.waves < 2:
    raise ConfigError(f"waves={options.waves}; the tuner needs at least 2 waves per virtual worker")
  if space.peers and not isinstance(profiles, BatchProfiles):
    raise ConfigError("the peer search splits batches unevenly: give the model's profiles at two batch sizes "
                      "(hetpipe_jax.cost.batch.BatchProfiles), or search no peers")
  units = list(profiles.at(batch_size)) if isinstance(profiles, BatchProfiles) else profiles
  choices, partitions = split_choices(cluster, units, space, options.setting, say)
  keep = shortlist(choices, batch_size, options.screen, options.front_size)
  ideal = ideal_images_per_sec(cluster, units, batch_size, precision=options.setting.costs.precision)
  key = rank_key(options.staleness_model)
  with Simulations(options.workers, SimContext(cluster, units, batch_size, options.setting), ideal) as sims:
    screened = screen(sims, keep, space, key, max(2, options.waves // 2), say)
    refined = refine(sims, screened[:options.refine], space.ds, options.waves, say)
    refined.update(run_fixed(sims, choices, space, options.waves, refined, say))
  results = sorted(refined.values(), key=key)
  peers: list[PeerResult] = []
  skipped: list[PeerSkip] = []
  accuracy = peer_accuracy(options)
  if space.peers:
    assert isinstance(profiles, BatchProfiles)
    peers, skipped = search_peers(space.peers, cluster, profiles, batch_size, options.setting.costs,
                                  space.peer_policies, say)
    peers.sort(key=peer_rank_key(accuracy))
  winner = best_of(results[0], peers, key, peer_rank_key(accuracy))
  return TuneResult(results[0], tuple(results + screened[options.refine:]), len(choices), partitions,
                    say.seconds, tuple(peers), tuple(skipped), winner, accuracy)


def rank_key(staleness_model: StalenessModel | None) -> RankKey:
  """The search's ranking, lowest first: by images/s, or by the predicted time to accuracy."""
  if staleness_model is None:
    return lambda r: -r.images_per_sec
  return lambda r: staleness_model.seconds(r.images_per_sec, r.staleness)


def peer_accuracy(options: TuneOptions) -> PeerAccuracyModel | None:
  """The peers' images to target under ``options``: theirs, or (time to accuracy without one) the staleness
  model's images0 for every peer; None when ranking by images/s."""
  if options.staleness_model is None:
    return None
  return options.peer_accuracy or fit_peer_accuracy((), options.staleness_model)


def peer_rank_key(accuracy: PeerAccuracyModel | None) -> PeerKey:
  """The peers' ranking, lowest first, on the same scale as :func:`rank_key`'s: by images/s, or by the
  predicted time to accuracy."""
  if accuracy is None:
    return lambda p: -p.images_per_sec
  return accuracy.seconds


def best_of(hetpipe: Result, peers: Sequence[PeerResult], key: RankKey, peer_key: PeerKey) -> Result | PeerResult:
  """The best of HetPipe's best and the peers (HetPipe's on a tie)."""
  peer = min(peers, key=peer_key, default=None)
  return peer if peer is not None and peer_key(peer) < key(hetpipe) else hetpipe


def split_choices(cluster: Cluster, units: Sequence[UnitProfile], space: SearchSpace, setting: RunSetting,
                  say: _Say) -> tuple[list[Candidate], int]:
  """(round 1 at every tensor-parallel degree of ``space.tp``, the partitions planned): a degree t > 1 plans every
  grouping of the groups' leads with each unit split over t (:mod:`hetpipe_jax.plan.tensor_groups`), then gives
  each stage its lead's partners, named ``grouping tp=t``.

  Raises:
    ConfigError: for a degree that does not divide the nodes, or when no grouping fits at any degree.
  """
  if space.tp == "per_type":
    raise ConfigError("tp=per_type: the tuner searches one degree for every stage of a configuration; give a degree "
                      "or auto (a policy's plan takes per_type: experiments.plan, train, the studies' policy rows)")
  degrees = tp_degrees(cluster) if space.tp == "auto" else [int(space.tp)]
  choices, partitions, error = [], 0, None
  for t in degrees:
    leads, partners = (cluster, {}) if t == 1 else lead_cluster(cluster, t)
    planner = Planner(leads, units if t == 1 else [u.split(t) for u in units], space.nm_max, setting)
    try:
      found = plan_choices(planner, space, say)
    except ConfigError as e:
      error = e
      continue
    finally:
      partitions += planner.partitions
    choices += found if t == 1 else [_with_partners(c, cluster, units, partners, setting, t) for c in found]
  if not choices:
    raise error or ConfigError(f"no grouping of cluster {cluster.name!r} fits the model")
  return choices, partitions


def _with_partners(candidate: Candidate, cluster: Cluster, units: Sequence[UnitProfile],
                   partners: dict[int, tuple[Gpu, ...]], setting: RunSetting, t: int) -> Candidate:
  """A candidate planned on the leads of degree ``t``, on the whole cluster: each stage with its lead's partners
  (the same stage times: :func:`hetpipe_jax.plan.vw_plan.vw_plan` splits each stage by its partners)."""
  plans = tuple(vw_plan(cluster, units, p.gpus, p.cuts, p.nm, window=p.window,
                        tp=[partners[g.index] for g in p.gpus], **setting.plan_kwargs) for p in candidate.plans)
  return dataclasses.replace(candidate, grouping=f"{candidate.grouping} tp={t}", plans=plans)


def plan_choices(planner: Planner, space: SearchSpace, say: _Say) -> list[Candidate]:
  """Round 1: every grouping that fits ``space`` partitioned at every Nm, and its Nm choices.

  Raises:
    ConfigError: when no grouping fits.
  """
  cluster, units = planner.cluster, len(planner.profiles)
  choices: list[Candidate] = []
  for name, groups in groupings(cluster):
    if any(len(g) > min(units, space.max_stages or units) for g in groups):
      continue
    states = max(search_states(g) for g in groups)
    if states > space.max_states:
      say(f"skipped {name}: a virtual worker's order search has {states:,} states (at most {space.max_states:,})")
      continue
    try:
      per_vw = [planner.plans(g) for g in groups]
    except ConfigError:
      continue  # a virtual worker that no partition fits
    if any(not p for p in per_vw):
      continue
    found = nm_choices(per_vw, [len(g) for g in groups], space.nm_max if space.windows else None)
    choices += [Candidate(name, rule, plans) for rule, plans in found]
    say(f"planned {name}: {len(groups)} virtual workers, {len(found)} Nm choices ({say.seconds:.1f} s)")
  if not choices:
    raise ConfigError(f"no grouping of cluster {cluster.name!r} fits the model at Nm = 1; use a cluster with "
                      "more GPU memory or a smaller batch size")
  return choices


def shortlist(choices: Sequence[Candidate], batch_size: int, count: int, front: int) -> list[Candidate]:
  """The choices to screen: the ``count`` best modelled, and of every grouping its best two and ``front``
  spread over its range of modelled rates (distinct, in that order)."""
  ranked = sorted(choices, key=lambda c: -c.modelled_images_per_sec(batch_size))
  keep = ranked[:count]
  for name in dict.fromkeys(c.grouping for c in choices):
    mine = [c for c in ranked if c.grouping == name]
    keep += mine[:2] + spread(mine, front)
  return list(dict.fromkeys(keep))


def screen(sims: Simulations, keep: Sequence[Candidate], space: SearchSpace, key: RankKey, waves: int,
           say: _Say) -> list[Result]:
  """Round 2 at D = min(ds) on runs of ``waves`` waves: a grouping's best modelled choice (its first in
  ``keep``) in every setting, its other choices in the two settings that served that one best. Every
  result, ranked by ``key``."""
  firsts = [c for i, c in enumerate(keep) if all(o.grouping != c.grouping for o in keep[:i])]
  every = space.settings()
  best: dict[str, list[Setting]] = {}  # grouping -> settings, best first
  screened: list[Result] = []
  done = 0
  for batch in ([(c, every) for c in firsts], [(c, None) for c in keep if c not in firsts]):
    jobs = [(c, tried or best[c.grouping][:2]) for c, tried in batch]
    for (c, _), found in zip(jobs, _in_settings(sims, jobs, min(space.ds), waves, key)):
      best.setdefault(c.grouping, [(r.candidate.placement, r.candidate.sim) for r in found])
      screened += found
      done += 1
      say(f"screened {done}/{len(keep)}: {c.grouping} Nm {[p.nm for p in c.plans]} "
          f"best {found[0].images_per_sec:.1f} images/s ({say.seconds:.1f} s)")
  return sorted(screened, key=key)


def _in_settings(sims: Simulations, jobs: Sequence[tuple[Candidate, Sequence[Setting]]], d: int, waves: int,
                 key: RankKey) -> Iterator[list[Result]]:
  """Every candidate of ``jobs`` at ``d`` in each of its settings, simulated at once: per candidate, in
  order, its results ranked by ``key`` (each list as soon as it is in)."""
  runs = sims.run([(_at(c, setting, d), waves) for c, settings in jobs for setting in settings])
  for _, settings in jobs:
    yield sorted((next(runs) for _ in settings), key=key)


def _at(candidate: Candidate, setting: Setting, d: int) -> Candidate:
  placement, sim = setting
  return dataclasses.replace(candidate, d=d, placement=placement, sim=sim)


def refine(sims: Simulations, top: Sequence[Result], ds: Sequence[int], waves: int,
           say: _Say) -> dict[Candidate, Result]:
  """Round 3: the ``top`` screened results at every D of ``ds`` on runs of ``waves`` waves."""
  refined: dict[Candidate, Result] = {}
  runs = sims.run([(dataclasses.replace(r.candidate, d=d), waves) for r in top for d in ds])
  for i, _ in enumerate(top):
    found = [next(runs) for _ in ds]
    refined.update((r.candidate, r) for r in found)
    say(f"refined {i + 1}/{len(top)}: {found[0].candidate.grouping} "
        f"{max(r.images_per_sec for r in found):.1f} images/s ({say.seconds:.1f} s)")
  return refined


def run_fixed(sims: Simulations, choices: Sequence[Candidate], space: SearchSpace, waves: int,
              refined: dict[Candidate, Result], say: _Say) -> dict[Candidate, Result]:
  """The fixed policies as the planner runs them (NP, ED, HD at max_fit), in every setting and at every D
  on runs of ``waves`` waves, but for those ``refined`` already holds: the tuned configuration is then at
  least as fast as each of them."""
  fixed = [c for c in choices if c.grouping in POLICIES and c.nm_rule == "max_fit"]
  todo = [[s for s in (_at(c, setting, d) for setting in space.settings() for d in space.ds) if s not in refined]
          for c in fixed]
  runs = sims.run([(s, waves) for group in todo for s in group])
  out: dict[Candidate, Result] = {}
  for c, group in zip(fixed, todo):
    out.update((s, next(runs)) for s in group)
    say(f"ran the fixed policy {c.grouping} in every setting ({say.seconds:.1f} s)")
  return out


def spread(items: Sequence[T], n: int) -> list[T]:
  """``n`` of ``items`` evenly spaced from the first to the last (all of them when there are at most n)."""
  if len(items) <= n:
    return list(items)
  if n <= 1:
    return list(items[:n])
  return [items[round(i * (len(items) - 1) / (n - 1))] for i in range(n)]
