"""plan_hetpipe: the plan of the run run_hetpipe would run, read before running it."""

import json

import pytest

from hetpipe_jax import ConfigError, RunConfig, get_cluster, get_model, plan_hetpipe, plan_table, run_hetpipe, synthetic
from hetpipe_jax.cost.context import CostContext
from hetpipe_jax.cost.profile import full_size_profiles
from hetpipe_jax.models import full_size_spec
from hetpipe_jax.plan.allocation import layout_plan, plan_cluster

from helpers import assert_trace_ok


@pytest.mark.parametrize("policy", ["NP", "ED", "HD"])
def test_layout_plan_of_a_planned_layout_is_the_plan(policy):
  cluster, profiles = get_cluster("paper_half"), full_size_profiles("vgg19", 32)
  plan = plan_cluster(cluster, profiles, policy, "local", costs=CostContext(optimizer_slots=1))
  assert layout_plan(cluster, profiles, plan.layout, policy, "local", CostContext(optimizer_slots=1)) == plan


def test_the_plan_is_what_the_run_runs():
  model, data = get_model("mlp"), synthetic(num_train=256, num_test=64)
  # The layout does not depend on the executor (run/setup.py prepares it for every one): sim runs it in no time.
  config = RunConfig.of(cluster="hetero4", executor="sim", policy="HD", nm="max_fit", d=1, waves=3, batch_size=16)
  doc = plan_hetpipe(model, data, config)
  json.dumps(doc)  # a JSON document, as experiments.plan writes it
  result = run_hetpipe(model, data, config)
  assert_trace_ok(result.events)
  meta = result.events[0]
  assert meta["gpus"] == [[d["name"] for d in vw["devices"]] for vw in doc["vws"]]
  assert meta["nm"] == [vw["nm"] for vw in doc["vws"]]
  assert meta["cuts"] == [[vw["stages"][0]["first_layer"]] + [s["last_layer"] + 1 for s in vw["stages"]]
                          for vw in doc["vws"]]
  assert doc["policy"] == "HD" and doc["model"] == model.name and doc["images_per_s"] > 0
  assert "virtual worker 1: Nm=" in plan_table(doc)
  # Its headline is the simulator's figure for this layout (fast mode, the config's D), beside the planner's bound.
  assert doc["images_per_s"] == doc["simulated"]["images_per_s"] and doc["simulated"]["d"] == 1
  assert doc["images_per_s"] <= doc["bound_images_per_s"] * (1 + 1e-9)
  assert plan_table(doc).splitlines()[0].count("simulated") >= 1
  bound_only = plan_hetpipe(model, data, config, simulate=False)
  assert bound_only["simulated"] is None and bound_only["images_per_s"] == doc["bound_images_per_s"]


def test_a_manual_layout_and_a_time_model_are_planned_too():
  model, data = get_model("mlp"), synthetic(num_train=256, num_test=64)
  manual = plan_hetpipe(model, data, RunConfig.of(num_vws=2, stages=(2, 1), nm=(2, 3), cuts=[[0, 1, 4], [0, 4]],
                                                  batch_size=16))
  assert manual["policy"] == "manual" and [vw["nm"] for vw in manual["vws"]] == [2, 3]
  assert [[s["first_layer"], s["last_layer"]] for s in manual["vws"][0]["stages"]] == [[0, 0], [1, 3]]
  clocked = plan_hetpipe(model, data, RunConfig.of(cluster="hetero4", policy="ED", time_model="vgg19", batch_size=16))
  assert clocked["model"] == "vgg19" and len(clocked["layers"]) == len(full_size_profiles("vgg19", 16))


def test_plan_hetpipe_refuses_what_run_hetpipe_refuses():
  with pytest.raises(ConfigError, match="trains on data"):
    plan_hetpipe(get_model("vgg19", 1000), full_size_spec("vgg19"), RunConfig.of(policy="ED"))
  with pytest.raises(ConfigError, match="D=-1"):
    plan_hetpipe(get_model("mlp"), synthetic(num_train=64, num_test=16), RunConfig.of(d=-1))
