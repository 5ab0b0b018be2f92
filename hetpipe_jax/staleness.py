"""The staleness-aware estimate of time to accuracy, and the staleness of a trace it is measured by.

A run's mean staleness (:func:`mean_staleness`) is the count of other minibatches' updates its forward
passes miss, read off its trace (real or simulated). The convergence study (``experiments.convergence``)
fits how the images a run needs to reach a target accuracy grow with it (:func:`fit_staleness_model`)
and validates the fit; the tuner (:mod:`hetpipe_jax.tune`) reads the fitted :class:`StalenessModel` to
rank configurations by their predicted time to accuracy.
"""

from __future__ import annotations

import bisect
import dataclasses
from collections.abc import Sequence
from typing import Any

from hetpipe_jax.core.check import as_version_1
from hetpipe_jax.errors import ConfigError


@dataclasses.dataclass(frozen=True)
class StalenessModel:
  """The staleness-aware estimate of time to accuracy: a run needs ``images0 x (1 + beta x staleness)``
  training images to reach the target, for ``staleness`` the mean count of updates missing from its forward
  passes (:func:`mean_staleness`), so its time to accuracy is that over its images/s. Fitted to real runs by
  :func:`fit_staleness_model` (the convergence study does, and validates it)."""

  images0: float
  beta: float
  target_accuracy: float | None = None

  def images(self, staleness: float) -> float:
    return self.images0 * (1 + self.beta * staleness)

  def seconds(self, images_per_sec: float, staleness: float) -> float:
    return self.images(staleness) / images_per_sec


def fit_staleness_model(points: Sequence[tuple[float, float]], target_accuracy: float | None = None
                        ) -> StalenessModel:
  """Least squares of images to target = a + b x staleness, b >= 0, over ``(staleness, images)`` points of
  real runs; images0 = a, beta = b / a (beta = 0 with one point, when the points all share one staleness, or
  when they fall with staleness: noise, which a negative beta would extrapolate into staler configurations
  needing fewer images, down to none).

  Raises:
    ConfigError: without points, or when the fit gives no positive images at zero staleness.
  """
  if not points:
    raise ConfigError("the staleness-aware estimate needs real runs that reached the target accuracy; none "
                      "did: lower the target or train longer")
  xs, ys = [p[0] for p in points], [p[1] for p in points]
  mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
  sxx = sum((x - mx) ** 2 for x in xs)
  b = 0.0 if sxx == 0 else sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx
  if b < 0:  # least squares under beta >= 0 (staleness never saves images): the optimum on the boundary
    b = 0.0
  a = my - b * mx
  if a <= 0:
    raise ConfigError(f"the staleness fit gives {a:.4g} images at zero staleness (slope {b:.4g} per unit of "
                      "staleness): the runs do not support a staleness-aware estimate; use more or longer runs")
  return StalenessModel(a, b / a, target_accuracy)


def mean_staleness(events: Sequence[dict[str, Any]]) -> float:
  """The mean staleness of a trace's forward passes, counted as asynchronous SGD counts it: the minibatch
  updates of *every* virtual worker that were done when the forward started but are missing from its
  weights. For minibatch p of virtual worker i starting at t: its own missing updates p - 1 - own, plus,
  for every other live virtual worker k, the minibatches k had completed by t minus the Nm_k x glob[k]
  its weights hold. (More virtual workers, larger Nm and larger D all raise it.) A trace of version 2 is read
  in version 1 (:func:`hetpipe_jax.core.check.as_version_1`)."""
  if events and events[0].get("version") == 2:
    events = list(as_version_1(events))
  meta = events[0]
  nms = meta["nm"]
  done: list[list[float]] = [[] for _ in nms]  # completion times per virtual worker, in order
  left: set[int] = set()
  for ev in events[1:]:
    if ev["ev"] == "complete":
      done[ev["vw"]].append(ev["t"])
  total = count = 0
  for ev in events[1:]:
    kind = ev["ev"]
    if kind == "leave":
      left.add(ev["vw"])
    elif kind == "join":
      left.discard(ev["vw"])
    elif kind == "fwd":
      i, t = ev["vw"], ev["t0"]
      missing = ev["mb"] - 1 - ev["own"]
      for k, g in enumerate(ev["glob"]):
        if k != i and k not in left:
          missing += max(0, bisect.bisect_right(done[k], t) - nms[k] * g)
      total += missing
      count += 1
  return total / count if count else 0.0
