"""Nm policy ``speed`` (hetpipe_jax.plan.waves): every virtual worker the most minibatches whose wave lasts at most
the longest wave at max_fit, beyond max_fit with a window; worked by hand, planned, run and refused."""

import pytest
from test_train_cli_defects import parsed
from test_window import in_flight_max

from experiments import run_flags
from hetpipe_jax import ConfigError, RunConfig, get_model, load_dataset, plan_hetpipe, run_hetpipe
from hetpipe_jax.cluster import GpuType, Link, get_cluster, make_cluster
from hetpipe_jax.cost.profile import UnitProfile
from hetpipe_jax.plan.allocation import plan_cluster
from hetpipe_jax.plan.partition import plan_virtual_worker
from hetpipe_jax.plan.vw_plan import StagePlan, VWPlan
from hetpipe_jax.plan.waves import speed_sized, wave_seconds
from hetpipe_jax.tune import nm_choices

from helpers import assert_trace_ok

FAST = GpuType("fast", 1 << 34, 2e12, 2e12, 1e15, 1.0)  # twice SLOW's flop/s
SLOW = GpuType("slow", 1 << 34, 1e12, 1e12, 1e15, 1.0)
NET = Link("net", 1e10, 1e-6)
TWO_NODES = make_cluster("fast_slow", [[FAST], [SLOW]], NET, NET)  # NP: one virtual worker per GPU


def units(n):  # 0.1 s forward and 0.2 s backward per unit on SLOW, half that on FAST
  return [UnitProfile(f"u{i}", 1e11, 2e11, 0, 0, 1024, 8, 0) for i in range(n)]


def _plans(seconds: float, holds: int) -> dict[int, VWPlan]:
  """A single-stage virtual worker of ``1 / seconds`` minibatches per second whose memory holds ``holds``."""
  gpu = TWO_NODES.gpus[0]
  return {n: VWPlan(n, (StagePlan(gpu, 0, 1, seconds, 0),)) for n in range(1, holds + 1)}


def _shape(plans):
  return [(p.nm, p.window) for p in plans]


@pytest.mark.parametrize("fast_holds, slow_holds, expected", [
    # the target is the slow one's max_fit wave, 4 x 1 s; the fast one (0.5 s) fits 8 in it, 2 in flight
    (2, 4, [(8, 2), (4, None)]),
    # max_fit waves of 4 x 0.5 s and 2 x 1 s: both 2 s already
    (4, 2, [(4, None), (2, None)]),
    # the fast one's max_fit wave, 8 x 0.5 s = 4 s, is the longest: the slow one runs 4, 2 in flight
    (8, 2, [(8, None), (4, 2)]),
])
def test_two_virtual_workers_twice_as_fast_by_hand(fast_holds, slow_holds, expected):
  sized = speed_sized([_plans(0.5, fast_holds), _plans(1.0, slow_holds)])
  assert _shape(sized) == expected
  assert wave_seconds(sized[0]) == pytest.approx(wave_seconds(sized[1]))
  assert [p.in_flight for p in sized] == [min(n, h) for (n, _), h in zip(expected, (fast_holds, slow_holds))]


def test_waves_within_the_target_lose_less_than_a_minibatch():
  # 3 and 1 minibatches/s... a third: 0.3 s and 1.0 s per minibatch, both hold 2: target 2 s, the fast one 6
  sized = speed_sized([_plans(0.3, 2), _plans(1.0, 2)])
  assert _shape(sized) == [(6, 2), (2, None)]
  assert 2.0 - 0.3 < wave_seconds(sized[0]) <= 2.0


def test_the_tuner_offers_the_same_sizing():
  per_vw = [_plans(0.5, 2), _plans(1.0, 4)]
  offered = {tuple((p.nm, p.window) for p in plans) for _, plans in nm_choices(per_vw, [1, 1], wave_max=8)}
  assert tuple(_shape(speed_sized(per_vw))) in offered


def test_plan_cluster_sizes_a_twice_as_fast_virtual_worker_by_hand():
  profiles = units(2)  # 0.3 s a minibatch on FAST, 0.6 s on SLOW (one stage each: no transfer)
  sized = plan_cluster(TWO_NODES, profiles, "NP", nm_policy="speed")
  # max_fit is 1 (nm_max: one GPU each): the target 0.6 s holds 2 of FAST's, one in flight
  assert _shape(sized.vws) == [(2, 1), (1, None)]
  assert [wave_seconds(p) for p in sized.vws] == pytest.approx([0.6, 0.6])
  assert sized.layout.windows == [1, 1] and sized.layout.nms == [2, 1]
  wider = plan_cluster(TWO_NODES, profiles, "NP", nm_policy="speed", nm_max=4)
  assert _shape(wider.vws) == [(8, 4), (4, None)]  # target 4 x 0.6 s; FAST holds 4 of its 8 in flight
  assert plan_cluster(TWO_NODES, profiles, "NP", nm_policy="max_fit", nm_max=4).layout.nms == [4, 4]
  alone = plan_virtual_worker(TWO_NODES, profiles, [TWO_NODES.gpus[0]], "speed", nm_max=4)
  assert (alone.nm, alone.window) == (4, None)  # alone: its max_fit


def test_alike_virtual_workers_get_their_max_fit():
  cluster, profiles = get_cluster("hetero4"), units(4)
  assert (plan_cluster(cluster, profiles, "ED", nm_policy="speed").layout
          == plan_cluster(cluster, profiles, "ED", nm_policy="max_fit").layout)


@pytest.mark.parametrize("executor", ["virtual", "sim"])
def test_a_speed_sized_run_runs_its_plan_and_its_trace_checks(executor):
  data = load_dataset("digits")
  model = get_model("mlp", data.num_classes)
  # the nodes of the fastest and the slowest class, on VGG-19's clock (an MLP's minibatch takes about as long on
  # every GPU)
  config = RunConfig.of(cluster="hetero4", policy=[[0, 1], [6, 7]], nm="speed", d=1, waves=2, batch_size=32,
                        executor=executor, time_model="vgg19")
  doc = plan_hetpipe(model, data, config, simulate=False)
  result = run_hetpipe(model, data, config)
  assert_trace_ok(result.events)
  meta = result.events[0]
  assert meta["nm"] == [vw["nm"] for vw in doc["vws"]] and len(set(meta["nm"])) > 1  # speeds differ
  windows = [vw["window"] or vw["nm"] for vw in doc["vws"]]
  assert meta["window"] == windows and windows != meta["nm"]
  for i, window in enumerate(windows):
    assert in_flight_max(result.events, i) == window
  assert sum(e["ev"] == "push" for e in result.events) == 2 * 2


@pytest.mark.parametrize("fields, match", [
    (dict(nm="speed"), r"^nm='speed' asks the planner for Nm, which needs a policy: give a policy \(NP, ED, HD"),
    (dict(nm="max_fit"), r"^nm='max_fit' asks the planner for Nm, which needs a policy"),
    (dict(nm="fastest", policy="ED"), r"^unknown nm rule 'fastest'; choose one of max_fit, best, speed$"),
    (dict(nm="speed", policy=[[0, 1]], cuts=[[0, 2, 4]]), r"^nm='speed' asks the planner for Nm, but a grouping "
                                                          r"with cuts is an explicit layout"),
])
def test_speed_without_a_planner_is_refused_in_one_line(fields, match):
  with pytest.raises(ConfigError, match=match) as error:
    RunConfig.of(**fields).validate()
  assert "\n" not in str(error.value)


def test_the_train_flags_pass_speed_to_the_planner_and_refuse_it_without_one():
  assert run_flags.layout(parsed("--policy=ED", "--nm=speed"))["nm"] == "speed"
  fv = parsed("--nm=speed")
  with pytest.raises(ConfigError, match=r"^nm='speed' asks the planner for Nm, which needs a policy"):
    run_flags.run_config(fv, **run_flags.layout(fv)).validate()
