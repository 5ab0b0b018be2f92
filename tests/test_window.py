"""A window below Nm: at most W minibatches in flight while the wave stays Nm (memory grows with what is
in flight, not with the wave), so a virtual worker that holds few minibatches still runs long waves."""


import pytest

from hetpipe_jax import ConfigError, RunConfig, get_model, load_dataset, run_hetpipe
from hetpipe_jax.cluster import GpuType, Link, make_cluster
from hetpipe_jax.core import schedule
from hetpipe_jax.core.check import check_trace
from hetpipe_jax.core.trace import Trace
from hetpipe_jax.cost.context import CostContext
from hetpipe_jax.cost.profile import UnitProfile
from hetpipe_jax.plan.costmodel import check_memory
from hetpipe_jax.plan.layout import Layout, VWLayout
from hetpipe_jax.plan.vw_plan import StagePlan, VWPlan, vw_plan
from hetpipe_jax.sim import SimJob, simulate
from hetpipe_jax.tune import nm_choices

from helpers import assert_trace_ok

FAST = GpuType("fast", 1 << 34, 2e12, 2e12, 1e15, 1.0)
SLOW = GpuType("slow", 1 << 34, 1e12, 1e12, 1e15, 1.0)
NET = Link("net", 1e10, 1e-6)


def units(n):  # 0.1 s forward and 0.2 s backward per unit on SLOW, half that on FAST
  return [UnitProfile(f"u{i}", 1e11, 2e11, 0, 0, 1024, 8, 0) for i in range(n)]


def in_flight_max(events, vw):
  """The most minibatches of ``vw`` injected and not yet completed at once."""
  now = top = 0
  for e in events:
    if e.get("vw") == vw and e["ev"] in ("inject", "complete"):
      now += 1 if e["ev"] == "inject" else -1
      top = max(top, now)
  return top


def test_window_caps_injection_and_keeps_the_wave():
  # 1F1B with Nm = 4 and a window of 2 is, tick for tick, the Nm = 2 table (the golden one of
  # test_schedules): only injection depends on what may be in flight
  assert schedule.timetable(2, 4, 8, window=2) == schedule.timetable(2, 2, 8)
  assert schedule.timetable(2, 4, 8, window=4) == schedule.timetable(2, 4, 8)
  cluster = make_cluster("two", [[FAST, FAST], [SLOW, SLOW]], NET, NET)
  layout = Layout((VWLayout(cluster.gpus[:2], (0, 2, 4), 4, 2), VWLayout(cluster.gpus[2:], (0, 2, 4), 3)))
  trace = Trace()
  simulate(SimJob(cluster, units(4), layout, 1, 5), trace)
  events = trace.events
  assert_trace_ok(events)
  assert events[0]["nm"] == [4, 3] and events[0]["window"] == [2, 3]
  assert in_flight_max(events, 0) == 2 and in_flight_max(events, 1) == 3
  # the wave stays Nm: VW 0 pushes once per 4 completed minibatches
  done = 0
  for e in events:
    if e.get("vw") == 0 and e["ev"] == "complete":
      done += 1
    elif e.get("vw") == 0 and e["ev"] == "push":
      assert done == 4 * (e["wave"] + 1)
  # the checker holds the run to its window: the same trace claiming a window of 1 is refused
  claimed = [{**events[0], "window": [1, 3]}] + events[1:]
  assert any(v.rule == "order" and "window=1, Nm=4" in v.message for v in check_trace(claimed))
  assert check_trace([{**events[0], "window": [5, 3]}] + events[1:])[0].rule == "format"


def test_window_lets_a_fast_virtual_worker_run_long_waves_without_more_in_flight():
  # one stage each: FAST runs a minibatch in 0.15 s, SLOW in 0.3 s. At D = 0 with Nm = 1 each, WSP holds
  # FAST to SLOW's wave rate (2 x 1 / 0.3 minibatches/s); with waves of 2 in a window of 1 (the memory
  # of Nm = 1), FAST does twice SLOW's minibatches per wave: 1 / 0.15 + 1 / 0.3 = 10 minibatches/s.
  cluster = make_cluster("pair", [[FAST], [SLOW]], NET, NET)
  rates = {}
  for nm, window in (((1, 1), (1, 1)), ((2, 1), (1, 1))):
    layout = Layout(tuple(VWLayout((g,), (0, 1), n, w) for g, n, w in zip(cluster.gpus, nm, window)))
    trace = Trace()
    seconds, _, _ = simulate(SimJob(cluster, units(1), layout, 0, 40), trace)
    assert_trace_ok(trace.events)
    assert in_flight_max(trace.events, 0) == 1
    rates[nm] = 40 * sum(nm) / seconds
  assert rates[(1, 1)] == pytest.approx(2 / 0.3, rel=0.02)
  assert rates[(2, 1)] == pytest.approx(1 / 0.15 + 1 / 0.3, rel=0.02)


def test_memory_follows_what_is_in_flight():
  tiny = GpuType("tiny", 2600, 1e12, 1e12, 1e15, 1.0)  # weights and gradient (2048 B) + 1 minibatch fit
  profiles = [UnitProfile("u", 1e11, 2e11, 0, 0, 1024, 8, 400)]  # 400 B kept per minibatch
  cluster = make_cluster("tiny", [[tiny]], NET, NET)
  gpus = cluster.gpus
  windowed = vw_plan(cluster, profiles, gpus, (0, 1), 8, window=1)
  assert windowed.stages == vw_plan(cluster, profiles, gpus, (0, 1), 1).stages
  assert windowed.nm == 8 and windowed.in_flight == 1 and windowed.layout.window == 1
  with pytest.raises(ConfigError, match=r"with Nm=8 in flight"):
    check_memory(profiles, Layout((VWLayout(gpus, (0, 1), 8),)), CostContext(weight_mode="latest", optimizer_slots=0.0))
  check_memory(profiles, Layout((VWLayout(gpus, (0, 1), 8, 1),)),
               CostContext(weight_mode="latest", optimizer_slots=0.0))  # fits with a window
  with pytest.raises(ConfigError, match=r"with window=2 \(Nm=8\) in flight"):
    check_memory(profiles, Layout((VWLayout(gpus, (0, 1), 8, 2),)),
                 CostContext(weight_mode="latest", optimizer_slots=0.0))


def test_layout_window_bounds_and_meta():
  gpus = make_cluster("one", [[SLOW]], NET, NET).gpus
  assert VWLayout(gpus, (0, 1), 3, 3).window is None  # a window of Nm is no window
  assert Layout((VWLayout(gpus, (0, 1), 3),)).meta().get("window") is None
  assert Layout((VWLayout(gpus, (0, 1), 3, 2),)).meta()["window"] == [2]
  for bad in (0, 4):
    with pytest.raises(ConfigError, match=f"window={bad} with Nm=3"):
      VWLayout(gpus, (0, 1), 3, bad)


def _plan(nm, seconds):
  return VWPlan(nm, (StagePlan(make_cluster("one", [[SLOW]], NET, NET).gpus[0], 0, 1, seconds, 0),))


def test_speed_sized_waves_beyond_memory_take_a_window():
  fast = {n: _plan(n, 0.25) for n in (1, 2)}  # 4 minibatches/s; memory holds 2 in flight
  slow = {n: _plan(n, 1.0) for n in range(1, 5)}  # 1 minibatch/s
  plain = {tuple(p.nm for p in plans) for _, plans in nm_choices([fast, slow], [1, 1])}
  assert max(nms[0] for nms in plain) == 2
  choices = {tuple(p.nm for p in plans): plans for _, plans in nm_choices([fast, slow], [1, 1], wave_max=8)}
  assert (8, 2) in choices and (4, 1) in choices  # waves of 2 s and 1 s each
  assert [p.in_flight for p in choices[(8, 2)]] == [2, 2]
  assert choices[(8, 2)][0].stages == fast[2].stages


def test_training_run_with_a_window_checks_its_trace():
  data = load_dataset("digits")
  result = run_hetpipe(get_model("mlp", data.num_classes), data, RunConfig.of(
      cluster="hetero4", num_vws=2, stages=2, nm=4, window=[2, 3], d=1, waves=3, batch_size=32))
  assert_trace_ok(result.events)
  assert result.events[0]["window"] == [2, 3]
  assert in_flight_max(result.events, 0) == 2 and in_flight_max(result.events, 1) == 3
  assert sum(e["ev"] == "push" for e in result.events) == 6
  assert RunConfig().layout.window is None
