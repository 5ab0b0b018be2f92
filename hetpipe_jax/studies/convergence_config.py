"""What the convergence study runs (:class:`ConvergenceConfig`), each setting checked before anything runs: a bad
one is refused in one line naming the flag of ``experiments.convergence`` that gives it."""

from __future__ import annotations

import dataclasses
import math

from hetpipe_jax.baselines.knobs import PeerKnobs
from hetpipe_jax.cluster import Cluster
from hetpipe_jax.errors import ConfigError
from hetpipe_jax.models import FULL_SIZE
from hetpipe_jax.optim import OPTIMIZERS, LrSchedule, make_ps_optimizer, parse_lr_schedule, parse_ps_optimizer
from hetpipe_jax.plan.allocation import parse_policy
from hetpipe_jax.recompute import CHOICES
from hetpipe_jax.run.config import check_seed
from hetpipe_jax.sim.noise import parse_noise
from hetpipe_jax.studies.convergence_lr import LR_GRID, OUTER_LR_GRID, check_grid
from hetpipe_jax.systems import BASE_LR_PER_32, LR_SCALINGS
from hetpipe_jax.systems.runs import without_type

PEERS = ("horovod", "hetero_dp", "sync_pipeline", "local_sgd")
TUNED_OBJECTIVES = ("time_to_accuracy", "throughput", "measured")
TARGET_METRICS = ("accuracy", "loss")


@dataclasses.dataclass(frozen=True)
class ConvergenceConfig:
  """The convergence study's settings (the defaults: ``experiments.convergence``'s flags; ``--full`` is theirs).

  Attributes:
    cluster: the emulated cluster.
    model / dataset: what every run trains, on what (``hetpipe_jax.get_model`` and ``load_dataset`` names).
    time_model: the full-size model whose cost on the cluster is the time axis (none or empty: the trained model's).
    policies: HetPipe's allocation policies (NP, ED, HD or groupings ``0,1;2,3``); ds: the D of their runs.
    nm: HetPipe's Nm (a number, max_fit or best).
    tuned / tuned_objective / pilots / pilot_seed: the tuned configuration, what it optimises, how many
      configurations are trained to choose it (``measured``), and the pilot runs' seed (learning rates too).
    ps_optimizer: the parameter server's rule of the policies' rows (``--ps_optimizer`` syntax, on DiLoCo's scale as
      ``outer``'s; ``add``, the paper's, by default).
    outer: the outer rules the tuned configuration's extra row chooses from (``--ps_optimizer`` specs separated by
      ';'; empty: no such row): each gets its learning rates searched, and the one whose pilots end best is the
      row's rule.
    systems / knobs: the peers and their knobs (``microbatches`` 0: the cluster's GPUs).
    optimizer / base_lr / lr_scaling: every run's optimizer and the learning-rate rule.
    lr_grid / outer_lr_grid / lr_epochs: the learning-rate search (:mod:`~hetpipe_jax.studies.convergence_lr`):
      factors on each rule's inner rate (one: no pilots), on each outer step's default rate, the pilots' epochs.
    lr_schedule: every system's inner rate over each optimizer's updates of a run (``constant`` or
      ``cosine:warmup=W,final=F``, :class:`hetpipe_jax.optim.LrSchedule`), the chosen rate its peak; pilots too.
    seeds / epochs / batch_size: every run's seeds, length and minibatch size.
    min_updates: the horizon's floor: every run (and pilot, by the same factor) trains long enough that the
      system with the most examples per optimizer update takes at least this many (0: ``epochs`` as given).
    target_accuracy / target_metric / smooth / eval_examples: the target (0: automatic), what it is on, the
      smoothing and how often runs are evaluated.
    eval_test_examples: test examples every evaluation takes, spread over the test split (0: all of it).
    ssp / ssp_d: the SSP parameter-server row and its staleness bound.
    whimpy: a GPU type the peers may not use (empty: none).
    recompute: activation recomputation (:mod:`hetpipe_jax.recompute`) of every system: none, selective or full on
      every GPU, or auto (HetPipe: the planner's choice per stage; a peer: the fastest mode it can run).
    noise_levels: noise specs (:mod:`hetpipe_jax.sim.noise`) under which every run is timed again, one table each
      (:mod:`~hetpipe_jax.studies.convergence_noise`; empty: none).
  """

  cluster: Cluster
  model: str = "mlp"
  dataset: str = "auto"
  time_model: str = "vgg19"
  policies: tuple[str, ...] = ("NP", "ED", "HD")
  ds: tuple[int, ...] = (0,)
  nm: int | str = "max_fit"
  tuned: bool = True
  tuned_objective: str = "measured"
  pilots: int = 4
  pilot_seed: int = 100
  ps_optimizer: str = "add"
  outer: str = "delayed_nesterov;heloco"  # Async Local-SGD's outer step, and HeLoCo's correction of stale pushes
  systems: tuple[str, ...] = PEERS
  knobs: PeerKnobs = PeerKnobs(h_by_speed=True)
  optimizer: str = "sgd"
  base_lr: float = BASE_LR_PER_32
  lr_scaling: str = "linear"
  lr_grid: tuple[float, ...] = LR_GRID
  outer_lr_grid: tuple[float, ...] = OUTER_LR_GRID
  lr_epochs: float = 0.5
  lr_schedule: str = "constant"
  seeds: tuple[int, ...] = (0, 1)
  epochs: float = 2.0
  min_updates: int = 0
  batch_size: int = 32
  target_accuracy: float = 0.0
  target_metric: str = "accuracy"
  smooth: int = 3
  eval_examples: int = 6000
  eval_test_examples: int = 0
  ssp: bool = False
  ssp_d: int = 4
  whimpy: str = ""
  recompute: str = "none"
  noise_levels: tuple[str, ...] = ()

  def __post_init__(self):
    for seed in self.seeds:
      check_seed(seed, "seeds")
    if not self.seeds:
      raise ConfigError("--seeds is empty; give one or more seeds, e.g. --seeds=0,1,2")
    if not self.ds or any(d < 0 for d in self.ds):
      raise ConfigError(f"--ds={','.join(map(str, self.ds))}; give one or more clock distance bounds D >= 0")
    self._check_ranges()
    check_grid("lr_grid", self.lr_grid, "0.1,0.3,1,3,10")
    check_grid("outer_lr_grid", self.outer_lr_grid, "0.5,1,1.5")
    if check_seed(self.pilot_seed, "pilot_seed") in self.seeds:
      raise ConfigError(f"--pilot_seed={self.pilot_seed} is one of --seeds; use a seed outside them, so that no "
                        "choice is fitted to the runs that judge it")
    if self.tuned and self.tuned_objective == "measured" and self.pilots < 1:
      raise ConfigError(f"--pilots={self.pilots}; --tuned_objective=measured needs at least 1 pilot run, e.g. "
                        "--pilots=4")
    self._check_choices()
    parse_lr_schedule(self.lr_schedule)
    for level in self.noise_levels:
      parse_noise(level)

  def _check_ranges(self) -> None:
    for name, value, ok, limit in (
        ("epochs", self.epochs, self.epochs > 0, "> 0"), ("lr_epochs", self.lr_epochs, self.lr_epochs > 0, "> 0"),
        ("smooth", self.smooth, self.smooth >= 1, ">= 1"),
        ("eval_examples", self.eval_examples, self.eval_examples >= 1, ">= 1"),
        ("eval_test_examples", self.eval_test_examples, self.eval_test_examples >= 0, ">= 0 (0: the whole split)"),
        ("target_accuracy", self.target_accuracy, self.target_accuracy >= 0 and (
            self.target_metric == "loss" or self.target_accuracy <= 1),
         "in [0, 1] for an accuracy, >= 0 for a loss (0: automatic)"),
        ("batch_size", self.batch_size, self.batch_size >= 1, ">= 1"),
        ("min_updates", self.min_updates, self.min_updates >= 0, ">= 0 (0: --epochs as given)")):
      if not (ok and math.isfinite(value)):
        raise ConfigError(f"--{name}={value}; give {limit}")

  def _check_choices(self) -> None:
    for name, value, choices in (("tuned_objective", self.tuned_objective, TUNED_OBJECTIVES),
                                 ("target_metric", self.target_metric, TARGET_METRICS),
                                 ("lr_scaling", self.lr_scaling, tuple(LR_SCALINGS)),
                                 ("optimizer", self.optimizer, tuple(OPTIMIZERS)),
                                 ("recompute", self.recompute, CHOICES)):
      if value not in choices:
        raise ConfigError(f"--{name}={value}; choose one of {', '.join(choices)}")
    if not self.policies:
      raise ConfigError("--policies is empty; give one or more HetPipe allocation policies, e.g. --policies=NP,ED")
    for policy in self.policies:
      parse_policy(policy)
    if self.time_model_name is not None and self.time_model_name not in FULL_SIZE:
      raise ConfigError(f"--time_model={self.time_model}; use one of {', '.join(FULL_SIZE)} or none")
    make_ps_optimizer(self.ps_optimizer)
    names = [parse_ps_optimizer(rule).name for rule in self.outer_rules]
    for rule in self.outer_rules:
      make_ps_optimizer(rule)
    if len(set(names)) < len(names):
      raise ConfigError(f"--outer={self.outer}: a rule is named twice; give each rule once (its keys set its rates)")

  @property
  def schedule(self) -> LrSchedule:
    """The parsed ``lr_schedule``."""
    return parse_lr_schedule(self.lr_schedule)

  @property
  def outer_rules(self) -> tuple[str, ...]:
    """The outer rules of ``outer`` (several separated by ';'; none when empty)."""
    return tuple(rule.strip() for rule in self.outer.split(";") if rule.strip())

  @property
  def peer_cluster(self) -> Cluster:
    """The cluster the peers run on: ``cluster`` without the ``whimpy`` type, where one is named."""
    return without_type(self.cluster, self.whimpy) if self.whimpy else self.cluster

  @property
  def time_model_name(self) -> str | None:
    """The full-size model of the time axis (None: the trained model's own cost)."""
    return None if self.time_model.lower() in ("", "none") else self.time_model
