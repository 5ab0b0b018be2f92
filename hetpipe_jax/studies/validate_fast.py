r"""The ``sim`` executor's fast mode against the full event simulation (issue 12).

For every configuration of a scaling study (:mod:`hetpipe_jax.studies.scale`: each model and cluster size
with its grouping, cuts, Nm, D, placement and transfer model) up to ``max_gpus``, runs the full event
simulation of all ``waves`` waves and the fast mode (:mod:`hetpipe_jax.sim.steady`), and reports the
throughput error of the fast mode and the host seconds of both; both traces pass the WSP checker.

Example::

  checks = validate_fast(FastConfig(rows=tuple(run_scale(ScaleConfig(...))), waves=30))
  worst(checks).error
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

from hetpipe_jax.cluster import Cluster, get_cluster
from hetpipe_jax.core.trace import Trace
from hetpipe_jax.cost.profile import full_size_profiles
from hetpipe_jax.errors import ConfigError
from hetpipe_jax.plan.layout import Layout, VWLayout
from hetpipe_jax.sim import SimJob, SimOptions, simulate, simulate_fast
from hetpipe_jax.studies.checked import progress, require_wsp
from hetpipe_jax.studies.scale import ScaleRow


@dataclasses.dataclass(frozen=True)
class FastConfig:
  """What the check runs: the study's rows up to ``max_gpus`` GPUs, each for ``waves`` waves both ways.

  Attributes:
    rows: the scaling study's rows (:func:`hetpipe_jax.studies.scale.row_from_json` reads scale.json's).
    max_gpus: check the configurations of clusters up to this many GPUs.
    waves: waves per virtual worker of both simulations.
    max_error: the largest relative throughput error of the fast mode that passes.
    study: where the rows come from, as an error names it (scale.json's path).
  """

  rows: tuple[ScaleRow, ...]
  max_gpus: int = 1024
  waves: int = 100
  max_error: float = 0.02
  study: str = "the study"

  @property
  def checked_rows(self) -> tuple[ScaleRow, ...]:
    """The rows of clusters up to ``max_gpus`` GPUs."""
    return tuple(r for r in self.rows if r.gpus <= self.max_gpus)


class FastCheck(NamedTuple):
  """Both simulations of one study row (the fields in validate_fast.json's order)."""

  model: str
  gpus: int
  configuration: str
  full_simulated_waves: int
  full_host_seconds: float
  full_minibatches_per_sec: float
  fast_method: str
  fast_simulated_waves: int
  fast_host_seconds: float
  fast_minibatches_per_sec: float
  error: float  # fast / full - 1


def layout_of(cluster: Cluster, setting: Mapping[str, Any]) -> Layout:
  """The layout a study row ran: its GPUs in pipeline order, cuts, Nm and window per virtual worker."""
  windows = setting.get("window") or setting["nm"]
  return Layout(tuple(VWLayout(tuple(cluster.gpus[i] for i in group), tuple(cuts), nm, w)
                      for group, cuts, nm, w in zip(setting["policy"], setting["cuts"], setting["nm"], windows)))


def row_job(row: ScaleRow, waves: int) -> SimJob:
  """The simulation a study row ran, for ``waves`` waves."""
  setting = row.setting
  profiles = full_size_profiles(row.model, setting["batch_size"], seq_len=setting["seq_len"])
  cluster = get_cluster(setting["cluster"])
  options = SimOptions(overlap_transfers=setting["overlap_transfers"], staged_ps=setting.get("staged_ps", False))
  return SimJob(cluster, profiles, layout_of(cluster, setting), setting["d"], waves, setting["placement"],
                precision=setting["precision"], options=options)


def check_row(row: ScaleRow, waves: int) -> FastCheck:
  """Both simulations of one study row: rates, error, host seconds."""
  job = row_job(row, waves)
  minibatches = sum(job.layout.nms) * waves
  trace = Trace()
  t0 = time.perf_counter()
  full_seconds, _, _ = simulate(job, trace)
  full_host = time.perf_counter() - t0
  require_wsp(trace.events, f"full simulation of {row.model} on {job.cluster.name}")
  trace = Trace()
  t0 = time.perf_counter()
  fast_seconds, _, _, info = simulate_fast(job, trace)
  fast_host = time.perf_counter() - t0
  require_wsp(trace.events, f"fast simulation of {row.model} on {job.cluster.name}")
  full, fast = minibatches / full_seconds, minibatches / fast_seconds
  return FastCheck(row.model, row.gpus, row.configuration, waves, full_host, full, info["method"],
                   max(info["simulated_waves"]), fast_host, fast, fast / full - 1)


def validate_fast(config: FastConfig) -> list[FastCheck]:
  """Every row of ``config.checked_rows`` simulated both ways.

  Raises:
    ConfigError: when no row of the study is as small as ``max_gpus``.
  """
  rows = config.checked_rows
  if not rows:
    raise ConfigError(f"--max_gpus={config.max_gpus}: no configuration of {config.study} is that small")
  checks = []
  for row in rows:
    progress("checking %s on %d GPUs", row.model, row.gpus)
    c = check_row(row, config.waves)
    progress("  error %+.3f%% (fast %s after %d waves, %.2f s; full %.2f s)", 100 * c.error, c.fast_method,
             c.fast_simulated_waves, c.fast_host_seconds, c.full_host_seconds)
    checks.append(c)
  return checks


def worst(checks: Sequence[FastCheck]) -> FastCheck:
  """The check of the largest absolute error."""
  return max(checks, key=lambda c: abs(c.error))
