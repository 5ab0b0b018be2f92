"""HetPipe as a system beside its peers: virtual workers of the planner's pipelines, data parallel through a
parameter server under Wave Synchronous Parallel (WSP).

Simulated with the planner (``knobs.policy``: NP, ED, HD, a grouping, or ``best``, the fastest of NP, ED and HD;
Nm the planner's max_fit) on the ``sim`` executor at D = 0 for :data:`WAVES` waves, its trace checked by the WSP
checker; trained with :func:`hetpipe_jax.run_hetpipe` on the ``virtual`` executor in the simulated layout, its
clock scaled so that its images/s equal the ``sim`` executor's (as the convergence study does). The studies'
HetPipe rows (every policy at every D, the tuned configurations) are configurations of this system that the
studies build themselves (:mod:`experiments.convergence`, :mod:`experiments.throughput`); the tuner's HetPipe
search is :func:`hetpipe_jax.tune.tune`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

from hetpipe_jax.api import run_hetpipe
from hetpipe_jax.baselines.knobs import PeerKnobs
from hetpipe_jax.cluster import Cluster
from hetpipe_jax.core.check import check_trace
from hetpipe_jax.core.trace import Trace
from hetpipe_jax.cost.batch import BatchProfiles
from hetpipe_jax.cost.context import DEFAULT_COSTS, CostContext
from hetpipe_jax.data import Dataset
from hetpipe_jax.errors import ConfigError, ProtocolError
from hetpipe_jax.models.base import LayeredModel
from hetpipe_jax.plan.allocation import POLICIES, ClusterPlan, plan_cluster
from hetpipe_jax.plan.costmodel import ideal_images_per_sec
from hetpipe_jax.plan.layout import Layout
from hetpipe_jax.run.config import RunConfig
from hetpipe_jax.sim import SimJob, simulate
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


class HetPipe(System):
  name = "hetpipe"
  summary = ("virtual workers of the planner's pipelines (policy NP, ED, HD), data parallel through a parameter "
             "server under WSP (this project)")
  kind = WSP
  weight_mode = "stash"

  def _simulate(self, cluster: Cluster, profiles: BatchProfiles, batch_size: int, policy: Any,
                costs: CostContext) -> tuple[HetPipeJob, float, Trace]:
    """(the job, its examples/s, its trace) of one policy."""
    units = list(profiles.at(batch_size))
    plan = plan_cluster(cluster, units, policy, "default", "max_fit", None, costs)
    trace = Trace()
    seconds, vws, _ = simulate(SimJob(cluster, units, Layout(tuple(p.layout for p in plan.vws)), 0, WAVES,
                                    weight_mode=costs.weight_mode, precision=costs.precision), trace)
    require_wsp(trace.events, f"hetpipe {policy}, simulated")
    return HetPipeJob(cluster, plan, policy), sum(vw.completed for vw in vws) * batch_size / seconds, trace

  def simulate(self, cluster: Cluster, profiles: BatchProfiles, batch_size: int, knobs: PeerKnobs = DEFAULT_KNOBS,
               costs: CostContext = DEFAULT_COSTS, model: str = "") -> SystemRun:
    costs = self.memory_costs(costs)
    policies = POLICIES if knobs.validate().policy == BEST else (knobs.policy,)
    runs, reasons = [], []
    for policy in policies:
      try:
        runs.append(self._simulate(cluster, profiles, batch_size, policy, costs))
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
                     sum(len(p.stages) for p in job.plan.vws), None, job, events)

  def train(self, model: LayeredModel, dataset: Dataset, run: SystemRun, setting: TrainSetting,
            knobs: PeerKnobs = DEFAULT_KNOBS) -> Curve:
    """The simulated layout on the ``virtual`` executor, for whole waves of ``setting.epochs`` epochs."""
    job: HetPipeJob = run.job
    vws = job.plan.vws
    nms = [p.nm for p in vws]
    per_wave = sum(nms) * setting.batch_size
    result = run_hetpipe(model, dataset, _config(job, setting).replace(
        waves=max(1, int(setting.epochs * len(dataset.x_train) // per_wave)),
        eval_every=max(1, round(setting.eval_examples / per_wave))))
    require_wsp(result.events, f"hetpipe, seed {setting.seed}")
    return hetpipe_curve(result.metrics, nms, result.images_per_second / run.images_per_sec)

  def update_examples(self, run: SystemRun) -> int:
    """A minibatch: every virtual worker updates its local weights after each of its minibatches."""
    return min(run.batch_sizes) // min(p.nm for p in run.job.plan.vws)

  def config(self, run: SystemRun) -> str:
    vws = run.job.plan.vws
    return f"{len(vws)} virtual workers, Nm {[p.nm for p in vws]}, default placement"

  def label(self, knobs: PeerKnobs, update_examples: int) -> str:
    return f"hetpipe {knobs.policy}, D=0"

  def signature(self, run: SystemRun) -> list[Any]:
    return [[p.nm for p in run.job.plan.vws], 0]

  @classmethod
  def entry_signature(cls, entry: Mapping[str, Any]) -> list[Any]:
    """Nm per virtual worker and D."""
    return [list(entry.get("nm") or []), entry.get("d")]


def require_wsp(events: Sequence[dict[str, Any]], what: str) -> None:
  """Raises ProtocolError naming the first violations when ``events`` break a WSP guarantee."""
  violations = check_trace(events)
  if violations:
    raise ProtocolError(f"{what}: the trace breaks WSP, {len(violations)} violations; first: "
                        + "; ".join(str(v) for v in violations[:3]))


def _config(job: HetPipeJob, setting: TrainSetting) -> RunConfig:
  """The run's config: the plan's layout on the virtual executor."""
  vws = job.plan.vws
  return RunConfig.of(cluster=job.cluster, batch_size=setting.batch_size, optimizer=setting.optimizer,
                      learning_rate=setting.lr, seed=setting.seed, executor="virtual", d=0,
                      policy=[[g.index for g in p.gpus] for p in vws], cuts=[list(p.cuts) for p in vws],
                      nm=[p.nm for p in vws])
