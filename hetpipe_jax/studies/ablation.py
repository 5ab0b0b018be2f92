"""What costs HetPipe its examples: examples to a fixed target against one factor at a time, every other held
(:func:`run_ablation`: an :class:`AblationConfig` in, an :class:`AblationResult` out).

The factors: the number of virtual workers N, the wave length Nm, the clock distance bound D, and the parameter
server's rule for a pushed wave (any ``--ps_optimizer`` spec: ``add``, summed, the paper's; ``avg``, each push x
1 / N, as asynchronous local SGD scales them; ``delayed_nesterov``; ``heloco``; ...). The rule ``local_sgd`` (or
``local_sgd:lr=..,momentum=..``, its outer Nesterov step, DiLoCo's 0.7 and 0.9 by default) trains synchronous local
SGD instead at the same point: N workers of H = Nm local steps each (D does not apply), the yardstick the
asynchronous rules are measured against. Every point is trained at every local learning rate of one log-spaced
grid and reported at its best (the rate that reaches the target with the fewest examples), so the usable learning
rate is a result, not a choice. Each virtual worker is one GPU (no pipeline: its local staleness is Nm's alone),
the first N GPUs of the cluster, on the ``virtual`` executor, every trace checked; the same model, data,
initialisation and examples for every run of a seed.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any, NamedTuple

from hetpipe_jax.api import run_hetpipe
from hetpipe_jax.baselines.numerics import outer_optimizer, train_sgd
from hetpipe_jax.cluster import Cluster
from hetpipe_jax.core.check import require_wsp
from hetpipe_jax.data import Dataset, load_dataset
from hetpipe_jax.errors import ConfigError, RunStopped
from hetpipe_jax.models import get_model
from hetpipe_jax.models.base import LayeredModel
from hetpipe_jax.optim import PSOptimizer, make_optimizer, parse_ps_optimizer
from hetpipe_jax.run.config import RunConfig, check_seed
from hetpipe_jax.staleness import mean_staleness
from hetpipe_jax.studies.convergence_config import TARGET_METRICS
from hetpipe_jax.studies.convergence_target import Target
from hetpipe_jax.systems.base import Curve, CurvePoint
from hetpipe_jax.systems.hetpipe import hetpipe_curve

FACTORS = ("vws", "nm", "d")  # the factors swept one at a time around the base
RULES = ("add", "avg")  # the default rules
LOCAL_SGD = "local_sgd"  # the rule that trains synchronous local SGD at the point instead
Progress = Callable[[str], None]


@dataclasses.dataclass(frozen=True)
class AblationConfig:
  """The ablation's settings (``experiments.ablation``'s flags).

  Attributes:
    cluster: the cluster (its first N GPUs hold the N virtual workers; at least max(``vws``) GPUs).
    model / dataset / batch_size / optimizer: what every run trains, on what, with which local optimizer.
    epochs: examples every run sees, in epochs; seeds: every point once per seed.
    lrs: the local learning rates every point is trained at.
    target_accuracy / target_metric / smooth / eval_examples: the target (a test accuracy, or with
      ``target_metric="loss"`` a test loss, as the convergence study's, for a language model), smoothed over
      ``smooth`` evaluations, evaluated about every ``eval_examples`` examples on ``eval_test_examples`` test
      examples spread over the test split (0: all of it).
    base_vws / base_nm / base_d: the point every sweep goes through.
    vws / nms / ds: the values of each factor's sweep; rules: the parameter server's rules compared.
  """

  cluster: Cluster
  model: str = "mlp"
  dataset: str = "auto"
  batch_size: int = 32
  optimizer: str = "sgd"
  epochs: float = 1.0
  seeds: tuple[int, ...] = (0,)
  lrs: tuple[float, ...] = (0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32)  # log-spaced over two decades
  target_accuracy: float = 0.8
  target_metric: str = "accuracy"
  smooth: int = 3
  eval_examples: int = 4000
  eval_test_examples: int = 0
  base_vws: int = 4
  base_nm: int = 4
  base_d: int = 0
  vws: tuple[int, ...] = (1, 2, 4, 8, 16)
  nms: tuple[int, ...] = (1, 4, 16)
  ds: tuple[int, ...] = (0, 4, 32)
  rules: tuple[str, ...] = RULES

  def __post_init__(self):
    for seed in self.seeds:
      check_seed(seed, "seeds")
    checks = [("seeds", self.seeds, bool(self.seeds), "one or more seeds"),
              ("lrs", self.lrs, bool(self.lrs) and all(math.isfinite(x) and x > 0 for x in self.lrs),
               "one or more learning rates > 0"),
              ("epochs", self.epochs, math.isfinite(self.epochs) and self.epochs > 0, "> 0"),
              ("target_metric", self.target_metric, self.target_metric in TARGET_METRICS,
               f"one of {', '.join(TARGET_METRICS)}"),
              ("target_accuracy", self.target_accuracy, self.target_accuracy > 0 and (
                  self.target_metric == "loss" or self.target_accuracy <= 1) and math.isfinite(self.target_accuracy),
               "in (0, 1] for an accuracy, > 0 for a loss"),
              ("vws", self.vws, bool(self.vws) and min(self.vws + (self.base_vws,)) >= 1, "counts >= 1"),
              ("nms", self.nms, bool(self.nms) and min(self.nms + (self.base_nm,)) >= 1, "Nm >= 1"),
              ("ds", self.ds, bool(self.ds) and min(self.ds + (self.base_d,)) >= 0, "bounds D >= 0"),
              ("rules", self.rules, bool(self.rules), "one or more rules"),
              ("smooth", self.smooth, self.smooth >= 1, ">= 1"),
              ("eval_examples", self.eval_examples, self.eval_examples >= 1, ">= 1"),
              ("eval_test_examples", self.eval_test_examples, self.eval_test_examples >= 0, ">= 0 (0: all of it)"),
              ("batch_size", self.batch_size, self.batch_size >= 1, ">= 1")]
    for name, value, ok, limit in checks:
      if not ok:
        shown = ",".join(map(str, value)) if isinstance(value, tuple) else value
        raise ConfigError(f"--{name}={shown}; give {limit}")
    for rule in self.rules:
      try:
        outer_of(rule)
      except ConfigError as e:
        raise ConfigError(f"--rules: {e}; give ps_optimizer specs or {LOCAL_SGD}[:lr=X,momentum=M], separated by ';'"
                          ) from None
    most = max(self.vws + (self.base_vws,))
    if most > self.cluster.num_gpus:
      raise ConfigError(f"--vws={','.join(map(str, self.vws))}: {most} virtual workers of one GPU each need "
                        f"{most} GPUs and cluster {self.cluster.name!r} has {self.cluster.num_gpus}; give smaller "
                        "counts or a larger --cluster")

  def points(self) -> list[tuple[str, int, int, int, int]]:
    """(factor, its value, N, Nm, D) of every point: each factor's sweep around the base."""
    base = {"vws": self.base_vws, "nm": self.base_nm, "d": self.base_d}
    values = {"vws": self.vws, "nm": self.nms, "d": self.ds}
    points = []
    for factor in FACTORS:
      for value in values[factor]:
        at = {**base, factor: value}
        points.append((factor, value, at["vws"], at["nm"], at["d"]))
    return points


class AblationRun(NamedTuple):
  """One run: its point (N, Nm, D), rule, learning rate and seed; examples to the target (None: missed), the
  final smoothed value (test accuracy, or test loss), the mean staleness of its trace, and its curve;
  ``diverged``: a pushed update was not finite and the run stopped there (a miss, its curve up to then)."""

  vws: int
  nm: int
  d: int
  rule: str
  lr: float
  seed: int
  examples_to_target: float | None
  final_smoothed: float
  mean_staleness: float
  curve: Curve
  diverged: bool = False


class AblationPoint(NamedTuple):
  """A point of a sweep for one rule, at its best learning rate: the mean examples to target over seeds (None:
  no rate reached it on every seed), the seeds that missed at that rate, the final smoothed accuracy."""

  factor: str
  value: int
  vws: int
  nm: int
  d: int
  rule: str
  best_lr: float | None
  examples_to_target: float | None
  missed: int
  final_smoothed: float


class AblationResult(NamedTuple):
  """The ablation: its settings, the dataset's name, every run, every point at its best learning rate, and the
  examples every run sees (a point that misses the target needs more than that)."""

  config: AblationConfig
  dataset: str
  runs: list[AblationRun]
  points: list[AblationPoint]
  budget: float = 0.0

  def to_json(self) -> dict[str, Any]:
    c = self.config
    setting = {k: v for k, v in dataclasses.asdict(c).items() if k != "cluster"}
    return {**setting, "cluster": c.cluster.name, "dataset_name": self.dataset, "budget": self.budget,
            "points": [p._asdict() for p in self.points],
            "runs": [{**r._asdict(), "curve": [list(p) for p in r.curve]} for r in self.runs]}


class _Runner:
  """Trains the runs of the ablation, each once (the base point is in every sweep)."""

  def __init__(self, config: AblationConfig, say: Progress):
    self.config, self.say = config, say
    self.dataset: Dataset = load_dataset(config.dataset).with_test_examples(config.eval_test_examples)
    self.model: LayeredModel = get_model(config.model, self.dataset.num_classes)
    self.target = Target(config.target_metric, config.smooth)
    self.runs: dict[tuple[int, int, int, str, float, int], AblationRun] = {}

  def run(self, vws: int, nm: int, d: int, rule: str, lr: float, seed: int) -> AblationRun:
    key = (vws, nm, 0 if is_local(rule) else d, rule, lr, seed)  # (D does not apply to local SGD: one run)
    if key not in self.runs:
      self.runs[key] = self._train(*key)
    return self.runs[key]

  def _train(self, vws: int, nm: int, d: int, rule: str, lr: float, seed: int) -> AblationRun:
    if is_local(rule):
      return self._train_local(vws, nm, d, rule, lr, seed)
    c, per_wave = self.config, vws * nm
    total = c.epochs * len(self.dataset.x_train) / c.batch_size
    config = RunConfig.of(cluster=c.cluster, executor="virtual", num_vws=vws, stages=1, nm=nm, d=d,
                          waves=max(1, math.ceil(total / per_wave)), batch_size=c.batch_size, optimizer=c.optimizer,
                          learning_rate=lr, seed=seed, ps_optimizer=rule,
                          eval_every=max(1, round(c.eval_examples / (per_wave * c.batch_size))))
    what = f"N={vws} Nm={nm} D={d} {rule} lr={lr:g} seed {seed}"
    try:
      result = run_hetpipe(self.model, self.dataset, config)
    except RunStopped as e:
      self.say(f"{what}: diverged ({e})")
      return AblationRun(vws, nm, d, rule, lr, seed, None, 0.0, 0.0, [], diverged=True)
    require_wsp(result.events, what)
    return self._scored((vws, nm, d, rule, lr, seed), hetpipe_curve(result.metrics, [nm] * vws),
                        mean_staleness(result.events), what)

  def _train_local(self, vws: int, nm: int, d: int, rule: str, lr: float, seed: int) -> AblationRun:
    """Synchronous local SGD at the point: ``vws`` workers, H = ``nm``, its outer Nesterov step (``rule``'s)."""
    c, outer = self.config, outer_of(rule)
    per_round = vws * nm * c.batch_size
    what = f"N={vws} H={nm} {rule} lr={lr:g} seed {seed}"
    try:
      result = train_sgd(model=self.model, dataset=self.dataset, tx=make_optimizer(c.optimizer, lr),
                         batch_sizes=[c.batch_size] * vws, local_steps=[nm] * vws, round_seconds=1.0,
                         rounds=max(1, math.ceil(c.epochs * len(self.dataset.x_train) / per_round)),
                         outer=outer_optimizer(outer.lr, outer.momentum), seed=seed,
                         eval_every=max(1, round(c.eval_examples / per_round)), what=what)
    except RunStopped as e:
      self.say(f"{what}: diverged ({e})")
      return AblationRun(vws, nm, d, rule, lr, seed, None, 0.0, 0.0, [], diverged=True)
    curve = [CurvePoint(r.time, r.examples / c.batch_size, r.test_accuracy, r.train_loss, r.test_loss)
             for r in result.rows if r.test_accuracy is not None and r.test_loss is not None]
    return self._scored((vws, nm, d, rule, lr, seed), curve, 0.0, what)

  def _scored(self, key: tuple[int, int, int, str, float, int], curve: Curve, staleness: float,
              what: str) -> AblationRun:
    """The run of ``key`` with its ``curve``: examples to the target and its final smoothed accuracy."""
    c = self.config
    examples = self.target.images_to(curve, c.target_accuracy, c.batch_size) if curve else None
    run = AblationRun(*key, examples, self.target.final(curve) if curve else 0.0, staleness, curve)
    self.say(f"{what}: " + ("missed" if examples is None else f"{examples:.0f} examples to target") +
             f", final {run.final_smoothed:.4f}")
    return run


def is_local(rule: str) -> bool:
  """Whether ``rule`` trains synchronous local SGD (``local_sgd[:keys]``)."""
  return rule.partition(":")[0].strip() == LOCAL_SGD


def outer_of(rule: str) -> PSOptimizer:
  """The parsed rule: a ``--ps_optimizer`` spec, or for ``local_sgd[:keys]`` its outer Nesterov step's spec.

  Raises:
    ConfigError: for a bad spec.
  """
  if is_local(rule):
    return parse_ps_optimizer("nesterov" + rule[rule.index(LOCAL_SGD) + len(LOCAL_SGD):])
  return parse_ps_optimizer(rule)


ACCURACY = Target()  # the default target: a test accuracy


def best_point(factor: str, value: int, runs: list[AblationRun], target: Target = ACCURACY) -> AblationPoint:
  """The point of ``runs`` (one point and rule, every rate and seed) at its best rate: the fewest mean examples
  to target over seeds among the rates every seed reached it with (none: the rate whose final smoothed value is
  best, by ``target``'s metric)."""
  first = runs[0]
  by_lr: dict[float, list[AblationRun]] = {}
  for r in runs:
    by_lr.setdefault(r.lr, []).append(r)
  reached = {lr: sum(r.examples_to_target for r in rs) / len(rs)  # type: ignore[misc]
             for lr, rs in by_lr.items() if all(r.examples_to_target is not None for r in rs)}
  final = {lr: sum(r.final_smoothed for r in rs) / len(rs) for lr, rs in by_lr.items()}
  lr = min(reached, key=lambda x: (reached[x], x)) if reached else max(final, key=lambda x: (target.better(final[x]),
                                                                                               -x))
  missed = sum(r.examples_to_target is None for r in by_lr[lr])
  return AblationPoint(factor, value, first.vws, first.nm, first.d, first.rule, lr, reached.get(lr), missed,
                       final[lr])


def run_ablation(config: AblationConfig, progress: Progress | None = None) -> AblationResult:
  """Trains every point of every sweep with every rule at every learning rate and seed; each point at its
  best rate.

  Raises:
    ConfigError: for a setting the cluster, the model or the data cannot run.
  """
  runner = _Runner(config, progress or (lambda line: None))
  points = []
  for factor, value, vws, nm, d in config.points():
    for rule in config.rules:
      runs = [runner.run(vws, nm, d, rule, lr, seed) for lr in config.lrs for seed in config.seeds]
      points.append(best_point(factor, value, runs, runner.target))
  budget = config.epochs * len(runner.dataset.x_train)
  return AblationResult(config, runner.dataset.name, list(runner.runs.values()), points, budget)
