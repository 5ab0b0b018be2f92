"""A tuned plan whose waves exceed what its memory holds in flight keeps its window wherever it is copied: onto
alike GPUs (:meth:`hetpipe_jax.tune.Planner.move`) and onto a larger cluster (:func:`hetpipe_jax.tune.replicate`).
Without it, Nm = 8 would be in flight on GPUs that hold 1: the memory check refuses the plan."""

from hetpipe_jax.cluster import GpuType, Link, make_cluster
from hetpipe_jax.core.trace import Trace
from hetpipe_jax.cost.profile import UnitProfile
from hetpipe_jax.plan.allocation import layout_plan
from hetpipe_jax.plan.costmodel import check_memory
from hetpipe_jax.plan.plan_json import plan_to_json
from hetpipe_jax.sim import simulate
from hetpipe_jax.tune import Candidate, Planner, RunSetting, replicate
from hetpipe_jax.tune.groupings import groupings

from helpers import assert_trace_ok

FAST = GpuType("fast", 10**9, 10e12, 10e12, 1e18, 1.0)  # 1 GB each: unit 1 (950 MB at Nm = 1) fits only
SLOW = GpuType("slow", 10**9, 5e12, 5e12, 1e18, 1.0)  # one minibatch in flight (1.3 GB at Nm = 2)
PCIE, NET = Link("pcie", 10e9, 1e-5), Link("net", 1e9, 1e-4)
# 100 MB and 300 MB of weights, 50 MB kept per minibatch in flight each
UNITS = [UnitProfile("u0", 1e12, 2e12, 1, 1, 100_000_000, 10_000_000, 50_000_000),
         UnitProfile("u1", 1e12, 2e12, 1, 1, 300_000_000, 10_000_000, 50_000_000)]
SMALL = make_cluster("2x2", [[FAST, SLOW], [SLOW, FAST]], PCIE, NET)
LARGE = make_cluster("4x2", [[SLOW, FAST], [FAST, SLOW]] * 2, PCIE, NET)
WAVE = 8


def tuned() -> Candidate:
  """NP on SMALL (a virtual worker per node), every one with waves of 8 in a window of 1 (its memory's)."""
  planner = Planner(SMALL, UNITS, WAVE, RunSetting())
  plans = []
  for gpus in dict(groupings(SMALL))["NP"]:
    fits = planner.plans(gpus)
    assert list(fits) == [1]  # the memory holds one minibatch in flight
    plans.append(fits[1].with_wave(WAVE))
  return Candidate("NP", "speed-sized", tuple(plans))


def test_a_plan_moved_to_alike_gpus_keeps_its_window():
  template = tuned().plans[0]
  assert (template.nm, template.window) == (WAVE, 1)
  moved = Planner(SMALL, UNITS, WAVE, RunSetting()).move(template, list(SMALL.node_gpus(1)))
  assert moved is not None and [g.node for g in moved.gpus] == [1, 1]
  assert (moved.nm, moved.window) == (WAVE, 1), f"moved: Nm {moved.nm}, window {moved.window}"
  assert [s.memory_bytes for s in moved.stages] == [s.memory_bytes for s in template.stages]


def test_a_replicated_configuration_keeps_every_window_and_fits_and_runs():
  candidate = replicate(tuned(), LARGE, UNITS)
  assert [(p.nm, p.window) for p in candidate.plans] == [(WAVE, 1)] * 4
  check_memory(UNITS, candidate.layout)  # raises naming the stage when 8 would be in flight
  trace = Trace()
  simulate(candidate.job(LARGE, UNITS, waves=2), trace)
  assert_trace_ok(trace.events)
  assert trace.events[0]["nm"] == [WAVE] * 4 and trace.events[0]["window"] == [1] * 4


def test_a_windowed_plans_json_names_its_window_and_what_is_in_flight():
  doc = plan_to_json(SMALL, UNITS, layout_plan(SMALL, UNITS, tuned().layout), "toy", 32)
  assert [(vw["nm"], vw["window"], vw["in_flight"]) for vw in doc["vws"]] == [(WAVE, 1, 1)] * 2
  plain = plan_to_json(SMALL, UNITS, layout_plan(SMALL, UNITS, tuned().layout.with_windows(WAVE)), "toy", 32)
  assert [(vw["nm"], vw["window"], vw["in_flight"]) for vw in plain["vws"]] == [(WAVE, None, WAVE)] * 2
