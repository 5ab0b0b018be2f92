r"""The ``multiprocess`` executor against the ``sim`` executor's prediction, on loopback.

Each case runs as a real multi-process job (one process per node, decentralised: activations, gradients,
pushes, pulls and the clock's control messages through the transport) with every task padded to its emulated
duration, and the ``sim`` executor predicts the same plan (same cluster, policy, Nm and D, so the same layout
and cost model). The cases cover NP, ED and HD layouts, D = 0 and D > 0, 2 and 4 processes. The emulated GPUs
are slow enough that a task lasts tens of milliseconds, so the schedule, the Nm window and the WSP gate set the
pace, and what the prediction leaves out is the runtime's own overhead. Links are fast in the cluster files
(100 GB/s): loopback has no network to compare the contention model with. Every trace is checked.

The jobs are started by the caller's ``run_job`` (``experiments.validate_multiprocess`` runs
``python -m experiments.train --executor=multiprocess`` in a subprocess), which returns the job's summary.

Example::

  checks = validate_multiprocess(MultiprocessConfig(out_dir="/tmp/v", waves=3), run_job)
"""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

from hetpipe_jax.api import RunConfig, run_hetpipe
from hetpipe_jax.core.trace import read_trace
from hetpipe_jax.data import synthetic
from hetpipe_jax.errors import ConfigError, RunStopped
from hetpipe_jax.models import get_model
from hetpipe_jax.plan.allocation import parse_policy
from hetpipe_jax.studies.checked import progress, require_wsp

GOAL = 0.10  # the largest acceptable relative error of a prediction
NM = "max_fit"  # the planner's Nm rule in both runs (the train CLI's default with --policy)

# Emulated GPU types (flop/s; memory is no limit for the MLP): a stage task lasts ~5-240 ms.
TYPES = {"fast": 2.4e7, "mid": 1.8e7, "slow": 1.2e7, "whimpy": 0.9e7}
# name -> the GPU types of each node (one process per node)
CLUSTERS = {
    "two": (("fast", "fast"), ("slow", "slow")),
    "four": (("fast", "fast"), ("mid", "mid"), ("slow", "slow"), ("whimpy", "whimpy")),
}


class MultiprocessCase(NamedTuple):
  cluster: str  # a name of CLUSTERS
  policy: str
  d: int


CASES = (
    MultiprocessCase("two", "NP", 0),
    MultiprocessCase("two", "ED", 1),
    MultiprocessCase("four", "NP", 1),
    MultiprocessCase("four", "ED", 0),
    MultiprocessCase("four", "ED", 2),
    MultiprocessCase("four", "HD", 0),
    MultiprocessCase("four", "HD", 1),
)

# Runs a training job: (the training CLI's flags, its output directory) -> its summary.json.
RunJob = Callable[[list[str], str], Mapping[str, Any]]


@dataclasses.dataclass(frozen=True)
class MultiprocessConfig:
  """What the validation runs.

  Attributes:
    out_dir: where the cluster files and every job's outputs go.
    waves: waves per virtual worker in every case.
    speedup: the emulated GPUs this many times faster (tasks this many times shorter).
    cases: the cases, in order.
  """

  out_dir: str
  waves: int = 12
  speedup: float = 1.0
  cases: tuple[MultiprocessCase, ...] = CASES

  def __post_init__(self):
    if not self.speedup > 0:
      raise ConfigError(f"--speedup={self.speedup}: give a factor > 0")


class MultiprocessCheck(NamedTuple):
  """One case measured (the job's summary) and predicted (sim), in images/s at the emulated speeds."""

  cluster: str
  processes: int
  policy: str
  d: int
  stages: list[int]
  nm: list[int]
  measured: float
  predicted: float
  error: float  # |predicted - measured| / measured
  host_seconds: float


def cluster_toml(name: str, nodes: Sequence[Sequence[str]], speedup: float) -> str:
  """A cluster file: the emulated types (``speedup`` times faster), fast links, ``nodes``."""
  lines = [f'name = "{name}"', "[links]", 'intra_node = {gbytes_per_s = 100, latency_us = 1}',
           'inter_node = {gbytes_per_s = 100, latency_us = 1}']
  for gpu, flops in TYPES.items():
    tflops = flops * speedup / 1e12
    lines += [f"[gpu_types.{gpu}]", "memory_gib = 8", f"fp32_tflops = {tflops!r}", f"fp16_tflops = {tflops!r}",
              "bandwidth_gbytes_per_s = 1000", "efficiency = 1.0"]
  for gpus in nodes:
    lines += ["[[nodes]]", "gpus = [" + ", ".join(f'"{g}"' for g in gpus) + "]"]
  return "\n".join(lines) + "\n"


def write_clusters(config: MultiprocessConfig) -> dict[str, str]:
  """Writes ``<out_dir>/<name>.toml`` for every cluster; returns the paths by name."""
  os.makedirs(config.out_dir, exist_ok=True)
  paths = {}
  for name, nodes in CLUSTERS.items():
    paths[name] = os.path.join(config.out_dir, f"{name}.toml")
    with open(paths[name], "w", encoding="utf-8") as f:
      f.write(cluster_toml(name, nodes, config.speedup))
  return paths


def job_flags(cluster_path: str, case: MultiprocessCase, waves: int) -> list[str]:
  """The training CLI's flags of one case's multi-process job on loopback, padded to the emulated speeds."""
  return ["--executor=multiprocess", f"--cluster={cluster_path}", f"--policy={case.policy}", f"--nm={NM}",
          f"--d={case.d}", f"--waves={waves}", "--time_scale=1", "--model=mlp", "--dataset=synthetic",
          f"--eval_every={waves}"]


def check_case(case: MultiprocessCase, cluster_path: str, config: MultiprocessConfig,
               run_job: RunJob) -> MultiprocessCheck:
  """One case as a job (``run_job``) and on the sim executor; both traces checked, the same plan required."""
  name, policy, d = case
  job_dir = os.path.join(config.out_dir, f"{name}_{policy}_d{d}")
  t = time.perf_counter()
  summary = run_job(job_flags(cluster_path, case, config.waves), job_dir)
  host = time.perf_counter() - t
  require_wsp(read_trace(os.path.join(job_dir, "trace.jsonl")), f"multiprocess run {name} {policy} D={d}")
  predicted = run_hetpipe(get_model("mlp"), synthetic(), RunConfig.of(
      cluster=cluster_path, policy=parse_policy(policy), nm=NM, d=d, waves=config.waves, executor="sim"))
  require_wsp(predicted.events, f"sim run {name} {policy} D={d}")
  planned = (predicted.events[0]["cuts"], predicted.events[0]["nm"])
  if planned != (summary["cuts"], summary["nm"]):
    raise RunStopped(f"the sim planned (cuts, Nm) {planned}, the job ran {summary['cuts'], summary['nm']}")
  measured = summary["images_per_second"]
  error = abs(predicted.images_per_second - measured) / measured
  return MultiprocessCheck(name, len(CLUSTERS[name]), policy, d, summary["stages"], summary["nm"], measured,
                           predicted.images_per_second, error, host)


def validate_multiprocess(config: MultiprocessConfig, run_job: RunJob,
                          done: Callable[[MultiprocessCheck], None] = lambda check: None) -> list[MultiprocessCheck]:
  """Every case of ``config``, in order; ``done`` is called with each check as it ends."""
  paths = write_clusters(config)
  checks = []
  for i, case in enumerate(config.cases):
    progress("configuration %d/%d: %s, %s, D=%d", i + 1, len(config.cases), *case)
    checks.append(check_case(case, paths[case.cluster], config, run_job))
    done(checks[-1])
  return checks
