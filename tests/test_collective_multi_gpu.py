"""The hierarchical all-reduce over nodes of several GPUs (hetpipe_jax/baselines/collective.py) on the simulator's
shared links (hetpipe_jax/sim/network.py): across nodes it runs one ring per GPU of a node, so each node sends g
flows at once, and beside other traffic it takes g shares of a port, not one. Alone, g flows of S / (g n) take
as long as one of S / n; only contention tells them apart, so the times here are worked by hand with another
flow on the same port."""

import pytest

from hetpipe_jax.baselines.collective import allreduce, ring_steps
from hetpipe_jax.cluster import GpuType, Link, make_cluster
from hetpipe_jax.sim.network import Simulator

FAST = GpuType("fast", 1 << 36, 10e12, 10e12, 1e18, 1.0)
PCIE, NET = Link("pcie", 10e9, 1e-5), Link("net", 1e9, 1e-4)
S = 4e8  # bytes each GPU all-reduces


@pytest.mark.parametrize("g", [2, 4])
def test_across_nodes_every_gpu_of_a_node_sends_its_own_flow(g):
  cluster = make_cluster("2xg", [[FAST] * g] * 2, PCIE, NET)
  steps = ring_steps(list(cluster.gpus), S)
  intra, inter = steps[:g - 1] + steps[len(steps) - (g - 1):], steps[g - 1:len(steps) - (g - 1)]
  assert len(steps) == 2 * (g - 1) + 2  # reduce-scatter in each node, 2 (n - 1) ring steps, all-gather
  assert all(sorted(step) == [(0, 0, S / g), (1, 1, S / g)] for step in intra)
  for step in inter:  # g rings at once, one per shard of S / g: from each node g flows of S / (g n)
    assert sorted(step) == [(0, 1, S / (2 * g))] * g + [(1, 0, S / (2 * g))] * g, step


def test_an_allreduce_of_two_gpus_per_node_takes_two_shares_beside_another_flow():
  """Two nodes of two GPUs, all four all-reducing 400 MB, while node 0 sends node 1 a long flow (10 GB).

  By hand: inside each node, a reduce-scatter step of 200 MB over 10 GB/s PCIe (1e-5 + 0.02 s). Across, two
  ring steps; in each, node 0 sends 2 flows of 100 MB beside the long one: node 0's egress (and node 1's
  ingress) is shared 3 ways, 1/3 GB/s each, so 1e-4 + 0.3 s (node 1's 2 flows to node 0, at 0.5 GB/s each,
  land first). Then the all-gather as the reduce-scatter: 2 x 0.02001 + 2 x 0.3001 = 0.64022 s. (One flow per
  node of 200 MB would take half of node 0's port, 0.4 s a step: 0.84022 s.)
  """
  cluster = make_cluster("2x2", [[FAST, FAST], [FAST, FAST]], PCIE, NET)
  sim = Simulator(cluster)
  ends: list[float] = []
  allreduce(sim, list(cluster.gpus), S, ends.append)
  sim.send(0, 1, 10e9, lambda t: None)
  sim.drain()
  assert ends == [pytest.approx(2 * (1e-5 + 0.02) + 2 * (1e-4 + 0.3), rel=1e-9)]

