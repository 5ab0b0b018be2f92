"""A configuration the tuner considers (:class:`Candidate`) and its modelled rate under WSP."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from hetpipe_jax.cluster import Cluster
from hetpipe_jax.cost.profile import UnitProfile
from hetpipe_jax.plan.layout import Layout
from hetpipe_jax.plan.vw_plan import VWPlan
from hetpipe_jax.sim import SimJob, SimOptions


@dataclasses.dataclass(frozen=True)
class Candidate:
  """One configuration: virtual workers (GPU order, cuts, Nm), D, placement, the simulator's transfer
  models (``sim``: overlapped stage-to-stage transfers, staged PS transfers)."""

  grouping: str
  nm_rule: str
  plans: tuple[VWPlan, ...]
  d: int = 0
  placement: str = "default"
  sim: SimOptions = SimOptions()

  @property
  def layout(self) -> Layout:
    return Layout(tuple(p.layout for p in self.plans))

  @property
  def label(self) -> str:
    transfers = "overlapped" if self.sim.overlap_transfers else "serial"
    windows = self.layout.windows
    window = "" if windows is None else f" window {windows}"
    return (f"{self.grouping}, Nm {self.nm_rule} {[p.nm for p in self.plans]}{window}, D={self.d}, "
            f"{self.placement} placement, {transfers} transfers{', staged PS' if self.sim.staged_ps else ''}")

  def job(self, cluster: Cluster, profiles: Sequence[UnitProfile], waves: int, **kw: Any) -> SimJob:
    """This configuration as a simulation of ``waves`` waves (``kw``: :class:`SimJob`'s other fields,
    ``placement`` included to simulate it elsewhere)."""
    return SimJob(cluster, profiles, self.layout, self.d, waves, **{"placement": self.placement, **kw},
                  options=self.sim)

  def modelled_images_per_sec(self, batch_size: int) -> float:
    """The plan's rate under WSP: every virtual worker runs waves at the slowest one's wave rate."""
    return modelled_images_per_sec(self.plans, batch_size)


def modelled_images_per_sec(plans: Sequence[VWPlan], batch_size: int) -> float:
  """``batch x sum_i Nm_i x min_i (T_i / Nm_i)``: the planned rate once WSP holds every virtual worker to
  the slowest wave rate (T_i: virtual worker i's modelled minibatches per second)."""
  waves_per_s = min(p.throughput / p.nm for p in plans)
  return batch_size * waves_per_s * sum(p.nm for p in plans)
