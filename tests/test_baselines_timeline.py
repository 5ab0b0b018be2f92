"""The Horovod cost model by hand, and trace timelines (Chrome trace JSON, Gantt PNG)."""

import json
import subprocess
import sys

import pytest

from hetpipe_jax.baselines.horovod import allreduce_seconds, horovod_iteration_seconds, ring_allreduce_seconds
from hetpipe_jax.cluster import GpuType, Link, make_cluster
from hetpipe_jax.cost.profile import UnitProfile
from hetpipe_jax.viz.timeline import chrome_trace

from helpers import schedule_only

FAST = GpuType("fast", 1 << 33, 10e12, 10e12, 1e15, 1.0)
SLOW = GpuType("slow", 1 << 33, 5e12, 5e12, 1e15, 1.0)
PCIE, NET = Link("pcie", 10e9, 1e-5), Link("net", 1e9, 1e-4)


def test_horovod_on_two_gpus_by_hand():
  cluster = make_cluster("two", [[FAST, SLOW]], PCIE, NET)
  units = [UnitProfile("u", 1e12, 2e12, 0, 0, 400_000_000, 0, 0)]  # 3 Tflop per step, 400 MB of weights
  # slowest GPU: 3e12 / 5e12 = 0.6 s; ring over 2: 2 * 1 * 1e-5 + 2 * 1/2 * 4e8 / 1e10 = 0.04002 s
  assert ring_allreduce_seconds(2, 4e8, PCIE) == pytest.approx(0.04002)
  assert horovod_iteration_seconds(cluster, units, list(cluster.gpus)) == pytest.approx(0.64002)


def test_horovod_overlaps_allreduce_with_backward_by_hand():
  cluster = make_cluster("two", [[FAST, SLOW]], PCIE, NET)
  units = [UnitProfile("a", 1e12, 2e12, 0, 0, 400_000_000, 0, 0),
           UnitProfile("b", 0.5e12, 1e12, 0, 0, 200_000_000, 0, 0)]
  # on the slow GPU: forward 0.2 + 0.1 = 0.3 s; b's backward ends at 0.5 s, its all-reduce takes
  # 2e-5 + 2e8 / 1e10 = 0.02002 s (network free at 0.52002); a's backward ends at 0.9 s, its all-reduce
  # 2e-5 + 4e8 / 1e10 = 0.04002 s: the step ends at 0.94002 s (in series: 0.9 + 0.06002)
  gpus = list(cluster.gpus)
  assert horovod_iteration_seconds(cluster, units, gpus, overlap=True) == pytest.approx(0.94002)
  assert horovod_iteration_seconds(cluster, units, gpus) == pytest.approx(0.96002)


def test_allreduce_is_hierarchical_across_nodes():
  cluster = make_cluster("2x2", [[FAST, FAST], [FAST, FAST]], PCIE, NET)
  s = 4e8
  # inside a node: 2 * 1e-5 + 1 * 4e8 / 1e10 = 0.04002; across 2 nodes: 2 rings of s/2 at once, sharing
  # each node's 1 GB/s link (0.5 GB/s each): 2 * 1e-4 + 2 * 1/2 * 2e8 / 0.5e9 = 0.4002
  assert allreduce_seconds(cluster, list(cluster.gpus), s) == pytest.approx(0.04002 + 0.4002)
  assert allreduce_seconds(cluster, list(cluster.gpus[:2]), s) == pytest.approx(0.04002)
  assert allreduce_seconds(cluster, list(cluster.gpus[:1]), s) == 0.0


def simulated_cross_node_seconds(cluster, g: int, num_bytes: float) -> float:
  """The cross-node phase of the hierarchical all-reduce on the simulator's shared links: g rings at once
  (one per shard of num_bytes / g), each 2 (n - 1) steps in which every node sends its ring neighbour a
  chunk of num_bytes / g / n; a step ends when its last chunk lands."""
  from hetpipe_jax.sim.network import Simulator

  sim = Simulator(cluster)
  nodes = sorted({gpu.node for gpu in cluster.gpus})
  n, state = len(nodes), {"step": 0, "pending": 0}

  def step(t: float) -> None:
    del t
    if state["step"] == 2 * (n - 1):
      return
    state["step"] += 1
    state["pending"] = n * g
    for i, node in enumerate(nodes):
      for _ in range(g):
        sim.send(node, nodes[(i + 1) % n], num_bytes / g / n, landed)

  def landed(t: float) -> None:
    state["pending"] -= 1
    if state["pending"] == 0:
      step(t)

  class Idle:  # no tasks: the simulator only moves the flows
    done = True
    vws = ()  # (no virtual workers)

    def begin(self, t):
      del t

    def startable(self, allow=None):
      del allow
      return []

  sim.at(0.0, step)
  return sim.run(Idle(), None)  # type: ignore[arg-type]


@pytest.mark.parametrize("nodes,g", [(2, 2), (4, 4), (3, 2)])
def test_the_baselines_cross_node_phase_agrees_with_the_simulator(nodes, g):
  """The cost model's cross-node phase = the same rings moved as flows over the simulator's links."""
  cluster = make_cluster("net", [[FAST] * g] * nodes, PCIE, NET)
  s = 4e8
  formula = allreduce_seconds(cluster, list(cluster.gpus), s) - ring_allreduce_seconds(g, s, PCIE)
  assert simulated_cross_node_seconds(cluster, g, s) == pytest.approx(formula, rel=1e-9)


def test_timeline_exports(tmp_path):
  events = schedule_only([2, 2], [2, 2], d=0, waves=4, slowdown=(1, 3))
  doc = chrome_trace(events)
  tasks = [e for e in doc["traceEvents"] if e.get("ph") == "X" and e["cat"] in ("fwd", "bwd")]
  assert len(tasks) == sum(e["ev"] in ("fwd", "bwd") for e in events)
  assert any(e.get("cat") == "wait" for e in doc["traceEvents"])  # VW 0 waited at the gate
  assert {e["name"] for e in tasks if e["pid"] == 0 and e["tid"] == 1} >= {"F1", "B1"}
  path = tmp_path / "t.jsonl"
  path.write_text("".join(json.dumps(e) + "\n" for e in events))
  proc = subprocess.run([sys.executable, "-m", "hetpipe_jax.timeline", str(path), "2"], capture_output=True,
                        text=True, timeout=120)
  assert proc.returncode == 0, proc.stderr
  assert (tmp_path / "t.gantt.png").stat().st_size > 10_000
  assert json.loads((tmp_path / "t.chrome.json").read_text())["traceEvents"]
