"""What a training system is to the studies, the tuner and ``experiments.baseline``: one object (:class:`System`)
that knows how it is simulated, trained, tuned and described (as jaxpp's schedule classes know their tasks).

A system is simulated on a cluster (:meth:`System.simulate`: its timeline and examples/s, a :class:`SystemRun`),
trained with its real numerics on the clock of its simulated round (:meth:`System.train`: a :class:`Curve`),
searched by the tuner over a grid of its knobs (:meth:`System.grid`), and described (:attr:`System.summary`,
:meth:`System.label`, :meth:`System.config`). Its :attr:`System.kind` says how the tuner's statistical model
predicts its images to target (:mod:`hetpipe_jax.tune.statistical`): a ``synchronous`` system by its global batch,
a ``local`` one by its local steps H, a ``wsp`` one by the staleness of its trace. The examples behind one update
(:meth:`System.update_examples`) are what the learning-rate rule scales with; a system with an outer step (local
SGD's outer Nesterov) names the knob of its rate (:attr:`System.outer_lr_knob`), which the convergence study
searches. Its memory charge is its :attr:`System.weight_mode`: the weight versions a GPU holds (``latest``: one, a
synchronous system that flushes before it updates; ``stash``: one per minibatch in flight, HetPipe).

A new system is one module with a subclass and one :func:`hetpipe_jax.systems.registry.register` call.
"""

from __future__ import annotations

import abc
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, ClassVar, NamedTuple

from hetpipe_jax.baselines.knobs import PeerKnobs
from hetpipe_jax.cluster import Cluster
from hetpipe_jax.cost.batch import BatchProfiles
from hetpipe_jax.cost.context import DEFAULT_COSTS, CostContext
from hetpipe_jax.optim import CONSTANT, LrSchedule

if TYPE_CHECKING:
  from hetpipe_jax.data import Dataset
  from hetpipe_jax.models.base import LayeredModel

SYNCHRONOUS, LOCAL, WSP = "synchronous", "local", "wsp"  # the kinds (:attr:`System.kind`)
KINDS = (SYNCHRONOUS, LOCAL, WSP)
DEFAULT_KNOBS = PeerKnobs()


def span(values: Sequence[int]) -> str:
  """``3`` or ``2..5``: the range of ``values`` (a system's :meth:`System.config` of per-GPU knobs)."""
  return f"{min(values)}" if min(values) == max(values) else f"{min(values)}..{max(values)}"


class SystemRun(NamedTuple):
  """A simulated system on a cluster.

  Attributes:
    system: the system's name.
    round_seconds: seconds of one round (a step; local SGD: H local steps and the synchronisation; HetPipe: the
      mean time of a wave of every virtual worker).
    examples_per_round: examples per round, every worker together.
    images_per_sec: examples per second.
    ideal_images_per_sec: the ideal heterogeneous aggregate of the cluster at the batch size.
    batch_sizes: each worker's examples per local step (a virtual worker's: its Nm minibatches).
    local_steps: each worker's local steps per round (1 for a synchronous system).
    gpus: the GPUs that train.
    timeline: the timeline, its ``meta`` complete (:mod:`hetpipe_jax.baselines.timeline`); None for a system
      whose record is its trace (``events``).
    job: what ran (a peer's :class:`~hetpipe_jax.baselines.sync.SyncJob`, HetPipe's plan).
    events: a trace's events (HetPipe), empty for a timeline.
  """

  system: str
  round_seconds: float
  examples_per_round: int
  images_per_sec: float
  ideal_images_per_sec: float
  batch_sizes: tuple[int, ...]
  local_steps: tuple[int, ...]
  gpus: int
  timeline: dict[str, Any] | None = None
  job: Any = None
  events: tuple[dict[str, Any], ...] = ()

  @property
  def efficiency(self) -> float:
    """Images/s over the ideal aggregate."""
    return self.images_per_sec / self.ideal_images_per_sec

  @property
  def meta(self) -> dict[str, Any]:
    """What ran, as the timeline's (or the trace's) meta line records it."""
    if self.timeline is not None:
      return self.timeline["meta"]
    return dict(self.events[0]) if self.events else {}


class CurvePoint(NamedTuple):
  """A training run at one evaluation (JSON: a list in this order).

  Attributes:
    time: seconds on the system's clock (its simulated rounds).
    minibatches: examples seen so far over the study's batch size.
    test_accuracy: the test accuracy.
    train_loss: the training loss of the last step or round.
    test_loss: the test loss.
  """

  time: float
  minibatches: float
  test_accuracy: float
  train_loss: float
  test_loss: float


Curve = list[CurvePoint]


class TrainSetting(NamedTuple):
  """How a study trains a system (every system the same).

  Attributes:
    seed: initialisation and shuffling seed.
    lr: the learning rate of the (inner) optimizer.
    optimizer: a name of :data:`hetpipe_jax.optim.OPTIMIZERS`.
    epochs: training examples, in epochs of the training set.
    eval_examples: evaluate about every this many training examples.
    batch_size: the study's batch size (a curve counts minibatches of it).
    schedule: the inner rate's warm-up and decay over each optimizer's updates of the run (``lr`` its peak).
  """

  seed: int
  lr: float
  optimizer: str
  epochs: float
  eval_examples: int
  batch_size: int
  schedule: LrSchedule = CONSTANT

  def rounds(self, examples_per_round: int, train_examples: int) -> int:
    """Whole rounds (steps, waves) of ``examples_per_round`` in ``epochs`` of ``train_examples`` (at least 1)."""
    return max(1, int(self.epochs * train_examples // examples_per_round))


class System(abc.ABC):
  """A training system: HetPipe or one of its peers.

  Class attributes:
    name: its name (``experiments.baseline --system=NAME``, a study's ``--systems``, ``tune.json``'s ``system``).
    summary: one line on what it is.
    kind: ``synchronous``, ``local`` or ``wsp`` (the module docstring).
    weight_mode: its memory charge: the weight versions a GPU holds (``latest`` or ``stash``).
    outer_lr_knob: the knob of :class:`~hetpipe_jax.baselines.knobs.PeerKnobs` that sets the learning rate of its
      outer step (None: it takes none).
  """

  name: ClassVar[str]
  summary: ClassVar[str]
  kind: ClassVar[str] = SYNCHRONOUS
  weight_mode: ClassVar[str] = "latest"
  outer_lr_knob: ClassVar[str | None] = None

  def outer_lr(self, knobs: PeerKnobs) -> float | None:
    """The learning rate of its outer step under ``knobs`` (None: it takes no outer step)."""
    return None if self.outer_lr_knob is None else float(getattr(knobs, self.outer_lr_knob))

  def with_outer_lr(self, knobs: PeerKnobs, lr: float) -> PeerKnobs:
    """``knobs`` with its outer step at ``lr`` (a system without one: ``knobs``)."""
    return knobs if self.outer_lr_knob is None else knobs._replace(**{self.outer_lr_knob: lr})

  def memory_costs(self, costs: CostContext) -> CostContext:
    """``costs`` with this system's memory charge."""
    return costs._replace(weight_mode=self.weight_mode)

  @abc.abstractmethod
  def simulate(self, cluster: Cluster, profiles: BatchProfiles, batch_size: int, knobs: PeerKnobs = DEFAULT_KNOBS,
               costs: CostContext = DEFAULT_COSTS, model: str = "") -> SystemRun:
    """The system on ``cluster`` at ``batch_size`` with ``knobs``, simulated (``model``: its name, for the record).

    Raises:
      ConfigError: for bad knobs, or a cluster the system cannot use.
    """

  @abc.abstractmethod
  def train(self, model: LayeredModel, dataset: Dataset, run: SystemRun, setting: TrainSetting,
            knobs: PeerKnobs = DEFAULT_KNOBS) -> Curve:
    """Trains ``model`` on ``dataset`` with the system's numerics, in the shape ``run`` simulated, on the clock of
    its round: the curve at every evaluation.

    Raises:
      ConfigError: for bad settings; RunStopped: when the run diverged.
    """

  def grid(self, cluster: Cluster, batch_size: int, policies: Sequence[str]) -> list[PeerKnobs]:
    """The knobs the tuner tries on ``cluster`` at ``batch_size`` (default: the defaults)."""
    del cluster, batch_size, policies
    return [DEFAULT_KNOBS]

  def update_examples(self, run: SystemRun) -> int:
    """Examples behind one update of the weights (the learning-rate rule's input): the global batch (default)."""
    return sum(run.batch_sizes)

  def label(self, knobs: PeerKnobs, update_examples: int) -> str:
    """A tuner row's name for a setting of ``knobs``."""
    del knobs
    return f"{self.name}, global batch {update_examples}"

  def config(self, run: SystemRun) -> str:
    """What ran, in a study's table."""
    return f"batch {run.meta.get('batch_size')} per GPU"

  def signature(self, run: SystemRun) -> list[Any]:
    """What identifies the configuration among a convergence study's runs (:meth:`entry_signature`)."""
    return [list(run.batch_sizes), list(run.local_steps)]

  @classmethod
  def entry_signature(cls, entry: Mapping[str, Any]) -> list[Any]:
    """:meth:`signature` of a convergence study's run entry (``convergence.json``): its batch per worker and
    local steps."""
    return [list(entry.get("batch_sizes") or []), list(entry.get("local_steps") or [])]
