"""Plans end to end: the plan CLI on the paper testbed, and training on planned layouts."""

import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import pytest

from hetpipe_jax import RunConfig, get_cluster, get_model, read_trace, run_hetpipe, synthetic
from hetpipe_jax.cost.context import CostContext
from hetpipe_jax.cost.profile import full_size_profiles, profile_units
from hetpipe_jax.plan.allocation import plan_cluster
from hetpipe_jax.plan.costmodel import CostModel
from hetpipe_jax.plan.plan_json import plan_to_json

from helpers import assert_trace_ok

ENV = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}


@pytest.mark.parametrize("model,policy,placement", [("vgg19", "ED", "local"), ("resnet152", "HD", "default")])
def test_plan_cli(tmp_path, model, policy, placement):
  out = tmp_path / "plan.json"
  proc = subprocess.run([sys.executable, "-m", "experiments.plan", f"--model={model}",
                         "--cluster=paper_testbed", f"--policy={policy}", f"--placement={placement}",
                         f"--out={out}"], capture_output=True, text=True, timeout=300, env=ENV)
  assert proc.returncode == 0, proc.stderr[-2000:]
  doc = json.loads(out.read_text())
  assert doc["model"] == model and doc["policy"] == policy and len(doc["vws"]) == 4
  assert "virtual worker 3: Nm=" in proc.stdout and str(out) in proc.stdout
  if placement == "local":
    assert all(vw["ps_cross_node_bytes_per_wave"] == 0 for vw in doc["vws"])


@pytest.mark.parametrize("model", ["vgg19", "resnet152"])
def test_every_policy_and_placement_plans_the_testbed(model):
  testbed = get_cluster("paper_testbed")
  profiles = full_size_profiles(model, 32)
  for policy in ("NP", "ED", "HD"):
    for placement in ("default", "local"):
      plan = plan_cluster(testbed, profiles, policy, placement, costs=CostContext(optimizer_slots=1))
      doc = plan_to_json(testbed, profiles, plan, model, 32)
      assert sorted(d["index"] for vw in doc["vws"] for d in vw["devices"]) == list(range(16))
      assert all(1 <= vw["nm"] <= 4 for vw in doc["vws"]) and doc["images_per_s"] > 0


@pytest.mark.parametrize("policy", ["NP", "ED", "HD"])
def test_training_runs_on_planned_layouts(policy):
  model, data = get_model("mlp"), synthetic(num_train=512, num_test=64)
  result = run_hetpipe(model, data, RunConfig.of(cluster="paper_half", policy=policy, nm="max_fit", d=1,
                                              waves=4, batch_size=16, eval_every=100))
  assert_trace_ok(result.events)
  meta = result.events[0]
  cluster = get_cluster("paper_half")
  plan = plan_cluster(cluster, profile_units(model, jax.ShapeDtypeStruct((16, 8, 8, 1), jnp.float32)), policy,
                      costs=CostContext(optimizer_slots=0))
  assert meta["cuts"] == [p.cuts for p in plan.vws] and meta["nm"] == [p.nm for p in plan.vws]
  assert meta["gpus"] == [[g.name for g in p.gpus] for p in plan.vws]
  # The virtual clock takes every task's duration from the cluster's cost model.
  cost = CostModel(cluster, profile_units(model, jax.ShapeDtypeStruct((16, 8, 8, 1), jnp.float32)),
                   plan.layout)
  for ev in result.events:
    if ev["ev"] in ("fwd", "bwd"):
      assert ev["t1"] - ev["t0"] == pytest.approx(cost.task_seconds(ev["vw"], ev["stage"], ev["ev"]))


@pytest.mark.slow  # (15-18 s: the README's command keeps under 10 minutes; .ci/run runs it)
def test_train_cli_on_the_paper_testbed(tmp_path):
  proc = subprocess.run([sys.executable, "-m", "experiments.train", "--cluster=paper_testbed", "--policy=HD",
                         "--model=mlp", "--dataset=digits", "--waves=3", f"--out_dir={tmp_path}",
                         "--batch_size=32"], capture_output=True, text=True, timeout=600, env=ENV)
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert "trace check: OK" in proc.stdout
  meta = read_trace(str(tmp_path / "trace.jsonl"))[0]
  assert meta["policy"] == "HD" and len(meta["gpus"]) == 4 and sum(meta["stages"]) == 16
  bad = subprocess.run([sys.executable, "-m", "experiments.train", "--policy=ED", "--num_vws=2"],
                       capture_output=True, text=True, timeout=300, env=ENV)
  assert bad.returncode == 1 and "--policy=ED lets the planner choose" in bad.stderr
