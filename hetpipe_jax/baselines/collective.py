"""Ring all-reduce as flows on the simulator's network (:class:`hetpipe_jax.sim.network.Simulator`).

The same links, the same sharing of a node's PCIe and network ports among concurrent flows, as the
``sim`` executor's HetPipe runs: a collective that runs beside other traffic (another collective, a
pipeline's activations) slows down with it, and nothing is a closed form where flows contend.

Participants G over n nodes, g = most of them on one node, S bytes each:

* one node (n = 1): a ring over the p GPUs, 2 (p - 1) steps (reduce-scatter, then all-gather), each moving
  S / p bytes from every GPU to its neighbour at once. The p copies of a step run on p different GPU
  links (a PCIe switch or NVLink, as NCCL rings use them), so a step is *one* flow of S / p bytes on the
  node's PCIe resource: alone on it, it lasts latency + S / (p B), the ring's textbook time; beside other
  flows it takes its share.
* several nodes: NCCL/Horovod's hierarchical all-reduce. A ring reduce-scatter inside each node
  (g_node - 1 steps of S / g_node), then g rings at once across the n nodes, one per shard of S / g bytes
  (2 (n - 1) steps; in each, every node sends g flows of S / (g n) bytes to the next node, sharing its
  network egress and the next node's ingress), then the all-gather inside each node.

A step starts when every flow of the previous one has landed (the ring's dependency); each flow pays the
link's latency, as the ``sim`` executor's flows do. Uncontended, the total equals the closed form of
:func:`hetpipe_jax.baselines.horovod.allreduce_seconds` (tested).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from hetpipe_jax.cluster import Gpu
from hetpipe_jax.sim.network import Simulator

Step = list[tuple[int, int, float]]  # the flows of one ring step: (from node, to node, bytes)


def ring_steps(gpus: Sequence[Gpu], num_bytes: float) -> list[Step]:
  """The steps of an all-reduce of ``num_bytes`` over ``gpus`` (see the module docstring).

  Args:
    gpus: the participants (distinct GPUs).
    num_bytes: bytes each holds.

  Returns:
    The flows of every step, in order; no step for fewer than two participants.
  """
  per_node: dict[int, int] = {}
  for g in gpus:
    per_node[g.node] = per_node.get(g.node, 0) + 1
  nodes = sorted(per_node)
  if len(gpus) <= 1 or num_bytes <= 0:
    return []
  if len(nodes) == 1:
    p, node = len(gpus), nodes[0]
    return [[(node, node, num_bytes / p)] for _ in range(2 * (p - 1))]
  g = max(per_node.values())
  intra = [[(node, node, num_bytes / per_node[node]) for node in nodes if per_node[node] - 1 > k]
           for k in range(g - 1)]
  n = len(nodes)
  inter = [[(node, nodes[(i + 1) % n], num_bytes / (g * n)) for i, node in enumerate(nodes) for _ in range(g)]
           for _ in range(2 * (n - 1))]
  return intra + inter + intra


def allreduce(sim: Simulator, gpus: Sequence[Gpu], num_bytes: float, done: Callable[[float], None]) -> None:
  """Starts an all-reduce of ``num_bytes`` over ``gpus`` now (``sim.t``); calls ``done(t)`` when it ends.

  Args:
    sim: the simulator whose links it uses.
    gpus: the participants.
    num_bytes: bytes each holds.
    done: called with the time the last flow of the last step landed (at once for one participant).
  """
  steps = ring_steps(gpus, num_bytes)

  def run(i: int, t: float) -> None:
    if i == len(steps):
      done(t)
      return
    left = [len(steps[i])]

    def landed(t_landed: float) -> None:
      left[0] -= 1
      if left[0] == 0:
        run(i + 1, t_landed)
    for src, dst, size in steps[i]:
      sim.send(src, dst, size, landed)

  run(0, sim.t)
