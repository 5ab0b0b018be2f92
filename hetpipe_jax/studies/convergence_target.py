"""When a convergence study's run reaches its target (:class:`Target`): the test accuracy (or, for a language
model, the test loss) smoothed by a trailing mean over ``smooth`` evaluations; a run reaches the target at the
first evaluation from which the smoothed curve stays at or above it (a loss: at or below) to the end. The
automatic target is :data:`TARGET_SHARE` of the best configuration's final smoothed accuracy (a loss: the best
over it). Everything is a function of the :class:`Target` given, never of a flag."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

from hetpipe_jax.systems import CurvePoint

TARGET_SHARE = 0.95  # the automatic target: this share of the best configuration's final smoothed accuracy
METRICS = ("accuracy", "loss")


def points(curve: Sequence[Sequence[float]]) -> list[CurvePoint]:
  """A curve (points or the lists ``convergence.json`` holds) as :class:`~hetpipe_jax.systems.CurvePoint` s."""
  return [p if isinstance(p, CurvePoint) else CurvePoint(*p) for p in curve]


class Target(NamedTuple):
  """What a target is on (``metric``: ``accuracy`` or ``loss``) and over how many evaluations it is smoothed."""

  metric: str = "accuracy"
  smooth: int = 3

  @property
  def loss(self) -> bool:
    """Whether the target is a test loss (lower is better)."""
    return self.metric == "loss"

  @property
  def what(self) -> str:
    return "test loss" if self.loss else "test accuracy"

  def values(self, curve: Sequence[Sequence[float]]) -> list[float]:
    """The curve's test accuracy (a loss target: its test loss) at every evaluation."""
    return [p.test_loss if self.loss else p.test_accuracy for p in points(curve)]

  def smoothed(self, curve: Sequence[Sequence[float]]) -> list[float]:
    """The values as a trailing mean over ``smooth`` evaluations (fewer at the start)."""
    v, k = self.values(curve), self.smooth
    return [sum(v[max(0, i - k + 1):i + 1]) / (i + 1 - max(0, i - k + 1)) for i in range(len(v))]

  def reached_at(self, curve: Sequence[Sequence[float]], target: float) -> int | None:
    """The first evaluation from which the smoothed curve stays at or above ``target`` to the end (a loss: at
    or below); None: it does not."""
    sign = -1.0 if self.loss else 1.0
    s = [sign * x for x in self.smoothed(curve)]
    if not s or s[-1] < sign * target:
      return None
    below = [i for i, x in enumerate(s) if x < sign * target]
    return below[-1] + 1 if below else 0

  def time_to(self, curve: Sequence[Sequence[float]], target: float) -> float | None:
    """Emulated seconds until ``curve`` reaches ``target`` (None: it does not)."""
    i = self.reached_at(curve, target)
    return None if i is None else points(curve)[i].time

  def images_to(self, curve: Sequence[Sequence[float]], target: float, batch_size: int) -> float | None:
    """Examples seen until ``curve`` reaches ``target`` (None: it does not)."""
    i = self.reached_at(curve, target)
    return None if i is None else points(curve)[i].minibatches * batch_size

  def final(self, curve: Sequence[Sequence[float]]) -> float:
    """The smoothed value at the end of ``curve``."""
    return self.smoothed(curve)[-1]

  def better(self, value: float) -> float:
    """``value`` as a score where higher is better (a loss negated)."""
    return -value if self.loss else value

  def auto(self, best: float) -> float:
    """The automatic target from the best final smoothed value: :data:`TARGET_SHARE` of an accuracy, a loss over
    it."""
    return best / TARGET_SHARE if self.loss else TARGET_SHARE * best

  def rule(self) -> str:
    """How the automatic target is set, in words."""
    return (f"the best final smoothed test loss / {TARGET_SHARE}" if self.loss else
            f"{TARGET_SHARE} x the best final smoothed accuracy")

  def of_runs(self, runs: Sequence[Mapping[str, Any]]) -> float:
    """The automatic target of ``runs`` (each with its ``name`` and ``curve``): from the best configuration's
    final smoothed value, its mean over seeds."""
    names = dict.fromkeys(r["name"] for r in runs)
    means = [sum(self.final(r["curve"]) for r in runs if r["name"] == n) / sum(r["name"] == n for r in runs)
             for n in names]
    return self.auto(max(means, key=self.better))
