"""The sim executor: the engine without numerics on the cost model, links shared by concurrent flows."""

import numpy as np
import pytest

from hetpipe_jax import RunConfig, get_model, run_hetpipe, synthetic
from hetpipe_jax.cluster import GpuType, Link, make_cluster
from hetpipe_jax.core.trace import Trace
from hetpipe_jax.cost.profile import UnitProfile
from hetpipe_jax.cost.transfer import stage_seconds
from hetpipe_jax.plan.layout import Layout, VWLayout
from hetpipe_jax.sim import SimJob, SimOptions, Simulator, simulate

from helpers import assert_trace_ok

GPU = GpuType("g", 1 << 34, 1e12, 1e12, 1e15, 1.0)
SLOW = GpuType("slow", 1 << 34, 0.5e12, 0.5e12, 1e15, 1.0)
PCIE, NET = Link("pcie", 1e10, 1e-6), Link("net", 1e9, 2e-6)


def units(n, act_bytes=8, param_bytes=1024):
  # 0.1 s forward and 0.2 s backward per unit on GPU; tiny tensors so links add microseconds
  return [UnitProfile(f"u{i}", 1e11, 2e11, 0, 0, param_bytes, act_bytes, 0) for i in range(n)]


def run(cluster, profiles, groups, cuts, nms, d, waves):
  trace = Trace()
  layout = Layout(tuple(VWLayout(tuple(g), tuple(c), nm) for g, c, nm in zip(groups, cuts, nms)))
  seconds, vws, rows = simulate(SimJob(cluster, profiles, layout, d, waves), trace)
  return trace.events, seconds, rows


def steady_rate(events, vw=0, skip=20):
  done = [e["t"] for e in events if e["ev"] == "complete" and e["vw"] == vw]
  return (len(done) - 1 - skip) / (done[-1] - done[skip])


@pytest.mark.parametrize("k", [2, 4])
def test_full_pipeline_runs_at_the_slowest_stage(k):
  cluster = make_cluster("one", [[GPU] * k], PCIE, NET)
  profiles, gpus, cut = units(k), list(cluster.gpus), list(range(k + 1))
  bottleneck = max(sum(stage_seconds(cluster, profiles, cut, gpus, j)) for j in range(k))
  events, _, _ = run(cluster, profiles, [gpus], [cut], [k], 0, 40)
  assert_trace_ok(events)
  assert steady_rate(events) == pytest.approx(1 / bottleneck, rel=0.01)


def test_nm1_runs_one_minibatch_through_all_stages():
  cluster = make_cluster("one", [[GPU] * 3], PCIE, NET)
  profiles, gpus, cut = units(3), list(cluster.gpus), [0, 1, 2, 3]
  round_trip = sum(sum(stage_seconds(cluster, profiles, cut, gpus, j)) for j in range(3))
  events, _, _ = run(cluster, profiles, [gpus], [cut], [1], 0, 40)
  assert_trace_ok(events)
  assert steady_rate(events) == pytest.approx(1 / round_trip, rel=0.01)


def test_d0_gates_the_fast_worker_to_the_slow_one():
  cluster = make_cluster("two", [[GPU, GPU], [SLOW, SLOW]], PCIE, NET)
  profiles = units(2)
  groups = [list(cluster.gpus[:2]), list(cluster.gpus[2:])]
  events, _, _ = run(cluster, profiles, groups, [[0, 1, 2]] * 2, [2, 2], 0, 30)
  assert_trace_ok(events)
  pushed = [0, 0]
  for e in events:
    if e["ev"] == "push":
      pushed[e["vw"]] += 1
      assert pushed[0] - pushed[1] <= 1  # D + 1
  assert sum(e["ev"] == "wait" and e["vw"] == 0 for e in events) > 10
  assert steady_rate(events, 0) == pytest.approx(steady_rate(events, 1), rel=0.05)


def test_concurrent_flows_share_a_link():
  cluster = make_cluster("two", [[GPU], [GPU]], PCIE, Link("net", 1e9, 0.0))
  sim = Simulator(cluster)
  landed = []
  sim.send(0, 1, 1e9, landed.append)
  sim.send(0, 1, 1e9, landed.append)
  sim.at(0.0, lambda t: sim.send(1, 0, 0.5e9, landed.append))  # the other direction is free
  sim.run(Idle(), cost=None)
  assert landed == pytest.approx([0.5, 2.0, 2.0])  # two flows at 0.5 GB/s each; the reverse alone


class Idle:  # an engine with nothing to do: the simulator only moves flows
  done = True
  vws = ()  # (no virtual workers)

  def begin(self, t):
    pass

  def startable(self, allow=None):
    del allow
    return []


def test_striped_flows_share_every_link_they_cross():
  # 3 nodes; links 1 GB/s, no latency. A push striped from node 0 is 2 subflows (to nodes 1 and 2),
  # each with half of node 0's egress: 1 GB leaves in 1 s. A point flow 1 -> 2 then shares node 2's
  # ingress with one subflow: node 0's egress still limits the striped flow to 0.5 GB/s per subflow.
  cluster = make_cluster("three", [[GPU], [GPU], [GPU]], PCIE, Link("net", 1e9, 0.0))
  sim = Simulator(cluster)
  landed = {}
  sim.send_striped(0, 1e9, True, lambda t: landed.setdefault("striped push", t))
  sim.run(Idle(), cost=None)
  assert landed["striped push"] == pytest.approx(1.0)

  sim, landed = Simulator(cluster), {}
  sim.send_striped(0, 1e9, True, lambda t: landed.setdefault("push", t))
  sim.send(1, 2, 0.5e9, lambda t: landed.setdefault("point", t))
  sim.run(Idle(), cost=None)
  assert landed == pytest.approx({"push": 1.0, "point": 1.0})  # 0.5 GB/s each on node 2's ingress

  # Two pulls striped to nodes 0 and 1 at once: node 2's egress carries one subflow of each, node 0's
  # egress one (to node 1), node 1's one (to node 0): each subflow moves at 0.5 GB/s, 2 GB in 2 s.
  sim, landed = Simulator(cluster), {}
  sim.send_striped(0, 2e9, False, lambda t: landed.setdefault("pull 0", t))
  sim.send_striped(1, 2e9, False, lambda t: landed.setdefault("pull 1", t))
  sim.run(Idle(), cost=None)
  assert landed == pytest.approx({"pull 0": 2.0, "pull 1": 2.0})


def test_timers_run_by_time_then_in_the_order_they_were_set():
  sim, ran = Simulator(make_cluster("one", [[GPU]], PCIE, NET)), []

  def first(t):
    ran.append(("first", t))
    sim.at(t, lambda t: ran.append(("set at 1 for 1", t)))  # after those already set for 1
    sim.at(2.0, lambda t: ran.append(("set at 1 for 2", t)))

  sim.at(2.0, lambda t: ran.append(("second at 2", t)))
  sim.at(1.0, first)
  sim.at(1.0, lambda t: ran.append(("second at 1", t)))
  sim.run(Idle(), cost=None)
  assert ran == [("first", 1.0), ("second at 1", 1.0), ("set at 1 for 1", 1.0), ("second at 2", 2.0),
                 ("set at 1 for 2", 2.0)]
  from hetpipe_jax.errors import ProtocolError
  with pytest.raises(ProtocolError, match="a timer set for t=1.0, before the simulator's clock t=2.0"):
    sim.at(1.0, print)


@pytest.mark.parametrize("seed", [0, 1])
def test_flows_as_objects_and_as_array_rows_land_at_the_same_doubles(seed, monkeypatch):
  # The same random flows (point and striped, many starting together) held as objects throughout, as array
  # rows throughout, and as either by turns: every flow lands at the same time to the last bit, in the same order.
  from hetpipe_jax.sim import network

  cluster = make_cluster("five", [[GPU]] * 5, PCIE, NET)
  rng = np.random.default_rng(seed)
  flows = [(float(rng.integers(0, 4)) * 1e-3, int(rng.integers(0, 5)), int(rng.integers(0, 5)),
            float(rng.integers(1, 50)) * 1e5, int(rng.integers(0, 3))) for _ in range(120)]

  def landings(arrays_from, scalars_below):
    monkeypatch.setattr(network, "ARRAYS_FROM", arrays_from)
    monkeypatch.setattr(network, "SCALARS_BELOW", scalars_below)
    sim, landed = Simulator(cluster), []
    for k, (start, a, b, num_bytes, kind) in enumerate(flows):
      done = lambda t, k=k: landed.append((k, t))
      send = (lambda _t, a=a, b=b, n=num_bytes, d=done: sim.send(a, b, n, d)) if kind == 0 else \
          (lambda _t, a=a, n=num_bytes, out=kind == 1, d=done: sim.send_striped(a, n, out, d))
      sim.at(start, send)
    sim.run(Idle(), cost=None)
    return landed

  as_objects = landings(10**9, 0)
  assert len(as_objects) == len(flows)
  assert landings(1, 0) == as_objects
  assert landings(6, 3) == as_objects  # (from objects to rows and back as the flows in flight rise and fall)


def test_rows_count_a_striped_flows_far_ends_as_objects_do():
  # Rows hold a striped flow's far ends back until the loads are read (a direction's N far ends charged once for
  # the flows that start or land together): loads, rates and landings stay those of objects throughout.
  import dataclasses

  from hetpipe_jax.sim import network

  sim = Simulator(make_cluster("four", [[GPU]] * 4, PCIE, NET))
  objects = network._ScalarFlows(sim._links)
  rows = network._ArrayFlows(sim._links, [], objects.loads())
  for node, outbound, num_bytes in [(0, True, 3e6), (1, False, 1e6), (2, True, 2e6), (1, True, 1.5e6)]:
    flow = sim.striped_flow(node, outbound, print)[1]
    objects.add(flow, num_bytes)
    rows.add(dataclasses.replace(flow), num_bytes)
  flow = sim.point_flow(3, 0, print)[1]
  objects.add(flow, 5e5)
  rows.add(dataclasses.replace(flow), 5e5)
  assert rows.loads() == objects.loads()
  for _ in range(4):  # (they land one after another)
    objects.rates()
    rows.rates()
    t = objects.next_end(0.0)
    assert rows.next_end(0.0) == t
    objects.advance(t)
    rows.advance(t)
    landed = [f.seq for f in objects.land()]
    assert landed and [f.seq for f in rows.land()] == landed
    assert rows.loads() == objects.loads()


def _random_flows(sim, rng, count, alike=False):
  """``count`` random flows of ``sim``'s nodes (one in eight striped), each as a pair: one for objects, one for rows
  (``alike``: all between the same nodes with the same bytes, so they land together)."""
  import dataclasses

  nodes, made = len(sim._nodes), []

  def draw() -> tuple[float, int, int, float]:  # (striped below 0.125, from node, to node, bytes)
    return rng.random(), int(rng.integers(nodes)), int(rng.integers(nodes)), float(rng.integers(1, 40)) * 1e5

  shape = draw()
  for _ in range(count):
    striped, a, b, num_bytes = shape if alike else draw()
    flow = sim.striped_flow(a, bool(b % 2), print)[1] if striped < 0.125 else sim.point_flow(a, b, print)[1]
    made.append((num_bytes, flow, dataclasses.replace(flow)))
  return made


@pytest.mark.parametrize("seed", range(4))
def test_rows_re_share_where_loads_changed_at_a_full_re_shares_rates(seed, monkeypatch):
  # Rows recompute the rates of the flows that cross a resource whose load changed (every flow after a capacity or
  # a striped flow's far ends changed); objects re-share every flow every time (the model as specified). Random
  # starts, alone and in groups (some of twelve alike, which land together), landings, partial advances and
  # capacity changes on 9 nodes: after every re-share each flow's rate, the next landing and the flows that land are
  # the same doubles either way (rows re-share where loads changed however few are in flight).
  import dataclasses

  from hetpipe_jax.sim import network

  monkeypatch.setattr(network, "LOCAL_FROM", 0)  # (however few rows)
  sim = Simulator(make_cluster("nine", [[GPU]] * 9, PCIE, NET))
  rng = np.random.default_rng(seed)
  objects = network._ScalarFlows(sim._links)
  rows = network._ArrayFlows(sim._links, [], objects.loads())
  t, capacity = 0.0, list(sim._links.capacity)
  for _ in range(400):
    if rng.random() < 0.1:  # a link's bandwidth moves, as noise moves it
      capacity[int(rng.integers(len(capacity)))] *= float(rng.choice([0.5, 0.8, 1.25, 2.0]))
      links = dataclasses.replace(sim._links, capacity=tuple(capacity))
      objects.relink(links)
      rows.relink(links)
    else:
      size = int(rng.choice([1, 1, 2, 12, 12]))
      group = _random_flows(sim, rng, size, alike=size == 12 and rng.random() < 0.5)
      for num_bytes, as_object, _ in group:
        objects.add(as_object, num_bytes)
      if len(group) == 1:
        rows.add(group[0][2], group[0][0])
      else:
        rows.add_all([(num_bytes, as_row) for num_bytes, _, as_row in group])
    objects.rates()
    rows.rates()
    assert {f.seq: float(rows._rate[f.slot]) for f in rows._flows} == {f.seq: f.rate for f in objects.flows}
    if not objects.count:
      continue
    t_end = objects.next_end(t)
    assert rows.next_end(t) == t_end
    dt = (t_end - t) * float(rng.choice([0.5, 1.0, 1.0]))  # (half way: nothing lands)
    objects.advance(dt)
    rows.advance(dt)
    t += dt
    landed = [f.seq for f in objects.land()]
    assert [f.seq for f in rows.land()] == landed
    assert rows.loads() == objects.loads()
    if landed or rng.random() < 0.3:
      objects.rates()
      rows.rates()


def test_rows_re_share_only_the_flows_on_the_links_a_flow_started_on(monkeypatch):
  # 40 flows between nodes 0-3 and 20 between nodes 4-7 are in flight; one more starts from node 4 to node 5: the
  # re-share recomputes the flows on node 4's egress and node 5's ingress and leaves every other rate as it was.
  from hetpipe_jax.sim import network

  monkeypatch.setattr(network, "LOCAL_FROM", 0)  # (however few rows)
  sim = Simulator(make_cluster("eight", [[GPU]] * 8, PCIE, NET))
  rows = network._ArrayFlows(sim._links, [], [0] * len(sim._links.capacity))
  pairs = [(a, b) for a in range(4) for b in range(4) if a != b] * 4 + [(4, 5)] * 10 + [(6, 7)] * 10
  for a, b in pairs[:60]:
    rows.add(sim.point_flow(a, b, print)[1], 1e6)
  rows.rates()
  rows._rate[:rows.count] = -1.0  # (marks: a rate left as it was keeps it)
  rows.add(sim.point_flow(4, 5, print)[1], 1e6)
  rows.rates()
  recomputed = {(f.ends, float(rows._rate[f.slot]) > 0) for f in rows._flows}
  out4, in5 = sim._resource[("out", 4)], sim._resource[("in", 5)]
  assert recomputed == {((out4, in5), True)} | {(f.ends, False) for f in rows._flows if f.ends != (out4, in5)}
  assert {float(rows._rate[f.slot]) for f in rows._flows if f.ends == (out4, in5)} == {1e9 / 11}


def test_striped_placement_spreads_the_ps_traffic_over_every_node():
  # 4 single-GPU VWs on 4 nodes, 2 units of 1 GB. Default: unit 0's shard on node 0, unit 1's on node 1;
  # every push sends nodes 0 and 1 3 GB each over the network (3 flows on each ingress: about 3 s).
  # Striped: every VW sends 3/4 of its 2 GB spread over the other nodes: 1.5 GB per link (about 1.5 s).
  cluster = make_cluster("four", [[GPU] for _ in range(4)], PCIE, Link("net", 1e9, 0.0))
  profiles = [UnitProfile(f"u{i}", 1e9, 2e9, 0, 0, 10**9, 8, 0) for i in range(2)]
  layout = Layout(tuple(VWLayout((g,), (0, 2), 1) for g in cluster.gpus))
  compute = 2 * 3e9 / GPU.peak_flops()  # both units forward and backward
  for placement, seconds in (("default", 3.0), ("striped", 1.5)):
    trace = Trace()
    simulate(SimJob(cluster, profiles, layout, 0, 3, placement), trace)
    assert_trace_ok(trace.events)
    ps = [e["t"] for e in trace.events if e["ev"] in ("push", "pull") and e["vw"] == 2]
    assert ps[:2] == pytest.approx([compute + seconds, compute + 2 * seconds])  # first push, then pull


@pytest.mark.parametrize("seed", range(12))
def test_random_configurations_pass_the_checker(seed):
  rng = np.random.default_rng(seed)
  n = int(rng.integers(1, 4))
  types = [GpuType(f"t{i}", 1 << 34, float(rng.uniform(0.3, 2)) * 1e12, 1e12, 1e15, 1.0) for i in range(3)]
  cluster = make_cluster("r", [[types[int(rng.integers(3))] for _ in range(4)] for _ in range(n)], PCIE, NET)
  profiles = [UnitProfile(f"u{i}", float(rng.uniform(1e10, 1e11)), float(rng.uniform(2e10, 2e11)), 0, 0,
                          int(rng.integers(1e5, 1e8)), int(rng.integers(1e4, 1e7)), 0) for i in range(6)]
  groups, cuts, nms = [], [], []
  for i in range(n):
    k = int(rng.choice([1, 2, 4]))
    groups.append(list(cluster.gpus[4 * i:4 * i + k]))
    cuts.append([0] + sorted(rng.choice(np.arange(1, 6), k - 1, replace=False).tolist()) + [6])
    nms.append(int(rng.choice([1, 2, 4])))
  d = int(rng.choice([0, 1, 3]))
  events, seconds, rows = run(cluster, profiles, groups, cuts, nms, d, 8)
  assert_trace_ok(events)
  assert seconds > 0 and len(rows) == 8 * n


def test_sim_executor_through_run_hetpipe():
  result = run_hetpipe(get_model("cnn"), synthetic(num_train=512, num_test=64), RunConfig.of(
      cluster="paper_half", policy="HD", executor="sim", d=1, waves=10, batch_size=16))
  assert_trace_ok(result.events)
  assert result.params is None and result.images_per_second > 0
  assert result.events[0]["executor"] == "sim" and len(result.metrics) == 10 * len(result.vws)


@pytest.mark.parametrize("failures,rejoin", [({}, False), ({1: [3], 2: [5]}, True)])
def test_transfers_overlapped_with_compute(failures, rejoin):
  """With overlap_transfers a stage's input travels while its device computes something else: every WSP
  guarantee still holds (failures and rejoins included), and ResNet-152 ED-local runs faster (not every plan
  does: BUILD_NOTES.md, "Throughput accounting")."""
  from hetpipe_jax.cluster import get_cluster
  from hetpipe_jax.cost.profile import full_size_profiles
  from hetpipe_jax.plan.allocation import plan_cluster

  cluster, profiles = get_cluster("paper_testbed"), full_size_profiles("resnet152", 32)
  layout = plan_cluster(cluster, profiles, "ED", "local", "max_fit", None).layout
  seconds = {}
  for overlap in (False, True):
    trace = Trace()
    seconds[overlap], _, _ = simulate(SimJob(cluster, profiles, layout, 1, 12, "local", failures=failures,
                                             rejoin=rejoin, options=SimOptions(overlap_transfers=overlap)), trace)
    assert_trace_ok(trace.events)
    assert sum(e["ev"] == "push" for e in trace.events) > 0
  if not failures:
    assert seconds[True] < seconds[False]


def _staged_pair(staged):
  """One virtual worker, a stage on each of two nodes, Nm 1, 2 waves; local PS shards (PCIe, 10 GB/s):
  unit 0 (stage 0) has 8 bytes of parameters, unit 1 (stage 1) 3 GB: 0.3 s each way."""
  cluster = make_cluster("pair", [[GPU], [GPU]], PCIE, NET)
  profiles = [UnitProfile("u0", 1e11, 2e11, 0, 0, 8, 8, 0), UnitProfile("u1", 1e11, 2e11, 0, 0, 3 * 10**9, 8, 0)]
  layout = Layout((VWLayout(tuple(cluster.gpus), (0, 1, 2), 1),))
  trace = Trace()
  simulate(SimJob(cluster, profiles, layout, 0, 2, "local", options=SimOptions(staged_ps=staged)), trace)
  assert_trace_ok(trace.events)
  return trace.events


def test_staged_ps_moves_each_stages_part_on_its_own_by_hand():
  """Minibatch 1: F0 [0, .1], F1 [.1, .2], B1 [.2, .4], B0 [.4, .6] (completes wave 0). Whole: the push
  leaves at .6 and lands at .9 (stage 1's 3 GB), the pull lands at 1.2, minibatch 2 enters then. Staged:
  stage 1's part leaves when B1 ends (.4) and lands at .7, so the push is applied at .7; stage 0's part
  of the pull lands at once (.7: minibatch 2 enters, F0 [.7, .8]), stage 1's at 1.0, where F1 of
  minibatch 2 waits for it (idle from .8: a pull wait in the breakdown)."""
  from hetpipe_jax.core.breakdown import time_breakdown

  approx = lambda x: pytest.approx(x, abs=1e-4)  # link latencies and 8-byte transfers: microseconds
  at = lambda events, **kw: [e for e in events if all(e.get(k) == v for k, v in kw.items())]
  whole, staged = _staged_pair(False), _staged_pair(True)
  assert at(whole, ev="push", wave=0)[0]["t"] == approx(0.9)
  assert [e["t"] for e in at(whole, ev="pull")] == [approx(1.2)]
  assert at(whole, ev="inject", mb=2)[0]["t"] == approx(1.2)
  assert at(staged, ev="push", wave=0)[0]["t"] == approx(0.7)
  assert {e["stage"]: e["t"] for e in at(staged, ev="pull")} == {0: approx(0.7), 1: approx(1.0)}
  assert at(staged, ev="inject", mb=2)[0]["t"] == approx(0.7)
  assert at(staged, ev="fwd", stage=1, mb=2)[0]["t0"] == approx(1.0)
  assert at(staged, ev="complete", mb=2)[0]["t"] == approx(1.5)  # F1 [1, 1.1], B1 [1.1, 1.3], B0 [1.3, 1.5]
  stage0, stage1 = (d["seconds"] for d in time_breakdown(staged)["devices"])
  assert stage0["push"] == approx(0.1) and stage1["pull"] == approx(0.2)


@pytest.mark.parametrize("seed", range(6))
def test_staged_ps_keeps_every_guarantee(seed):
  """Random layouts with staged push and pull parts, failures and rejoins: the checker passes; every
  forward of a gated minibatch or a later one, at every stage, holds at least the snapshot that its pull
  brought (for D > 0 the checker's bounds alone would also accept the weights before it); without
  failures the staged run pushes as many waves as the whole one."""
  rng = np.random.default_rng(100 + seed)
  cluster = make_cluster("r", [[GPU, SLOW] for _ in range(3)], PCIE, NET)
  profiles = [UnitProfile(f"u{i}", float(rng.uniform(1e10, 1e11)), float(rng.uniform(2e10, 2e11)), 0, 0,
                          int(rng.integers(1e5, 3e8)), int(rng.integers(1e4, 1e7)), 0) for i in range(4)]
  groups, cuts, nms = [], [], []
  for i in range(3):
    k = int(rng.choice([1, 2]))
    groups.append(tuple(cluster.gpus[2 * i:2 * i + k]))
    cuts.append((0, 2, 4) if k == 2 else (0, 4))
    nms.append(int(rng.choice([1, 2, 3])))
  layout = Layout(tuple(VWLayout(g, c, nm) for g, c, nm in zip(groups, cuts, nms)))
  d, placement = int(rng.choice([0, 1, 3])), str(rng.choice(["default", "local", "striped"]))
  failures = {1: [3]} if seed % 2 else {}
  pushes = {}
  for staged in (False, True):
    trace = Trace()
    options = SimOptions(overlap_transfers=bool(seed % 3), staged_ps=staged)
    simulate(SimJob(cluster, profiles, layout, d, 8, placement, failures=failures, rejoin=bool(failures),
                    options=options), trace)
    assert_trace_ok(trace.events)
    pushes[staged] = sum(e["ev"] == "push" for e in trace.events)
    if staged:
      _assert_forwards_hold_their_pull(trace.events)
  if not failures:
    assert pushes[True] == pushes[False] == 8 * 3


def _assert_forwards_hold_their_pull(events):
  """Every forward of virtual worker i's minibatch mb holds, component by component, at least the snapshot
  of i's last pull (whole, a join's, or a staged one's stage-0 part) whose gated minibatch is <= mb."""
  brought: dict[int, list[tuple[int, list[int]]]] = {}  # vw -> (gated minibatch, snapshot), in order
  pending: dict[int, list[int]] = {}
  checked = 0
  for e in events[1:]:
    if e["ev"] == "pull" and not e.get("stage"):
      pending[e["vw"]] = e["glob"]
    elif e["ev"] == "inject" and e["vw"] in pending:
      brought.setdefault(e["vw"], []).append((e["mb"], pending.pop(e["vw"])))
    elif e["ev"] == "join":
      brought.pop(e["vw"], None)  # the replacement starts from its join's pull
    elif e["ev"] == "fwd":
      held = [glob for mb, glob in brought.get(e["vw"], []) if mb <= e["mb"]]
      if held:
        assert all(g >= s for g, s in zip(e["glob"], held[-1])), e
        checked += 1
  assert checked > 0


def test_staged_ps_is_refused_with_numerics():
  from hetpipe_jax.core.engine import Engine
  from hetpipe_jax.core.server import ClockServer
  from hetpipe_jax.core.worker import NoNumerics, Shape, VirtualWorker
  from hetpipe_jax.errors import ProtocolError

  class Computing(NoNumerics):
    @property
    def stages(self):
      return ("a stage",)

  class Staged:
    staged = True

  vw = VirtualWorker.create(0, Shape(1, 1), 4, 1, numerics=Computing(1))
  with pytest.raises(ProtocolError, match="staged push and pull transfers are a timing model"):
    Engine([vw], ClockServer(1, 0, num_shards=1), Trace(), comm=Staged())  # type: ignore[arg-type]
