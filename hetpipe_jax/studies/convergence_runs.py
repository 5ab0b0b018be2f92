"""The convergence study's runs (:class:`Runner`): a peer trained with its own numerics on its simulated round's
clock, a HetPipe configuration (a policy at a D, a tuned one, SSP) on the ``virtual`` executor with its clock
scaled to the ``sim`` executor's images/s (:mod:`hetpipe_jax.systems.hetpipe`), and the learning-rate pilots that
choose every system's rates (:meth:`Runner.choose_learning_rates`, searched as
:mod:`~hetpipe_jax.studies.convergence_lr` says)."""

from __future__ import annotations

import functools
import math
from typing import Any, NamedTuple

from hetpipe_jax.core.meta import meta_gpus
from hetpipe_jax.errors import ConfigError, RunStopped
from hetpipe_jax.plan.allocation import horovod_gpus
from hetpipe_jax.studies.convergence_lr import LrChoice, LrPilot, outer_rate, search_rates, spec_outer_lr
from hetpipe_jax.studies.convergence_study import HETPIPE, Progress, Spec, Study, outer_system
from hetpipe_jax.systems import Curve, SystemSpec, TrainSetting, rule_lr
from hetpipe_jax.systems.hetpipe import (
  HetPipeSetting,
  Trainer,
  WaveRun,
  simulated_images_per_sec,
  simulated_run,
  training_of,
)

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
  smoothed), test loss and perplexity, and the optimizer updates one weight copy had taken at the target (None:
  missed)."""

  time_to_target_s: float | None
  images_to_target: float | None
  final_test_accuracy: float
  final_smoothed_accuracy: float
  final_test_loss: float
  final_test_perplexity: float
  updates_to_target: float | None = None


class ConvergenceRun(NamedTuple):
  """One run of a configuration at a seed (``convergence.json``'s ``runs``).

  Attributes:
    name / row / system: the configuration, its row in the table, its system (``hetpipe``, ``ssp``, a peer's).
    seed / d / nm / lr / gpus: what it ran with.
    images_per_sec / efficiency: the configuration's simulated examples/s, over the ideal aggregate.
    curve: its evaluations.
    peer: a peer's workers (None for HetPipe and SSP); wsp: HetPipe's and SSP's time scale and staleness.
    outcome: against the target (None until it is known); language: a language model's run (a perplexity curve).
    outer_lr: a peer's outer learning rate (None: it has no outer step; HetPipe's is in its ``ps_optimizer``).
    examples_per_update: examples behind one of its optimizer updates (a HetPipe stage's local update: the
      minibatch, x K under a control that accumulates K); updates: the optimizer updates of one weight copy in the
      run (a synchronous step, a local worker's inner step, a HetPipe stage's local update).
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
  outer_lr: float | None = None
  examples_per_update: int = 0
  updates: int = 0

  @property
  def perplexity_curve(self) -> list[list[float]]:
    """[time s, test perplexity] at every evaluation."""
    return [[p.time, math.exp(p.test_loss)] for p in self.curve]

  def to_json(self) -> dict[str, Any]:
    head = {k: getattr(self, k) for k in ("name", "row", "system", "seed", "d", "nm", "lr", "gpus",
                                          "examples_per_update", "updates")}
    tail = {"images_per_sec": self.images_per_sec, "efficiency": self.efficiency}
    if self.peer is not None:
      outer = {} if self.outer_lr is None else {"outer_lr": self.outer_lr}
      doc = {**head, **outer, **self.peer._asdict(), **tail, "curve": self.curve}
    else:
      assert self.wsp is not None
      doc = {**head, "time_scale": self.wsp.time_scale, **tail, "ps_optimizer": self.wsp.ps_optimizer,
             "curve": self.curve, "staleness": self.wsp.staleness, "mean_staleness": self.wsp.mean_staleness}
    doc.update(self.outcome._asdict() if self.outcome is not None else {})
    return {**doc, "perplexity_curve": self.perplexity_curve} if self.language else doc


class LrSubject(NamedTuple):
  """A learning-rate system of the study: its name, its rule's inner rate, its outer step's default rate (None: it
  takes none), what its pilots train (a peer; HetPipe's first policy configuration), and for HetPipe with an outer
  rule that rule (a ``--ps_optimizer`` spec)."""

  system: str
  rule_lr: float
  outer_lr: float | None
  what: Spec | SystemSpec
  outer_rule: str | None = None


class Runner:
  """Trains the study's configurations; keeps what runs reuse: the ``sim`` executor's images/s and time scale of
  each HetPipe configuration (computed at its first run), the runs at a smaller D (:class:`Trainer`), the learning
  rates chosen (``lrs``) and their pilots."""

  def __init__(self, study: Study, progress: Progress):
    self.study, self.config, self.say = study, study.config, progress
    self.trainer = Trainer(study.model, study.dataset, study.base, progress)
    self.images: dict[str, float] = {}  # configuration -> the sim executor's images/s
    self.gpus: dict[str, int] = {}  # configuration -> its GPUs on the sim executor (tensor-parallel partners too)
    self.scales: dict[str, float] = {}  # configuration -> its time scale to the sim executor
    self.choices: dict[str, LrChoice] = {}  # learning-rate system -> its rates
    self.lr_pilots: list[LrPilot] = []
    self.settings: dict[str, tuple[HetPipeSetting, int]] = {}  # configuration -> its setting and waves (the clock)
    self.noisy: dict[tuple[str, str], float] = {}  # (configuration, noise) -> its examples/s under it

  @property
  def lrs(self) -> dict[str, float]:
    """Learning-rate system -> its inner rate."""
    return {system: choice.lr for system, choice in self.choices.items()}

  def train(self, spec: Spec, seed: int, lr: float, epochs: float | None = None) -> ConvergenceRun:
    """One HetPipe run of ``spec`` at ``lr`` for the config's epochs (or ``epochs``), its trace checked."""
    study, b = self.study, self.config.batch_size
    nms = study.plan_nms(spec.setting)
    total = study.total if epochs is None else int(epochs * study.epoch)
    waves = max(1, math.ceil(total / sum(nms)))
    accumulate = self.config.knobs.control.accumulate
    run = WaveRun(seed, waves, lr, max(1, round(self.config.eval_examples / (sum(nms) * b))))
    self.say(f"seed {seed}, {spec.name}: {len(nms)} virtual workers, Nm={nms}, {waves} waves, learning rate "
             f"{lr:.4g}")
    result = self.trainer.train(spec.setting, run, f"seed {seed}, {spec.name}")
    if spec.name not in self.scales:
      self.settings[spec.name] = (spec.setting, waves)
      sim = simulated_run(study.sim_model, study.sim_data, study.base, spec.setting, waves, study.knobs.noise,
                          study.knobs.adapt)
      self.images[spec.name], self.gpus[spec.name] = sim.images_per_second, meta_gpus(sim.events[0])
      self.scales[spec.name] = result.images_per_second / self.images[spec.name]
    t = training_of(result, self.scales[spec.name])
    images = self.images[spec.name]
    return ConvergenceRun(spec.name, spec.row, HETPIPE, seed, spec.setting.d, t.nm, lr, self.gpus[spec.name], images,
                          images / study.ideal, t.curve,
                          wsp=WspStats(t.time_scale, spec.setting.ps_optimizer or "add", t.staleness,
                                       t.mean_staleness),
                          examples_per_update=b * accumulate(max(nms)),
                          updates=waves * max(nms) // accumulate(max(nms)))

  def images_under(self, run: ConvergenceRun, noise: str) -> float:
    """``run``'s configuration's examples/s under ``noise`` (each system adapting by the study's knobs), simulated
    once per configuration and noise."""
    key = (run.name, noise)
    if key not in self.noisy:
      study = self.study
      if run.name in self.settings:
        setting, waves = self.settings[run.name]
        self.noisy[key] = simulated_images_per_sec(study.sim_model, study.sim_data, study.base, setting, waves, noise,
                                                   study.knobs.adapt)
      else:
        spec = next(p for p in study.peers if p.name == run.name)
        self.noisy[key] = spec.system.simulate(self.config.peer_cluster, study.profiles, self.config.batch_size,
                                               study.knobs._replace(noise=noise), study.costs,
                                               self.config.time_model_name or study.model.name).images_per_sec
    return self.noisy[key]

  def train_system(self, spec: SystemSpec, seed: int, lr: float, epochs: float,
                   outer_lr: float | None = None) -> Curve:
    """``spec``'s system trained with its own numerics for ``epochs`` epochs (its outer step at ``outer_lr``; None:
    the study's knob): its curve."""
    knobs = self.study.knobs
    knobs = knobs if outer_lr is None else spec.system.with_outer_lr(knobs, outer_lr)
    return spec.system.train(self.study.model, self.study.dataset, spec.simulated,
                             self.train_setting(seed, lr, epochs), knobs)

  def train_setting(self, seed: int, lr: float, epochs: float) -> TrainSetting:
    """How a peer trains at ``seed`` and ``lr`` for ``epochs`` epochs (the study's optimizer, schedule, batch and
    evaluations)."""
    c = self.config
    return TrainSetting(seed, lr, c.optimizer, epochs, c.eval_examples, c.batch_size, c.schedule)

  def peer_run(self, spec: SystemSpec, seed: int) -> ConvergenceRun:
    """One peer's run with its numerics, at its chosen rates."""
    choice, outer = self.choices[spec.system.name], ""
    if choice.outer_lr is not None:
      outer = f", outer learning rate {choice.outer_lr:.4g}"
    self.say(f"seed {seed}, {spec.name}: {len(spec.batch_sizes)} workers, batches {spec.batch_sizes}, H "
             f"{spec.local_steps}, learning rate {choice.lr:.4g}{outer}")
    curve = self.train_system(spec, seed, choice.lr, self.study.epochs, choice.outer_lr)
    run, name = spec.simulated, spec.system.name
    rounds = self.train_setting(seed, choice.lr, self.study.epochs).rounds(run.examples_per_round,
                                                                          len(self.study.dataset.x_train))
    return ConvergenceRun(spec.name, name, name, seed, 0, [1], choice.lr, run.gpus, run.images_per_sec,
                          run.efficiency, curve, peer=PeerShape(sum(spec.batch_sizes), spec.batch_sizes,
                                                                spec.local_steps, run.round_seconds),
                          outer_lr=choice.outer_lr, examples_per_update=spec.update_examples,
                          updates=rounds * max(spec.local_steps))

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

  def lr_subjects(self) -> list[LrSubject]:
    """Every learning-rate system: each peer that runs, HetPipe (on its first policy's configuration) and, with
    ``--outer`` and the tuned row, HetPipe with each outer rule; each with the outer rate it declares (a peer's
    :class:`~hetpipe_jax.systems.System`, the rule's ``lr``)."""
    c, study = self.config, self.study
    rule = lambda examples: rule_lr(examples, c.base_lr, c.lr_scaling)
    subjects = [LrSubject(p.system.name, rule(p.update_examples), p.system.outer_lr(study.knobs), p)
                for p in study.peers if p.run is not None]
    hetpipe = study.policy_specs()[0]
    local = study.update_examples.get(HETPIPE, c.batch_size)  # (a minibatch; K of them under accumulation)
    subjects.append(LrSubject(HETPIPE, rule(local), None, hetpipe))
    if c.tuned:  # (the outer rule's row is the tuned configuration's)
      subjects += [LrSubject(outer_system(r), rule(local), spec_outer_lr(r),
                             hetpipe._replace(lr_system=outer_system(r)), r) for r in c.outer_rules]
    return subjects

  def best_outer_rule(self) -> str | None:
    """The outer rule whose learning-rate pilots (each rule's, the same number on the same configuration) ended
    best (None: no outer rule; a tie: the first of ``--outer``)."""
    rules, rank = self.config.outer_rules, self.study.target.better
    final = {r: max((rank(p.final_smoothed) for p in self.lr_pilots
                     if p.system == outer_system(r) and p.final_smoothed is not None), default=-math.inf)
             for r in rules}
    return max(rules, key=lambda r: (final[r], -rules.index(r))) if rules else None

  def choose_learning_rates(self) -> None:
    """Every system's rates into ``choices`` (the pilot runs into ``lr_pilots``), searched the same way for each
    (:func:`~hetpipe_jax.studies.convergence_lr.search_rates`)."""
    c = self.config
    for s in self.lr_subjects():
      before = len(self.lr_pilots)
      factor, outer = search_rates(functools.partial(self.lr_pilot, s), c.lr_grid, c.outer_lr_grid,
                                   s.outer_lr is not None)
      edge = len(c.lr_grid) > 1 and not min(c.lr_grid) < factor < max(c.lr_grid)
      choice = LrChoice(s.system, s.rule_lr, factor, s.rule_lr * factor, None if s.outer_lr is None else
                        outer_rate(s.outer_lr, outer), None if s.outer_lr is None else outer,
                        len(self.lr_pilots) - before, edge)
      self.choices[s.system] = choice
      if choice.pilots:
        self.say(f"learning rate of {s.system}: {choice.lr:.4g}" + (
            "" if choice.outer_lr is None else f", outer {choice.outer_lr:.4g}") + f" ({choice.pilots} pilots)")

  def lr_pilot(self, subject: LrSubject, factor: float, outer_factor: float, stage: int) -> float:
    """One learning-rate pilot of ``subject`` at ``factor`` x its rule's rate and ``outer_factor`` x its default
    outer rate: its score (the final smoothed value, higher better; -inf when it diverged), recorded in
    ``lr_pilots``."""
    c, rule, lr = self.config, self.study.target, subject.rule_lr * factor
    outer = None if subject.outer_lr is None else outer_rate(subject.outer_lr, outer_factor)
    curve = self.pilot_curve(subject, lr, outer)
    final = rule.final(curve) if curve else None
    self.lr_pilots.append(LrPilot(subject.system, stage, lr, factor, outer, None if outer is None else outer_factor,
                                  c.pilot_seed, self.study.lr_epochs, final, final is None, curve or []))
    self.say(f"learning rate of {subject.system}: {lr:.4g} (x{factor:.4g})" +
             ("" if outer is None else f", outer {outer:.4g} (x{outer_factor:g})") +
             f" ends at {'divergence' if final is None else f'{final:.4f}'}")
    return -math.inf if final is None else rule.better(final)

  def pilot_curve(self, subject: LrSubject, lr: float, outer_lr: float | None) -> Curve | None:
    """A learning-rate pilot: ``subject`` trained on the pilot seed for the pilots' epochs at ``lr`` (its outer
    step at ``outer_lr``); None when it diverged."""
    c, what = self.config, subject.what
    try:
      if isinstance(what, Spec):
        spec = what if subject.outer_rule is None else self.outer_row(what, subject.outer_rule, outer_lr)
        return self.train(spec, c.pilot_seed, lr, self.study.lr_epochs).curve
      return self.train_system(what, c.pilot_seed, lr, self.study.lr_epochs, outer_lr)
    except RunStopped as e:
      self.say(f"pilot at learning rate {lr:.4g} stopped: {e}")
      return None

  def outer_row(self, spec: Spec, rule: str, outer_lr: float | None) -> Spec:
    """``spec`` with the outer ``rule`` at its parameter server at ``outer_lr`` (on DiLoCo's scale,
    :meth:`Study.outer_spec`; None: the rule's own)."""
    ps_rule = self.study.outer_spec(len(self.study.plan_nms(spec.setting)), rule, outer_lr)
    return Spec(f"{spec.name} + {ps_rule}", spec.setting._replace(ps_optimizer=ps_rule), spec.row, outer_system(rule))
