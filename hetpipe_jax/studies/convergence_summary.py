"""The convergence study's results against the target: each run's :class:`Outcome` (:func:`with_target`), each
configuration over seeds (:class:`Summary`), the one table (:class:`TableRow`: images/s and time to target against
the best peer's), the staleness-aware estimate fitted to the HetPipe and SSP runs and validated leaving one run
out (:class:`StalenessCheck`), and a language model's unigram baseline."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, NamedTuple

from hetpipe_jax.errors import ConfigError
from hetpipe_jax.evaluate import unigram_loss
from hetpipe_jax.staleness import StalenessModel, fit_staleness_model
from hetpipe_jax.studies.convergence_runs import ConvergenceRun, Outcome
from hetpipe_jax.studies.convergence_target import Target
from hetpipe_jax.systems import WSP, systems


def is_peer(system: str) -> bool:
  """Whether ``system`` (a run's) is a peer: a registered system that is not a WSP one (HetPipe; SSP is none)."""
  known = systems().get(system)
  return known is not None and known.kind != WSP


def with_target(run: ConvergenceRun, rule: Target, target: float, batch_size: int) -> ConvergenceRun:
  """``run`` with its :class:`Outcome` against ``target``."""
  last = run.curve[-1]
  images = rule.images_to(run.curve, target, batch_size)
  # one weight copy's updates at the target: its share of the run's examples x the updates it took in the run
  updates = None if images is None else run.updates * images / (last.minibatches * batch_size)
  return run._replace(outcome=Outcome(rule.time_to(run.curve, target), images, last.test_accuracy,
                                      rule.final(run.curve), last.test_loss, math.exp(last.test_loss), updates))


class Summary(NamedTuple):
  """A configuration over seeds: its row, system, GPUs, learning rate, images/s and efficiency, the seeds, how many
  missed the target, the mean and range of its time to target (the mean: None unless every seed reached it), its
  mean final test accuracy, perplexity and smoothed accuracy, its mean examples to target (None unless every
  seed reached it), its examples per update, one weight copy's updates in a run and their mean to the target."""

  row: str
  system: str
  gpus: int
  lr: float
  images_per_sec: float
  efficiency: float
  seeds: list[int]
  missed: int
  mean_time_to_target_s: float | None
  min_time_to_target_s: float | None
  max_time_to_target_s: float | None
  mean_final_test_accuracy: float
  mean_final_test_perplexity: float
  mean_final_smoothed_accuracy: float
  mean_examples_to_target: float | None = None
  examples_per_update: int = 0
  updates: int = 0
  mean_updates_to_target: float | None = None


def summarise(runs: Sequence[ConvergenceRun]) -> Summary:
  """One configuration's runs (with their outcomes) over seeds."""
  outcomes = [r.outcome for r in runs if r.outcome is not None]
  times = [o.time_to_target_s for o in outcomes if o.time_to_target_s is not None]
  examples = [o.images_to_target for o in outcomes if o.images_to_target is not None]
  updates = [o.updates_to_target for o in outcomes if o.updates_to_target is not None]
  first, n = runs[0], len(runs)
  return Summary(first.row, first.system, first.gpus, first.lr, first.images_per_sec, first.efficiency,
                 [r.seed for r in runs], n - len(times), sum(times) / len(times) if len(times) == n else None,
                 min(times) if times else None, max(times) if times else None,
                 sum(o.final_test_accuracy for o in outcomes) / n, sum(o.final_test_perplexity for o in outcomes) / n,
                 sum(o.final_smoothed_accuracy for o in outcomes) / n,
                 sum(examples) / n if len(examples) == n else None, first.examples_per_update, first.updates,
                 sum(updates) / n if len(updates) == n else None)


class TableRow(NamedTuple):
  """A configuration's row of the table: images/s and efficiency, their ratio to the best peer's, the time to
  target (mean, min, max over seeds; seeds that missed it) and the best peer's mean time over it; the mean examples
  to target and their ratio to the fewest of a peer (> 1: more examples than that peer); the examples per optimizer
  update, the updates a weight copy takes in the run and the mean updates to target."""

  name: str
  row: str
  system: str
  gpus: int
  images_per_sec: float
  efficiency: float
  images_per_sec_vs_best_peer: float | None
  mean_time_to_target_s: float | None
  min_time_to_target_s: float | None
  max_time_to_target_s: float | None
  missed: int
  seeds: int
  speedup_vs_best_peer: float | None
  mean_final_smoothed_accuracy: float
  lr: float
  mean_examples_to_target: float | None = None
  examples_vs_best_peer: float | None = None
  examples_per_update: int = 0
  updates: int = 0
  mean_updates_to_target: float | None = None


def table(summary: dict[str, Summary]) -> list[TableRow]:
  """One row per configuration (:class:`TableRow`)."""
  peers = [s for s in summary.values() if is_peer(s.system)]
  best_ips = max((s.images_per_sec for s in peers), default=None)
  best_time = min((s.mean_time_to_target_s for s in peers if s.mean_time_to_target_s is not None), default=None)
  fewest = min((s.mean_examples_to_target for s in peers if s.mean_examples_to_target is not None), default=None)
  rows = []
  for name, s in summary.items():
    t = s.mean_time_to_target_s
    rows.append(TableRow(name, s.row, s.system, s.gpus, s.images_per_sec, s.efficiency,
                         s.images_per_sec / best_ips if best_ips else None, t, s.min_time_to_target_s,
                         s.max_time_to_target_s, s.missed, len(s.seeds), best_time / t if best_time and t else None,
                         s.mean_final_smoothed_accuracy, s.lr, s.mean_examples_to_target,
                         s.mean_examples_to_target / fewest if fewest and s.mean_examples_to_target else None,
                         s.examples_per_update, s.updates, s.mean_updates_to_target))
  return rows


class HeldOut(NamedTuple):
  """A run left out of the fit: its measured time to target, the fit of the others' prediction, the error."""

  name: str
  seed: int
  measured_s: float
  predicted_s: float
  error: float


class StalenessCheck(NamedTuple):
  """The staleness-aware estimate fitted to the runs that reached the target (None: no fit, ``note`` says why),
  and its leave-one-out check: per run its measured and predicted time to target and the error."""

  model: StalenessModel | None
  note: str | None = None
  runs: list[HeldOut] = []
  mean_abs_error: float | None = None
  max_abs_error: float | None = None

  def to_json(self) -> dict[str, Any]:
    if self.model is None:
      return {"staleness_note": self.note}
    return {"staleness_model": {"images0": self.model.images0, "beta": self.model.beta,
                                "target_accuracy": self.model.target_accuracy},
            "staleness_validation": {"runs": [c._asdict() for c in self.runs], "mean_abs_error": self.mean_abs_error,
                                     "max_abs_error": self.max_abs_error}}


def validate_staleness_model(runs: Sequence[ConvergenceRun], target: float) -> StalenessCheck:
  """Fits images to ``target`` against mean staleness over the HetPipe and SSP runs that reached it, and validates
  the fit leaving one run out: the predicted time to target (images over the run's images/s) against the measured
  one."""
  reached = [(r, r.wsp.mean_staleness, r.outcome.images_to_target, r.outcome.time_to_target_s) for r in runs
             if r.wsp is not None and r.outcome is not None and r.outcome.images_to_target is not None
             and r.outcome.time_to_target_s is not None]
  try:
    model = fit_staleness_model([(s, images) for _, s, images, _ in reached], target)
  except ConfigError as e:
    return StalenessCheck(None, str(e))
  checks = []
  for i, (r, staleness, images, measured) in enumerate(reached):
    rest = reached[:i] + reached[i + 1:]
    try:
      held = fit_staleness_model([(s, x) for _, s, x, _ in rest]) if rest else model
    except ConfigError:
      continue
    predicted = held.seconds(images / measured, staleness)
    checks.append(HeldOut(r.name, r.seed, measured, predicted, predicted / measured - 1))
  errors = [abs(c.error) for c in checks]
  return StalenessCheck(model, None, checks, sum(errors) / len(errors) if errors else None,
                        max(errors) if errors else None)


class Unigram(NamedTuple):
  """A language model's context: the test loss and perplexity of the training set's token frequencies."""

  unigram_test_loss: float
  unigram_test_perplexity: float


def unigram_baseline(dataset: Any) -> Unigram:
  loss = unigram_loss(dataset)
  return Unigram(loss, math.exp(loss))
