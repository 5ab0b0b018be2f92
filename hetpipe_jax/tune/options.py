"""What the tuner searches (:class:`SearchSpace`), how (:class:`TuneOptions`), and the run it tunes for
(:class:`RunSetting`)."""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable
from typing import Any

from hetpipe_jax.cost.context import DEFAULT_COSTS, CostContext
from hetpipe_jax.plan.allocation import POLICIES
from hetpipe_jax.plan.placement import PLACEMENTS
from hetpipe_jax.sim import SimOptions
from hetpipe_jax.staleness import StalenessModel
from hetpipe_jax.tune.statistical import PeerAccuracyModel

Progress = Callable[[str], None]
Setting = tuple[str, SimOptions]  # a PS placement and the simulator's transfer models


@dataclasses.dataclass(frozen=True)
class RunSetting:
  """The run a configuration is tuned for, as for a run: what memory and the simulated run depend on."""

  costs: CostContext = DEFAULT_COSTS  # weight mode, optimizer slots, precision: memory and stage times
  schedule: str = "1f1b"

  @property
  def plan_kwargs(self) -> dict[str, Any]:
    """The keywords the partitioner and :func:`~hetpipe_jax.plan.vw_plan.vw_plan` take."""
    return {"costs": self.costs}


@dataclasses.dataclass(frozen=True)
class SearchSpace:
  """What the tuner tries.

  Attributes:
    ds / placements / transfers / staged: the D values, placements, transfer models (overlapped or not)
      and PS transfer models (staged or not) searched.
    nm_max: the largest Nm tried.
    windows: Nm sized to speed may exceed what a virtual worker's memory holds in flight, up to
      ``nm_max``, with a window (:func:`hetpipe_jax.tune.nm_choices`).
    max_states: groupings with a virtual worker whose order search is larger than this are skipped
      (:func:`hetpipe_jax.plan.partition.search_states`; 16 GPUs of 16 distinct (type, node) pairs have
      about a million).
    max_stages: groupings with a larger virtual worker are skipped (e.g. a small model trained on the
      tuned configuration's clock has only so many units to cut).
    peers: the peer systems (registered: :func:`hetpipe_jax.systems.get_system`) searched beside HetPipe, each over
      its grid of knobs (:mod:`hetpipe_jax.tune.peers`); empty: HetPipe alone.
    peer_policies: the groupings of the peers' pipelines searched (sync_pipeline, local_sgd's pipeline workers).
    tp: the tensor-parallel degrees searched (:mod:`hetpipe_jax.plan.tensor_groups`): a degree, or "auto" (every
      degree that divides the cluster's nodes); each grouping is formed on the groups' leads of each degree.
    noise: the GPUs' variance every configuration is simulated under (:mod:`hetpipe_jax.sim.noise`).
  """

  ds: tuple[int, ...] = (0, 4, 32)
  placements: tuple[str, ...] = tuple(PLACEMENTS)
  transfers: tuple[bool, ...] = (False, True)
  staged: tuple[bool, ...] = (False, True)
  nm_max: int = 32
  windows: bool = True
  max_states: int = 100_000
  max_stages: int | None = None
  peers: tuple[str, ...] = ()
  peer_policies: tuple[str, ...] = POLICIES
  tp: int | str = 1
  noise: str = "none"

  def settings(self) -> list[Setting]:
    """Every (placement, transfer models) searched: placements outermost, PS transfer models innermost."""
    return [(p, SimOptions(overlap_transfers=o, staged_ps=s, noise=self.noise))
            for p, o, s in itertools.product(self.placements, self.transfers, self.staged)]


@dataclasses.dataclass(frozen=True)
class TuneOptions:
  """How the tuner searches.

  Attributes:
    waves: waves per virtual worker of the refining (and predicting) runs; screening runs half as many.
    screen / refine: how many modelled choices are screened, and how many screened ones refined.
    front: also screen up to this many of every grouping's Nm choices, spread evenly over its modelled
      rates (fewer minibatches per wave: fewer images/s but less staleness), so that the results hold the
      trade-off between images/s and staleness and not only the fastest choices (None: 6 with a
      ``staleness_model``, else 0).
    staleness_model: rank by its predicted time to accuracy (fastest first) instead of by images/s.
    peer_accuracy: with ``staleness_model``, the peers' images to target
      (:func:`hetpipe_jax.tune.statistical.fit_peer_accuracy` of the convergence study's runs; None: the
      staleness model's images0 for every peer).
    setting: the run tuned for (:class:`RunSetting`).
    workers: processes that simulate candidates at once (None: one per CPU core; 1: this process only).
      The results are the same for any count.
    progress: called with a line at every step.
  """

  waves: int = 50
  screen: int = 16
  refine: int = 6
  front: int | None = None
  staleness_model: StalenessModel | None = None
  peer_accuracy: PeerAccuracyModel | None = None
  setting: RunSetting = RunSetting()
  workers: int | None = None
  progress: Progress | None = None

  @property
  def front_size(self) -> int:
    """``front``, its default resolved."""
    if self.front is not None:
      return self.front
    return 6 if self.staleness_model is not None else 0
