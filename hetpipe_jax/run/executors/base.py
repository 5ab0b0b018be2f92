"""An executor's registry entry: what it accepts, and how it runs a laid-out run."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from hetpipe_jax.core.meta import VERSIONS
from hetpipe_jax.errors import ConfigError
from hetpipe_jax.plan.placement import PLACEMENTS
from hetpipe_jax.run.config import FLAT_NAME, RunConfig
from hetpipe_jax.run.result import RunResult
from hetpipe_jax.run.setup import Setup
from hetpipe_jax.sim.options import ADAPT_OPTIONS, ELSEWHERE


@dataclasses.dataclass(frozen=True)
class Executor:
  """Attributes:
    name: what ``RunConfig.executor`` says.
    run: runs a :class:`~hetpipe_jax.run.setup.Setup` to its result.
    doc: one line: its clock and whether its numerics run.
    numerics: it trains (needs a dataset, checks memory, evaluates).
    sim_options: it reads :class:`~hetpipe_jax.sim.options.SimOptions` (the others refuse any set).
    wall_options: it reads :class:`~hetpipe_jax.run.config.WallOptions`.
    checkpoints: it can save and resume checkpoints.
    slows: it runs ``faults.slow`` (a real delay of a node's tasks).
    adapts: it reads the sim options ``adapt`` and ``replan_every`` (HetPipe's adaptation, live).
    placements / precisions / trace_versions: what it runs (writes) of those.
    check: further rules of its own on a config (after the common ones).
  """

  name: str
  run: Callable[[Setup], RunResult]
  doc: str
  numerics: bool = True
  sim_options: bool = False
  wall_options: bool = False
  checkpoints: bool = True
  slows: bool = False
  adapts: bool = False
  placements: tuple[str, ...] = PLACEMENTS
  precisions: tuple[str, ...] = ("fp32",)
  trace_versions: tuple[int, ...] = VERSIONS
  check: Callable[[RunConfig], None] | None = None

  def validate(self, config: RunConfig) -> None:
    """Refuses what this executor does not run, naming the option and what to change.

    Raises:
      ConfigError: for an option of another executor, a placement or precision it does not model, or
        checkpoints where it has no numerics.
    """
    if not self.sim_options:
      for field in config.sim.set_fields():
        if self.adapts and field in ADAPT_OPTIONS:
          continue
        name = FLAT_NAME[("sim", field)]
        raise ConfigError(f"{name} is a model of the sim executor; the {self.name} executor {ELSEWHERE[field]}: "
                          f"drop {name} or use executor=sim")
    if not self.wall_options and config.wall.set_fields():
      raise ConfigError(f"time_scale={config.wall.time_scale} pads the tasks of the wall and multiprocess "
                        f"executors; the {self.name} executor {self.doc}: drop time_scale or use executor=wall")
    if config.faults.slow and not self.slows:
      raise ConfigError(f"slow={config.faults.slow[0][0]}:... delays a node's tasks for real, in the multiprocess "
                        f"runtime; the {self.name} executor {self.doc}: drop slow or use executor=multiprocess (a "
                        "noise file's events slow the sim executor's GPUs)")
    if config.checkpoint.enabled and not self.checkpoints:
      raise ConfigError(f"checkpoints are for runs with numerics; the {self.name} executor has none (rerunning it "
                        "is cheaper than a checkpoint): drop checkpoint_dir/resume or use another executor")
    if config.layout.placement not in self.placements:
      raise ConfigError(f"placement={config.layout.placement} is not modelled by the {self.name} executor; use "
                        f"placement={' or '.join(self.placements)}")
    if config.precision not in self.precisions:
      raise ConfigError(f"precision={config.precision!r} is not trained by the {self.name} executor; use "
                        f"precision={' or '.join(repr(p) for p in self.precisions)}")
    if config.trace_version not in self.trace_versions:
      raise ConfigError(f"trace_version={config.trace_version} is not written by the {self.name} executor; use "
                        f"trace_version={' or '.join(map(str, self.trace_versions))}")
    if self.check is not None:
      self.check(config)

