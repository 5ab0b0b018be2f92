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
from hetpipe_jax.sim.steady import SteadyState


def simulate(cluster: Cluster, profiles: Sequence[UnitProfile], layout: Layout, d: int, waves: int,
             trace: Trace, placement: str = "default", schedule: str = "1f1b", weight_mode: str = "stash",
             precision: str = "fp32", meta: dict | None = None, failures: Mapping[int, Sequence[int]] | None = None,
             rejoin: bool = False, overlap_transfers: bool = False, staged_ps: bool = False,
             steady: SteadyState | None = None) -> tuple[float, list[VirtualWorker], list[dict]]:
  """Simulates the virtual workers of ``layout`` for ``waves`` waves (``failures``/``rejoin``: fault
  injection, as for :class:`~hetpipe_jax.core.engine.Engine`; ``overlap_transfers``: stage-to-stage
  transfers overlap computation, see :mod:`hetpipe_jax.sim.network`; ``staged_ps``: each stage's part of a
  push and a pull moves on its own, see :mod:`hetpipe_jax.core.engine`; ``steady``: fast mode, no minibatch
  is injected once ``steady`` says the waves have settled, see :mod:`hetpipe_jax.sim.steady`).

  Writes the trace's meta line first (``meta`` adds or overrides fields). Returns (simulated seconds,
  the virtual workers, one metrics row per pushed wave).
  """
  num_vws, nms = layout.num_vws, layout.nms
  trace.emit(**{"ev": "meta", "version": 1, "num_vws": num_vws, "nm": nms, "d": d,
                "stages": layout.stages, "weight_mode": weight_mode, "executor": "sim",
                "schedule": schedule, "shards": len(profiles), "placement": placement,
                **({} if layout.windows is None else {"window": layout.windows}),
                **({"staged_ps": True} if staged_ps else {}), **(meta or {})})
  shard_nodes = place_shards(cluster, profiles, layout, placement)
  vws = [VirtualWorker.create(i, vw.k, vw.nm, waves * vw.nm, num_vws, schedule, weight_mode, window=vw.window)
         for i, vw in enumerate(layout.vws)]
  rows: list[dict] = []

  def on_wave(vw: int, wave: int, t: float, _) -> None:
    rows.append({"vw": vw, "wave": wave, "step": (wave + 1) * nms[vw], "time": t, "train_loss": None})
    if steady is not None:
      steady.push(vw, t)

  simulator = Simulator(cluster, overlap_transfers)
  engine = Engine(vws, ClockServer(num_vws, d, num_shards=len(profiles)), trace, on_wave=on_wave,
                  comm=SimComm(simulator, profiles, layout, shard_nodes, precision, staged_ps), failures=failures,
                  rejoin=rejoin)
  seconds = simulator.run(engine, CostModel(cluster, profiles, layout, precision),
                          stop=None if steady is None else steady.settled)
  return seconds, vws, rows


def simulate_fast(cluster: Cluster, profiles: Sequence[UnitProfile], layout: Layout, d: int, waves: int,
                  trace: Trace, placement: str = "default", schedule: str = "1f1b", weight_mode: str = "stash",
                  precision: str = "fp32", meta: dict | None = None, overlap_transfers: bool = False,
                  staged_ps: bool = False) -> tuple[float, list[VirtualWorker], list[dict], dict]:
  """:func:`simulate`'s fast mode (:mod:`hetpipe_jax.sim.steady`): the seconds of a ``waves``-wave run,
  from a shorter simulated one.

  The run is simulated until its waves settle. When every virtual worker would end within one wave of
  the others, the end is extrapolated from there. Otherwise (a faster virtual worker runs ahead and ends
  first) a run of ``n`` waves, long enough to settle and hold that tail, is simulated to its end, and the
  ``waves - n`` settled waves missing from its middle are added: ``T(waves) = T(n) + (waves - n) x P``.

  Returns:
    (the whole run's seconds, the simulated run's virtual workers, its metrics rows, ``{"method":
    "extrapolated" | "tail" | "full", "simulated_waves": waves each virtual worker ran}``); ``trace``
    holds the simulated run, complete in itself.
  """
  kwargs = {"placement": placement, "schedule": schedule, "weight_mode": weight_mode, "precision": precision,
            "meta": {**(meta or {}), "sim_fast": True}, "overlap_transfers": overlap_transfers,
            "staged_ps": staged_ps}
  scratch = Trace(None)
  steady = SteadyState(layout.num_vws, waves)
  seconds, vws, rows = simulate(cluster, profiles, layout, d, waves, scratch, steady=steady, **kwargs)
  if steady.stopped_at is None or steady.tail_waves() <= 1:
    trace.extend(scratch.events)
    if steady.stopped_at is None:  # never settled: simulated to the end
      return seconds, vws, rows, {"method": "full", "simulated_waves": [waves] * layout.num_vws}
    return max(steady.ends()), vws, rows, {"method": "extrapolated",
                                           "simulated_waves": [vw.total_mbs // vw.nm for vw in vws]}
  short = max(steady.stopped_at) + steady.tail_waves() + 2 * steady.max_cycle
  if short >= waves:
    seconds, vws, rows = simulate(cluster, profiles, layout, d, waves, trace, **kwargs)
    return seconds, vws, rows, {"method": "full", "simulated_waves": [waves] * layout.num_vws}
  seconds, vws, rows = simulate(cluster, profiles, layout, d, short, trace, **kwargs)
  return (seconds + (waves - short) * steady.period(), vws, rows,
          {"method": "tail", "simulated_waves": [short] * layout.num_vws})
