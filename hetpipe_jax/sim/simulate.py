"""The ``sim`` executor: the engine's schedule and WSP protocol on a cost model, without numerics.

The same :class:`~hetpipe_jax.core.engine.Engine` as every executor, with virtual workers that only
schedule (:class:`~hetpipe_jax.core.worker.NoNumerics`) and a clock-only server
(:class:`~hetpipe_jax.core.server.ClockServer`), on the simulated network of
:mod:`hetpipe_jax.sim.network`: task inputs, pushes and pulls are flows over shared links. The trace is
the same as every executor's, and the checker accepts it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple, Protocol

from hetpipe_jax.cluster import Cluster
from hetpipe_jax.core.controls import PER_MINIBATCH, Control
from hetpipe_jax.core.engine import Engine
from hetpipe_jax.core.meta import meta_event
from hetpipe_jax.core.server import ClockServer
from hetpipe_jax.core.trace import Trace
from hetpipe_jax.core.worker import VirtualWorker, virtual_workers
from hetpipe_jax.cost.profile import UnitProfile
from hetpipe_jax.plan.costmodel import CostModel
from hetpipe_jax.plan.layout import Layout
from hetpipe_jax.plan.placement import place_shards
from hetpipe_jax.sim.network import SimComm, Simulator
from hetpipe_jax.sim.noise import realise
from hetpipe_jax.sim.options import SimOptions
from hetpipe_jax.sim.steady import SteadyState


class Watch(Protocol):
  """What :func:`simulate` tells of its pushes and asks whether to stop injecting."""

  def push(self, vw: int, t: float) -> None: ...

  def settled(self) -> bool: ...


class SimJob(NamedTuple):
  """What the ``sim`` executor simulates: ``layout`` on ``cluster`` for ``waves`` waves under WSP with bound
  ``d``; ``failures``/``rejoin``: fault injection, as for :class:`~hetpipe_jax.core.engine.Engine`;
  ``options``: the network's and the run length's models (:class:`~hetpipe_jax.sim.options.SimOptions`;
  ``fast`` is :func:`simulate_fast`'s, which a caller picks: :func:`run`)."""

  cluster: Cluster
  profiles: Sequence[UnitProfile]
  layout: Layout
  d: int
  waves: int
  placement: str = "default"
  schedule: str = "1f1b"
  weight_mode: str = "stash"
  precision: str = "fp32"
  options: SimOptions = SimOptions()
  failures: Mapping[int, Sequence[int]] | None = None
  rejoin: bool = False
  control: Control = PER_MINIBATCH


def meta_line(job: SimJob, meta: Mapping[str, Any] | None = None, version: int = 1) -> dict[str, Any]:
  """The trace's meta line of ``job`` (``meta`` adds or overrides fields: what the run layer records)."""
  opts = job.options
  own = {"placement": job.placement, **({"overlap_transfers": True} if opts.overlap_transfers else {}),
         **({"staged_ps": True} if opts.staged_ps else {}), **({"noise": opts.noise} if opts.noise != "none" else {})}
  return meta_event(job.layout.meta(), job.d, job.weight_mode, job.schedule, "sim", len(job.profiles), version,
                    job.control, **{**own, **(meta or {})})


def simulate(job: SimJob, trace: Trace, meta: Mapping[str, Any] | None = None, steady: Watch | None = None,
             simulator: Simulator | None = None) -> tuple[float, list[VirtualWorker], list[dict]]:
  """Simulates ``job`` (``steady``: told of every push, no minibatch is injected once it says ``settled``: fast
  mode's :class:`~hetpipe_jax.sim.steady.SteadyState`, or a re-planning run's watch; ``simulator``: the network
  to run on, for a run that continues another one, else a new one with ``job``'s options).

  Writes the trace's meta line first (:func:`meta_line`). Returns (simulated seconds, the virtual workers,
  one metrics row per pushed wave).
  """
  cluster, profiles, layout = job.cluster, job.profiles, job.layout
  nms = layout.nms
  trace.emit(**meta_line(job, meta, trace.version))
  shard_nodes = place_shards(cluster, profiles, layout, job.placement)
  vws = virtual_workers(layout.vws, job.waves, job.schedule, job.weight_mode, control=job.control)
  rows: list[dict] = []

  def on_wave(vw: int, wave: int, t: float, _) -> None:
    rows.append({"vw": vw, "wave": wave, "step": (wave + 1) * nms[vw], "time": t, "train_loss": None})
    if steady is not None:
      steady.push(vw, t)

  simulator = simulator or Simulator(cluster, job.options.overlap_transfers, realise(job.options.noise, cluster))
  comm = SimComm(simulator, profiles, layout, shard_nodes, job.precision, job.options.staged_ps)
  engine = Engine(vws, ClockServer(layout.num_vws, job.d, num_shards=len(profiles)), trace, on_wave=on_wave,
                  comm=comm, failures=job.failures, rejoin=job.rejoin)
  seconds = simulator.run(engine, CostModel(cluster, profiles, layout, job.precision),
                          stop=None if steady is None else steady.settled)
  return seconds, vws, rows


def simulate_fast(job: SimJob, trace: Trace,
                  meta: Mapping[str, Any] | None = None) -> tuple[float, list[VirtualWorker], list[dict], dict]:
  """:func:`simulate`'s fast mode (:mod:`hetpipe_jax.sim.steady`): the seconds of a ``job.waves``-wave run,
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
  meta = {**(meta or {}), "sim_fast": True}
  waves, num_vws = job.waves, job.layout.num_vws
  scratch = trace.scratch()
  steady = SteadyState(num_vws, waves)
  seconds, vws, rows = simulate(job, scratch, meta, steady)
  if steady.stopped_at is None or steady.tail_waves() <= 1:
    trace.adopt(scratch)
    if steady.stopped_at is None:  # never settled: simulated to the end
      return seconds, vws, rows, {"method": "full", "simulated_waves": [waves] * num_vws}
    return max(steady.ends()), vws, rows, {"method": "extrapolated",
                                           "simulated_waves": [vw.total_mbs // vw.nm for vw in vws]}
  short = max(steady.stopped_at) + steady.tail_waves() + 2 * steady.max_cycle
  if short >= waves:
    seconds, vws, rows = simulate(job, trace, meta)
    return seconds, vws, rows, {"method": "full", "simulated_waves": [waves] * num_vws}
  seconds, vws, rows = simulate(job._replace(waves=short), trace, meta)
  return (seconds + (waves - short) * steady.period(), vws, rows,
          {"method": "tail", "simulated_waves": [short] * num_vws})


def run(job: SimJob, trace: Trace,
        meta: Mapping[str, Any] | None = None) -> tuple[float, list[VirtualWorker], list[dict], dict | None]:
  """:func:`simulate_fast` when ``job.options.fast``, else :func:`simulate` (its fast-mode info None)."""
  if job.options.fast:
    return simulate_fast(job, trace, meta)
  return (*simulate(job, trace, meta), None)
