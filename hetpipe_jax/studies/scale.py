r"""Weak scaling on the simulated cluster: 16 to 1,024 heterogeneous GPUs (issue 12).

The clusters are ``mixed<N>x<G>`` (:func:`hetpipe_jax.cluster.mixed_cluster`): nodes of G GPUs of one type,
cycling through 8 types, PCIe inside a node and 56 Gb/s InfiniBand between nodes. For each model:

1. **Configuration.** At every size up to ``base`` GPUs the tuner (:mod:`hetpipe_jax.tune`, at D = 0,
   transfers overlapped, the placements and PS transfer models of the configuration) picks the grouping,
   order, cuts and Nm of every virtual worker and the placement. A larger cluster runs the base size's
   tuned configuration replicated (:func:`hetpipe_jax.tune.replicate`).
2. **Plan and simulate.** Each size is planned (replicated) and simulated for ``waves`` waves per virtual
   worker with the ``sim`` executor's fast mode (:mod:`hetpipe_jax.sim.steady`); every simulated trace
   (version 2) passes the WSP checker as it is emitted (a few thousand events held at a time). A row's
   simulations run side by side, one per core (``jobs``), each in a process forked with the plan in it. The
   host seconds of a row are all of it: planning, every simulation, every check (each part also on its own,
   summed over the simulations).
3. **Parameter server.** The same configuration is also simulated with one PS shard per unit on one node
   (``default`` placement) beside byte-range shards on every node (``striped``).

Example::

  rows = run_scale(ScaleConfig(models=("resnet152",), sizes=(8, 16), per_node=1, base=8, waves=30,
                               tune_waves=8))
  rows[-1].efficiency
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import math
import multiprocessing
import os
import time
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple, cast

from hetpipe_jax.cluster import Cluster, mixed_cluster
from hetpipe_jax.core.check import StreamCheck
from hetpipe_jax.core.trace import Trace
from hetpipe_jax.cost.context import CostContext
from hetpipe_jax.cost.profile import UnitProfile, full_size_profiles
from hetpipe_jax.errors import ConfigError
from hetpipe_jax.models import FULL_SIZE
from hetpipe_jax.plan.costmodel import ideal_images_per_sec
from hetpipe_jax.sim import simulate_fast
from hetpipe_jax.studies.checked import progress, require_sound
from hetpipe_jax.tune import Candidate, RunSetting, SearchSpace, TuneOptions, candidate_json, replicate, tune

SIZES = (16, 32, 64, 128, 256, 512, 1024)


@dataclasses.dataclass(frozen=True)
class ScaleConfig:
  """What the scaling study runs (the fields are ``experiments.scale``'s flags).

  Attributes:
    models: full-size models (a CNN, or a GPT preset).
    sizes: cluster sizes in GPUs, each a positive multiple of ``per_node``.
    per_node: GPUs per node (all of one type).
    base: the largest size tuned directly; larger ones replicate its configuration.
    placements: PS placements the tuner searches.
    staged: PS transfer models the tuner searches (False: a push and a pull as one; True: per stage).
    batch_size: images per minibatch of a CNN.
    gpt_batch_size / gpt_seq_len / gpt_precision: sequences per minibatch, tokens per sequence and
      precision of a GPT.
    waves: waves per virtual worker of every simulated run.
    tune_waves: waves per virtual worker of the tuner's refining runs.
    jobs: how many of a row's simulations (and their checks) run side by side, each in a process of its own
      (0: one per core; 1: one after another in this process).
  """

  models: tuple[str, ...] = ("resnet152", "gpt2-xl")
  sizes: tuple[int, ...] = SIZES
  per_node: int = 8
  base: int = 64
  placements: tuple[str, ...] = ("striped",)
  staged: tuple[bool, ...] = (False,)
  batch_size: int = 32
  gpt_batch_size: int = 8
  gpt_seq_len: int = 1024
  gpt_precision: str = "bf16"
  waves: int = 100
  tune_waves: int = 40
  jobs: int = 0

  def __post_init__(self):
    if any(n < 1 or n % self.per_node for n in self.sizes):
      raise ConfigError(f"--sizes={','.join(map(str, self.sizes))}: every size must be a positive multiple of "
                        f"--per_node={self.per_node}")
    if self.waves < 2 or self.tune_waves < 2:
      raise ConfigError(f"--waves={self.waves}, --tune_waves={self.tune_waves}: at least 2 each")
    if self.jobs < 0:
      raise ConfigError(f"--jobs={self.jobs}: at least 0 (0: one per core, 1: one simulation at a time)")
    for model in self.models:
      if model not in FULL_SIZE:
        raise ConfigError(f"--models: {model!r} is not a full-size model; use one of {', '.join(FULL_SIZE)}")


class ModelSetting(NamedTuple):
  """How a model runs in the study: a CNN in fp32 with momentum SGD (one parameter-sized optimizer slot), a
  GPT with Adam (two)."""

  batch_size: int  # examples per minibatch
  seq_len: int | None  # tokens per example (None: a CNN)
  precision: str
  optimizer_slots: float

  @property
  def items(self) -> int:
    """Images or tokens per minibatch."""
    return self.batch_size * (self.seq_len or 1)


class ScaleRow(NamedTuple):
  """One model on one cluster size."""

  model: str
  gpus: int
  nodes: int
  vws: int
  configuration: str
  placement: str
  items_per_sec: float  # images (CNN) or tokens (GPT) per second, with ``placement``
  ideal_items_per_sec: float
  items_per_sec_striped: float
  items_per_sec_per_unit: float  # one PS shard per unit, on one node (``default`` placement)
  plan_seconds: float  # host seconds: replicating the tuned configuration
  sim_seconds: float  # every simulation of the row (its placement, striped and default), checks left out, summed
  check_seconds: float  # checking every simulated trace as it was emitted, summed over the simulations
  row_seconds: float  # the whole row's wall on the host: plan, every simulation and check (side by side with
  #   ScaleConfig.jobs > 1, so it can be below plan + sim + check), the ideal aggregate
  simulated_waves: int
  fast_method: str
  setting: Mapping[str, Any]  # batch size, tokens per example, precision, cluster, tune.candidate_json

  @property
  def efficiency(self) -> float:
    return self.items_per_sec / self.ideal_items_per_sec

  @property
  def plan_sim_seconds(self) -> float:
    """What the row took on the host, all of it (:attr:`row_seconds`)."""
    return self.row_seconds


# The columns of scale.json's rows (then "setting") and of scale.csv, in order.
FIELDS = ("model", "gpus", "nodes", "vws", "placement", "items_per_sec", "ideal_items_per_sec", "efficiency",
          "items_per_sec_striped", "items_per_sec_per_unit", "plan_seconds", "sim_seconds", "check_seconds",
          "row_seconds", "plan_sim_seconds",
          "simulated_waves", "fast_method", "configuration")


PARTS = ("plan_seconds", "sim_seconds", "check_seconds", "row_seconds")  # what a row's host time is made of


def growth_exponent(gpus: Sequence[int], seconds: Sequence[float]) -> float | None:
  """The exponent b of seconds ~ a x GPUs^b, least squares on the logs (None below two sizes)."""
  if len(gpus) < 2 or min(seconds) <= 0:
    return None
  xs, ys = [math.log(g) for g in gpus], [math.log(s) for s in seconds]
  mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
  return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)


def row_json(row: ScaleRow) -> dict[str, Any]:
  """A row as scale.json holds it: :data:`FIELDS`, then its setting."""
  return {**{f: getattr(row, f) for f in FIELDS}, "setting": row.setting}


def row_from_json(doc: Mapping[str, Any]) -> ScaleRow:
  """A row of scale.json (:func:`row_json`) as a :class:`ScaleRow`."""
  return ScaleRow(**{f: doc[f] for f in ScaleRow._fields})


def model_setting(config: ScaleConfig, model: str) -> ModelSetting:
  """The batch, sequence length, precision and optimizer slots of ``model`` in the study."""
  if model.startswith("gpt"):
    return ModelSetting(config.gpt_batch_size, config.gpt_seq_len, config.gpt_precision, 2.0)
  return ModelSetting(config.batch_size, None, "fp32", 1.0)


class Simulated(NamedTuple):
  """One simulation of a row: minibatches per second, the host seconds it took (the check's left out), those
  of checking its trace, and the fast mode's info."""

  rate: float
  sim_seconds: float
  check_seconds: float
  info: dict[str, Any]


def simulate(cluster: Cluster, profiles: Sequence[UnitProfile], candidate: Candidate, waves: int,
             placement: str, precision: str) -> Simulated:
  """``candidate`` simulated with the fast mode for ``waves`` waves, its trace (version 2: O(1) per event)
  checked as it is emitted (:class:`~hetpipe_jax.core.check.StreamCheck`), never held whole."""
  stream = StreamCheck()
  trace = Trace(keep=False, version=2, sink=stream)
  t0 = time.perf_counter()
  seconds, _, _, info = simulate_fast(candidate.job(cluster, profiles, waves, placement=placement,
                                                    precision=precision), trace)
  require_sound(cast(StreamCheck, trace.sink).finish(), f"simulated run on {cluster.name}")
  host = time.perf_counter() - t0
  return Simulated(sum(candidate.layout.nms) * waves / seconds, host - stream.seconds, stream.seconds, info)


def simulations(cluster: Cluster, profiles: Sequence[UnitProfile], candidate: Candidate, placements: Sequence[str],
                config: ScaleConfig, precision: str) -> dict[str, Simulated]:
  """:func:`simulate` of ``candidate`` with each of ``placements``, by placement: ``config.jobs`` at a time, each in a
  process of its own (:func:`_processes`), or one after another here."""
  jobs = min(config.jobs or os.cpu_count() or 1, len(placements))
  args = [(cluster, profiles, candidate, config.waves, placement, precision) for placement in placements]
  if jobs == 1:
    return {placement: simulate(*a) for placement, a in zip(placements, args)}
  with concurrent.futures.ProcessPoolExecutor(jobs, mp_context=_processes()) as pool:
    futures = [pool.submit(simulate, *a) for a in args]
    return {placement: future.result() for placement, future in zip(placements, futures)}


def _processes() -> Any:
  """How a simulation's process starts (a multiprocessing context): forked from this one (the plan is in it
  already, nothing is sent), unless JAX's runtime is up here, whose threads make a fork unsafe; then spawned
  afresh, as the tuner's are (the plan sent)."""
  from jax._src import xla_bridge  # private: the only way to ask without starting the runtime

  return multiprocessing.get_context("spawn" if xla_bridge.backends_are_initialized() else "fork")


def tune_bases(config: ScaleConfig, model: str, profiles: Sequence[UnitProfile],
               setting: RunSetting) -> dict[int, Candidate]:
  """The tuned configuration of every size up to ``config.base`` the study needs, by size."""
  space = SearchSpace(ds=(0,), placements=config.placements, transfers=(True,), staged=config.staged)
  tuned = {}
  for n in sorted({min(n, config.base) for n in config.sizes}):
    cluster = mixed_cluster(n, config.per_node)
    progress("%s: tuning on %s (%d GPUs)", model, cluster.name, n)
    out = tune(cluster, profiles, model_setting(config, model).batch_size, space,
               TuneOptions(waves=config.tune_waves, refine=3, setting=setting,
                           progress=lambda line: progress("  %s", line)))
    tuned[n] = out.best.candidate
  return tuned


def scale_row(config: ScaleConfig, model: str, n: int, tuned: Candidate, profiles: Sequence[UnitProfile],
              setting: RunSetting) -> ScaleRow:
  """``model`` on ``n`` GPUs: ``tuned`` replicated there, simulated with its placement, striped and default."""
  ms = model_setting(config, model)
  t0 = time.perf_counter()
  cluster = mixed_cluster(n, config.per_node)
  candidate = replicate(tuned, cluster, profiles, setting=setting)
  plan_seconds = time.perf_counter() - t0
  placements = list(dict.fromkeys((candidate.placement, "striped", "default")))  # the comparison, whichever tuned
  runs = simulations(cluster, profiles, candidate, placements, config, ms.precision)
  ideal = ideal_images_per_sec(cluster, profiles, ms.batch_size, precision=ms.precision)
  rate, info = runs[candidate.placement].rate, runs[candidate.placement].info
  return ScaleRow(model, n, cluster.num_nodes, len(candidate.plans), candidate.label, candidate.placement,
                  rate * ms.items, ideal * ms.items / ms.batch_size, runs["striped"].rate * ms.items,
                  runs["default"].rate * ms.items, plan_seconds, sum(r.sim_seconds for r in runs.values()),
                  sum(r.check_seconds for r in runs.values()), time.perf_counter() - t0,
                  max(info["simulated_waves"]), info["method"],
                  {"batch_size": ms.batch_size, "seq_len": ms.seq_len, "precision": ms.precision,
                   "cluster": cluster.name, **candidate_json(candidate)})


def scale_model(config: ScaleConfig, model: str) -> list[ScaleRow]:
  """The study of one model: a row per size of ``config.sizes``, in order."""
  ms = model_setting(config, model)
  setting = RunSetting(CostContext(optimizer_slots=ms.optimizer_slots, precision=ms.precision))
  profiles = full_size_profiles(model, ms.batch_size, seq_len=ms.seq_len)
  tuned = tune_bases(config, model, profiles, setting)
  rows = []
  for n in config.sizes:
    row = scale_row(config, model, n, tuned[min(n, config.base)], profiles, setting)
    progress("%s on %s: %.0f per s, efficiency %.3f, planned and simulated in %.2f s (%s, %d waves)",
             model, row.setting["cluster"], row.items_per_sec, row.efficiency, row.plan_sim_seconds,
             row.fast_method, row.simulated_waves)
    rows.append(row)
  return rows


def run_scale(config: ScaleConfig) -> list[ScaleRow]:
  """The whole study: every model of ``config.models`` at every size, model by model."""
  return [row for model in config.models for row in scale_model(config, model)]
