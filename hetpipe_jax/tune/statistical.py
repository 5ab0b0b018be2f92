"""How many images a peer needs to reach the target accuracy: the peers' half of the tuner's time-to-accuracy
objective (HetPipe's half is the staleness model, :class:`hetpipe_jax.staleness.StalenessModel`).

A peer's kind is its system's :attr:`~hetpipe_jax.systems.base.System.kind` (:mod:`hetpipe_jax.systems`).

- **Synchronous peers** (kind ``synchronous``: ``horovod``, ``hetero_dp``, ``sync_pipeline``, ...) are
  synchronous SGD at their global batch B: no staleness, but past the critical batch size a larger batch needs
  more images (McCandlish et al. 2018, "An empirical model of large-batch training", arXiv 1812.06162): ``E(B) =
  E_min x (1 + B / B_noise)`` (:class:`CriticalBatch`), fitted by least squares of ``E = a + b x B`` over the
  convergence study's runs of the three systems together (``E_min = a``, ``B_noise = a / b``). With runs at one
  B only (the default study: every synchronous peer at 32 x GPUs), or when the images do not grow with B, E is
  the measured mean for every B.
- **Local SGD** (kind ``local``: ``local_sgd``): the measured images to target at each H (the fastest worker's local
  steps; its mean over seeds), linearly interpolated in H between measured H and the nearest measured
  value outside them (:class:`LocalStepsFit`); constant with runs at one H.

A run counts with ``images_to_target`` (null: missed, left out); its B is its ``global_batch`` and its H its
``local_steps`` (a list: the largest). A run without them is taken at an unknown B (or H): the fit is then the
measured mean. Every fit is validated leaving one run out (:func:`leave_one_out`) when there are at least
:data:`LOO_MIN` runs. Without any run of a kind, that kind falls back to the staleness model's ``images0``
(the images at staleness 0); with runs of a kind that all missed the target, the kind does not reach it
(infinite images: ranked last). Every choice is stated in the model's ``notes``.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from hetpipe_jax.errors import ConfigError
from hetpipe_jax.staleness import StalenessModel
from hetpipe_jax.systems import LOCAL, SYNCHRONOUS, get_system, systems
from hetpipe_jax.tune.peers import PeerResult

LOO_MIN = 3  # runs needed for a leave-one-out validation (a held-out fit of at least two)
Point = tuple[float | None, float]  # (B or H, None when the run does not record it; images to target)


@dataclasses.dataclass(frozen=True)
class CriticalBatch:
  """``E(B) = e_min x (1 + B / b_noise)`` images to target at global batch B (``b_noise`` infinite: E does
  not depend on B). ``how``: one line on how it was fitted."""

  e_min: float
  b_noise: float = math.inf
  how: str = ""

  def images(self, global_batch: float) -> float:
    return self.e_min * (1 + global_batch / self.b_noise)


@dataclasses.dataclass(frozen=True)
class LocalStepsFit:
  """Images to target at H local steps: the measured (H, mean images) ``points`` (H ascending), linearly
  interpolated, constant outside them. ``how``: one line on how it was fitted."""

  points: tuple[tuple[float, float], ...]
  how: str = ""

  def images(self, local_steps: float) -> float:
    xs = [p[0] for p in self.points]
    if local_steps <= xs[0]:
      return self.points[0][1]
    for (x0, y0), (x1, y1) in zip(self.points, self.points[1:]):
      if local_steps <= x1:
        return y0 + (y1 - y0) * (local_steps - x0) / (x1 - x0)
    return self.points[-1][1]


def _mean(values: Sequence[float]) -> float:
  return sum(values) / len(values)


def fit_critical_batch(points: Sequence[Point]) -> CriticalBatch:
  """:class:`CriticalBatch` by least squares over ``(B, images to target)`` points (B None: not recorded).

  Raises:
    ConfigError: without points.
  """
  if not points:
    raise ConfigError("the critical-batch fit needs synchronous runs that reached the target; none did")
  mean = _mean([y for _, y in points])
  known = [(float(b), y) for b, y in points if b is not None]
  if len(known) < len(points):
    return CriticalBatch(mean, how=f"{len(points) - len(known)} of {len(points)} runs record no global batch: E = "
                                   f"their mean {mean:.4g} images for every B")
  batches = sorted({b for b, _ in known})
  if len(batches) < 2:
    return CriticalBatch(mean, how=f"runs at one global batch only (B = {batches[0]:g}): E = their mean {mean:.4g} "
                                   "images for every B")
  mx, my = _mean([b for b, _ in known]), mean
  slope = sum((b - mx) * (y - my) for b, y in known) / sum((b - mx) ** 2 for b, _ in known)
  a = my - slope * mx
  span = f"B = {batches[0]:g}..{batches[-1]:g}"
  if slope <= 0:
    return CriticalBatch(mean, how=f"the images to target do not grow with B over {span} (slope {slope:.3g}): E = "
                                   f"their mean {mean:.4g} images for every B")
  if a <= 0:
    return CriticalBatch(mean, how=f"the fit over {span} gives E_min = {a:.4g} <= 0: E = their mean {mean:.4g} "
                                   "images for every B")
  return CriticalBatch(a, a / slope, how=f"E(B) = {a:.4g} x (1 + B / {a / slope:.4g}) images, fitted over {span} "
                                         f"({len(known)} runs)")


def fit_local_steps(points: Sequence[Point]) -> LocalStepsFit:
  """:class:`LocalStepsFit` over ``(H, images to target)`` points (H None: not recorded).

  Raises:
    ConfigError: without points.
  """
  if not points:
    raise ConfigError("the local-steps fit needs local SGD runs that reached the target; none did")
  known = [(float(h), y) for h, y in points if h is not None]
  if len(known) < len(points):
    mean = _mean([y for _, y in points])
    return LocalStepsFit(((1.0, mean),), f"{len(points) - len(known)} of {len(points)} local SGD runs record no H: "
                                         f"E = their mean {mean:.4g} images for every H")
  hs = sorted({h for h, _ in known})
  means = tuple((h, _mean([y for x, y in known if x == h])) for h in hs)
  if len(hs) == 1:
    return LocalStepsFit(means, f"local SGD runs at one H only (H = {hs[0]:g}): E = their mean {means[0][1]:.4g} "
                                "images for every H")
  return LocalStepsFit(means, f"local SGD: E linear in H between the measured H = {', '.join(f'{h:g}' for h in hs)} "
                              f"(constant outside), {len(known)} runs")


def leave_one_out(points: Sequence[Point], fit: Callable[[Sequence[Point]], Any]) -> list[float]:
  """Relative errors (predicted / measured - 1) of ``fit`` on each point when fitted to the others (none below
  :data:`LOO_MIN` points). ``fit`` returns a :class:`CriticalBatch` or :class:`LocalStepsFit`."""
  if len(points) < LOO_MIN:
    return []
  errors = []
  for i, (x, y) in enumerate(points):
    held = fit(list(points[:i]) + list(points[i + 1:]))
    errors.append(held.images(x if x is not None else 0.0) / y - 1)
  return errors


@dataclasses.dataclass(frozen=True)
class PeerAccuracyModel:
  """The images a peer needs to reach the target (the module docstring), and its predicted time to accuracy.

  Attributes:
    sync / local: the fits of the synchronous peers and of local SGD (None: no run reached the target).
    sync_missed / local_missed: every run of that kind missed the target (it is then taken not to reach it).
    fallback_images: images for a kind without runs: the staleness model's ``images0`` (None: none).
    target_accuracy: the target the runs were measured to.
    sync_errors / local_errors: the leave-one-out relative errors of each fit.
    notes: one line per assumption made (what the tuner prints).
  """

  sync: CriticalBatch | None = None
  local: LocalStepsFit | None = None
  sync_missed: bool = False
  local_missed: bool = False
  fallback_images: float | None = None
  target_accuracy: float | None = None
  sync_errors: tuple[float, ...] = ()
  local_errors: tuple[float, ...] = ()
  notes: tuple[str, ...] = ()

  def images(self, peer: PeerResult) -> float:
    """Images ``peer`` needs to reach the target (infinite when its kind's runs all missed it).

    Raises:
      ConfigError: for a kind without runs and no fallback.
    """
    local = get_system(peer.system).kind == LOCAL
    fit, missed = (self.local, self.local_missed) if local else (self.sync, self.sync_missed)
    if fit is not None:
      return fit.images(peer.knobs.local_steps if isinstance(fit, LocalStepsFit) else peer.examples_per_update)
    if missed:
      return math.inf
    if self.fallback_images is None:
      raise ConfigError(f"no convergence runs of {peer.system}'s kind and no staleness model to fall back on: run "
                        "python -m experiments.convergence")
    return self.fallback_images

  def seconds(self, peer: PeerResult) -> float:
    """Predicted seconds to the target: its images over the peer's images/s."""
    return self.images(peer) / peer.images_per_sec

  def lines(self) -> list[str]:
    """The notes, and the leave-one-out error of each fit validated."""
    out = list(self.notes)
    for kind, errors in (("synchronous peers", self.sync_errors), ("local SGD", self.local_errors)):
      if errors:
        out.append(f"{kind}: leave-one-out error of the images to target mean "
                   f"{_mean([abs(e) for e in errors]):.1%}, worst {max(abs(e) for e in errors):.1%} "
                   f"over {len(errors)} runs")
    return out

  def to_json(self) -> dict[str, Any]:
    """The model as ``tune.json`` records it (an infinite B_noise as null)."""
    sync = None if self.sync is None else {"e_min": self.sync.e_min, "how": self.sync.how, "b_noise":
                                           self.sync.b_noise if math.isfinite(self.sync.b_noise) else None}
    local = None if self.local is None else {"points": [list(p) for p in self.local.points], "how": self.local.how}
    return {"sync": sync, "local": local, "sync_missed": self.sync_missed, "local_missed": self.local_missed,
            "fallback_images": self.fallback_images, "target_accuracy": self.target_accuracy,
            "sync_loo_errors": list(self.sync_errors), "local_loo_errors": list(self.local_errors),
            "notes": self.lines()}


def _points(runs: Sequence[Mapping[str, Any]], kind: str, key: str) -> tuple[list[Point], int]:
  """(the (x, images to target) points of the runs of registered systems of ``kind`` that reached it, how many
  runs there are)."""
  names = {name for name, system in systems().items() if system.kind == kind}
  mine = [r for r in runs if r.get("system") in names]
  points: list[Point] = []
  for r in mine:
    if r.get("images_to_target") is None:
      continue
    x = r.get(key)
    if isinstance(x, (list, tuple)):
      x = max(x) if x else None
    points.append((None if x is None else float(x), float(r["images_to_target"])))
  return points, len(mine)


def fit_peer_accuracy(runs: Sequence[Mapping[str, Any]], staleness: StalenessModel | None = None,
                      target_accuracy: float | None = None) -> PeerAccuracyModel:
  """The peers' images to target from the convergence study's ``runs`` (``convergence.json``'s entries: their
  ``system``, ``images_to_target``, ``global_batch``, ``local_steps``), ``staleness``'s images0 for a kind without
  runs (the module docstring)."""
  fallback = None if staleness is None else staleness.images(0.0)
  target = target_accuracy if target_accuracy is not None else (staleness.target_accuracy if staleness else None)
  notes: list[str] = []
  fits: dict[str, Any] = {}
  for kind, system_kind, key, fit in (("synchronous peers", SYNCHRONOUS, "global_batch", fit_critical_batch),
                                      ("local SGD", LOCAL, "local_steps", fit_local_steps)):
    points, count = _points(runs, system_kind, key)
    errors: list[float] = []
    model = None
    if points:
      model = fit(points)
      errors = leave_one_out(points, fit)
      left = f" ({count - len(points)} of {count} runs missed the target, left out)" if count > len(points) else ""
      notes.append(f"{kind}: {model.how}{left}")
    elif count:
      notes.append(f"{kind}: none of the {count} runs reached the target: taken not to reach it (ranked last)")
    elif fallback is not None:
      notes.append(f"{kind}: no convergence runs; images to target fall back to the staleness model's images0 "
                   f"({fallback:.4g} images, staleness 0)")
    else:
      notes.append(f"{kind}: no convergence runs and no staleness model; no images to target")
    fits[kind] = (model, bool(count) and not points, tuple(errors))
  (sync, sync_missed, sync_errors), (local, local_missed, local_errors) = fits["synchronous peers"], fits["local SGD"]
  return PeerAccuracyModel(sync, local, sync_missed, local_missed, fallback, target, sync_errors, local_errors,
                           tuple(notes))
