"""Tensor parallelism inside a stage (hetpipe_jax/tensor.py): a stage split over 2 or 4 CPU devices computes what
one device computes (outputs, input gradients, weights after updates), keeps its weights split as Megatron-LM
does, and resumes from a checkpoint to the same numbers."""

import collections
import dataclasses
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding

from hetpipe_jax import RunConfig, get_cluster, get_model, run_hetpipe
from hetpipe_jax.baselines.knobs import PeerKnobs
from hetpipe_jax.baselines.sync import SyncJob, Worker, simulate_sync
from hetpipe_jax.baselines.sync_pipeline import sync_pipeline_job
from hetpipe_jax.cluster import GIB, LINKS, GpuType, Link, make_cluster
from hetpipe_jax.core.meta import meta_gpus
from hetpipe_jax.core.trace import Trace
from hetpipe_jax.cost.batch import BatchProfiles, fixed
from hetpipe_jax.cost.context import CostContext
from hetpipe_jax.cost.memory import stage_memory_bytes
from hetpipe_jax.cost.profile import profile_units
from hetpipe_jax.cost.roofline import unit_seconds
from hetpipe_jax.cost.transfer import allreduce_seconds, split_allreduce_seconds
from hetpipe_jax.cost.unit import TensorSplit, UnitProfile
from hetpipe_jax.data import tokens
from hetpipe_jax.efficiency import efficiency_report
from hetpipe_jax.errors import ConfigError
from hetpipe_jax.models import full_size_model, full_size_spec
from hetpipe_jax.models.gpt import gpt
from hetpipe_jax.plan.allocation import plan_cluster
from hetpipe_jax.plan.costmodel import CostModel, vw_profiles
from hetpipe_jax.plan.layout import Layout, VWLayout
from hetpipe_jax.plan.tensor_groups import lead_cluster, tp_degrees, type_degrees
from hetpipe_jax.runtime.numerics.stage import DEFAULT_OPTIONS, Stage, StageOptions
from hetpipe_jax.sim import SimJob, simulate
from hetpipe_jax.studies.convergence import run_convergence
from hetpipe_jax.studies.convergence_config import ConvergenceConfig
from hetpipe_jax.systems.registry import get_system
from hetpipe_jax.tensor import COLUMNS, ROWS, SPLIT, WHOLE
from hetpipe_jax.tune import SearchSpace, TuneOptions, tune
from hetpipe_jax.tune.result import candidate_json

from helpers import assert_trace_ok

ROOT = Path(__file__).resolve().parents[1]

MODEL = gpt(vocab_size=16, layers=2, width=16, heads=4, context=8)
TOKENS = jax.random.randint(jax.random.key(1), (4, 8), 0, 16)
LABELS = jnp.roll(TOKENS, -1, axis=1)
PARAMS = MODEL.init(jax.random.key(0), TOKENS)


def run(devices, units=range(4), tx=None, steps=3, options=DEFAULT_OPTIONS):
  """(outputs, input gradients, final weights) of ``steps`` forwards and backwards of a stage on ``devices``."""
  first, last = units.start, units.stop
  stage = Stage(MODEL, units, PARAMS[first:last], devices, tx or optax.adam(1e-2), nm=1, options=options)
  x = TOKENS if first == 0 else MODEL.apply(PARAMS, TOKENS, 0, first)
  labels = LABELS if last == MODEL.num_units else None
  outs, grads = [], []
  for mb in range(1, steps + 1):  # Nm = 1: minibatch mb is wave mb - 1
    out = stage.forward(mb, jax.device_put(x, stage.device), labels)
    ct = 1e-3 * jax.random.normal(jax.random.key(mb), out.shape)  # a middle stage's incoming gradient
    g = stage.backward(mb, None if stage.is_last else jax.device_put(ct, stage.device))
    stage.take_wave(mb - 1)
    outs.append(np.asarray(out))
    grads.append(None if g is None else np.asarray(g))
  return outs, grads, jax.tree.map(np.asarray, stage.params), stage


def assert_close(a, b, tol):
  """Equal within ``tol`` of each array's largest magnitude (a sum in another order rounds alike)."""
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
    np.testing.assert_allclose(x, y, atol=tol * float(np.max(np.abs(y))), rtol=0)


@pytest.mark.parametrize("degree", [2, 4])
@pytest.mark.parametrize("units", [range(0, 4), range(1, 3)], ids=["whole model", "blocks"])
def test_a_split_stage_computes_what_one_device_computes(degree, units):
  sgd = optax.sgd(0.05, momentum=0.9)  # not Adam: it scales the rounding noise of a zero gradient (the key bias's)
  one = run([jax.devices()[0]], units, sgd)
  split = run(jax.devices()[:degree], units, sgd)
  for i in range(3):  # the outputs and input gradients, and the weights after three updates
    assert_close(one[i], split[i], 2e-5)
  assert split[3].tp == degree and one[3].tp == 1


@pytest.mark.slow
def test_recomputation_in_a_split_stage_keeps_the_numerics():
  plain = run(jax.devices()[:2], range(1, 3), optax.sgd(0.05))
  again = run(jax.devices()[:2], range(1, 3), optax.sgd(0.05), options=StageOptions(recompute="selective"))
  for i in range(3):
    assert_close(plain[i], again[i], 2e-5)


def split_as(array, spec) -> bool:
  return array.sharding.is_equivalent_to(NamedSharding(array.sharding.mesh, spec), array.ndim)


def test_weights_and_optimizer_state_are_split_as_megatron_does():
  *_, stage = run(jax.devices()[4:8], steps=1)
  block = stage.params[1]
  assert split_as(block["qkv"]["kernel"], COLUMNS) and split_as(block["proj"]["kernel"], ROWS)
  assert split_as(block["fc"]["kernel"], COLUMNS) and split_as(block["out"]["kernel"], ROWS)
  assert split_as(block["fc"]["bias"], SPLIT) and split_as(block["out"]["bias"], WHOLE)
  assert split_as(block["ln1"]["scale"], WHOLE) and not split_as(block["fc"]["kernel"], WHOLE)
  assert split_as(stage.params[0]["tokens"]["embedding"], WHOLE)  # the embedding has no rule: whole
  assert split_as(stage.params[3]["logits"]["kernel"], COLUMNS)  # the head splits the vocabulary
  shards = block["fc"]["kernel"].addressable_shards
  assert {s.device for s in shards} == set(jax.devices()[4:8]) and {s.data.shape for s in shards} == {(16, 16)}
  assert split_as(stage.state.opt_state[0].mu[1]["fc"]["kernel"], COLUMNS)  # Adam's moments split alike


def collectives(hlo: str | None) -> collections.Counter:
  return collections.Counter(re.findall(r"= \S+ (all-reduce|all-gather|all-to-all|reduce-scatter)\(", hlo or ""))


def test_the_compiled_block_sums_its_partial_products_with_two_all_reduces_each_way():
  stage = Stage(MODEL, range(1, 2), PARAMS[1:2], jax.devices()[:2], optax.sgd(0.1), nm=1)
  x = jax.device_put(MODEL.apply(PARAMS, TOKENS, 0, 1), stage.device)
  out, vjp = stage._fwd(stage.params, x, None)
  forward = stage._fwd.lower(stage.params, x, None).compile().as_text()
  backward = stage._bwd_first.lower(vjp, out, stage.params, stage.state.opt_state, None, {}).compile().as_text()
  # Megatron-LM's f and g: one all-reduce after attention and one after the MLP, and the same two backward;
  # no weight is gathered (each device computes with its own part)
  assert collectives(forward) == collectives(backward) == {"all-reduce": 2}


def test_a_resumed_split_stage_continues_bit_identically():
  devices = jax.devices()[:2]
  _, _, _, stage = run(devices, steps=2)
  snapshot = jax.tree.map(np.asarray, stage.checkpoint_state())
  resumed = Stage(MODEL, range(4), PARAMS, devices, optax.adam(1e-2), nm=1)
  resumed.warm_up(TOKENS, jax.device_put(LABELS, resumed.device))
  resumed.restore_checkpoint_state(snapshot)
  assert split_as(resumed.params[1]["qkv"]["kernel"], COLUMNS)
  for s in (stage, resumed):
    s.forward(3, jax.device_put(TOKENS, s.device), jax.device_put(LABELS, s.device))
    s.backward(3, None)
  for a, b in zip(jax.tree.leaves(stage.state), jax.tree.leaves(resumed.state)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_a_degree_that_does_not_divide_the_heads_is_refused():
  with pytest.raises(ConfigError, match="tensor-parallel degree 3 does not divide GPT block's heads"):
    Stage(MODEL, range(1, 2), PARAMS[1:2], jax.devices()[:3], optax.sgd(0.1), nm=1)


# --- the layout, the cost and memory models, a run ---------------------------------------------------------------

GPU = GpuType("G", 16 * GIB, 1e13, 1e13, 5e11)
NODES = make_cluster("two_nodes", [[GPU] * 4, [GPU] * 4], LINKS["pcie3"], LINKS["eth10"])


def test_a_split_profile_is_worked_by_hand():
  split = TensorSplit(split_param_bytes=800, in_bytes=64, fwd_allreduces=2, bwd_allreduces=2, whole_kept_bytes=100)
  unit = UnitProfile("block", 40.0, 80.0, 400.0, 800.0, 1000, 64, 500, tp=split)
  half = unit.split(4)
  assert (half.fwd_flops, half.bwd_flops, half.fwd_bytes, half.bwd_bytes) == (10.0, 20.0, 100.0, 200.0)
  assert half.param_bytes == 200 + 800 // 4 and half.kept_bytes == 100 + 400 // 4 and half.degree == 4
  assert half.allreduce_bytes("fwd") == (2, 64) and unit.allreduce_bytes("fwd") == (0, 0)
  plain = dataclasses.replace(unit, tp=None).split(4)  # no rule: whole on every device
  assert (plain.fwd_flops, plain.param_bytes, plain.allreduce_bytes("bwd")) == (40.0, 1000, (0, 0))
  with pytest.raises(ConfigError, match="split over 4 already"):
    half.split(2)


def test_a_ring_all_reduce_is_worked_by_hand():
  link, gpus = NODES.link(NODES.gpus[0], NODES.gpus[1]), NODES.gpus[:4]
  expected = 2 * 3 * (link.latency_s + 1e6 / 4 / link.bytes_per_s)  # 2 (t - 1) steps of a quarter each
  assert allreduce_seconds(NODES, gpus, 1e6) == pytest.approx(expected)
  assert allreduce_seconds(NODES, gpus[:1], 1e6) == 0.0


def test_the_cost_model_charges_a_split_stage_its_share_and_its_all_reduces():
  profiles = profile_units(MODEL, jax.ShapeDtypeStruct(TOKENS.shape, TOKENS.dtype), cache_dir=None)
  g = NODES.gpus
  one = Layout((VWLayout((g[0],), (0, 4), 1),))
  two = Layout((VWLayout((g[0],), (0, 4), 1, tp=((g[1],),)),))
  assert two.num_gpus == 2 and two.meta()["tp"] == [[[g[1].name]]] and "tp" not in one.meta()
  # a run's GPU count read back from its meta line counts the partners (the convergence table's column)
  four = Layout((VWLayout((g[0], g[4]), (0, 2, 4), 1, tp=((g[1], g[2], g[3]), (g[5],))),))
  assert [meta_gpus(x.meta()) for x in (one, two, four)] == [1, 2, 6] == [x.num_gpus for x in (one, two, four)]
  c1, c2 = CostModel(NODES, profiles, one), CostModel(NODES, profiles, two)
  halves = [u.split(2) for u in profiles]
  for kind, k in (("fwd", 0), ("bwd", 1)):
    compute = sum(unit_seconds(u, GPU)[k] for u in halves)
    reduce = sum(n * allreduce_seconds(NODES, g[:2], b) for n, b in (u.allreduce_bytes(kind) for u in halves) if n)
    assert c2.compute_seconds(0, 0, kind) == pytest.approx(compute + reduce) and reduce > 0
    assert c1.compute_seconds(0, 0, kind) == pytest.approx(sum(unit_seconds(u, GPU)[k] for u in profiles))
  memory = lambda layout: stage_memory_bytes(vw_profiles(profiles, layout.vws[0]), 1)
  assert memory(two) < memory(one)
  for mode in ("selective", "full"):  # a split and a recomputation commute
    a, b = profiles[1].split(2).under(mode), profiles[1].under(mode).split(2)
    assert (a.bwd_flops, a.kept_bytes, a.transient_bytes) == pytest.approx((b.bwd_flops, b.kept_bytes,
                                                                             b.transient_bytes), abs=1)


def test_the_simulators_network_carries_a_split_stages_all_reduces_on_its_nodes_link():
  # one node of 4 GPUs on a 1 GB/s link: a block's 2 forward all-reduces of 100 MB over 2 GPUs move 2 x 100 MB
  # per GPU (the ring's 2 (p - 1) / p) after its 0.8 s of compute (4e12 flops at half of 1e13 flop/s); alone that
  # is the cost model's task time, and
  # two split stages computing at once share the link: 0.2 s more each
  link = Link("pcie", 1e9, 1e-6)
  cluster = make_cluster("one_node", [[GPU] * 4], link, link)
  split = TensorSplit(split_param_bytes=800, in_bytes=100_000_000, fwd_allreduces=2, bwd_allreduces=2,
                      whole_kept_bytes=0)
  profiles = [UnitProfile("block", 8e12, 16e12, 0.0, 0.0, 1000, 64, 0, tp=split)]
  g = cluster.gpus
  stage = lambda lead, partner: VWLayout((g[lead],), (0, 1), 1, tp=((g[partner],),))
  fwd = lambda layout: [e["t1"] - e["t0"] for e in _sim_events(cluster, profiles, layout) if e["ev"] == "fwd"][:2]
  alone = CostModel(cluster, profiles, Layout((stage(0, 1),))).task_seconds(0, 0, "fwd")
  assert alone == pytest.approx(0.8 + 4 * 1e-6 + 0.2, rel=1e-9)  # compute, 2 x 2 ring steps' latency, 200 MB
  assert fwd(Layout((stage(0, 1),)))[0] == pytest.approx(alone, rel=1e-9)
  assert fwd(Layout((stage(0, 1), stage(2, 3)))) == pytest.approx([alone + 0.2] * 2, rel=1e-9)


def test_the_peers_simulator_carries_them_alike():
  link = Link("pcie", 1e9, 1e-6)
  cluster = make_cluster("one_node", [[GPU] * 4], link, link)
  split = TensorSplit(split_param_bytes=800, in_bytes=100_000_000, fwd_allreduces=2, bwd_allreduces=2,
                      whole_kept_bytes=0)
  profiles = fixed([UnitProfile("block", 8e12, 16e12, 0.0, 0.0, 1000, 64, 0, tp=split)], 1)
  g = cluster.gpus
  worker = lambda lead, partner: Worker((g[lead],), (0, 1), 1, tp=((g[partner],),))

  def forward_seconds(workers):
    timeline = simulate_sync(SyncJob("t", cluster, workers, profiles, rounds=1)).timeline
    return [b - a for d, a, b, cat, label in timeline["intervals"] if label == "F1" and d in (0, 2)]
  assert forward_seconds((worker(0, 1),)) == pytest.approx([0.8 + 4e-6 + 0.2], rel=1e-9)
  assert forward_seconds((worker(0, 1), worker(2, 3))) == pytest.approx([0.8 + 4e-6 + 0.4] * 2, rel=1e-9)


def _sim_events(cluster, profiles, layout):
  trace = Trace()
  simulate(SimJob(cluster, profiles, layout, 0, 1), trace)
  assert_trace_ok(trace.events)
  return trace.events


def test_a_stage_split_over_gpus_of_another_node_or_twice_is_refused():
  g = NODES.gpus
  with pytest.raises(ConfigError, match=r"split over \['n1.G.4'\], not GPUs of its node and type"):
    VWLayout((g[0],), (0, 4), 1, tp=((g[4],),))
  with pytest.raises(ConfigError, match="hold a GPU twice"):
    VWLayout((g[0], g[1]), (0, 2, 4), 1, tp=((g[1],), ()))
  assert VWLayout((g[0],), (0, 4), 1, tp=((),)).tp is None


@pytest.mark.parametrize("fields, message", [
    (dict(tp=0), "tp=0; the GPUs a stage is split over must be >= 1"),
    (dict(tp="auto"), "tp=auto asks the planner for the tensor-parallel degree, which needs a policy"),
    (dict(tp="per_type"), "tp=per_type asks the planner for the tensor-parallel degree, which needs a policy"),
    (dict(tp="two"), "tp='two'; give the GPUs each stage is split over"),
    (dict(tp=2, policy=[[0, 2], [4, 6]]), "tp=2 with a grouping of GPU indices and no cuts"),
    (dict(tp=2, policy=[[1, 2]], cuts=[[0, 2, 4]], nm=1), r"tp=2: GPU 1 \(n0.A.1\) is not the first GPU of its "
                                                         r"group of 2 .*; name the groups' leads: \[0, 2, 4, 6\]"),
    (dict(tp=8, policy="ED"), r"tp=8: node 0 of cluster 'hetero4' has 2 .* GPUs, which do not divide into groups "
                              r"of 8 .*; use tp in \[1, 2\] or auto"),
    (dict(tp=2, time_model="gpt2-xl"), "tp=2 with time_model=.gpt2-xl. and a layout by num_vws and stages: .*policy"),
    (dict(tp=2, num_vws=3, stages=2), r"need 12 GPUs, but cluster 'hetero4' has 8; use fewer virtual workers "
                                      r"\(num_vws=2 with these stages, say\)"),
])
def test_a_tp_the_run_cannot_take_is_refused_in_one_line(fields, message):
  with pytest.raises(ConfigError, match=message):
    run_hetpipe(MODEL, tokens(num_train=64, num_test=8, vocab_size=16, seq_len=8), RunConfig.of(**fields))


def test_the_planner_plans_a_degree_on_its_groups_leads_and_prices_it_as_the_cost_model_does():
  profiles = profile_units(MODEL, jax.ShapeDtypeStruct(TOKENS.shape, TOKENS.dtype), cache_dir=None)
  leads, partners = lead_cluster(NODES, 2)
  assert [g.index for g in leads.gpus] == [0, 2, 4, 6] and partners == {i: (NODES.gpus[i + 1],) for i in (0, 2, 4, 6)}
  assert tp_degrees(NODES) == [1, 2, 4]
  plan = plan_cluster(NODES, profiles, "NP", tp=2)
  assert plan.layout.num_gpus == NODES.num_gpus and len(plan.vws) == 2
  model = CostModel(NODES, profiles, plan.layout)
  for i, vw in enumerate(plan.layout.vws):
    assert all(vw.degree(j) == 2 and vw.stage_gpus(j)[1].index == vw.gpus[j].index + 1 for j in range(vw.k))
    for j, stage in enumerate(plan.vws[i].stages):  # the planner's stage time is the clock's (two tasks)
      clock = model.task_seconds(i, j, "fwd") + model.task_seconds(i, j, "bwd")
      assert stage.seconds == pytest.approx(clock, rel=1e-12)
  # the leads' cluster with each unit split by hand (the DP adds the all-reduces on the node's link) plans alike
  by_hand = plan_cluster(leads, [u.split(2) for u in profiles], "NP")
  assert [p.cuts for p in by_hand.vws] == [p.cuts for p in plan.vws]
  assert plan.throughput == pytest.approx(by_hand.throughput, rel=1e-12)
  best = plan_cluster(NODES, profiles, "NP", tp="auto")
  every = [plan_cluster(NODES, profiles, "NP", tp=t).throughput for t in tp_degrees(NODES)]
  assert best.throughput == max(every)


FAST, SLOW = GpuType("F", 16 * GIB, 2e13, 2e13, 1e12), GpuType("S", 16 * GIB, 5e12, 5e12, 2.5e11)
MIXED = make_cluster("mixed_nodes", [[FAST] * 4, [SLOW] * 4], LINKS["nvlink2"], LINKS["eth10"])


def test_a_degree_per_gpu_type_groups_each_type_by_its_own():
  leads, partners = lead_cluster(MIXED, {"F": 4, "S": 2})
  assert [g.index for g in leads.gpus] == [0, 4, 6]
  assert partners == {0: tuple(MIXED.gpus[1:4]), 4: (MIXED.gpus[5],), 6: (MIXED.gpus[7],)}
  assert type_degrees(MIXED, "F") == [1, 2, 4]
  with pytest.raises(ConfigError, match=r"tp=8: node 1 of cluster 'mixed_nodes' has 4 S GPUs, which do not divide "
                                        r"into groups of 8 .*; use tp in \[1, 2, 4\] or auto"):
    lead_cluster(MIXED, {"S": 8})


def test_a_plan_at_a_degree_per_type_prices_each_stage_at_its_own_degree():
  profiles = profile_units(MODEL, jax.ShapeDtypeStruct(TOKENS.shape, TOKENS.dtype), cache_dir=None)
  same = plan_cluster(NODES, profiles, "NP", tp={"G": 2})  # one type: the uniform degree's plan
  uniform = plan_cluster(NODES, profiles, "NP", tp=2)
  assert same.layout == uniform.layout and same.throughput == pytest.approx(uniform.throughput, rel=1e-12)
  plan = plan_cluster(MIXED, profiles, "NP", tp={"F": 4, "S": 2})
  model = CostModel(MIXED, profiles, plan.layout)
  for i, vw in enumerate(plan.layout.vws):
    assert all(vw.degree(j) == {"F": 4, "S": 2}[g.type.name] for j, g in enumerate(vw.gpus))
    for j, stage in enumerate(plan.vws[i].stages):  # the planner's stage time is the clock's (two tasks)
      clock = model.task_seconds(i, j, "fwd") + model.task_seconds(i, j, "bwd")
      assert stage.seconds == pytest.approx(clock, rel=1e-12)


def test_per_type_finds_a_degree_per_type_that_no_single_change_improves():
  # GPT-2 XL (Adam, recomputation) under HD on a node of 4 fast and a node of 4 slow GPUs, NVLink inside: the slow
  # node's stages split over 4 and the fast one's over 2 beat every uniform degree (0.426 against 0.420
  # sequences/s at degree 2), and no combination of the 3 x 3 does better
  profiles = BatchProfiles.full_size("gpt2-xl", 8).at(8)
  costs = CostContext(optimizer_slots=2.0, recompute="auto")
  plan = lambda tp: plan_cluster(MIXED, profiles, "HD", "default", "max_fit", None, costs, tp)
  best = plan("per_type")
  found = {g.type.name: vw.degree(j) for vw in best.layout.vws for j, g in enumerate(vw.gpus)}
  assert found == {"F": 2, "S": 4} and best.throughput > plan("auto").throughput
  every = [plan({"F": f, "S": t}).throughput for f in type_degrees(MIXED, "F") for t in type_degrees(MIXED, "S")]
  assert best.throughput == pytest.approx(max(every), rel=1e-12)


def test_a_run_at_a_degree_per_type_simulates_the_mixed_stages_and_checks_its_trace():
  config = RunConfig.of(cluster=MIXED, policy="HD", tp="per_type", nm="max_fit", recompute="auto", optimizer="adam",
                        batch_size=8, executor="sim", waves=4)
  result = run_hetpipe(full_size_model("gpt2-xl"), full_size_spec("gpt2-xl", 8), config)
  assert_trace_ok(result.events)
  meta = result.events[0]
  degrees = {(g.split(".")[1], len(p) + 1) for gs, ps in zip(meta["gpus"], meta["tp"]) for g, p in zip(gs, ps)}
  assert len(degrees) == 2 and {t for t, _ in degrees} == {"F", "S"}  # one degree per type, and not the same one
  assert len({d for _, d in degrees}) == 2


def test_a_split_plan_that_fits_no_memory_says_so_at_its_degree():
  tiny = GpuType("T", 1 << 16, 1e13, 1e13, 5e11)  # 64 KiB: the small GPT's stages fit at no degree
  cluster = make_cluster("tiny_nodes", [[tiny] * 2, [tiny] * 2], LINKS["pcie3"], LINKS["eth10"])
  profiles = profile_units(MODEL, jax.ShapeDtypeStruct(TOKENS.shape, TOKENS.dtype), cache_dir=None)
  for tp in (2, {"T": 2}):
    with pytest.raises(ConfigError, match=r"no partition of the model over 1 GPUs \(n0.T.0\) fits in memory"):
      plan_cluster(cluster, profiles, "ED", tp=tp)


def test_the_planner_refuses_a_degree_that_does_not_divide_a_node_in_one_line():
  with pytest.raises(ConfigError, match=r"tp=3: node 0 of cluster 'two_nodes' has 4 G GPUs, which do not divide "
                                        r"into groups of 3 .*; use tp in \[1, 2, 4\] or auto"):
    lead_cluster(NODES, 3)


def test_a_pipeline_peer_splits_its_stages_as_the_planner_does():
  units = profile_units(MODEL, jax.ShapeDtypeStruct(TOKENS.shape, TOKENS.dtype), cache_dir=None)
  job = sync_pipeline_job(NODES, fixed(units, 4), 4, PeerKnobs(policy="NP", tp=2, microbatches=2))
  assert dict(job.knobs)["gpus"] == 8 and dict(job.knobs)["tp"] == 2
  plan = plan_cluster(NODES, units, "NP", costs=CostContext(weight_mode="latest"), tp=2)
  assert [(w.gpus, w.tp) for w in job.workers] == [(tuple(p.gpus), p.tp) for p in plan.vws]
  timeline = simulate_sync(job).timeline
  spans = collections.defaultdict(list)
  for device, start, end, category, label in timeline["intervals"]:
    if category == "compute":
      spans[device].append((start, end, label))
  lead, partner = NODES.gpus[0].index, NODES.gpus[1].index
  assert spans[lead] and spans[lead] == spans[partner]  # a split stage's GPUs work alike
  w = job.workers[0]
  stage = next(j for j in range(len(w.gpus)) if w.gpus[j].index == lead)
  forward = sum(unit_seconds(u.split(2), GPU)[0] + split_allreduce_seconds(NODES, u.split(2))[0]
                for u in units[w.cuts[stage]:w.cuts[stage + 1]])  # its share, and its all-reduces on the node's link
  first = min((s for s in spans[lead] if s[2] == "F1"), key=lambda s: s[0])
  assert first[1] - first[0] == pytest.approx(forward, rel=1e-9)
  for name in ("sync_pipeline", "hetpipe"):  # a system's run counts the partners among its GPUs
    knobs = PeerKnobs(policy="NP", tp=2, microbatches=2)
    assert get_system(name).simulate(NODES, fixed(units, 4), 4, knobs).gpus == 8


@pytest.mark.slow
@pytest.mark.parametrize("layout, gpus, partners", [
    (dict(num_vws=2, stages=2, nm=2), [["n0.A.0", "n1.B.2"], ["n2.C.4", "n3.D.6"]],  # each stage its node's two
     [[["n0.A.1"], ["n1.B.3"]], [["n2.C.5"], ["n3.D.7"]]]),
    (dict(policy="ED"), None, [[["n0.A.1"], ["n1.B.3"], ["n2.C.5"], ["n3.D.7"]]]),  # the planner's order of leads
], ids=["num_vws", "policy"])
def test_a_run_with_split_stages_trains_and_says_so_in_its_trace(layout, gpus, partners):
  data = tokens(num_train=256, num_test=32)
  config = RunConfig.of(cluster="hetero4", d=1, waves=4, batch_size=8, tp=2, eval_every=100, **layout)
  result = run_hetpipe(get_model("gpt", data.num_classes), data, config)
  assert_trace_ok(result.events)
  meta = result.events[0]
  if gpus is not None:
    assert meta["gpus"] == gpus
  assert sorted(map(sorted, meta["tp"])) == sorted(map(sorted, partners))
  node = lambda name: name.split(".")[0]
  assert all(node(p) == node(g) for vw_g, vw_p in zip(meta["gpus"], meta["tp"])  # a stage's partners: its node's
             for g, stage_partners in zip(vw_g, vw_p) for p in stage_partners)
  losses = [m["train_loss"] for m in result.metrics if "train_loss" in m]
  assert np.isfinite(losses).all()
  report = efficiency_report(result.events)  # the layout rebuilt from the trace, with its partners
  assert report["ideal_images_per_sec"] > 0


@pytest.mark.slow
def test_the_convergence_study_times_split_stages_and_trains_them_on_their_leads():
  # GPT-2 XL's clock on 4 nodes of 2 GPUs, stages split over 2 GPUs: HetPipe ED's row is the throughput study's
  # "tp=2" row, its clock the sim executor's of the split plan (one VW of 4 two-GPU stages), its numerics the
  # small GPT on each stage's lead (a split stage computes what one device does), its trace checked
  config = ConvergenceConfig(get_cluster("hetero4"), model="gpt6", dataset="text", time_model="gpt2-xl",
                             policies=("ED",), systems=("sync_pipeline",), knobs=PeerKnobs(tp=2), optimizer="adam",
                             batch_size=8, recompute="auto", tuned=True, tuned_objective="throughput", ds=(0,),
                             outer="", lr_grid=(1.0,), seeds=(0,), epochs=0.02, eval_examples=256,
                             eval_test_examples=64, target_accuracy=10.0, target_metric="loss")
  result = run_convergence(config)
  (hetpipe, tuned) = [r for r in result.runs if r.system == "hetpipe"]
  # its GPU count is the timed layout's, partners included (the numerics run on the 4 leads of these 8 GPUs)
  assert hetpipe.name == "HetPipe ED D=0 tp=2" and hetpipe.gpus == 8
  # the tuned row searches the study's degree: its grouping is of the leads, trained on them, timed split
  assert "tp=2" in tuned.name and tuned.gpus <= 8 and tuned.gpus % 2 == 0 and tuned.wsp is not None
  split = plan_cluster(config.cluster, BatchProfiles.full_size("gpt2-xl", 8).at(8), "ED", "default", "max_fit", None,
                       CostContext(optimizer_slots=2.0, recompute="auto"), 2)
  assert len(split.vws) == 1 and hetpipe.nm == [vw.nm for vw in split.vws]
  assert hetpipe.images_per_sec > 0 and hetpipe.wsp is not None  # (its trace checked by the study)
  (peer,) = [r for r in result.runs if r.system == "sync_pipeline"]
  assert peer.images_per_sec > 0


def test_the_tuner_searches_the_degree_on_each_degrees_leads():
  units = profile_units(MODEL, jax.ShapeDtypeStruct(TOKENS.shape, TOKENS.dtype), cache_dir=None)
  space = SearchSpace(ds=(0,), placements=("default",), transfers=(False,), staged=(False,), tp="auto", nm_max=4)
  out = tune(NODES, units, 4, space, TuneOptions(waves=4, screen=64, refine=64, workers=1))
  split = [r for r in out.results if "tp=" in r.candidate.grouping]
  assert split and {r.candidate.grouping.rsplit("tp=", 1)[1] for r in split} == {"2", "4"}
  assert any("tp=" not in r.candidate.grouping for r in out.results)  # degree 1 is searched too
  for r in split:
    layout, t = r.candidate.layout, int(r.candidate.grouping.rsplit("tp=", 1)[1])
    assert layout.num_gpus == t * sum(vw.k for vw in layout.vws)
    assert all(vw.degree(j) == t for vw in layout.vws for j in range(vw.k))
    stages = [p.tp or () for p in r.candidate.plans]
    assert candidate_json(r.candidate)["tp"] == [[[g.index for g in s] for s in p] for p in stages]


@pytest.mark.slow  # about 30 s of subprocesses
def test_a_tuned_plan_with_split_stages_runs_from_the_plan(tmp_path):
  """The tuner's best configuration at tp=2 (GPT-2 XL's clock on 4 nodes of 2 GPUs) runs from its plan: on sim
  it reproduces the prediction, on the virtual executor the small GPT trains on its clock, the trace checked."""
  env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=8", "JAX_PLATFORMS": "cpu"}
  run = lambda *args: subprocess.run([sys.executable, "-m", *args], cwd=ROOT, env=env, capture_output=True, text=True,
                                     timeout=300)
  proc = run("experiments.tune", "--model=gpt2-xl", "--cluster=hetero4", "--tp=2", "--optimizer=adam",
             "--recompute=auto", "--batch_size=8", "--waves=6", "--peers=", f"--out_dir={tmp_path}")
  assert proc.returncode == 0, proc.stderr[-2000:]
  best = json.loads((tmp_path / "tune.json").read_text())["best_hetpipe"]
  assert best["grouping"].endswith("tp=2") and all(len(p) == 1 for vw in best["tp"] for p in vw)
  plan = f"--plan={tmp_path / 'tune.json'}"
  proc = run("experiments.train", plan, "--plan_entry=best_hetpipe", "--executor=sim", f"--out_dir={tmp_path / 'sim'}")
  assert proc.returncode == 0, proc.stderr[-2000:]
  summary = json.loads((tmp_path / "sim" / "summary.json").read_text())
  assert summary["tokens_per_second"] / 1024 == pytest.approx(best["images_per_sec"], rel=0.02)
  meta = json.loads((tmp_path / "sim" / "trace.jsonl").read_text().splitlines()[0])
  assert meta["tp"] == [[[f"n{g // 2}.{'ABCD'[g // 2]}.{g}" for g in stage] for stage in vw] for vw in best["tp"]]
  proc = run("experiments.train", plan, "--plan_entry=best_hetpipe", "--executor=virtual", "--model=gpt",
             "--dataset=text", "--waves=2", f"--out_dir={tmp_path / 'virtual'}")
  assert proc.returncode == 0, proc.stderr[-2000:]
  assert "trace check: OK" in proc.stdout
  proc = run("experiments.train", plan, "--plan_entry=best_hetpipe", "--executor=sim", "--tp=1")
  assert proc.returncode == 1
  assert proc.stderr.strip().splitlines()[-1].startswith("error: --tp=1 disagrees with --plan=")
