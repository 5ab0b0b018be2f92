"""The ``sim`` executor's own options: how its network and its run length are modelled.

Only the ``sim`` executor reads them (its runs have no numerics); a run on another executor with any of
them set is refused once, by the run layer (:mod:`hetpipe_jax.run.config`), naming the option and what
that executor does instead (:data:`ELSEWHERE`).
"""

from __future__ import annotations

import dataclasses

from hetpipe_jax.sim.noise import HELP as NOISE_HELP


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

  def set_fields(self) -> list[str]:
    """The options that differ from their defaults, by name."""
    return [f.name for f in dataclasses.fields(self) if getattr(self, f.name) != f.default]


# What an executor that runs numerics does instead of each option (for the one refusal message).
ELSEWHERE = {
    "overlap_transfers": "receives each task's input in series",
    "staged_ps": "moves a virtual worker's push and pull as one",
    "fast": "runs every wave",
    "noise": "runs every task at its own machine's speed (the sim executor's variance model is not there)",
}
