"""Activation recomputation: a stage under selective or full recomputation computes what it computes without,
keeps fewer bytes for its backward passes, and the profile, the memory model and the planner charge it."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from hetpipe_jax import ConfigError, RunConfig, get_model, run_hetpipe
from hetpipe_jax.cluster import GIB, LINKS, GpuType, get_cluster, make_cluster
from hetpipe_jax.cost.batch import BatchProfiles
from hetpipe_jax.cost.context import CostContext
from hetpipe_jax.cost.memory import nbytes, stage_memory_bytes
from hetpipe_jax.cost.profile import profile_units
from hetpipe_jax.data import tokens
from hetpipe_jax.models.gpt import gpt
from hetpipe_jax.plan.layout import VWLayout
from hetpipe_jax.plan.partition import partition
from hetpipe_jax.recompute import MODES, checkpointed
from hetpipe_jax.runtime.numerics.stage import Stage, StageOptions
from hetpipe_jax.studies.throughput_records import ThroughputConfig
from hetpipe_jax.systems import get_system

from helpers import assert_trace_ok

MODEL = gpt(vocab_size=32, layers=1, width=32, heads=4, context=16, name="tiny_gpt")


@functools.cache
def _params() -> tuple:
  return MODEL.init(jax.random.key(0), jnp.zeros((4, 16), jnp.int32))


def _stage(units: range, mode: str) -> Stage:
  return Stage(MODEL, units, _params()[units.start:units.stop], jax.devices()[0], optax.sgd(0.1), 2,
               StageOptions(recompute=mode))


def _input(units: range) -> jax.Array:
  tokens = jax.random.randint(jax.random.key(1), (4, 16), 0, 32)
  return tokens if units.start == 0 else jax.jit(MODEL.apply, static_argnums=(2, 3))(_params()[:units.start],
                                                                                     tokens, 0, units.start)


def test_a_recomputing_stage_computes_what_it_computes_without_and_keeps_less():
  units = range(1, 3)  # block and head: an input gradient and the loss (the first stage's: the run below)
  x, labels = _input(units), jax.random.randint(jax.random.key(2), (4, 16), 0, 32)
  out, kept, grads, weights = {}, {}, {}, {}
  for mode in MODES:
    stage = _stage(units, mode)
    last = units.stop == MODEL.num_units
    out[mode] = stage.forward(1, x, labels if last else None)
    kept[mode] = nbytes(jax.tree.leaves(stage._saved[1])) - nbytes(stage.params)
    g = None if last else jnp.ones_like(out[mode])
    grads[mode] = stage.backward(1, g)
    weights[mode] = stage.params
  for mode in ("selective", "full"):
    np.testing.assert_allclose(out[mode], out["none"], rtol=1e-6, atol=1e-6)
    if units.start > 0:
      np.testing.assert_allclose(grads[mode], grads["none"], rtol=1e-5, atol=1e-6)
    for a, b in zip(jax.tree.leaves(weights[mode]), jax.tree.leaves(weights["none"])):
      np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
  assert kept["full"] < kept["selective"] < kept["none"], kept


def test_the_profile_measures_each_mode_and_under_charges_it():
  profiles = profile_units(MODEL, jax.ShapeDtypeStruct((8, 16), jnp.int32), cache_dir=None)
  block = profiles[1]
  assert block.selective is not None and block.full is not None
  assert block.full.kept_bytes < block.selective.kept_bytes < block.kept_bytes
  assert block.bwd_flops < block.selective.bwd_flops < block.full.bwd_flops  # the recomputed forward
  full = block.under("full")
  assert (full.bwd_flops, full.kept_bytes) == (block.full.bwd_flops, block.full.kept_bytes)
  assert full.transient_bytes == block.kept_bytes - block.full.kept_bytes
  assert block.under("none") is block
  with pytest.raises(ConfigError, match="recompute='some'"):
    block.under("some")
  # full recomputation is charged one more forward on top of the backward, keeping the unit's input: XLA's own
  # analysis of the recomputing backward finds somewhat less (it drops what the backward does not need)
  f = lambda p, x: MODEL.units[1].apply({"params": p}, x)
  p = jax.eval_shape(lambda: MODEL.init(jax.random.key(0), jnp.zeros((8, 16), jnp.int32)))[1]
  x = jax.ShapeDtypeStruct((8, 16, 32), jnp.float32)
  residuals = jax.eval_shape(lambda p_, x_: jax.vjp(checkpointed(f, "full"), p_, x_)[1], p, x)
  measured = jax.jit(lambda vjp, ct: vjp(ct)).lower(residuals, x).cost_analysis()["flops"]
  assert 0.8 * block.full.bwd_flops < measured <= block.full.bwd_flops
  assert block.full.kept_bytes == nbytes(x)
  # weights, accumulator, one slot and 3 stashed versions; 3 minibatches kept, and one backward holds the
  # recomputed activations of one unit at a time: the largest
  costs = CostContext(optimizer_slots=1.0)
  stage = [u.under("full") for u in profiles[1:3]]
  want = sum(u.param_bytes for u in stage) * (2 + 1 + 3) + 3 * sum(u.kept_bytes for u in stage) + max(
      u.transient_bytes for u in stage)
  assert stage_memory_bytes(stage, 3, costs) == want


def test_auto_recomputes_where_memory_asks_for_it():
  """On GPUs too small for every activation, none does not fit (and says to recompute), full does at a cost in
  time, and auto takes the fastest mode that fits on each stage."""
  profiles = profile_units(MODEL, jax.ShapeDtypeStruct((512, 16), jnp.int32), cache_dir=None)
  costs = lambda mode: CostContext(optimizer_slots=2.0, recompute=mode)
  big = make_cluster("big", [[GpuType("G", 64 * GIB, 1e13, 1e13, 5e11)] * 2], LINKS["pcie3"], LINKS["eth10"])
  need = {m: max(s.memory_bytes for s in partition(big, profiles, big.gpus, 2, costs(m)).stages) for m in MODES}
  assert need["full"] < need["selective"] < need["none"]
  memory = (need["full"] + need["selective"]) // 2  # full fits, selective and none do not
  small = make_cluster("small", [[GpuType("G", memory, 1e13, 1e13, 5e11)] * 2], LINKS["pcie3"], LINKS["eth10"])
  with pytest.raises(ConfigError, match="recompute=full or auto"):
    partition(small, profiles, small.gpus, 2, costs("none"))
  auto = partition(small, profiles, small.gpus, 2, costs("auto"))
  assert "full" in {s.recompute for s in auto.stages}
  assert all(s.memory_bytes <= memory for s in auto.stages)
  fast = partition(big, profiles, big.gpus, 2, costs("auto"))
  assert {s.recompute for s in fast.stages} == {"none"}  # nothing to gain where everything fits
  assert fast.bottleneck_s < auto.bottleneck_s  # the recomputed forward costs time


def test_layout_rejects_a_mode_per_stage_that_is_not_one():
  gpus = tuple(get_cluster("hetero4").gpus[:2])
  with pytest.raises(ConfigError, match="recompute='some'"):
    VWLayout(gpus, (0, 1, 4), 1, recompute=("none", "some"))
  with pytest.raises(ConfigError, match="2 stages"):
    VWLayout(gpus, (0, 1, 4), 1, recompute=("full",))
  assert VWLayout(gpus, (0, 1, 4), 1, recompute=("none", "none")).recompute is None


@pytest.mark.slow
def test_a_run_with_recomputation_trains_as_without_and_says_so_in_its_trace():
  data = tokens(num_train=256, num_test=32, vocab_size=32, seq_len=16)
  runs = {mode: run_hetpipe(get_model("gpt", 32), data, RunConfig.of(
      cluster="hetero4", num_vws=1, stages=2, nm=2, d=0, waves=3, batch_size=8, recompute=mode, eval_every=100))
      for mode in ("none", "full")}
  for result in runs.values():
    assert_trace_ok(result.events)
  assert "recompute" not in runs["none"].events[0]
  assert runs["full"].events[0]["recompute"] == [["full", "full"]]
  np.testing.assert_allclose(runs["full"].metrics[-1]["train_loss"], runs["none"].metrics[-1]["train_loss"],
                             rtol=1e-5)


def test_a_peer_recomputes_on_every_gpu_alike():
  """A peer under full recomputation runs every GPU's backward with one more forward (slower where none fits
  too); under auto it runs the fastest mode it can (none where it fits, full on GPUs too small for the rest);
  profiles are taken under a mode once."""
  profiles = BatchProfiles.full_size("vgg19", 32)
  costs, horovod = CostContext(optimizer_slots=1.0), get_system("horovod")
  need = {m: stage_memory_bytes(profiles.under(m).at(32), 1, horovod.memory_costs(costs)) for m in MODES}
  assert need["full"] < need["selective"] <= need["none"]
  def cluster(memory):
    return make_cluster("c", [[GpuType("G", memory, 1e13, 1e13, 5e11)] * 2], LINKS["pcie3"], LINKS["eth10"])
  big, small = cluster(2 * need["none"]), cluster((need["full"] + need["selective"]) // 2)
  none = horovod.simulate(big, profiles, 32, costs=costs)
  full = horovod.simulate(big, profiles, 32, costs=costs._replace(recompute="full"))
  assert full.round_seconds > none.round_seconds and full.ideal_images_per_sec == none.ideal_images_per_sec
  assert full.timeline["meta"]["recompute"] == "full" and "recompute" not in none.timeline["meta"]
  auto = costs._replace(recompute="auto")
  assert horovod.simulate(big, profiles, 32, costs=auto).round_seconds == none.round_seconds
  assert horovod.simulate(small, profiles, 32, costs=auto).timeline["meta"]["recompute"] == "full"
  with pytest.raises(ConfigError, match="horovod: no worker"):
    horovod.simulate(small, profiles, 32, costs=costs)
  unit = profiles.under("full").at(32)[5]
  assert unit.under("full") is unit and unit.recompute == "full"
  with pytest.raises(ConfigError, match="under recompute=full already"):
    unit.under("selective")


def test_a_run_refuses_an_unknown_recomputation_in_one_line():
  with pytest.raises(ConfigError, match=r"recompute='most'; use one of none, selective, full, auto"):
    RunConfig.of(recompute="most").validate()


def test_hetpipe_fits_gpt2_xl_on_the_testbed_only_by_recomputing():
  """The system the studies simulate: GPT-2 XL with Adam in bf16 fits no 4-GPU pipeline of the paper testbed
  without recomputation, and runs with auto (the plan's stages say which mode they took)."""
  hetpipe, cluster = get_system("hetpipe"), get_cluster("paper_testbed")
  profiles = BatchProfiles.full_size("gpt2-xl", 8)
  costs = CostContext(optimizer_slots=2.0, precision="bf16")
  with pytest.raises(ConfigError, match="recompute=full or auto"):
    hetpipe.simulate(cluster, profiles, 8, costs=costs)
  run = hetpipe.simulate(cluster, profiles, 8, costs=costs._replace(recompute="auto"))
  assert run.images_per_sec > 0 and run.events[0]["recompute"]
  with pytest.raises(ConfigError, match="--recompute=most; choose one of none, selective, full, auto"):
    ThroughputConfig(cluster, recompute="most")
