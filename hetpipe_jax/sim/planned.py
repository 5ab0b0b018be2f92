"""A plan's images/s as the ``sim`` executor measures it: the figure the planner prints.

The planner's own figure (:attr:`~hetpipe_jax.plan.allocation.ClusterPlan.throughput`) adds up every virtual
worker's pipeline rate alone, each on its own links: a bound. Under WSP every virtual worker moves, in
the long run, at the slowest one's wave rate (docs/PROTOCOL.md section 3.7), and virtual workers share
links and the parameter server: the simulator runs the plan's layout with all of that.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

from hetpipe_jax.cluster import Cluster
from hetpipe_jax.core.trace import Trace
from hetpipe_jax.cost.unit import UnitProfile
from hetpipe_jax.plan.allocation import ClusterPlan
from hetpipe_jax.sim.options import SimOptions
from hetpipe_jax.sim.simulate import SimJob, simulate_fast

WAVES = 100  # long enough that the fill transient is a small part (fast mode simulates until settled)


class SimulatedPlan(NamedTuple):
  """What the simulator measured of a plan: ``images_per_s`` of the cluster and of each virtual worker over
  a run of ``waves`` waves each under WSP with bound ``d``, lasting ``seconds`` (simulated)."""

  images_per_s: float
  vw_images_per_s: tuple[float, ...]
  seconds: float
  waves: int
  d: int

  def to_json(self) -> dict:
    return {"images_per_s": self.images_per_s, "vw_images_per_s": list(self.vw_images_per_s),
            "seconds": self.seconds, "waves": self.waves, "d": self.d}


def simulate_plan(cluster: Cluster, profiles: Sequence[UnitProfile], plan: ClusterPlan, batch_size: int, *,
                  d: int = 1, waves: int = WAVES, weight_mode: str = "stash", schedule: str = "1f1b",
                  precision: str = "fp32") -> SimulatedPlan:
  """Simulates ``plan`` (its layout and PS placement) in fast mode (:mod:`hetpipe_jax.sim.steady`).

  Args:
    cluster / profiles: what the plan was made for.
    plan: the plan.
    batch_size: examples per minibatch.
    d / waves / weight_mode / schedule / precision: the run's (``d``: the WSP bound; the long-run rate does
      not depend on it, the fill transient does).

  Returns:
    A :class:`SimulatedPlan`.
  """
  job = SimJob(cluster, profiles, plan.layout, d, waves, plan.placement, schedule, weight_mode, precision,
               SimOptions(fast=True))
  seconds, _, _, _ = simulate_fast(job, Trace(None, keep=False))
  vw_images = tuple(waves * nm * batch_size / seconds for nm in plan.layout.nms)
  return SimulatedPlan(sum(vw_images), vw_images, seconds, waves, d)
