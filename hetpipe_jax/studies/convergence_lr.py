"""The convergence study's learning-rate search, the same for every system (:func:`search_rates`): a log-spaced grid
of inner (local) rates around each system's rule, then as many pilots again for every system: the outer rate on a
small grid at the best inner rate where the system has an outer step, the inner rate refined between the best and
its neighbours where it has none. Nobody wins by a better chosen rate: every system gets the same number of pilot
runs of the same length, on the same seed, scored the same way.

The grids are factors: on the rule's inner rate (:func:`~hetpipe_jax.systems.rule_lr` of the examples behind one
update), and on the system's own default outer rate (local SGD's ``--outer_lr``, DiLoCo's 0.7; the outer rule's
``lr`` of HetPipe's ``--outer`` row: DiLoCo's 0.7 for Nesterov, 1 for ``avg``)."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import NamedTuple

from hetpipe_jax.errors import ConfigError
from hetpipe_jax.optim import PS_OPTIMIZERS, parse_ps_optimizer
from hetpipe_jax.systems import Curve

# 7 factors log-spaced over two decades, 0.1 to 10 (10^(k/3), k = -3..3): the inner grid around each rule.
LR_GRID = tuple(10 ** (k / 3) for k in range(-3, 4))
# Half to 1.5 times each outer rule's default: DiLoCo's outer Nesterov 0.35, 0.7, 1.05 (its authors' 0.7 in the
# middle); averaged pushes 0.5, 1 (the plain mean), 1.5.
OUTER_LR_GRID = (0.5, 1.0, 1.5)
GRID, OUTER, REFINE = 1, 2, 3  # a pilot's stage: the inner grid; the outer grid; the inner rate refined

Score = Callable[[float, float, int], float]  # (inner factor, outer factor, stage) -> higher is better, -inf diverged


class LrPilot(NamedTuple):
  """A learning-rate pilot (``convergence.json``'s ``lr_pilots``).

  Attributes:
    system: the learning-rate system (a peer's name, ``hetpipe``, ``hetpipe_outer:NAME`` for an outer rule).
    stage: :data:`GRID` (the inner grid at the default outer rate), :data:`OUTER` (the outer grid at the best
      inner rate) or :data:`REFINE` (the inner rate between the best and its neighbours, a system without an outer
      step).
    lr / factor: the inner rate, ``factor`` x the rule's.
    outer_lr / outer_factor: the outer rate, ``outer_factor`` x the system's default (None: no outer step).
    seed / epochs: the pilot seed and the pilots' length.
    final_smoothed: its final smoothed value (None: it diverged); diverged: whether it did.
    curve: its evaluations (empty: it diverged).
  """

  system: str
  stage: int
  lr: float
  factor: float
  outer_lr: float | None
  outer_factor: float | None
  seed: int
  epochs: float
  final_smoothed: float | None
  diverged: bool
  curve: Curve


class LrChoice(NamedTuple):
  """A system's chosen rates (``convergence.json``'s ``lr_choices``): the inner ``lr`` (``factor`` x the rule's
  ``rule_lr``), the outer ``outer_lr`` (``outer_factor`` x its default; None: no outer step), how many pilots chose
  them, and whether the inner rate is at an end of the grid (the grid may be too narrow for this system)."""

  system: str
  rule_lr: float
  factor: float
  lr: float
  outer_lr: float | None
  outer_factor: float | None
  pilots: int
  at_edge: bool


def check_grid(flag: str, grid: Sequence[float], example: str) -> None:
  """Refuses an empty grid, a factor that is not a finite number > 0, or one given twice.

  Raises:
    ConfigError: in one line naming the flag, its value and what to give.
  """
  if not grid or any(not (math.isfinite(x) and x > 0) for x in grid) or len(set(grid)) < len(grid):
    raise ConfigError(f"--{flag}={','.join(f'{x:g}' for x in grid)}; give one or more distinct factors > 0, e.g. "
                      f"{example}")


def spec_outer_lr(spec: str) -> float | None:
  """The outer learning rate of a ``--ps_optimizer`` spec (None: a rule without one, ``add``)."""
  parsed = parse_ps_optimizer(spec)
  return parsed.lr if "lr" in PS_OPTIMIZERS[parsed.name] else None


def outer_rate(default: float, factor: float) -> float:
  """An outer rate of the grid: ``default`` x ``factor`` to 12 significant digits (0.7 x 1.5 is 1.05, not
  1.0499999999999998: a rule's spec reads as it was meant)."""
  return float(f"{default * factor:.12g}")


def refinements(grid: Sequence[float], best: float, count: int) -> list[float]:
  """``count`` factors between ``best`` (of ``grid``) and its neighbours, log-spaced and nearest first, alternately
  below and above (at an end of the grid: the step of its one neighbour, mirrored), e.g. 2 of the default grid:
  ``best`` x 10^(-1/6) and x 10^(1/6)."""
  ordered = sorted(grid)
  i = ordered.index(best)
  down = ordered[i] / ordered[i - 1] if i > 0 else ordered[i + 1] / ordered[i]
  up = ordered[i + 1] / ordered[i] if i + 1 < len(ordered) else down
  half = (count + 1) // 2
  offsets = sorted((sign * k / (half + 1) for k in range(1, half + 1) for sign in (-1, 1)), key=abs)[:count]
  return [best * (up ** o if o > 0 else down ** o) for o in offsets]


def search_rates(score: Score, grid: Sequence[float], outer_grid: Sequence[float],
                 has_outer: bool) -> tuple[float, float]:
  """The (inner, outer) factors whose pilot scores best. Stage 1: every factor of ``grid`` at the default outer rate
  (outer factor 1). Stage 2, as many pilots for every system (the factors of ``outer_grid`` other than 1): with an
  outer step (``has_outer``), each of them at stage 1's best inner factor; without, as many inner factors between
  the best and its neighbours (:func:`refinements`). A tie goes to the smaller rate. One inner factor: that one, at
  the default outer rate, and no pilot."""
  if len(grid) == 1:
    return grid[0], 1.0
  scores = {(f, 1.0): score(f, 1.0, GRID) for f in sorted(grid)}
  rank = lambda pair: (scores[pair], -pair[0], -pair[1])
  best = max(scores, key=rank)[0]
  extra = [o for o in sorted(outer_grid) if o != 1.0]
  if has_outer:
    scores.update({(best, o): score(best, o, OUTER) for o in extra})
  else:
    scores.update({(f, 1.0): score(f, 1.0, REFINE) for f in refinements(grid, best, len(extra))})
  return max(scores, key=rank)
