"""Boundary transfers between pipeline stages, and a stage's time (docs/PROTOCOL.md section 4).

The one definition of what a stage receives and how long that takes, for the partitioner's DP, the
plans' stage times and the cost model of the virtual clock and the simulator:

* The tensor at cut position ``c`` (between units ``c - 1`` and ``c``) is unit ``c - 1``'s output
  activation; its gradient, sent back, has the same size. Nothing crosses at ``c = 0`` or
  ``c = num_units``: only empty stages sit beyond them.
* Stage j receives, before a forward pass, the activation at its first cut from stage j - 1, and before
  a backward pass, the gradient at its last cut from stage j + 1 (none for the first / last stage).
* Receiving ``b`` bytes from GPU ``src`` on GPU ``dst`` takes ``latency + b / bandwidth`` of the link
  between them (:meth:`hetpipe_jax.cluster.Cluster.link`), and nothing when they are the same GPU. This
  is the time alone on the link; the simulator adds contention.

Precision (:mod:`hetpipe_jax.precision`): in fp16/bf16 the boundary activations and their gradients
travel in 16 bits, so a receive moves the profile's fp32 ``out_bytes`` x
:func:`~hetpipe_jax.precision.byte_scale`. (The simulator's pushes and pulls to the parameter server
scale too: :class:`hetpipe_jax.sim.network.SimComm`.)

Stage time = the roofline compute of its units (:mod:`hetpipe_jax.cost.roofline`) + its receives.
O(1) per transfer, O(units) per stage; :func:`receive_seconds_by_position` is O(units) per GPU pair.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, NamedTuple

import numpy as np

from hetpipe_jax.cluster import Cluster, Gpu, Link
from hetpipe_jax.cost.roofline import stage_compute_seconds
from hetpipe_jax.precision import byte_scale

if TYPE_CHECKING:
  from hetpipe_jax.cost.unit import UnitProfile


class Receive(NamedTuple):
  """A boundary tensor a stage receives before it computes: its size and the GPU that sends it."""

  num_bytes: int
  src: Gpu


def link_seconds(link: Link, num_bytes):
  """Seconds to move ``num_bytes`` over ``link`` alone: latency + bytes / bandwidth.

  Args:
    link: the link.
    num_bytes: bytes (a number or a numpy array).

  Returns:
    Seconds, of the shape of ``num_bytes``.
  """
  return link.latency_s + num_bytes / link.bytes_per_s


def transfer_seconds(cluster: Cluster, src: Gpu, dst: Gpu, num_bytes: float) -> float:
  """Seconds to move ``num_bytes`` from ``src`` to ``dst`` alone on their link; 0 on the same GPU.

  Args:
    cluster: the cluster (which link joins the two GPUs).
    src / dst: the sending and the receiving GPU.
    num_bytes: bytes.

  Returns:
    Seconds.
  """
  return 0.0 if src.index == dst.index else link_seconds(cluster.link(src, dst), num_bytes)


def ring_allreduce_seconds(p: int, num_bytes: float, link: Link) -> float:
  """Seconds of a ring all-reduce of ``num_bytes`` over ``p`` participants joined by ``link``, alone on it:
  2 (p - 1) steps that each move ``num_bytes / p`` between neighbours (Patarasuk and Yuan, "Bandwidth optimal
  all-reduce algorithms for clusters of workstations", JPDC 2009); 0 for one participant."""
  if p <= 1:
    return 0.0
  return 2 * (p - 1) * link.latency_s + 2 * (p - 1) / p * num_bytes / link.bytes_per_s


def allreduce_seconds(cluster: Cluster, gpus: Sequence[Gpu], num_bytes: float) -> float:
  """Seconds of a ring all-reduce of ``num_bytes`` over ``gpus`` (of one node) alone on their links
  (:func:`ring_allreduce_seconds`)."""
  return 0.0 if len(gpus) == 1 else ring_allreduce_seconds(len(gpus), num_bytes, cluster.link(gpus[0], gpus[1]))


def stage_allreduce_seconds(cluster: Cluster, units: Sequence[UnitProfile],
                            precision: str = "fp32") -> tuple[float, float]:
  """(forward, backward) seconds of the all-reduces of a stage's ``units``, each split over its profile's degree
  of GPUs of one node by tensor parallelism (:func:`split_allreduce_seconds`, summed)."""
  fwd, bwd = zip(*(split_allreduce_seconds(cluster, u, precision) for u in units)) if units else ((), ())
  return sum(fwd), sum(bwd)


def stage_allreduce_flows(cluster: Cluster, units: Sequence[UnitProfile],
                          precision: str = "fp32") -> tuple[tuple[float, float], tuple[float, float]]:
  """(forward, backward) all-reduces of a stage's split ``units`` as the simulator's network carries them: each
  (bytes every GPU of the stage sends on its node's link, seconds of their steps' latencies), the ring's 2 (p - 1)
  steps of 1/p of each all-reduce's bytes summed (:func:`ring_allreduce_seconds`: alone on the link, latency +
  bytes / bandwidth is :func:`stage_allreduce_seconds`); (0, 0) for units on one GPU."""
  link, scale = cluster.intra_node, byte_scale(precision)

  def flow(kind: str) -> tuple[float, float]:
    num_bytes = latency = 0.0
    for u in units:
      n, size = u.allreduce_bytes(kind)
      if n and u.degree > 1:
        num_bytes += n * 2 * (u.degree - 1) / u.degree * size * scale
        latency += n * 2 * (u.degree - 1) * link.latency_s
    return num_bytes, latency
  return flow("fwd"), flow("bwd")


def split_allreduce_seconds(cluster: Cluster, unit: UnitProfile, precision: str = "fp32") -> tuple[float, float]:
  """(forward, backward) seconds of the all-reduces of one ``unit`` split over its profile's degree of GPUs of one
  node (:meth:`hetpipe_jax.cost.unit.UnitProfile.allreduce_bytes`, at the activations' ``precision``), each a
  ring on the cluster's link inside a node (:func:`ring_allreduce_seconds`)."""
  def seconds(kind: str) -> float:
    n, num_bytes = unit.allreduce_bytes(kind)
    return n * ring_allreduce_seconds(unit.degree, num_bytes * byte_scale(precision), cluster.intra_node) if n else 0.0
  return seconds("fwd"), seconds("bwd")


def boundary_receive(profiles: Sequence[UnitProfile], position: int, src: Gpu | None,
                     precision: str = "fp32") -> Receive | None:
  """What crosses cut ``position`` from ``src``: unit ``position - 1``'s output, or None.

  Args:
    profiles: per-unit profiles of the model.
    position: a cut position, 0 .. number of units.
    src: the neighbouring stage's GPU, or None where the stage has no neighbour on that side.
    precision: the activations' precision (their bytes: the fp32 profile's x its byte scale).

  Returns:
    The receive, or None at positions 0 and ``len(profiles)`` and without a neighbour.
  """
  if src is None or not 0 < position < len(profiles):
    return None
  return Receive(int(profiles[position - 1].out_bytes * byte_scale(precision)), src)


def stage_neighbours(gpus: Sequence[Gpu], j: int) -> tuple[Gpu | None, Gpu | None]:
  """The GPUs stage j receives from: (stage j - 1's, before a forward pass; stage j + 1's, before a
  backward pass), None for the first / last stage.

  Args:
    gpus: the virtual worker's GPUs in pipeline order.
    j: the stage.

  Returns:
    (previous GPU or None, next GPU or None).
  """
  return gpus[j - 1] if j > 0 else None, gpus[j + 1] if j + 1 < len(gpus) else None


def stage_transfers(profiles: Sequence[UnitProfile], cut: Sequence[int], gpus: Sequence[Gpu],
                    j: int, precision: str = "fp32") -> tuple[Receive | None, Receive | None]:
  """What stage j receives: (before a forward pass, before a backward pass).

  Args:
    profiles: per-unit profiles of the model.
    cut: the virtual worker's cut positions ``(0, ..., num_units)``.
    gpus: the virtual worker's GPUs in pipeline order.
    j: the stage.
    precision: the activations' precision (see :func:`boundary_receive`).

  Returns:
    The activation at ``cut[j]`` from stage j - 1 and the gradient at ``cut[j + 1]`` from stage j + 1,
    each a :class:`Receive` ``(num_bytes, src)`` or None where nothing crosses.
  """
  prev, nxt = stage_neighbours(gpus, j)
  return (boundary_receive(profiles, cut[j], prev, precision),
          boundary_receive(profiles, cut[j + 1], nxt, precision))


def receive_seconds(cluster: Cluster, receive: Receive | None, dst: Gpu) -> float:
  """Seconds for ``dst`` to receive ``receive`` alone on the link; 0 for None.

  Args:
    cluster: the cluster.
    receive: a boundary tensor, or None.
    dst: the receiving GPU.

  Returns:
    Seconds.
  """
  return 0.0 if receive is None else transfer_seconds(cluster, receive.src, dst, receive.num_bytes)


def receive_seconds_by_position(cluster: Cluster, profiles: Sequence[UnitProfile], src: Gpu | None,
                                dst: Gpu, precision: str = "fp32") -> np.ndarray:
  """:func:`receive_seconds` at every cut position: the partitioner's vectorised form.

  Args:
    cluster: the cluster.
    profiles: per-unit profiles of the model.
    src: the neighbouring stage's GPU, or None.
    dst: the receiving GPU.
    precision: the activations' precision (see :func:`boundary_receive`).

  Returns:
    An array of ``len(profiles) + 1`` seconds, entry c for a boundary at cut position c.
  """
  return np.array([receive_seconds(cluster, boundary_receive(profiles, c, src, precision), dst)
                   for c in range(len(profiles) + 1)], np.float64)


def stage_seconds(cluster: Cluster, profiles: Sequence[UnitProfile], cut: Sequence[int],
                  gpus: Sequence[Gpu], j: int, precision: str = "fp32") -> tuple[float, float]:
  """The time of stage j per minibatch: its units on its GPU plus receiving its boundary tensors.

  Args:
    cluster: the cluster.
    profiles: per-unit profiles of the model.
    cut: the virtual worker's cut positions.
    gpus: the virtual worker's GPUs in pipeline order.
    j: the stage.
    precision: "fp32", "fp16" or "bf16" (the roofline's peak and bytes, the boundary tensors' bytes).

  Returns:
    (forward, backward) seconds: compute plus the activation received before the forward pass, compute
    plus the gradient received before the backward pass, each alone on its link.
  """
  return with_receives(cluster, stage_compute_seconds(profiles, cut, gpus[j], j, precision),
                       stage_transfers(profiles, cut, gpus, j, precision), gpus[j])


def with_receives(cluster: Cluster, compute: tuple[float, float], receives: tuple[Receive | None, Receive | None],
                  dst: Gpu) -> tuple[float, float]:
  """(forward, backward) ``compute`` seconds plus receiving each pass's input (``receives``, of
  :func:`stage_transfers`) alone on its link to ``dst``: :func:`stage_seconds` from its parts."""
  return (compute[0] + receive_seconds(cluster, receives[0], dst),
          compute[1] + receive_seconds(cluster, receives[1], dst))
