"""The tuner's simulations: one candidate on the ``sim`` executor (:func:`simulate_candidate`), and many at
once on a process pool (:class:`Simulations`)."""

from __future__ import annotations

import concurrent.futures
import dataclasses
import multiprocessing
import os
from collections.abc import Iterable, Iterator, Sequence

from hetpipe_jax.cluster import Cluster
from hetpipe_jax.core.check import check_trace
from hetpipe_jax.core.trace import Trace
from hetpipe_jax.cost.profile import UnitProfile
from hetpipe_jax.errors import ProtocolError
from hetpipe_jax.sim import simulate_fast
from hetpipe_jax.staleness import mean_staleness
from hetpipe_jax.tune.candidate import Candidate
from hetpipe_jax.tune.options import RunSetting
from hetpipe_jax.tune.result import Result

Job = tuple[Candidate, int]  # a candidate and the waves it runs


@dataclasses.dataclass(frozen=True)
class SimContext:
  """What every simulation of one search shares: the cluster, the model's profiles, the batch size and the
  run setting (a pool's processes each receive it once)."""

  cluster: Cluster
  profiles: Sequence[UnitProfile]
  batch_size: int
  setting: RunSetting = RunSetting()


def simulate_candidate(context: SimContext, candidate: Candidate, waves: int) -> tuple[float, float]:
  """Images per second of ``candidate`` on the ``sim`` executor over ``waves`` waves (as a run's
  ``images_per_second``), simulated in the fast mode (:mod:`hetpipe_jax.sim.steady`: until the waves
  repeat, then extrapolated), and the mean staleness of its simulated trace.

  Raises:
    ProtocolError: when the trace breaks a WSP guarantee.
  """
  s = context.setting
  trace = Trace()
  seconds, _, _, _ = simulate_fast(candidate.job(context.cluster, context.profiles, waves, schedule=s.schedule,
                                                 weight_mode=s.costs.weight_mode, precision=s.costs.precision,
                                                 control=s.costs.control), trace)
  violations = check_trace(trace.events)
  if violations:
    raise ProtocolError(f"tuner candidate {candidate.label}: {violations[0]}")
  return context.batch_size * waves * sum(candidate.layout.nms) / seconds, mean_staleness(trace.events)


class _PoolProcess:
  """A pool process's own state: the context its pool installed when the process started (a spawned
  process runs the pool's initializer, then the jobs it is sent, each of which needs the context)."""

  context: SimContext | None = None

  @classmethod
  def install(cls, context: SimContext) -> None:
    cls.context = context

  @classmethod
  def simulate(cls, job: Job) -> tuple[float, float]:
    if cls.context is None:
      raise RuntimeError("a tuner pool process ran a job before its pool installed the context")
    return simulate_candidate(cls.context, *job)


class Simulations:
  """The tuner's simulations, on ``workers`` processes (None: one per CPU core) when more than one:
  each a deterministic function of its candidate, so the results do not depend on how many run at once."""

  def __init__(self, workers: int | None, context: SimContext, ideal: float):
    self.workers = (os.cpu_count() or 1) if workers is None else workers
    self.context, self.ideal = context, ideal
    self.pool: concurrent.futures.ProcessPoolExecutor | None = None

  def __enter__(self) -> Simulations:
    if self.workers > 1:
      self.pool = concurrent.futures.ProcessPoolExecutor(
          self.workers, mp_context=multiprocessing.get_context("spawn"), initializer=_PoolProcess.install,
          initargs=(self.context,))
    return self

  def __exit__(self, *exc: object) -> None:
    if self.pool is not None:
      self.pool.shutdown(cancel_futures=True)

  def run(self, jobs: list[Job]) -> Iterator[Result]:
    """The results of ``jobs`` (candidate, waves) in order, each as soon as it and those before it are in."""
    if self.pool is None or len(jobs) < 2:
      outs: Iterable[tuple[float, float]] = (simulate_candidate(self.context, *job) for job in jobs)
    else:
      outs = self.pool.map(_PoolProcess.simulate, jobs)
    return (Result(c, ips, self.ideal, w, staleness) for (c, w), (ips, staleness) in zip(jobs, outs))
