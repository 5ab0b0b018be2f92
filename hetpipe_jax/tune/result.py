"""What the tuner finds: a simulated candidate (:class:`Result`), the search's outcome (:class:`TuneResult`,
with the peers' settings it simulated: :class:`~hetpipe_jax.tune.peers.PeerResult`), and both as ``tune.json``
holds them."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable
from typing import Any, NamedTuple

from hetpipe_jax.staleness import StalenessModel
from hetpipe_jax.tune.candidate import Candidate
from hetpipe_jax.tune.peers import PeerResult, PeerSkip, peer_json
from hetpipe_jax.tune.statistical import PeerAccuracyModel


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


@dataclasses.dataclass(frozen=True)
class TuneResult:
  """The outcome of :func:`hetpipe_jax.tune.tune`.

  Attributes:
    best: the fastest refined HetPipe (WSP) configuration (by the search's ranking).
    results: every simulated run, ranked: the refined ones (``best`` first), then the screened ones the
      refining round left out.
    planned: how many modelled choices the search planned.
    partitions: how many virtual workers it partitioned.
    seconds: host seconds the search took.
    peers: every simulated setting of the peers searched (``SearchSpace.peers``), ranked the same way.
    peers_skipped: the peers' settings that cannot run on the cluster, with why.
    winner: the best of every system searched, HetPipe's ``best`` or a peer (None: ``best``; see
      :attr:`overall`).
    peer_accuracy: the peers' images to target the ranking used (time to accuracy; None: by images/s).
  """

  best: Result
  results: tuple[Result, ...]
  planned: int
  partitions: int
  seconds: float
  peers: tuple[PeerResult, ...] = ()
  peers_skipped: tuple[PeerSkip, ...] = ()
  winner: Result | PeerResult | None = None
  peer_accuracy: PeerAccuracyModel | None = None

  @property
  def overall(self) -> Result | PeerResult:
    """The best of every system searched."""
    return self.best if self.winner is None else self.winner

  def best_peers(self) -> dict[str, PeerResult]:
    """The best setting of every peer system (``peers`` are ranked), in rank order."""
    best: dict[str, PeerResult] = {}
    for p in self.peers:
      best.setdefault(p.system, p)
    return best


def pareto_front(results: Iterable[Result]) -> list[Result]:
  """The results no other is both faster and less stale than, least stale first (one per staleness): the
  trade-off between images/s and mean staleness the tuner found."""
  front: list[Result] = []
  for r in sorted(results, key=lambda r: (r.staleness, -r.images_per_sec)):
    if not front or r.images_per_sec > front[-1].images_per_sec:
      front.append(r)
  return front


class Row(NamedTuple):
  """Configurations the tuner's table shows as one row: ``results`` that differ only in D and ran the same
  (the same images/s and mean staleness: a gate that never closed), the first standing for them all."""

  results: tuple[Result, ...]

  @property
  def first(self) -> Result:
    return self.results[0]

  @property
  def label(self) -> str:
    """The first's label, with every D of the row (``D=0/4/32``)."""
    ds = "/".join(str(r.candidate.d) for r in self.results)
    return self.first.candidate.label.replace(f"D={self.first.candidate.d},", f"D={ds},", 1)


def distinct_rows(results: Iterable[Result], count: int) -> list[Row]:
  """The first ``count`` distinct rows of ``results`` (ranked): results that differ only in D and ran the same
  merge into one :class:`Row` (in rank order, wherever they rank)."""
  rows: dict[tuple, list[Result]] = {}
  for r in results:
    c = r.candidate
    key = (c.grouping, c.nm_rule, tuple((p.nm, p.in_flight, tuple(p.cuts), tuple(g.index for g in p.gpus))
                                        for p in c.plans), c.placement, c.sim, r.images_per_sec, r.staleness)
    if key not in rows and len(rows) == count:
      continue
    rows.setdefault(key, []).append(r)
  return [Row(tuple(rs)) for rs in rows.values()]


def policy_rows(results: Iterable[Result]) -> dict[str, Result]:
  """The first result of every grouping in ``results`` (the best, when they are ranked)."""
  best: dict[str, Result] = {}
  for r in results:
    best.setdefault(r.candidate.grouping, r)
  return best


def candidate_json(candidate: Candidate) -> dict[str, Any]:
  """A candidate's settings as a run takes them: the grouping (GPU indices in pipeline order), cuts, Nm,
  window (most minibatches in flight), D, placement, transfer models (``overlap_transfers``, ``staged_ps``:
  the flat names of :class:`~hetpipe_jax.run.config.RunConfig` and ``experiments.train --plan``), and where a
  stage is split by tensor parallelism, each stage's partner GPUs (``tp``, indices)."""
  split = any(p.tp for p in candidate.plans)
  return {"grouping": candidate.grouping, "nm_rule": candidate.nm_rule,
          **({"tp": [[[g.index for g in partners] for partners in p.tp or [()] * len(p.stages)]
                     for p in candidate.plans]} if split else {}),
          "policy": [[g.index for g in p.gpus] for p in candidate.plans],
          "cuts": [list(p.cuts) for p in candidate.plans], "nm": [p.nm for p in candidate.plans],
          "window": [p.in_flight for p in candidate.plans],
          "d": candidate.d, "placement": candidate.placement,
          "overlap_transfers": candidate.sim.overlap_transfers, "staged_ps": candidate.sim.staged_ps}


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


def peer_result_json(peer: PeerResult, peer_accuracy: PeerAccuracyModel | None = None) -> dict[str, Any]:
  """A peer's setting as ``tune.json`` holds it (:func:`~hetpipe_jax.tune.peers.peer_json`), with its predicted
  images and time to accuracy when ``peer_accuracy`` is given (null when its kind does not reach the target)."""
  out = peer_json(peer)
  if peer_accuracy is not None:
    images = peer_accuracy.images(peer)
    finite = math.isfinite(images)
    out["images_to_target"] = images if finite else None
    out["time_to_accuracy_s"] = images / peer.images_per_sec if finite else None
  return out
