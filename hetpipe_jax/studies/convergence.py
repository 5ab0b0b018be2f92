r"""The convergence study as library code: HetPipe (its policies at every D, the tuned configuration, the tuned one
with an outer optimizer at the parameter server, the tuner's fastest) against its peers in time to accuracy
(:func:`run_convergence`: a :class:`~hetpipe_jax.studies.convergence_config.ConvergenceConfig` in, a
:class:`ConvergenceResult` out).

Real training on the emulated cluster's clock: every run trains the same model from the same initialisation on the
same examples, once per seed. The time axis is the cost of ``config.time_model`` on the cluster. The modules:

* :mod:`~hetpipe_jax.studies.convergence_config`: the settings, checked;
* :mod:`~hetpipe_jax.studies.convergence_study`: what every run shares (the model, the data, the peers simulated,
  the HetPipe configurations of the policies);
* :mod:`~hetpipe_jax.studies.convergence_runs`: the runs (a peer with its own numerics; HetPipe and SSP through
  :mod:`hetpipe_jax.systems.hetpipe`) and the learning-rate pilots;
* :mod:`~hetpipe_jax.studies.convergence_lr`: the learning-rate search, the same for every system;
* :mod:`~hetpipe_jax.studies.convergence_tuned`: the tuned configuration;
* :mod:`~hetpipe_jax.studies.convergence_summary`: the target's outcomes, the summaries, the table and the
  staleness-aware estimate's validation.

``experiments.convergence`` turns its flags into the config, writes the files and prints the report.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

from hetpipe_jax.baselines.numerics import train_sgd
from hetpipe_jax.optim import make_optimizer
from hetpipe_jax.studies.convergence_config import ConvergenceConfig
from hetpipe_jax.studies.convergence_lr import LrChoice, LrPilot
from hetpipe_jax.studies.convergence_noise import noise_tables
from hetpipe_jax.studies.convergence_runs import ConvergenceRun, Runner
from hetpipe_jax.studies.convergence_study import HETPIPE, Progress, Study, make_study
from hetpipe_jax.studies.convergence_summary import (
  StalenessCheck,
  Summary,
  TableRow,
  Unigram,
  summarise,
  table,
  unigram_baseline,
  validate_staleness_model,
  with_target,
)
from hetpipe_jax.studies.convergence_target import Target
from hetpipe_jax.studies.convergence_tuned import TunedChoice, tune_config
from hetpipe_jax.studies.noise_scale import NoiseScale, gradient_noise_scale
from hetpipe_jax.systems import LOCAL


def grid_words(grid: tuple[float, ...]) -> str:
  """A grid of factors in words: ``each of 7 log-spaced factors 0.1..10`` where it is log-spaced (3 or more), else
  ``each of 0.5,1``."""
  ordered = sorted(grid)
  ratios = [b / a for a, b in zip(ordered, ordered[1:])]
  if len(grid) > 2 and max(ratios) / min(ratios) < 1 + 1e-9:
    return f"each of {len(grid)} log-spaced factors {ordered[0]:g}..{ordered[-1]:g}"
  return f"each of {','.join(f'{x:g}' for x in grid)}"


class ConvergenceResult(NamedTuple):
  """The study: its setting, the target, every run, the summaries and the table, the learning rates and their
  pilots, the tuned choice, the staleness-aware estimate and a language model's unigram baseline.

  Attributes:
    config: the settings.
    model / dataset / time_axis / ideal_images_per_sec / unit / per_example / epoch: the trained model's and the
      dataset's names, the time axis in words, the cluster's ideal aggregate, what an example counts as, and the
      minibatches per epoch.
    target: the target (given, or automatic from the runs).
    runs: every run, seed by seed, with its outcome.
    summary: configuration -> its runs over seeds; table: one row per configuration.
    lr_choices / lr_pilots: each learning-rate system's rates (inner, and outer where it has an outer step) and
      the pilot runs that chose them.
    not_run: row -> why it cannot run on the cluster.
    tuned: the tuned choice (None: not tuned).
    staleness: the staleness-aware estimate and its check.
    unigram: a language model's unigram baseline (None: an image model).
    noise_tables: noise level -> the table with every run timed under it (``config.noise_levels``).
    epochs / lr_epochs: every run's and every pilot's length in epochs (the config's, scaled alike to
      ``config.min_updates``: :attr:`~hetpipe_jax.studies.convergence_study.Study.horizon`).
    noise_scale: the proxy's gradient noise scale at the target (:func:`noise_at_target`; None: no synchronous
      run reached it), beside every row's examples per update.
  """

  config: ConvergenceConfig
  model: str
  dataset: str
  time_axis: str
  ideal_images_per_sec: float
  unit: str
  per_example: int
  epoch: float
  target: float
  runs: list[ConvergenceRun]
  summary: dict[str, Summary]
  table: list[TableRow]
  lr_choices: dict[str, LrChoice]
  lr_pilots: list[LrPilot]
  not_run: dict[str, str]
  tuned: TunedChoice | None
  staleness: StalenessCheck
  unigram: Unigram | None
  noise_tables: dict[str, list[TableRow]] = {}  # noqa: RUF012 (a NamedTuple's default, never mutated)
  epochs: float = 0.0
  lr_epochs: float = 0.0
  noise_scale: NoiseScale | None = None

  @property
  def target_rule(self) -> str:
    """``given``, or how the automatic target was set."""
    c = self.config
    return "given" if c.target_accuracy else Target(c.target_metric, c.smooth).rule()

  @property
  def learning_rates(self) -> dict[str, float]:
    """Each learning-rate system's inner rate."""
    return {system: choice.lr for system, choice in self.lr_choices.items()}

  @property
  def lr_rule(self) -> str:
    """The learning-rate rule and its search in words."""
    c = self.config
    scaled = "linearly" if c.lr_scaling == "linear" else "with the square root"
    metric = "test loss" if c.target_metric == "loss" else "accuracy"
    rule = (f"{c.base_lr:g} per 32-example update, scaled {scaled} with the examples of one update, times "
            f"{grid_words(c.lr_grid)}")
    if len(c.lr_grid) == 1:
      return f"{rule}; no pilots, every outer step at its default rate"
    extra = sum(1 for o in c.outer_lr_grid if o != 1.0)
    return (f"{rule} at the default outer rate, then {extra} more pilots per system: the outer rate times each of "
            f"{','.join(f'{o:g}' for o in c.outer_lr_grid if o != 1.0)} at the best inner rate (a system with an "
            f"outer step), or as many inner rates between the best and its neighbours (one without); "
            f"{len(c.lr_grid) + extra} pilots of {self.lr_epochs:.4g} epochs on seed {c.pilot_seed} for every "
            f"system, the best final smoothed {metric} kept; the rate {c.schedule} over each optimizer's updates")

  def to_json(self) -> dict[str, Any]:
    """``convergence.json``."""
    c = self.config
    return {"target_accuracy": self.target, "target_metric": c.target_metric, "target_rule": self.target_rule,
            "smooth": c.smooth, "time_axis": self.time_axis, "time_model": c.time_model, "model": self.model,
            "optimizer": c.optimizer, "recompute": c.recompute, "dataset": self.dataset, "cluster": c.cluster.name,
            "epochs": self.epochs, "min_updates": c.min_updates, "lr_schedule": str(c.schedule),
            "staleness_control": c.knobs.staleness, "whimpy": c.whimpy, "seeds": list(c.seeds),
            "noise_scale": None if self.noise_scale is None else self.noise_scale._asdict(),
            "ideal_images_per_sec": self.ideal_images_per_sec, "unit": self.unit, "per_example": self.per_example,
            "table": [r._asdict() for r in self.table],
            "summary": {k: s._asdict() for k, s in self.summary.items()}, "learning_rates": self.learning_rates,
            "lr_rule": self.lr_rule, "lr_grid": list(c.lr_grid), "outer_lr_grid": list(c.outer_lr_grid),
            "lr_choices": {k: v._asdict() for k, v in self.lr_choices.items()},
            "lr_pilots": [p._asdict() for p in self.lr_pilots], "not_run": self.not_run,
            "tuned": {} if self.tuned is None else self.tuned.to_json(),
            **({} if self.unigram is None else self.unigram._asdict()), **self.staleness.to_json(),
            "noise_levels": {level: [r._asdict() for r in rows] for level, rows in self.noise_tables.items()},
            "runs": [r.to_json() for r in self.runs]}


def run_study(runner: Runner) -> tuple[list[ConvergenceRun], TunedChoice | None]:
  """Every run, seed by seed: the peers, HetPipe at every policy and D, the tuned configurations (chosen once the
  first seed's runs are in) and SSP; the tuned choice (None: not tuned)."""
  study, c = runner.study, runner.config
  runs: list[ConvergenceRun] = []
  tuned: TunedChoice | None = None
  for seed in c.seeds:
    runs += [runner.peer_run(p, seed) for p in study.peers if p.run is not None]
    runs += [runner.train(spec, seed, runner.lrs[HETPIPE]) for spec in study.policy_specs()]
    if c.tuned:
      if tuned is None:
        tuned = tune_config(runner, runs)
      runs += [runner.train(spec, seed, runner.lrs[spec.lr_system]) for spec in tuned.specs]
    if c.ssp:
      runs.append(runner.ssp_run(seed))
  return runs, tuned


def run_convergence(config: ConvergenceConfig, progress: Progress | None = None) -> ConvergenceResult:
  """Runs the study: the learning rates (pilot runs), every run, the target and every run's outcome, the
  summaries, the table and the staleness-aware estimate.

  Args:
    config: the settings.
    progress: takes a line per step (None: silent).

  Raises:
    ConfigError: for a setting the cluster, the model or the data cannot run; RunStopped: a run that diverged.
  """
  say = progress or (lambda line: None)
  study = make_study(config, say)
  runner = Runner(study, say)
  runner.choose_learning_rates()
  runs, tuned = run_study(runner)
  rule = study.target
  target = config.target_accuracy or rule.of_runs([{"name": r.name, "curve": r.curve} for r in runs])
  runs = [with_target(r, rule, target, config.batch_size)._replace(language=study.language) for r in runs]
  summary = {name: summarise([r for r in runs if r.name == name]) for name in dict.fromkeys(r.name for r in runs)}
  noisy = noise_tables(runs, config.noise_levels, runner.images_under, rule, target, config.batch_size, study.ideal)
  return ConvergenceResult(config, study.model.name, study.dataset.name, study.time_axis, study.ideal, study.unit,
                           study.per_example, study.epoch, target, runs, summary, table(summary), runner.choices,
                           runner.lr_pilots, study.not_run, tuned, validate_staleness_model(runs, target),
                           unigram_baseline(study.dataset) if study.language else None, noisy, study.epochs,
                           study.lr_epochs, noise_at_target(study, runs, say))


def noise_at_target(study: Study, runs: list[ConvergenceRun], say: Progress) -> NoiseScale | None:
  """The trained model's gradient noise scale (:mod:`~hetpipe_jax.studies.noise_scale`) at the weights where the
  synchronous run that reached the target on the fewest examples reached it: that run trained again, on its seed
  and rates, for the steps it took (the same weights: the same trajectory's prefix). None when no synchronous run
  reached it."""
  sync = {p.name: p for p in study.peers if p.run is not None and p.system.kind != LOCAL}
  reached = [(r.outcome.images_to_target, i, r) for i, r in enumerate(runs)
             if r.name in sync and r.outcome is not None and r.outcome.images_to_target is not None]
  if not reached:
    say("gradient noise scale: not measured (no synchronous run reached the target)")
    return None
  examples, _, run = min(reached)
  spec, c = sync[run.name], study.config
  steps = max(1, math.ceil(examples / spec.simulated.examples_per_round))
  tx = make_optimizer(c.optimizer, c.schedule.rate(run.lr, run.updates))
  params = train_sgd(model=study.model, dataset=study.dataset, tx=tx, batch_sizes=spec.batch_sizes, rounds=steps,
                     round_seconds=spec.simulated.round_seconds, seed=run.seed, eval_every=steps,
                     what=f"{run.name} to the target (noise scale)").params
  scale = gradient_noise_scale(study.model, params, study.dataset, seed=c.pilot_seed,
                               at=f"{run.name}, seed {run.seed}, step {steps} of {run.updates} (the target)")
  say(f"gradient noise scale at the target: B_simple {scale.b_simple:.4g} examples ({scale.at})")
  return scale


__all__ = ["ConvergenceConfig", "ConvergenceResult", "run_convergence"]
