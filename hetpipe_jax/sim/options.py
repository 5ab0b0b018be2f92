"""The ``sim`` executor's own options: how its network and its run length are modelled.

Only the ``sim`` executor reads them (its runs have no numerics); a run on another executor with any of
them set is refused once, by the run layer (:mod:`hetpipe_jax.run.config`), naming the option and what
that executor does instead (:data:`ELSEWHERE`).
"""

from __future__ import annotations

import dataclasses

from hetpipe_jax.errors import ConfigError
from hetpipe_jax.sim.noise import HELP as NOISE_HELP
from hetpipe_jax.sim.noise import parse_noise

ADAPT = ("auto", "on", "off")
ADAPT_OPTIONS = ("adapt", "replan_every")  # what an executor that adapts live reads too (Executor.adapts)


@dataclasses.dataclass(frozen=True)
class SimOptions:
  """Attributes:
    overlap_transfers: a stage's input travels while its device computes other tasks (as a GPU's copy
      engines allow) instead of being received in series inside the task (:mod:`hetpipe_jax.sim.network`).
    staged_ps: each stage's part of a push leaves as soon as that stage's last backward of the wave
      ends, and each stage's part of a pull lands on its own (the gated forwards wait at each stage for
      that stage's part only) instead of the virtual worker's push and pull moving as one
      (:mod:`hetpipe_jax.core.engine`).
    fast: simulate until the waves settle and extrapolate the rest of the run
      (:mod:`hetpipe_jax.sim.steady`; the trace holds the simulated waves, the result's ``seconds`` and
      ``images`` are the whole run's).
    noise: the GPUs' and links' variance (:mod:`hetpipe_jax.sim.noise`).
    adapt: HetPipe's adaptation to it (:mod:`hetpipe_jax.sim.replan`): ``on``, ``off``, ``auto`` (under noise).
    replan_every: the adaptation decides every this many waves (:class:`~hetpipe_jax.sim.replan.Replanning`).
  """

  # metadata: the training CLI's help, and the flat name (hetpipe_jax.run.config.setting)
  overlap_transfers: bool = dataclasses.field(default=False, metadata={"help": (
      "sim executor: a stage's input travels while its device computes other tasks, instead of being received in "
      "series inside the task.")})
  staged_ps: bool = dataclasses.field(default=False, metadata={"help": (
      "sim executor: each stage's part of a push leaves when that stage's last backward of the wave ends, and each "
      "stage's part of a pull lands on its own (the gated forwards wait at a stage for its part only), instead of "
      "a virtual worker's push and pull moving as one.")})
  fast: bool = dataclasses.field(default=False, metadata={"flat": "fast_sim", "help": (
      "sim executor: simulate until every virtual worker's wave period settles, then extrapolate the rest of "
      "--waves (hetpipe_jax.sim.steady; checked by experiments.validate_fast).")})
  noise: str = dataclasses.field(default="none", metadata={"help": (
      "sim executor: the GPUs' variance (hetpipe_jax.sim.noise): " + NOISE_HELP + ".")})
  adapt: str = dataclasses.field(default="auto", metadata={"help": (
      "sim executor: HetPipe's adaptation (hetpipe_jax.sim.replan): re-cut the stages and re-size the waves from "
      "measured speed when it pays: on, off, or auto (under --noise); multiprocess executor: on re-plans live "
      "from measured task times (hetpipe_jax.run.executors.live_replan), auto and off keep the layout.")})
  replan_every: int = dataclasses.field(default=10, metadata={"help": (
      "sim and multiprocess executors: HetPipe's adaptation decides every this many waves.")})

  def __post_init__(self):
    if self.adapt not in ADAPT:
      raise ConfigError(f"adapt={self.adapt!r}; give one of {', '.join(ADAPT)}")
    if self.replan_every < 1:
      raise ConfigError(f"replan_every={self.replan_every}; give a number of waves >= 1")
    parse_noise(self.noise)

  @property
  def adapting(self) -> bool:
    """Whether the run adapts (``adapt``, ``auto`` resolved: where the GPUs vary)."""
    return self.adapt == "on" or (self.adapt == "auto" and not parse_noise(self.noise).quiet)

  def check_replan_every(self, adapting: bool) -> None:
    """Refuses ``replan_every`` set for a run that does not adapt (``adapting``: as its executor resolves ``adapt``).

    Raises:
      ConfigError: naming the value and what to change.
    """
    if "replan_every" in self.set_fields() and not adapting:
      raise ConfigError(f"replan_every={self.replan_every} paces HetPipe's adaptation, which this run does not do "
                        f"(adapt={self.adapt}): give --adapt=on, or drop replan_every")

  def set_fields(self) -> list[str]:
    """The options that differ from their defaults, by name."""
    return [f.name for f in dataclasses.fields(self) if getattr(self, f.name) != f.default]


# What an executor that runs numerics does instead of each option (for the one refusal message).
ELSEWHERE = {
    "overlap_transfers": "receives each task's input in series",
    "staged_ps": "moves a virtual worker's push and pull as one",
    "fast": "runs every wave",
    "noise": "runs every task at its own machine's speed (the sim executor's variance model is not there)",
    "adapt": "keeps its layout (re-planning from measured speed is the sim and multiprocess executors')",
    "replan_every": "keeps its layout (re-planning from measured speed is the sim and multiprocess executors')",
}
