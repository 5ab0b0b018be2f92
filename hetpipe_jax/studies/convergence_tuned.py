"""The convergence study's tuned configuration (:func:`tune_config`): the tuner's best on the time model, by
predicted time to accuracy (the staleness model fitted to the first seed's HetPipe runs), by images/s, or measured
(pilot runs of the tuner's images/s-staleness front, the first to the target kept); with it the tuned
configuration with the best outer rule, and the tuner's fastest by images/s.

Rule, outer learning rate and wave sizing are searched together, in stages: every ``--outer`` rule gets the same
learning-rate search (inner and outer rate, :mod:`~hetpipe_jax.studies.convergence_lr`), the rule whose pilots end
best is kept, and the measured choice pilots the tuner's front (groupings, D, and Nm per virtual worker: the same
for all, max_fit, or sized to speed, :func:`~hetpipe_jax.tune.nm_choices`) once under the plain rule and once under
that rule at its rates, so the outer row's configuration is the one that learns fastest with it."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any, NamedTuple, TypeVar

from hetpipe_jax.errors import ConfigError
from hetpipe_jax.staleness import StalenessModel, fit_staleness_model
from hetpipe_jax.studies.convergence_runs import ConvergenceRun, Runner
from hetpipe_jax.studies.convergence_study import HETPIPE, Spec, outer_system
from hetpipe_jax.systems.hetpipe import HetPipeSetting
from hetpipe_jax.tune import RunSetting, SearchSpace, TuneOptions, candidate_json, pareto_front, tune
from hetpipe_jax.tune.candidate import Candidate
from hetpipe_jax.tune.result import Result

TUNED, TUNED_OUTER, TUNED_IPS = "HetPipe tuned", "HetPipe tuned + outer", "HetPipe tuned for images/s"
TUNED_EXAMPLES = "HetPipe tuned for examples + outer"
T = TypeVar("T")


class TunedPilot(NamedTuple):
  """A pilot run of the measured choice: the tuner's configuration (``label``, its simulated images/s and mean
  staleness), the run's mean staleness, the estimate's time to the provisional target, the measured time and
  examples to it, the final test accuracy and the seed."""

  label: str
  images_per_sec: float
  mean_staleness_sim: float
  mean_staleness: float
  predicted_time_to_target_s: float | None
  time_to_target_s: float | None
  images_to_target: float | None
  final_test_accuracy: float
  seed: int
  rule: str = "add"


class Fastest(NamedTuple):
  """The tuner's fastest configuration by images/s."""

  label: str
  images_per_sec: float
  mean_staleness: float


class TunedChoice(NamedTuple):
  """The tuned configuration (``convergence.json``'s ``tuned``): what chose it (``objective``), the chosen one
  (``label``, its simulated images/s and mean staleness), the staleness model fitted to the first seed's runs, the
  provisional target, its predicted time to it, the tuner's fastest, and the pilot runs (measured); ``specs``: the
  configurations the study trains (not in the JSON)."""

  objective: str
  label: str
  images_per_sec: float
  mean_staleness: float
  fit: StalenessModel | None
  provisional_target: float
  predicted_time_to_target_s: float | None
  fastest: Fastest
  pilots: list[TunedPilot]
  specs: list[Spec]
  outer_rule: str | None = None
  outer_label: str | None = None
  examples_label: str | None = None

  def to_json(self) -> dict[str, Any]:
    doc = {k: getattr(self, k) for k in ("objective", "label", "images_per_sec", "mean_staleness", "outer_rule",
                                         "outer_label", "examples_label")}
    doc.update(fit=None if self.fit is None else dataclasses.asdict(self.fit),
               provisional_target=self.provisional_target,
               predicted_time_to_target_s=self.predicted_time_to_target_s, fastest=self.fastest._asdict())
    return {**doc, "pilots": [p._asdict() for p in self.pilots]} if self.pilots else doc


def candidate_spec(name: str, row: str, candidate: Any) -> Spec:
  """A tuner candidate as the study runs it: its settings as a run takes them
  (:func:`~hetpipe_jax.tune.candidate_json`), its transfer models for the ``sim`` executor's time scale."""
  s = candidate_json(candidate)
  degrees = {1 + len(partners) for vw in s.get("tp", []) for partners in vw}
  setting = HetPipeSetting(s["policy"], s["nm"], s["d"], s["cuts"], s["window"], s["placement"], None,
                           s["overlap_transfers"], s["staged_ps"], degrees.pop() if degrees else None)
  return Spec(name, setting, row)


def provisional_target(runner: Runner, runs: Sequence[ConvergenceRun]) -> float:
  """The config's target, or the automatic target from the runs so far (the first seed's)."""
  if runner.config.target_accuracy:
    return runner.config.target_accuracy
  rule = runner.study.target
  return rule.auto(max((rule.final(r.curve) for r in runs), key=rule.better))


def fit_first_seed(runner: Runner, runs: Sequence[ConvergenceRun], target: float) -> StalenessModel | None:
  """The staleness model of the HetPipe runs so far at ``target`` (None: they give no fit)."""
  rule, b = runner.study.target, runner.config.batch_size
  done = [(r.wsp.mean_staleness, rule.images_to(r.curve, target, b)) for r in runs
          if r.system == HETPIPE and r.wsp is not None]
  try:
    return fit_staleness_model([(s, i) for s, i in done if i], target)
  except ConfigError as e:
    runner.say(f"ranking by images/s: {e}")
    return None


def tune_config(runner: Runner, runs: Sequence[ConvergenceRun]) -> TunedChoice:
  """The tuner's best on the time model by the config's objective (the staleness model fitted to ``runs``, the
  first seed's, at the target they give; images/s when they give no fit; measured: the pilot runs' fastest to the
  target), and the configurations to train: it, it with the outer optimizer, the tuner's fastest by images/s."""
  study, c = runner.study, runner.config
  target = provisional_target(runner, runs)
  fit = fit_first_seed(runner, runs, target) if c.tuned_objective != "throughput" else None
  # (the trained model is cut over the stages' leads; the study's degree is searched as the throughput study does)
  space = SearchSpace(ds=tuple(c.ds), max_stages=study.model.num_units,
                      tp="auto" if c.knobs.tp == "per_type" else c.knobs.tp)  # (one degree per configuration)
  options = TuneOptions(staleness_model=fit, front=0 if c.tuned_objective == "throughput" else 6,
                        setting=RunSetting(study.costs), progress=lambda line: runner.say(f"tuner: {line}"))
  out = tune(study.cluster, study.clock_profiles, c.batch_size, space, options)
  best, pilots, rule = out.best, [], runner.best_outer_rule()
  best_outer, fewest, objective = best, None, "time_to_accuracy" if fit else "throughput"
  if c.tuned_objective == "measured":  # (an estimate without a staleness cost says nothing of the front)
    ranked_by = fit if fit and fit.beta > 0 else None
    best, pilots, _ = measured_best(runner, out.results, ranked_by, target)
    if rule is not None:
      best_outer, outer_pilots, fewest_result = measured_best(runner, out.results, ranked_by, target, rule)
      pilots, fewest = pilots + outer_pilots, fewest_result and fewest_result.candidate
    objective = "measured"
  runner.say(f"tuned ({objective}): {best.candidate.label}" +
             ("" if rule is None else f"; with the outer rule {rule}: {best_outer.candidate.label}"))
  fastest = max(out.results, key=lambda r: r.images_per_sec)
  return TunedChoice(objective, best.candidate.label, best.images_per_sec, best.staleness, fit, target,
                     None if fit is None else fit.seconds(best.images_per_sec, best.staleness),
                     Fastest(fastest.candidate.label, fastest.images_per_sec, fastest.staleness), pilots,
                     tuned_specs(runner, best.candidate, fastest.candidate, rule, best_outer.candidate, fewest),
                     rule, None if rule is None else best_outer.candidate.label, fewest and fewest.label)


def tuned_specs(runner: Runner, tuned: Candidate, fastest: Candidate, rule: str | None = None,
                tuned_outer: Candidate | None = None, fewest: Candidate | None = None) -> list[Spec]:
  """The tuned configuration; with an outer ``rule``, the configuration tuned for it (``tuned_outer``; None: the
  tuned one) with the rule at its chosen outer rate, and the one whose pilot needed the fewest examples with it
  (``fewest``) when it is another one; and the fastest when it is another one."""
  specs = [candidate_spec(f"{TUNED} ({tuned.grouping}, D={tuned.d})", TUNED, tuned)]
  if rule is not None:
    chosen = tuned_outer or tuned
    for name, row, c in ((TUNED, TUNED_OUTER, chosen), (f"{TUNED} for examples", TUNED_EXAMPLES, fewest)):
      if c is not None and (row == TUNED_OUTER or c.label != chosen.label):
        specs.append(runner.outer_row(candidate_spec(f"{name} ({c.grouping}, D={c.d})", row, c), rule,
                                      runner.choices[outer_system(rule)].outer_lr))
  if fastest.label != tuned.label:
    specs.append(candidate_spec(f"{TUNED_IPS} ({fastest.grouping}, D={fastest.d})", TUNED_IPS, fastest))
  return specs


def measured_best(runner: Runner, results: Sequence[Result], fit: StalenessModel | None, target: float,
                  outer: str | None = None) -> tuple[Result, list[TunedPilot], Result | None]:
  """Trains :func:`pilot_choices` of the tuner's results on the pilot seed (with the ``outer`` rule at its chosen
  rates; None: the plain rule): the one that reached ``target`` first (on the emulated clock; none: the one whose
  smoothed accuracy ended best), the pilot runs, and the one that reached it on the fewest examples (the faster
  of a tie; None: none reached it)."""
  c, rule = runner.config, runner.study.target
  chosen, front = pilot_choices(results, fit, c.pilots)
  runner.say(f"measured choice{'' if outer is None else ' with ' + outer}: {len(chosen)} pilot runs on seed "
             f"{c.pilot_seed}, of {len(front)} configurations on the front")
  timed, pilots, curves = [], [], []
  system = HETPIPE if outer is None else outer_system(outer)
  for i, r in enumerate(chosen):
    spec = candidate_spec(f"pilot {i + 1}: {r.candidate.label}", "", r.candidate)
    if outer is not None:
      spec = runner.outer_row(spec, outer, runner.choices[system].outer_lr)
    run = runner.train(spec, c.pilot_seed, runner.lrs[system])
    assert run.wsp is not None
    curves.append(run.curve)
    when = rule.time_to(run.curve, target)
    pilots.append(TunedPilot(r.candidate.label, r.images_per_sec, r.staleness, run.wsp.mean_staleness,
                             None if fit is None else fit.seconds(r.images_per_sec, r.staleness), when,
                             rule.images_to(run.curve, target, c.batch_size), run.curve[-1].test_accuracy,
                             c.pilot_seed, spec.setting.ps_optimizer or "add"))
    runner.say(f"pilot {i + 1}/{len(chosen)}: {r.candidate.label}: time to target "
               f"{'not reached' if when is None else f'{when:.4g} s'}")
    if when is not None:
      timed.append((when, -r.images_per_sec, i, r))
  if not timed:  # none reached the target: the one that came closest
    runner.say(f"no pilot run reached the provisional target {target:.4g}: the tuned configuration is the pilot "
               "whose smoothed accuracy ended best")
    return chosen[max(range(len(chosen)), key=lambda i: (rule.better(rule.final(curves[i])), -i))], pilots, None
  return min(timed)[3], pilots, fewest_examples(chosen, pilots)


def fewest_examples(chosen: Sequence[T], pilots: Sequence[TunedPilot]) -> T | None:
  """Of the configurations ``chosen`` and their ``pilots`` (in the same order), the one that reached the target on
  the fewest examples, the sooner of a tie (None: none reached it)."""
  reached = [(p.images_to_target, p.time_to_target_s, i) for i, p in enumerate(pilots)
             if p.time_to_target_s is not None and p.images_to_target is not None]
  return chosen[min(reached)[2]] if reached else None


def pilot_choices(results: Sequence, fit: StalenessModel | None, count: int) -> tuple[list, list]:
  """``count`` configurations to train, and the front they come from: the tuner's results on the front of
  images/s against mean staleness (no other is both faster and less stale), one setting per grouping and Nm (its
  fastest). Half of them (rounded up) are the best by the staleness-aware estimate ``fit``, the others (all of
  them without a fit) evenly spaced inside the part of the front that is faster than those: more images/s for
  more staleness, the trade-off the estimate may judge wrongly."""
  best: dict[tuple, Any] = {}
  for r in pareto_front(results):  # in order of images/s: the last of a configuration is its fastest
    best[(r.candidate.grouping, tuple((p.nm, p.in_flight) for p in r.candidate.plans))] = r
  front = sorted(best.values(), key=lambda r: r.images_per_sec)
  chosen = []
  if fit is not None:
    chosen = sorted(front, key=lambda r: fit.seconds(r.images_per_sec, r.staleness))[:(count + 1) // 2]
  faster = [r for r in front if r.images_per_sec > max((c.images_per_sec for c in chosen), default=0.0)]
  n = count - len(chosen)
  chosen += list(dict.fromkeys(faster[(i + 1) * len(faster) // (n + 1)] for i in range(n))) if faster else []
  return chosen, front
