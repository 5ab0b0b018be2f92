"""Systems as the studies run them: each simulated on the study's cluster (:func:`simulate_systems`: a
:class:`SystemSpec` per system, or why it cannot run), then trained with its own numerics on the clock of its
simulated round (:meth:`~hetpipe_jax.systems.base.System.train`) at the rate of the learning-rate rule
(:func:`rule_lr`)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import NamedTuple

from hetpipe_jax.baselines.knobs import PeerKnobs
from hetpipe_jax.cluster import Cluster, make_cluster
from hetpipe_jax.cost.batch import BatchProfiles
from hetpipe_jax.cost.context import CostContext
from hetpipe_jax.errors import ConfigError
from hetpipe_jax.systems.base import System, SystemRun
from hetpipe_jax.systems.registry import get_system

BASE_LR_PER_32 = 0.02  # the learning-rate rule's base: 0.02 per update of a 32-example minibatch
LR_SCALINGS = ("linear", "sqrt")  # how the rule scales with the examples of an update (:func:`rule_lr`)
Progress = Callable[[str], None]


def rule_lr(update_examples: int, base: float = BASE_LR_PER_32, scaling: str = "linear") -> float:
  """The learning-rate rule's centre for an update of ``update_examples`` examples: ``base`` per 32-example
  update, scaled linearly with the examples (SGD: Goyal et al. 2017) or with their square root (Adam: Malladi
  et al. 2022)."""
  ratio = update_examples / 32
  return base * (ratio if scaling == "linear" else ratio ** 0.5)


class SystemSpec(NamedTuple):
  """A system of a study.

  Attributes:
    system: the system.
    name: its row's name.
    run: the simulated run, or None when the system cannot run on the cluster (``reason``).
    reason: why it cannot run (None when it can).
  """

  system: System
  name: str
  run: SystemRun | None
  reason: str | None

  @property
  def simulated(self) -> SystemRun:
    """The simulated run (only for a system that runs)."""
    assert self.run is not None, self.reason
    return self.run

  @property
  def batch_sizes(self) -> list[int]:
    """Each worker's examples per local step."""
    return list(self.simulated.batch_sizes)

  @property
  def local_steps(self) -> list[int]:
    """Each worker's local steps per round (1 for a synchronous system)."""
    return list(self.simulated.local_steps)

  @property
  def update_examples(self) -> int:
    """Examples behind one update of the weights (:meth:`~hetpipe_jax.systems.base.System.update_examples`)."""
    return self.system.update_examples(self.simulated)


def without_type(cluster: Cluster, exclude: str) -> Cluster:
  """``cluster`` without its nodes of GPU type ``exclude``."""
  kept = [[g.type for g in cluster.node_gpus(n)] for n in sorted({g.node for g in cluster.gpus})
          if cluster.node_gpus(n)[0].type.name != exclude]
  return make_cluster(f"{cluster.name}-no-{exclude.replace(' ', '_')}", kept, cluster.intra_node, cluster.inter_node)


def simulate_systems(names: Sequence[str], cluster: Cluster, profiles: BatchProfiles, batch_size: int,
                     costs: CostContext, knobs: PeerKnobs, model: str = "",
                     progress: Progress | None = None) -> list[SystemSpec]:
  """Every system of ``names`` simulated on ``cluster`` (:func:`without_type` leaves a GPU type out).

  Returns:
    One spec per system, in order; a system the cluster cannot run (no GPU holds the model, ...) with its
    reason instead of a run.

  Raises:
    ConfigError: for an unknown system.
  """
  say = progress or (lambda _: None)
  specs = []
  for system in map(get_system, names):
    try:
      run = system.simulate(cluster, profiles, batch_size, knobs, costs, model)
      name = f"{system.name} ({run.gpus} GPUs)"
      specs.append(SystemSpec(system, name, run, None))
      say(f"{name}: {run.images_per_sec:.1f} examples/s (simulated), efficiency {run.efficiency:.3f}")
    except ConfigError as e:
      specs.append(SystemSpec(system, system.name, None, str(e)))
      say(f"{system.name} cannot run here: {e}")
  return specs
