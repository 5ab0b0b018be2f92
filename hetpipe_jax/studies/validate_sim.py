r"""The ``sim`` executor against real runs: the same cost model, measured vs. predicted.

Real runs use the ``wall`` executor on CPU devices with every task padded to its emulated duration
(``time_scale`` = 1: the emulated GPUs are slow enough that a task lasts milliseconds, so the schedule, not
CPU noise, sets the pace); the ``sim`` executor predicts the same configuration from the same cost model.
Links are fast (100 GB/s): CPU devices have no links to compare the contention model with, so this validates
the schedule, the Nm window and WSP gating across heterogeneous speeds. Goal: every prediction within 10%.

Example (the process needs :attr:`SimValidationConfig.devices` CPU devices)::

  checks = validate_sim(SimValidationConfig(waves=4))
  max(c.error for c in checks)
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

from hetpipe_jax.api import RunConfig, run_hetpipe
from hetpipe_jax.cluster import Cluster, GpuType, Link, make_cluster
from hetpipe_jax.data import Dataset, synthetic
from hetpipe_jax.models import LayeredModel, get_model
from hetpipe_jax.studies.checked import progress, require_wsp

GOAL = 0.10  # the largest acceptable relative error of a prediction
# Emulated GPUs at 100, 50 and 33 Mflop/s: an MLP stage task at batch 16 lasts a few milliseconds.
SPEEDS = {"fast": 1e8, "slow": 5e7, "whimpy": 3.3e7}
FAST_LINK = Link("fast", 1e11, 1e-6)


class SimCase(NamedTuple):
  """One configuration: virtual workers, stages (all or each), Nm (all or each), D, each VW's GPU speed."""

  vws: int
  stages: int | tuple[int, ...]
  nm: int | tuple[int, ...]
  d: int
  speeds: tuple[str, ...]

  @property
  def stages_per_vw(self) -> list[int]:
    """The stages of each virtual worker."""
    return [self.stages] * self.vws if isinstance(self.stages, int) else list(self.stages)


CASES = (
    SimCase(1, 2, 1, 0, ("fast",)),
    SimCase(1, 4, 4, 0, ("slow",)),
    SimCase(2, 2, 2, 0, ("fast", "whimpy")),
    SimCase(2, 2, 2, 3, ("fast", "whimpy")),
    SimCase(3, 2, 3, 1, ("fast", "slow", "whimpy")),
    SimCase(2, (1, 3), (2, 3), 1, ("slow", "fast")),
)


@dataclasses.dataclass(frozen=True)
class SimValidationConfig:
  """What the validation runs: ``waves`` waves per virtual worker of each case, minibatches of ``batch_size``."""

  waves: int = 12
  cases: tuple[SimCase, ...] = CASES
  batch_size: int = 16

  @property
  def devices(self) -> int:
    """The CPU devices the runs need (one per emulated GPU of the largest case)."""
    return max(sum(case.stages_per_vw) for case in self.cases)


class SimCheck(NamedTuple):
  """One case measured (wall, padded) and predicted (sim), in images/s on the emulated clock."""

  case: SimCase
  measured: float
  predicted: float
  error: float  # |predicted - measured| / measured


def case_cluster(case: SimCase) -> Cluster:
  """A node per virtual worker, each of its stages' GPUs of the case's speed for it, fast links."""
  types = {name: GpuType(name, 1 << 33, f, f, 1e15, 1.0) for name, f in SPEEDS.items()}
  return make_cluster("validate", [[types[case.speeds[i]]] * k for i, k in enumerate(case.stages_per_vw)],
                      FAST_LINK, FAST_LINK)


def check_case(case: SimCase, config: SimValidationConfig, model: LayeredModel, data: Dataset) -> SimCheck:
  """One case run on the wall executor (padded) and on the sim executor; both traces checked."""
  # eval_every=waves: the global weights are evaluated once, at the last clock tick (no "never").
  run = RunConfig.of(cluster=case_cluster(case), num_vws=case.vws, stages=case.stages, nm=case.nm, d=case.d,
                     waves=config.waves, batch_size=config.batch_size, eval_every=config.waves)
  measured = run_hetpipe(model, data, run.replace(executor="wall", time_scale=1.0))
  predicted = run_hetpipe(model, data, run.replace(executor="sim"))
  what = f"{case.vws} x {case.stages}, Nm={case.nm}, D={case.d}"
  require_wsp(measured.events, f"wall run {what}")
  require_wsp(predicted.events, f"sim run {what}")
  error = abs(predicted.images_per_second - measured.images_per_second) / measured.images_per_second
  return SimCheck(case, measured.images_per_second, predicted.images_per_second, error)


def validate_sim(config: SimValidationConfig) -> list[SimCheck]:
  """Every case of ``config``, in order (the MLP on synthetic data)."""
  model, data = get_model("mlp"), synthetic(num_train=512, num_test=64)
  checks = []
  for case in config.cases:
    checks.append(check_case(case, config, model, data))
    progress("%s: error %.1f%%", case, 100 * checks[-1].error)
  return checks
