"""The convergence study's runs (:class:`Runner`): a peer trained with its own numerics on its simulated round's
clock, a HetPipe configuration (a policy at a D, a tuned one, SSP) on the ``virtual`` executor with its clock
scaled to the ``sim`` executor's images/s (:mod:`hetpipe_jax.systems.hetpipe`), and the learning-rate pilots that
choose every system's rate (:meth:`Runner.choose_learning_rates`)."""

from __future__ import annotations

import math
from typing import Any, NamedTuple

from hetpipe_jax.errors import ConfigError, RunStopped
from hetpipe_jax.plan.allocation import horovod_gpus
from hetpipe_jax.studies.convergence_study import HETPIPE, HETPIPE_OUTER, Progress, Spec, Study
from hetpipe_jax.systems import Curve, SystemSpec, TrainSetting, rule_lr
from hetpipe_jax.systems.hetpipe import HetPipeSetting, Trainer, WaveRun, simulated_images_per_sec, training_of

LR_EXTENSIONS = 3  # learning-rate pilots: how many steps the grid may extend past an edge that is best
SSP = "ssp"


class PeerShape(NamedTuple):
  """A peer's workers: the global batch, each worker's batch and local steps, the round's seconds."""

  global_batch: int
  batch_sizes: list[int]
  local_steps: list[int]
  round_seconds: float


class WspStats(NamedTuple):
  """A HetPipe (or SSP) run's time scale to the ``sim`` executor, PS optimizer and staleness."""

  time_scale: float
  ps_optimizer: str
  staleness: dict[str, Any]
  mean_staleness: float


class Outcome(NamedTuple):
  """A run against the target: its time and examples to it (None: missed), its final test accuracy (raw and
  smoothed), test loss and perplexity."""

  time_to_target_s: float | None
  images_to_target: float | None
  final_test_accuracy: float
  final_smoothed_accuracy: float
  final_test_loss: float
  final_test_perplexity: float


class ConvergenceRun(NamedTuple):
  """One run of a configuration at a seed (``convergence.json``'s ``runs``).

  Attributes:
    name / row / system: the configuration, its row in the table, its system (``hetpipe``, ``ssp``, a peer's).
    seed / d / nm / lr / gpus: what it ran with.
    images_per_sec / efficiency: the configuration's simulated examples/s, over the ideal aggregate.
    curve: its evaluations.
    peer: a peer's workers (None for HetPipe and SSP); wsp: HetPipe's and SSP's time scale and staleness.
    outcome: against the target (None until it is known); language: a language model's run (a perplexity curve).
  """

  name: str
  row: str
  system: str
  seed: int
  d: int
  nm: list[int]
  lr: float
  gpus: int
  images_per_sec: float
  efficiency: float
  curve: Curve
  peer: PeerShape | None = None
  wsp: WspStats | None = None
  outcome: Outcome | None = None
  language: bool = False

  @property
  def perplexity_curve(self) -> list[list[float]]:
    """[time s, test perplexity] at every evaluation."""
    return [[p.time, math.exp(p.test_loss)] for p in self.curve]

  def to_json(self) -> dict[str, Any]:
    head = {k: getattr(self, k) for k in ("name", "row", "system", "seed", "d", "nm", "lr", "gpus")}
    tail = {"images_per_sec": self.images_per_sec, "efficiency": self.efficiency}
    if self.peer is not None:
      doc = {**head, **self.peer._asdict(), **tail, "curve": self.curve}
    else:
      assert self.wsp is not None
      doc = {**head, "time_scale": self.wsp.time_scale, **tail, "ps_optimizer": self.wsp.ps_optimizer,
             "curve": self.curve, "staleness": self.wsp.staleness, "mean_staleness": self.wsp.mean_staleness}
    doc.update(self.outcome._asdict() if self.outcome is not None else {})
    return {**doc, "perplexity_curve": self.perplexity_curve} if self.language else doc


class LrPilot(NamedTuple):
  """A learning-rate pilot: the system, its rate (``factor`` x the rule's), seed and epochs, its final smoothed
  value (None: it diverged)."""

  system: str
  lr: float
  factor: float
  seed: int
  epochs: float
  final_smoothed: float | None
  diverged: bool


class Runner:
  """Trains the study's configurations; keeps what runs reuse: the ``sim`` executor's images/s and time scale of
  each HetPipe configuration (computed at its first run), the runs at a smaller D (:class:`Trainer`), the learning
  rates chosen (``lrs``) and their pilots."""

  def __init__(self, study: Study, progress: Progress):
    self.study, self.config, self.say = study, study.config, progress
    self.trainer = Trainer(study.model, study.dataset, study.base, progress)
    self.images: dict[str, float] = {}  # configuration -> the sim executor's images/s
    self.scales: dict[str, float] = {}  # configuration -> its time scale to the sim executor
    self.lrs: dict[str, float] = {}  # learning-rate system -> its rate
    self.lr_pilots: list[LrPilot] = []

  def train(self, spec: Spec, seed: int, lr: float, epochs: float | None = None) -> ConvergenceRun:
    """One HetPipe run of ``spec`` at ``lr`` for the config's epochs (or ``epochs``), its trace checked."""
    study, b = self.study, self.config.batch_size
    nms = study.plan_nms(spec.setting)
    total = study.total if epochs is None else int(epochs * study.epoch)
    waves = max(1, math.ceil(total / sum(nms)))
    run = WaveRun(seed, waves, lr, max(1, round(self.config.eval_examples / (sum(nms) * b))))
    self.say(f"seed {seed}, {spec.name}: {len(nms)} virtual workers, Nm={nms}, {waves} waves, learning rate "
             f"{lr:.4g}")
    result = self.trainer.train(spec.setting, run, f"seed {seed}, {spec.name}")
    if spec.name not in self.scales:
      self.images[spec.name] = simulated_images_per_sec(study.sim_model, study.sim_data, study.base, spec.setting,
                                                        waves)
      self.scales[spec.name] = result.images_per_second / self.images[spec.name]
    t = training_of(result, self.scales[spec.name])
    images = self.images[spec.name]
    return ConvergenceRun(spec.name, spec.row, HETPIPE, seed, spec.setting.d, t.nm, lr, t.gpus, images,
                          images / study.ideal, t.curve,
                          wsp=WspStats(t.time_scale, spec.setting.ps_optimizer or "add", t.staleness,
                                       t.mean_staleness))

  def train_system(self, spec: SystemSpec, seed: int, lr: float, epochs: float) -> Curve:
    """``spec``'s system trained with its own numerics for ``epochs`` epochs: its curve."""
    c = self.config
    setting = TrainSetting(seed, lr, c.optimizer, epochs, c.eval_examples, c.batch_size)
    return spec.system.train(self.study.model, self.study.dataset, spec.simulated, setting, self.study.knobs)

  def peer_run(self, spec: SystemSpec, seed: int) -> ConvergenceRun:
    """One peer's run with its numerics."""
    lr = self.lrs[spec.system.name]
    self.say(f"seed {seed}, {spec.name}: {len(spec.batch_sizes)} workers, batches {spec.batch_sizes}, H "
             f"{spec.local_steps}, learning rate {lr:.4g}")
    curve = self.train_system(spec, seed, lr, self.config.epochs)
    run, name = spec.simulated, spec.system.name
    return ConvergenceRun(spec.name, name, name, seed, 0, [1], lr, run.gpus, run.images_per_sec, run.efficiency,
                          curve, peer=PeerShape(sum(spec.batch_sizes), spec.batch_sizes, spec.local_steps,
                                                run.round_seconds))

  def ssp_run(self, seed: int) -> ConvergenceRun:
    """An SSP parameter server without pipelining (a worker per GPU that holds the model, Nm = 1, D = ssp_d)."""
    study, c = self.study, self.config
    gpus = [g for g in horovod_gpus(study.cluster, study.clock_profiles, study.costs) if g.type.name != c.whimpy]
    if not gpus:
      raise ConfigError("no GPU of the cluster holds the whole model for the SSP baseline; drop --ssp")
    name = f"SSP PS ({len(gpus)} GPUs) D={c.ssp_d}"
    run = self.train(Spec(name, HetPipeSetting([[g.index] for g in gpus], 1, c.ssp_d), "SSP"), seed,
                     self.lrs[HETPIPE])
    return run._replace(system=SSP)

  # Learning rates.

  def choose_learning_rates(self) -> None:
    """Every system's learning rate into ``lrs`` (the pilot runs into ``lr_pilots``): the rule's rate times the
    grid's factor whose pilot ends best, the grid extended past an edge that is best."""
    c, study = self.config, self.study
    rule = lambda examples: rule_lr(examples, c.base_lr, c.lr_scaling)
    hetpipe = study.policy_specs()[0]
    candidates: list[tuple[str, float, Any]] = [(p.system.name, rule(p.update_examples), p) for p in study.peers
                                                if p.run is not None]
    candidates.append((HETPIPE, rule(c.batch_size), hetpipe))
    if c.outer:
      spec = study.outer_spec(len(study.plan_nms(hetpipe.setting)))
      outer = Spec(f"{hetpipe.name} + {spec}", hetpipe.setting._replace(ps_optimizer=spec), hetpipe.row,
                   HETPIPE_OUTER)
      candidates.append((HETPIPE_OUTER, rule(c.batch_size), outer))
    for system, base, what in candidates:
      self.lrs[system] = base * self.best_factor(system, base, what)
      if len(c.lr_grid) > 1:
        self.say(f"learning rate of {system}: {self.lrs[system]:.4g}")

  def best_factor(self, system: str, base: float, what: Any) -> float:
    """The grid's factor whose pilot ends best, the grid extended up to :data:`LR_EXTENSIONS` times past an edge
    that is best (one factor: that one, no pilot)."""
    grid = self.config.lr_grid
    if len(grid) == 1:
      return grid[0]
    scores: dict[float, float] = {}
    factors = sorted(grid)
    for _ in range(LR_EXTENSIONS + 1):  # the grid, then one step further while the best is at an edge
      for factor in factors:
        if factor not in scores:
          scores[factor] = self.lr_pilot(system, what, base, factor)
      best = max(scores, key=lambda f: (scores[f], -f))  # the highest final accuracy; a tie: the smaller rate
      ends = sorted(scores)
      if scores[best] == -math.inf or best not in (ends[0], ends[-1]):
        break
      factors = [best * (ends[-1] / ends[-2] if best == ends[-1] else ends[0] / ends[1])]
    return best

  def lr_pilot(self, system: str, what: Any, base: float, factor: float) -> float:
    """One learning-rate pilot of ``system`` at ``base`` x ``factor``: its score (the final smoothed value, higher
    better; -inf when it diverged), recorded in ``lr_pilots``."""
    c, rule, lr = self.config, self.study.target, base * factor
    curve = self.pilot_curve(what, lr)
    self.lr_pilots.append(LrPilot(system, lr, factor, c.pilot_seed, c.lr_epochs,
                                  rule.final(curve) if curve else None, not curve))
    self.say(f"learning rate of {system}: {lr:.4g} (x{factor:g}) ends at "
             f"{f'{rule.final(curve):.4f}' if curve else 'divergence'}")
    return rule.better(rule.final(curve)) if curve else -math.inf

  def pilot_curve(self, what: Spec | SystemSpec, lr: float) -> Curve | None:
    """A learning-rate pilot: ``what`` trained on the pilot seed for the pilots' epochs at ``lr``; None when it
    diverged."""
    c = self.config
    try:
      if isinstance(what, Spec):
        return self.train(what, c.pilot_seed, lr, c.lr_epochs).curve
      return self.train_system(what, c.pilot_seed, lr, c.lr_epochs)
    except RunStopped as e:
      self.say(f"pilot at learning rate {lr:.4g} stopped: {e}")
      return None
