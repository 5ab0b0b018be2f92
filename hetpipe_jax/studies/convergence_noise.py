"""The convergence study under noise (issue 39, item 4): every run re-clocked at each noise level, one table per
level.

The noise moves the clock, not the numerics: a run's examples to target are its own, and under a noise level
its time is its curve's times x (its images/s without that noise / with it). So one study trains every
configuration once and gives a table per level (``--noise_levels``): each run of training seed s is timed under
the level's noise with seed s (three training seeds: three noise seeds), every system adapting as its authors
do (``knobs.adapt``: the peers re-size from measured times, HetPipe re-plans; :mod:`hetpipe_jax.baselines.adapt`,
:mod:`hetpipe_jax.sim.replan`). What this leaves out: where an adaptation changes a run's shape (local SGD's H,
a re-plan's Nm under a planner's rule), the numerics stay those of the nominal shape; the timeline of each peer
and the first meta line of each HetPipe trace say what ran.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from hetpipe_jax.sim.noise import parse_noise
from hetpipe_jax.studies.convergence_runs import ConvergenceRun
from hetpipe_jax.studies.convergence_summary import TableRow, summarise, table, with_target
from hetpipe_jax.studies.convergence_target import Target

Clock = Callable[[ConvergenceRun, str], float]  # (a run, a noise spec) -> its configuration's examples/s under it


def seeded(level: str, seed: int) -> str:
  """The noise ``level`` with its draws seeded by ``seed`` (``none`` as it is)."""
  parse_noise(level)  # (a bad level is one line before anything is simulated)
  return level if parse_noise(level).quiet else f"{level},seed={seed}"


def reclocked(run: ConvergenceRun, images_per_sec: float, ideal: float) -> ConvergenceRun:
  """``run`` on a clock at ``images_per_sec``: its curve's times x its own rate over that one."""
  k = run.images_per_sec / images_per_sec
  return run._replace(curve=[p._replace(time=p.time * k) for p in run.curve], images_per_sec=images_per_sec,
                      efficiency=images_per_sec / ideal, outcome=None)


def noise_tables(runs: Sequence[ConvergenceRun], levels: Sequence[str], clock: Clock, rule: Target, target: float,
                 batch_size: int, ideal: float) -> dict[str, list[TableRow]]:
  """One table per noise level (see the module docstring): each run re-clocked at ``clock(run, level with the
  run's seed)``, its outcome against ``target`` by ``rule``."""
  tables = {}
  for level in levels:
    timed = [with_target(reclocked(r, clock(r, seeded(level, r.seed)), ideal), rule, target, batch_size)
             ._replace(language=r.language) for r in runs]
    summary = {name: summarise([r for r in timed if r.name == name]) for name in dict.fromkeys(r.name for r in timed)}
    tables[level] = table(summary)
  return tables
