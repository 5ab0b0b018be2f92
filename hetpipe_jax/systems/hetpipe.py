"""HetPipe as a system beside its peers: virtual workers of the planner's pipelines, data parallel through a
parameter server under Wave Synchronous Parallel (WSP).

Simulated with the planner (``knobs.policy``: NP, ED, HD, a grouping, or ``best``, the fastest of NP, ED and HD;
Nm by ``knobs.nm_rule``: the planner's max_fit by default, best, or speed, waves sized to each virtual worker's
speed with windows) on the ``sim`` executor at D = 0 for :data:`WAVES` waves, its trace checked by the WSP
checker; trained with :func:`hetpipe_jax.run_hetpipe` on the ``virtual`` executor in the simulated layout, its
clock scaled so that its images/s equal the ``sim`` executor's. A study's HetPipe rows (every policy at every D,
the tuned configurations, an SSP parameter server) are :class:`HetPipeSetting` s the study chooses; this module
gives their ``sim`` executor's images/s (:func:`simulated_images_per_sec`) and trains them (:class:`Trainer`, the
path :meth:`HetPipe.train` takes too; :func:`training_of` for the curve and the staleness). The tuner's HetPipe
search is :func:`hetpipe_jax.tune.tune`.
"""

from __future__ import annotations

import dataclasses
import gc
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

from hetpipe_jax.api import run_hetpipe
from hetpipe_jax.baselines.knobs import PeerKnobs
from hetpipe_jax.cluster import Cluster
from hetpipe_jax.core.check import require_wsp
from hetpipe_jax.core.controls import DEFAULT as DEFAULT_CONTROL
from hetpipe_jax.core.controls import parse_control
from hetpipe_jax.core.meta import meta_gpus
from hetpipe_jax.core.trace import Trace, staleness_stats
from hetpipe_jax.cost.batch import BatchProfiles
from hetpipe_jax.cost.context import DEFAULT_COSTS, CostContext
from hetpipe_jax.data import Dataset
from hetpipe_jax.errors import ConfigError
from hetpipe_jax.models.base import LayeredModel
from hetpipe_jax.plan.allocation import POLICIES, ClusterPlan, plan_cluster
from hetpipe_jax.plan.costmodel import ideal_images_per_sec
from hetpipe_jax.run.config import RunConfig
from hetpipe_jax.run.result import RunResult
from hetpipe_jax.sim import SimJob, SimOptions, simulate
from hetpipe_jax.sim.replan import Replanning, first_trace, simulate_replanning
from hetpipe_jax.staleness import mean_staleness
from hetpipe_jax.systems.base import DEFAULT_KNOBS, WSP, Curve, CurvePoint, System, SystemRun, TrainSetting

WAVES = 50  # waves simulated per virtual worker
BEST = "best"


class HetPipeJob(NamedTuple):
  """What a simulated HetPipe ran: the cluster, the plan and its policy."""

  cluster: Cluster
  plan: ClusterPlan
  policy: Any


def hetpipe_curve(metrics: Sequence[dict[str, Any]], nms: Sequence[int], scale: float = 1.0) -> Curve:
  """A HetPipe run's metrics as a curve: at every evaluation, its time x ``scale`` and the minibatches so far
  (every virtual worker's Nm per wave)."""
  curve, done = [], 0
  for row in metrics:
    done += nms[row["vw"]]
    if "test_accuracy" in row:
      curve.append(CurvePoint(row["time"] * scale, done, row["test_accuracy"], row["train_loss"], row["test_loss"]))
  return curve


def simulated_rate(job: SimJob, batch_size: int, what: str,
                   replanning: tuple[CostContext, Replanning] | None = None) -> tuple[float, Trace]:
  """(examples/s, the trace) of ``job`` on the simulator, the trace checked by the WSP checker (``what`` names the
  run in the error): how every HetPipe configuration a study times by its plans is simulated. With
  ``replanning`` (the costs it plans with, its rule), HetPipe's adaptation runs (:mod:`hetpipe_jax.sim.replan`,
  which checks every segment's trace): the first is returned, its meta line listing the segments.

  Raises:
    ProtocolError: when a trace breaks a WSP guarantee.
  """
  if replanning is None:
    trace = Trace()
    seconds, vws, _ = simulate(job, trace)
    require_wsp(trace.events, what)
    return sum(vw.completed for vw in vws) * batch_size / seconds, trace
  segments = simulate_replanning(job, *replanning)
  trace = Trace()
  trace.extend(first_trace(segments))
  return sum(s.minibatches for s in segments) * batch_size / segments[-1].end, trace


class HetPipe(System):
  name = "hetpipe"
  summary = ("virtual workers of the planner's pipelines (policy NP, ED, HD), data parallel through a parameter "
             "server under WSP (this project)")
  kind = WSP
  weight_mode = "stash"

  def _simulate(self, cluster: Cluster, profiles: BatchProfiles, batch_size: int, policy: Any,
                costs: CostContext, knobs: PeerKnobs) -> tuple[HetPipeJob, float, Trace]:
    """(the job, its examples/s, its trace) of one policy, its Nm by the knobs' rule, at their tensor-parallel
    degree."""
    units = list(profiles.at(batch_size))
    plan = plan_cluster(cluster, units, policy, "default", knobs.nm_rule, None, costs, knobs.tp)
    rate, trace = simulated_rate(SimJob(cluster, units, plan.layout, 0, WAVES, weight_mode=costs.weight_mode,
                                        precision=costs.precision, options=SimOptions(noise=knobs.noise),
                                        control=costs.control),
                                 batch_size, f"hetpipe {policy}, simulated",
                                 (costs, Replanning(nm_rule=knobs.nm_rule)) if knobs.adapting else None)
    return HetPipeJob(cluster, plan, policy), rate, trace

  def simulate(self, cluster: Cluster, profiles: BatchProfiles, batch_size: int, knobs: PeerKnobs = DEFAULT_KNOBS,
               costs: CostContext = DEFAULT_COSTS, model: str = "") -> SystemRun:
    knobs = knobs.validate()
    costs = self.memory_costs(costs)._replace(control=parse_control(knobs.staleness))
    policies = POLICIES if knobs.policy == BEST else (knobs.policy,)
    runs, reasons = [], []
    for policy in policies:
      try:
        runs.append(self._simulate(cluster, profiles, batch_size, policy, costs, knobs))
      except ConfigError as e:
        reasons.append(f"{policy}: {e}")
    if not runs:
      raise ConfigError(f"hetpipe: no policy fits cluster {cluster.name}: {'; '.join(reasons)}")
    job, rate, trace = max(runs, key=lambda r: r[1])
    nms = [p.nm for p in job.plan.vws]
    ideal = ideal_images_per_sec(cluster, list(profiles.at(batch_size)), batch_size, precision=costs.precision)
    events = (dict(trace.events[0], model=model), *trace.events[1:])
    return SystemRun(self.name, sum(nms) * batch_size / rate, sum(nms) * batch_size, rate, ideal,
                     tuple(nm * batch_size for nm in nms), tuple(1 for _ in nms),
                     job.plan.layout.num_gpus, None, job, events)

  def train(self, model: LayeredModel, dataset: Dataset, run: SystemRun, setting: TrainSetting,
            knobs: PeerKnobs = DEFAULT_KNOBS) -> Curve:
    """The simulated layout on the ``virtual`` executor, for whole waves of ``setting.epochs`` epochs."""
    job: HetPipeJob = run.job
    vws = job.plan.vws
    nms = [p.nm for p in vws]
    per_wave = sum(nms) * setting.batch_size
    base = RunConfig.of(cluster=job.cluster, batch_size=setting.batch_size, optimizer=setting.optimizer,
                        executor="virtual", staleness=knobs.staleness)
    layout = HetPipeSetting([[g.index for g in p.gpus] for p in vws], nms, 0, [list(p.cuts) for p in vws],
                            job.plan.layout.windows)  # (the windows it was timed with: speed-sized waves have some)
    waves = WaveRun(setting.seed, setting.rounds(per_wave, len(dataset.x_train)), setting.lr,
                    max(1, round(setting.eval_examples / per_wave)))
    result = Trainer(model, dataset, base).train(layout, waves, f"hetpipe, seed {setting.seed}")
    return hetpipe_curve(result.metrics, nms, result.images_per_second / run.images_per_sec)

  def update_examples(self, run: SystemRun) -> int:
    """A minibatch: every virtual worker updates its local weights after each of its minibatches (K of them under a
    staleness control that accumulates K: the smallest K of a virtual worker)."""
    minibatch = min(run.batch_sizes) // min(p.nm for p in run.job.plan.vws)
    return minibatch * min(run.meta.get("accumulate") or [1])

  def config(self, run: SystemRun) -> str:
    return plan_config(run.job.plan)

  def label(self, knobs: PeerKnobs, update_examples: int) -> str:
    control = "" if knobs.staleness == DEFAULT_CONTROL else f", {knobs.staleness}"
    return f"hetpipe {knobs.policy}{rule_tag(knobs.nm_rule)}, D=0{control}"

  def signature(self, run: SystemRun) -> list[Any]:
    return [[p.nm for p in run.job.plan.vws], 0]

  @classmethod
  def entry_signature(cls, entry: Mapping[str, Any]) -> list[Any]:
    """Nm per virtual worker and D."""
    return [list(entry.get("nm") or []), entry.get("d")]


def rule_tag(nm_rule: str) -> str:
  """How a row or label names an Nm rule: nothing for max_fit (the default), `` speed`` for speed."""
  return "" if nm_rule == "max_fit" else f" {nm_rule}"


def plan_config(plan: ClusterPlan) -> str:
  """A plan of the default placement in words: its virtual workers, Nm and (where one is set) windows, and each
  stage's tensor-parallel degree where one is above 1."""
  layout = plan.layout
  held = "" if layout.windows is None else f", windows {layout.windows}"
  degrees = sorted({vw.degree(j) for vw in layout.vws for j in range(vw.k)})
  split = "" if degrees == [1] else f", stages on {'/'.join(map(str, degrees))} GPUs (tensor parallelism)"
  return f"{len(plan.vws)} virtual workers, Nm {[p.nm for p in plan.vws]}{held}{split}, default placement"


class HetPipeSetting(NamedTuple):
  """A HetPipe configuration as a study runs it: :class:`~hetpipe_jax.RunConfig` fields by their flat names (None:
  not given, the config's own), and the ``sim`` executor's transfer models, which only that executor has (for the
  configuration's images/s).

  Attributes:
    policy: an allocation policy (NP, ED, HD) or a grouping of GPU indices, one list per virtual worker.
    nm: Nm (a number, max_fit, best or speed; or one per virtual worker).
    d: the clock distance bound D.
    cuts / window / placement: the layout's unit boundaries per virtual worker, most minibatches in flight,
      placement.
    ps_optimizer: the parameter server's (outer) optimizer (``--ps_optimizer`` syntax; None: it adds).
    overlap_transfers / staged_ps: the ``sim`` executor's transfer models.
    tp: the tensor-parallel degree of a policy's stages (None: the base config's).
  """

  policy: Any
  nm: Any
  d: int = 0
  cuts: list[list[int]] | None = None
  window: list[int] | None = None
  placement: str | None = None
  ps_optimizer: str | None = None
  overlap_transfers: bool | None = None
  staged_ps: bool | None = None
  tp: Any = None

  def run_fields(self) -> dict[str, Any]:
    """The fields the ``virtual`` executor's run takes (the given ones)."""
    names = ("policy", "cuts", "nm", "window", "d", "placement", "ps_optimizer", "tp")
    return {k: getattr(self, k) for k in names if getattr(self, k) is not None}

  def sim_fields(self) -> dict[str, Any]:
    """The fields the ``sim`` executor's run takes: the layout and its transfer models (an outer optimizer takes
    no time)."""
    fields = {k: v for k, v in self.run_fields().items() if k != "ps_optimizer"}
    return {**fields, **{k: getattr(self, k) for k in ("overlap_transfers", "staged_ps") if getattr(self, k)
                         is not None}}


class WaveRun(NamedTuple):
  """How long and with what a configuration trains: seed, waves, learning rate, evaluations every this many
  waves."""

  seed: int
  waves: int
  lr: float
  eval_every: int


def simulated_images_per_sec(model: LayeredModel, dataset: Any, base: RunConfig, setting: HetPipeSetting,
                             waves: int, noise: str = "none", adapt: str = "auto") -> float:
  """``setting``'s examples/s on the ``sim`` executor (:func:`simulated_run`)."""
  return simulated_run(model, dataset, base, setting, waves, noise, adapt).images_per_second


def simulated_run(model: LayeredModel, dataset: Any, base: RunConfig, setting: HetPipeSetting, waves: int,
                  noise: str = "none", adapt: str = "auto") -> RunResult:
  """``setting`` on the ``sim`` executor (its transfer models, ``noise``, the GPUs' variance, and ``adapt``,
  HetPipe's re-planning under it; at most :data:`WAVES` waves of ``model`` on ``dataset``, a full-size model's input
  spec or a dataset), its trace checked by the WSP checker. Its meta line names every GPU of the layout, the
  tensor-parallel partners that a numerics run on the stages' leads leaves out included."""
  sim = run_hetpipe(model, dataset, base.replace(**setting.sim_fields(), time_model=None, executor="sim",
                                                 waves=min(waves, WAVES), noise=noise, adapt=adapt))
  require_wsp(sim.events, "simulated run")
  return sim


class HetPipeTraining(NamedTuple):
  """A trained HetPipe configuration: its curve on the clock scaled to the ``sim`` executor (x ``time_scale``),
  Nm per virtual worker, its GPUs (tensor-parallel partners counted), the staleness of its trace
  (:func:`~hetpipe_jax.core.trace.staleness_stats`) and its mean staleness."""

  curve: Curve
  nm: list[int]
  gpus: int
  time_scale: float
  staleness: dict[str, Any]
  mean_staleness: float


def training_of(result: RunResult, time_scale: float) -> HetPipeTraining:
  """A run's curve (its clock x ``time_scale``) and staleness."""
  meta = result.events[0]
  return HetPipeTraining(hetpipe_curve(result.metrics, meta["nm"], time_scale), meta["nm"], meta_gpus(meta),
                         time_scale, staleness_stats(result.events), mean_staleness(result.events))


class Trainer:
  """Trains HetPipe configurations of ``model`` on ``dataset`` (``base``: every run's config before its own
  fields), each on the ``virtual`` executor and its trace checked. A run whose gate never closed is kept: the
  same configuration at a larger D is the same run, event for event, and reuses it."""

  def __init__(self, model: LayeredModel, dataset: Dataset, base: RunConfig,
               progress: Callable[[str], None] | None = None):
    self.model, self.dataset, self.base, self.say = model, dataset, base, progress or (lambda line: None)
    self._ungated: dict[tuple[str, WaveRun], list[RunResult]] = {}  # (the setting at D=0, the run) -> its runs

  def train(self, setting: HetPipeSetting, run: WaveRun, what: str) -> RunResult:
    """``setting``'s run (``what`` names it in progress lines and errors), or the same run at a smaller D whose
    gate never closed."""
    family = (repr(setting._replace(d=0)), run)
    same = next((r for r in self._ungated.get(family, []) if r.events[0]["d"] < setting.d), None)
    if same is not None:
      self.say(f"{what}: the same run as at D={same.events[0]['d']} (its gate never closed)")
      result = dataclasses.replace(same, events=[{**same.events[0], "d": setting.d}] + list(same.events[1:]))
    else:
      result = run_hetpipe(self.model, self.dataset, self.base.replace(
          seed=run.seed, waves=run.waves, **setting.run_fields(), learning_rate=run.lr, eval_every=run.eval_every))
    require_wsp(result.events, what)
    if not any(e["ev"] == "wait" for e in result.events):
      # kept without its virtual workers: their compiled programs would stay mapped (a 64-GPU study's runs
      # exceed the kernel's 65,530 memory maps of a process), and only the trace, metrics and clock are reused
      self._ungated.setdefault(family, []).append(dataclasses.replace(result, vws=[], init_params=None,
                                                                      params=None))
    gc.collect()  # the run's programs freed now, not when the collector next runs
    return result
