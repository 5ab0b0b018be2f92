"""A peer of HetPipe as a :class:`~hetpipe_jax.systems.base.System`: simulated by its ``*_job`` builder
(:mod:`hetpipe_jax.baselines`) on :func:`hetpipe_jax.baselines.sync.simulate_sync` (the same cost model,
catalogue, links and shared-flow network as HetPipe's ``sim`` executor), trained with
:func:`hetpipe_jax.baselines.numerics.train_sgd`: synchronous SGD at its global batch with each worker's gradient
weighted by its share, or (a ``local`` peer) local SGD with its H and outer step.

A new peer is a subclass naming its ``build`` (a ``*_job`` builder), one module, one ``register`` call.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import ClassVar

from hetpipe_jax.baselines.knobs import PeerKnobs
from hetpipe_jax.baselines.numerics import outer_optimizer, train_sgd
from hetpipe_jax.baselines.sync import SyncJob, simulate_sync
from hetpipe_jax.cluster import Cluster
from hetpipe_jax.cost.batch import BatchProfiles
from hetpipe_jax.cost.context import DEFAULT_COSTS, CostContext
from hetpipe_jax.data import Dataset
from hetpipe_jax.errors import ConfigError
from hetpipe_jax.models.base import LayeredModel
from hetpipe_jax.optim import make_optimizer
from hetpipe_jax.plan.costmodel import ideal_images_per_sec
from hetpipe_jax.recompute import MODES
from hetpipe_jax.sim.noise import realise
from hetpipe_jax.systems.base import DEFAULT_KNOBS, LOCAL, Curve, CurvePoint, System, SystemRun, TrainSetting

Builder = Callable[[Cluster, BatchProfiles, int, PeerKnobs, CostContext], SyncJob]


class Peer(System):
  """A synchronous (or local-SGD) peer: its builder (``build``) and what the base class says."""

  build: ClassVar[Builder]

  def simulate(self, cluster: Cluster, profiles: BatchProfiles, batch_size: int, knobs: PeerKnobs = DEFAULT_KNOBS,
               costs: CostContext = DEFAULT_COSTS, model: str = "") -> SystemRun:
    """The peer simulated (see :meth:`System.simulate`), every GPU under ``costs.recompute``; under ``auto``, the
    fastest of none, selective and full that the peer can run (each GPU alike, as a user of the peer would set
    it), its timeline's meta saying which."""
    costs = self.memory_costs(costs)
    if costs.recompute != "auto":
      return self._simulate(cluster, profiles, batch_size, knobs, costs, model)
    runs, refused = [], []
    for mode in MODES:
      try:
        runs.append(self._simulate(cluster, profiles, batch_size, knobs, costs._replace(recompute=mode), model))
      except ConfigError as e:
        refused.append(e)
    if not runs:
      raise refused[0]
    return max(runs, key=lambda r: r.images_per_sec)

  def _simulate(self, cluster: Cluster, profiles: BatchProfiles, batch_size: int, knobs: PeerKnobs,
                costs: CostContext, model: str) -> SystemRun:
    job = type(self).build(cluster, profiles.under(costs.recompute), batch_size, knobs.validate(), costs)
    result = simulate_sync(job, realise(knobs.noise, cluster))
    ideal = ideal_images_per_sec(cluster, list(profiles.at(batch_size)), batch_size, precision=costs.precision)
    timeline = result.timeline
    timeline["meta"].update(model=model, round_seconds=result.round_seconds,
                            examples_per_round=result.examples_per_round, images_per_sec=result.images_per_sec,
                            ideal_images_per_sec=ideal, efficiency=result.images_per_sec / ideal,
                            **({} if costs.recompute == "none" else {"recompute": costs.recompute}))
    accumulated = job.weights_sharded  # (its local steps are micro-steps of one update: one batch per round)
    workers = result.workers  # (the last round's: as adapted, where the peer adapts)
    return SystemRun(self.name, result.round_seconds, result.examples_per_round, result.images_per_sec, ideal,
                     tuple(w.examples_per_round if accumulated else w.batch for w in workers),
                     tuple(1 if accumulated else w.local_steps for w in workers),
                     len({g.index for w in job.workers for g in w.all_gpus}), timeline, job)

  def train(self, model: LayeredModel, dataset: Dataset, run: SystemRun, setting: TrainSetting,
            knobs: PeerKnobs = DEFAULT_KNOBS) -> Curve:
    """Trains ``run``'s shape for ``setting.epochs`` epochs: whole rounds, evaluated about every
    ``setting.eval_examples`` examples; the curve on the clock of the simulated round."""
    per_round = run.examples_per_round
    local = self.kind == LOCAL
    rounds = setting.rounds(per_round, len(dataset.x_train))
    rate = lambda updates: make_optimizer(setting.optimizer, setting.schedule.rate(setting.lr, updates))
    # (the schedule over each optimizer's own updates: a synchronous step each round, a local worker's H_i)
    tx = [rate(rounds * h) for h in run.local_steps] if local and not setting.schedule.constant else rate(rounds)
    result = train_sgd(model=model, dataset=dataset, tx=tx,
                       batch_sizes=run.batch_sizes, rounds=rounds,
                       round_seconds=run.round_seconds, local_steps=run.local_steps if local else None,
                       outer=outer_optimizer(knobs.outer_lr, knobs.outer_momentum, True) if local else None,
                       seed=setting.seed, eval_every=max(1, round(setting.eval_examples / per_round)),
                       what=f"{self.name} ({run.gpus} GPUs), seed {setting.seed}")
    return [CurvePoint(r.time, r.examples / setting.batch_size, r.test_accuracy, r.train_loss, r.test_loss)
            for r in result.rows if r.test_accuracy is not None and r.test_loss is not None]
