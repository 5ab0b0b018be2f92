"""Local SGD / DiLoCo: H local steps per worker, then an all-reduce of the weight change and an outer Nesterov
step (:mod:`hetpipe_jax.baselines.local_sgd`)."""

from __future__ import annotations

import itertools
from collections.abc import Sequence

from hetpipe_jax.baselines.knobs import PeerKnobs
from hetpipe_jax.baselines.local_sgd import local_sgd_job
from hetpipe_jax.cluster import Cluster
from hetpipe_jax.systems.base import DEFAULT_KNOBS, LOCAL, SystemRun, span
from hetpipe_jax.systems.peer import Peer

LOCAL_STEPS = (2, 4, 8, 16)  # the tuner's grid of H


class LocalSGD(Peer):
  """The outer learning rate and momentum change no time: the tuner keeps their defaults (DiLoCo's 0.7 and 0.9); the
  convergence study searches the outer rate (:attr:`outer_lr_knob`)."""

  name = "local_sgd"
  summary = "H local steps per worker, then an all-reduce of the weight change and an outer Nesterov step (DiLoCo)"
  kind = LOCAL
  outer_lr_knob = "outer_lr"
  build = local_sgd_job

  def grid(self, cluster: Cluster, batch_size: int, policies: Sequence[str]) -> list[PeerKnobs]:
    """H in 2, 4, 8, 16 x H sized to speed or not x GPU workers, or pipeline workers of each policy."""
    workers = [("gpu", DEFAULT_KNOBS.policy)] + [("vw", p) for p in policies]
    return [DEFAULT_KNOBS._replace(local_steps=h, h_by_speed=s, local_workers=w, policy=p)
            for (w, p), h, s in itertools.product(workers, LOCAL_STEPS, (False, True))]

  def update_examples(self, run: SystemRun) -> int:
    """A worker's local step (the largest)."""
    return max(run.batch_sizes)

  def label(self, knobs: PeerKnobs, update_examples: int) -> str:
    workers = "GPU workers" if knobs.local_workers == "gpu" else f"{knobs.policy} pipeline workers"
    return f"{self.name} H={knobs.local_steps}{' by speed' if knobs.h_by_speed else ''}, {workers}"

  def config(self, run: SystemRun) -> str:
    meta = run.meta
    return f"{meta['local_workers']} workers, H {span(meta['local_steps'])}, batch {meta['batch_size']}"

