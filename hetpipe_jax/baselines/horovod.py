"""Horovod-style synchronous data parallelism: on the simulator's network (:func:`horovod_job`, the peer of
``experiments.baseline --system=horovod``), and as the closed-form cost model below (docs/PROTOCOL.md
section 5), which the simulated one equals where no flows contend (tested).

Every GPU holds the whole model and trains its own minibatch; gradients are summed with ring all-reduce
every step. The baseline runs on the GPUs that hold the whole model
(:func:`hetpipe_jax.plan.allocation.horovod_gpus`). One iteration on GPUs G:

  T = max_{g in G} (forward + backward of the whole model on g's type) + T_allreduce(S)

for S = the model's parameter bytes. Ring all-reduce over p GPUs on one kind of link (bandwidth B,
latency a) moves 2 (p-1)/p S bytes per GPU in 2 (p-1) steps:

  T_ring(p, S, link) = 2 (p-1) a + 2 (p-1)/p * S / B

Across nodes it is hierarchical (NCCL/Horovod's hierarchical all-reduce): a ring reduce-scatter inside
each node (g = most GPUs of one node), then g rings at once, one per shard of S/g bytes, all-reduce
across the n nodes, then a ring all-gather inside each node. The g concurrent rings share each node's
network link (as the simulator shares a node's egress among its flows), so each moves at B_inter / g:

  T = 2 (g-1) a_intra + 2 (g-1)/g * S / B_intra + 2 (n-1) a_inter + 2 (n-1)/n * (S/g) / (B_inter/g)
    = T_ring(g, S, intra-node link) + T_ring(n, S, inter-node link)

(Until issue 11 the cross-node phase was T_ring(n, S/g, inter-node link): every ring as if it had the
node's whole link, g times too fast.)

In fp16/bf16 (mixed precision) the gradients are all-reduced in 16 bits: S x
:func:`~hetpipe_jax.precision.byte_scale`.

Throughput = |G| x batch / T images per second. O(units x GPUs) per iteration time.
"""

from __future__ import annotations

from collections.abc import Sequence

from hetpipe_jax.baselines.knobs import PeerKnobs
from hetpipe_jax.baselines.sync import SyncJob, equal_batch_job
from hetpipe_jax.cluster import Cluster, Gpu
from hetpipe_jax.cost.batch import BatchProfiles
from hetpipe_jax.cost.context import DEFAULT_COSTS, CostContext
from hetpipe_jax.cost.roofline import model_compute_seconds, unit_seconds
from hetpipe_jax.cost.transfer import ring_allreduce_seconds
from hetpipe_jax.cost.unit import UnitProfile
from hetpipe_jax.precision import byte_scale


def allreduce_seconds(cluster: Cluster, gpus: Sequence[Gpu], num_bytes: float) -> float:
  """All-reduce time over ``gpus``: a flat ring inside one node, hierarchical across nodes.

  Args:
    cluster: the cluster (links).
    gpus: the participants.
    num_bytes: bytes each holds.

  Returns:
    Seconds.
  """
  per_node: dict[int, int] = {}
  for g in gpus:
    per_node[g.node] = per_node.get(g.node, 0) + 1
  if len(per_node) == 1:
    return ring_allreduce_seconds(len(gpus), num_bytes, cluster.intra_node)
  g = max(per_node.values())
  intra = ring_allreduce_seconds(g, num_bytes, cluster.intra_node)  # reduce-scatter + all-gather
  # g rings of S/g bytes at once, sharing each node's link: as long as one ring of S on the whole link
  return intra + ring_allreduce_seconds(len(per_node), num_bytes, cluster.inter_node)


def horovod_iteration_seconds(cluster: Cluster, profiles: Sequence[UnitProfile], gpus: Sequence[Gpu],
                              precision: str = "fp32", overlap: bool = False) -> float:
  """One synchronous step: the slowest GPU's forward + backward, then the gradient all-reduce.

  With ``overlap`` the all-reduce overlaps the backward pass, as Horovod's background all-reduce does:
  a unit's gradient is all-reduced once every GPU has finished that unit's backward (last unit first),
  the all-reduces queue on the network one after another (each its own ring; no tensor fusion), and the
  step ends when the last is done (or the backward, if later). The fair baseline for a HetPipe run whose
  transfers overlap its computation.

  Args:
    cluster: the cluster.
    profiles: per-unit profiles of the model.
    gpus: the participating GPUs.
    precision: "fp32", "fp16" or "bf16" (the roofline, and the gradients' bytes).
    overlap: all-reduce each unit's gradient as soon as it is ready (else after the whole backward).

  Returns:
    Seconds per step.
  """
  types = {g.type.name: g.type for g in gpus}.values()
  compute = max(model_compute_seconds(profiles, t, precision) for t in types)
  scale = byte_scale(precision)  # the gradients' bytes per fp32 parameter byte
  if not overlap:
    return compute + allreduce_seconds(cluster, gpus, sum(u.param_bytes for u in profiles) * scale)
  times = {t.name: [unit_seconds(u, t, precision) for u in profiles] for t in types}
  clock = {name: sum(f for f, _ in ts) for name, ts in times.items()}  # every GPU's forward is done
  network = 0.0  # when the network is free
  for u in range(len(profiles) - 1, -1, -1):
    for name, ts in times.items():
      clock[name] += ts[u][1]
    if profiles[u].param_bytes:
      network = max(network, max(clock.values())) + allreduce_seconds(cluster, gpus,
                                                                      profiles[u].param_bytes * scale)
  return max(network, compute)


def horovod_images_per_second(cluster: Cluster, profiles: Sequence[UnitProfile], gpus: Sequence[Gpu],
                              batch_size: int, precision: str = "fp32", overlap: bool = False) -> float:
  """Throughput of the baseline: every GPU's minibatch per iteration.

  Args:
    cluster / profiles / gpus / precision / overlap: as for :func:`horovod_iteration_seconds`.
    batch_size: examples per GPU's minibatch.

  Returns:
    Images per second.
  """
  return len(gpus) * batch_size / horovod_iteration_seconds(cluster, profiles, gpus, precision, overlap)


def horovod_job(cluster: Cluster, profiles: BatchProfiles, batch_size: int, knobs: PeerKnobs,
                costs: CostContext = DEFAULT_COSTS) -> SyncJob:
  """Horovod on the simulator's network (:mod:`hetpipe_jax.baselines.sync`): every GPU that holds the whole
  model trains ``batch_size`` examples a step, the gradients are all-reduced in fusion buffers as the
  backward pass produces them (Horovod's background all-reduce), and the step ends when the last is done.

  What it assumes: equal batches (the paper's 2018 baseline); the GPUs that cannot hold the model at that
  batch sit out (:func:`hetpipe_jax.plan.allocation.horovod_gpus`); hierarchical ring all-reduce
  (:mod:`hetpipe_jax.baselines.collective`); Horovod's defaults of a 64 MiB fusion buffer and a 1 ms cycle
  (``knobs``).

  Raises:
    ConfigError: when no GPU holds the model.
  """
  return equal_batch_job("horovod", cluster, profiles, batch_size, knobs.sim_rounds, costs,
                         (("fusion_mb", knobs.fusion_mb),), overlap=True, fusion_bytes=knobs.fusion_bytes,
                         cycle_s=knobs.cycle_s)
