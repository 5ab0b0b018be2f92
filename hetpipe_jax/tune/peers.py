"""The peers in the tuner's search: a small grid of every peer system's knobs (each system's
:meth:`~hetpipe_jax.systems.base.System.grid`), each setting simulated by its system (:func:`search_peers`), and
what a simulated setting is to the tuner (:class:`PeerResult`) and to ``tune.json`` (:func:`peer_json`, read back
by :func:`peer_knobs`).

The grid, per system (``G``: the cluster's GPUs, ``b``: the batch size), as the systems define it
(:mod:`hetpipe_jax.systems`):

- ``horovod``: a 64 MiB fusion buffer (Horovod's default), and 0 (every tensor alone) as a check;
- ``hetero_dp``: the global batch at 1/2, 1 and 2 x ``b x G``;
- ``sync_pipeline``: the pipelines of each policy of ``policies`` (NP, ED, HD) x ``G``, 2 ``G`` and 4 ``G``
  microbatches per iteration (over every pipeline, split by speed);
- ``local_sgd``: H in 2, 4, 8, 16 x H sized to speed or not x GPU workers, or pipeline workers of each
  policy. The outer learning rate and momentum change no time: they keep their defaults (DiLoCo's 0.7 and
  0.9) and are recorded;
- any other system: its defaults.

A setting the system cannot run (a :class:`~hetpipe_jax.errors.ConfigError`: no GPU holds the model, a
microbatch count below the pipelines, ...) is skipped with its reason (:class:`PeerSkip`).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from hetpipe_jax.baselines.knobs import PeerKnobs
from hetpipe_jax.cluster import Cluster
from hetpipe_jax.cost.batch import BatchProfiles
from hetpipe_jax.cost.context import DEFAULT_COSTS, CostContext
from hetpipe_jax.cost.profile import profile_units
from hetpipe_jax.data import load_dataset
from hetpipe_jax.errors import ConfigError
from hetpipe_jax.models import FULL_SIZE, get_model
from hetpipe_jax.plan.allocation import POLICIES
from hetpipe_jax.systems import get_system

HETPIPE = "hetpipe"  # the ``system`` of a HetPipe (WSP) configuration in tune.json
KNOB_KEYS = tuple(PeerKnobs._fields)  # tune.json keeps every knob under its experiments.baseline flag's name


@dataclasses.dataclass(frozen=True)
class PeerResult:
  """A simulated setting of a peer.

  Attributes:
    system: the peer's name in the registry (:func:`hetpipe_jax.systems.get_system`).
    knobs: its knobs.
    images_per_sec: examples per second on the simulated cluster.
    ideal_images_per_sec: the ideal heterogeneous aggregate at the batch size.
    round_seconds: one round (a step; local SGD: H local steps and the synchronisation).
    examples_per_round: examples per round, every worker together.
    examples_per_update: examples behind one update of the weights: the global batch for the synchronous
      peers, the largest worker's local step for local SGD.
    gpus: GPUs that train.
    local_steps: the largest worker's H (1 for the synchronous peers).
  """

  system: str
  knobs: PeerKnobs
  images_per_sec: float
  ideal_images_per_sec: float
  round_seconds: float
  examples_per_round: int
  examples_per_update: int
  gpus: int
  local_steps: int = 1

  @property
  def efficiency(self) -> float:
    return self.images_per_sec / self.ideal_images_per_sec

  @property
  def staleness(self) -> float:
    """Zero: every peer's forward passes see every update before them (local SGD's drift is in its images to
    target, not here)."""
    return 0.0

  @property
  def label(self) -> str:
    """The setting's name, as its system writes it."""
    return get_system(self.system).label(self.knobs, self.examples_per_update)


class PeerSkip(NamedTuple):
  """A setting of the grid the system cannot run, and why."""

  system: str
  knobs: PeerKnobs
  reason: str


def peer_grid(system: str, cluster: Cluster, batch_size: int, policies: Sequence[str] = POLICIES
              ) -> list[PeerKnobs]:
  """The knobs the tuner tries for ``system`` on ``cluster`` at ``batch_size`` (the module docstring).

  Raises:
    ConfigError: for an unknown system.
  """
  return get_system(system).grid(cluster, batch_size, policies)


def simulate_setting(system: str, cluster: Cluster, profiles: BatchProfiles, batch_size: int, knobs: PeerKnobs,
                     costs: CostContext = DEFAULT_COSTS) -> PeerResult:
  """One setting of a peer, simulated.

  Raises:
    ConfigError: when the system cannot run it.
  """
  peer = get_system(system)
  run = peer.simulate(cluster, profiles, batch_size, knobs, costs)
  return PeerResult(system, knobs, run.images_per_sec, run.ideal_images_per_sec, run.round_seconds,
                    run.examples_per_round, peer.update_examples(run), run.gpus, max(run.local_steps))


def search_peers(systems: Iterable[str], cluster: Cluster, profiles: BatchProfiles, batch_size: int,
                 costs: CostContext = DEFAULT_COSTS, policies: Sequence[str] = POLICIES,
                 progress: Callable[[str], None] | None = None) -> tuple[list[PeerResult], list[PeerSkip]]:
  """Every setting of :func:`peer_grid` of every system of ``systems``, simulated (in this process: each takes
  10-100 ms).

  Returns:
    (the results, in grid order; the settings the systems cannot run, with why).

  Raises:
    ConfigError: for an unknown system.
  """
  say = progress or (lambda _: None)
  results: list[PeerResult] = []
  skipped: list[PeerSkip] = []
  for system in systems:
    t0, before, left = time.perf_counter(), len(results), len(skipped)
    for knobs in peer_grid(system, cluster, batch_size, policies):
      try:
        results.append(simulate_setting(system, cluster, profiles, batch_size, knobs, costs))
      except ConfigError as e:
        skipped.append(PeerSkip(system, knobs, str(e)))
    mine = results[before:]
    best = f", best {max(r.images_per_sec for r in mine):.1f} images/s" if mine else ""
    say(f"peer {system}: {len(mine)} settings simulated, {len(skipped) - left} cannot run{best} "
        f"({time.perf_counter() - t0:.2f} s)")
  return results, skipped


def peer_json(peer: PeerResult) -> dict[str, Any]:
  """A peer's setting as ``tune.json`` holds it: its system and knobs under the names of ``experiments.baseline``'s
  flags, the predicted images/s and efficiency, and what the time-to-accuracy objective reads."""
  return {"system": peer.system, **peer.knobs._asdict(), "images_per_sec": peer.images_per_sec,
          "efficiency": peer.efficiency, "ideal_images_per_sec": peer.ideal_images_per_sec,
          "round_seconds": peer.round_seconds, "examples_per_round": peer.examples_per_round,
          "examples_per_update": peer.examples_per_update, "gpus": peer.gpus, "max_local_steps": peer.local_steps,
          "mean_staleness": peer.staleness, "label": peer.label}


def peer_knobs(doc: Mapping[str, Any]) -> PeerKnobs:
  """The knobs of a peer's entry of ``tune.json`` (:func:`peer_json`); a knob it lacks keeps its default.

  Raises:
    ConfigError: for a knob out of range.
  """
  defaults = PeerKnobs()
  values = {k: type(getattr(defaults, k))(doc[k]) for k in KNOB_KEYS if doc.get(k) is not None}
  return PeerKnobs(**values).validate()


def system_of(doc: Mapping[str, Any]) -> str:
  """The system of a ``tune.json`` entry: ``hetpipe`` for one written before entries named their system."""
  return str(doc.get("system") or HETPIPE)


def tuner_profiles(model: str, dataset: str, batch_size: int) -> BatchProfiles:
  """The model's unit profiles as the tuner (``experiments.tune``) reads them, at ``batch_size`` and twice it:
  a full-size model's on its input, a small model's on ``dataset``'s inputs."""
  if model in FULL_SIZE:
    return BatchProfiles.full_size(model, batch_size)
  return BatchProfiles(tuple(small_profiles(model, dataset, batch_size)),
                       tuple(small_profiles(model, dataset, 2 * batch_size)), batch_size, 2 * batch_size)


def small_profiles(model: str, dataset: str, batch_size: int) -> list:
  """A small model's unit profiles on ``dataset``'s inputs at ``batch_size``."""

  data = load_dataset(dataset)
  return profile_units(get_model(model, data.num_classes),
                       jax.ShapeDtypeStruct((batch_size,) + data.x_train.shape[1:], jnp.float32))
