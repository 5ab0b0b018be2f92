"""The ``sim`` executor: the engine's schedule and WSP protocol on a cost model, without numerics.

The same :class:`~hetpipe_jax.core.engine.Engine` as every executor, with virtual workers that only
schedule (:class:`~hetpipe_jax.core.worker.NoNumerics`) and a clock-only server
(:class:`~hetpipe_jax.core.server.ClockServer`), on the simulated network of
:mod:`hetpipe_jax.sim.network`: task inputs, pushes and pulls are flows over shared links. The trace is
the same as every executor's, and the checker accepts it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from hetpipe_jax.cluster import Cluster
from hetpipe_jax.core.engine import Engine
from hetpipe_jax.core.server import ClockServer
from hetpipe_jax.core.trace import Trace
from hetpipe_jax.core.worker import VirtualWorker
from hetpipe_jax.cost.profile import UnitProfile
from hetpipe_jax.plan.costmodel import CostModel
from hetpipe_jax.plan.layout import Layout
from hetpipe_jax.plan.placement import place_shards
from hetpipe_jax.sim.network import SimComm, Simulator


def simulate(cluster: Cluster, profiles: Sequence[UnitProfile], layout: Layout, d: int, waves: int,
             trace: Trace, placement: str = "default", schedule: str = "1f1b", weight_mode: str = "stash",
             precision: str = "fp32", meta: dict | None = None, failures: Mapping[int, Sequence[int]] | None = None,
             rejoin: bool = False, overlap_transfers: bool = False) -> tuple[float, list[VirtualWorker], list[dict]]:
  """Simulates the virtual workers of ``layout`` for ``waves`` waves (``failures``/``rejoin``: fault
  injection, as for :class:`~hetpipe_jax.core.engine.Engine`; ``overlap_transfers``: stage-to-stage
  transfers overlap computation, see :mod:`hetpipe_jax.sim.network`).

  Writes the trace's meta line first (``meta`` adds or overrides fields). Returns (simulated seconds,
  the virtual workers, one metrics row per pushed wave).
  """
  num_vws, nms = layout.num_vws, layout.nms
  trace.emit(**{"ev": "meta", "version": 1, "num_vws": num_vws, "nm": nms, "d": d,
                "stages": layout.stages, "weight_mode": weight_mode, "executor": "sim",
                "schedule": schedule, "shards": len(profiles), "placement": placement, **(meta or {})})
  shard_nodes = place_shards(cluster, profiles, layout, placement)
  vws = [VirtualWorker.create(i, vw.k, vw.nm, waves * vw.nm, num_vws, schedule, weight_mode)
         for i, vw in enumerate(layout.vws)]
  rows: list[dict] = []
  on_wave = lambda vw, wave, t, _: rows.append(
      {"vw": vw, "wave": wave, "step": (wave + 1) * nms[vw], "time": t, "train_loss": None})
  simulator = Simulator(cluster, overlap_transfers)
  engine = Engine(vws, ClockServer(num_vws, d, num_shards=len(profiles)), trace, on_wave=on_wave,
                  comm=SimComm(simulator, profiles, layout, shard_nodes, precision), failures=failures,
                  rejoin=rejoin)
  seconds = simulator.run(engine, CostModel(cluster, profiles, layout, precision))
  return seconds, vws, rows
