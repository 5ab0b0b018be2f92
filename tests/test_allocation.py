"""Allocation policies on the paper testbed, shard placement, Horovod-eligible GPUs, cluster files."""

import pytest

from hetpipe_jax import ConfigError, get_cluster
from hetpipe_jax.cost.context import CostContext
from hetpipe_jax.cost.memory import stage_memory_bytes
from hetpipe_jax.cost.profile import full_size_profiles
from hetpipe_jax.plan.allocation import allocate, horovod_gpus, plan_cluster
from hetpipe_jax.plan.placement import ps_cross_node_bytes
from hetpipe_jax.plan.plan_json import plan_to_json

TESTBED = get_cluster("paper_testbed")


def types(group):
  return sorted(g.type.name for g in group)


def test_testbed_preset():
  assert TESTBED.num_gpus == 16 and TESTBED.num_nodes == 4
  assert [types(TESTBED.node_gpus(n))[0] for n in range(4)] == ["TITAN V", "TITAN RTX", "RTX 2060",
                                                                 "Quadro P4000"]
  assert TESTBED.inter_node.bytes_per_s == 7e9 and TESTBED.intra_node.name == "pcie3"


def test_np_is_one_vw_per_node():
  groups = allocate(TESTBED, "NP")
  assert len(groups) == 4 and all(len({g.node for g in grp}) == 1 and len(grp) == 4 for grp in groups)


def test_ed_gives_every_vw_one_gpu_of_each_type():
  groups = allocate(TESTBED, "ED")
  assert len(groups) == 4
  assert all(types(grp) == sorted(["TITAN V", "TITAN RTX", "RTX 2060", "Quadro P4000"]) for grp in groups)
  assert sorted(g.index for grp in groups for g in grp) == list(range(16))


def test_hd_pairs_fast_with_whimpy_nodes():
  groups = allocate(TESTBED, "HD")
  assert len(groups) == 4 and all(len(grp) == 4 for grp in groups)
  pairs = sorted(tuple(sorted(set(types(grp)))) for grp in groups)
  # fastest (TITAN RTX) with slowest (Quadro P4000), TITAN V with RTX 2060; two of each per VW
  assert pairs == [("Quadro P4000", "TITAN RTX")] * 2 + [("RTX 2060", "TITAN V")] * 2
  assert all(len({g.node for g in grp}) == 2 for grp in groups)


def test_custom_grouping_and_errors():
  assert [[g.index for g in grp] for grp in allocate(TESTBED, [[0, 5], [9]])] == [[0, 5], [9]]
  with pytest.raises(ConfigError, match="at most once"):
    allocate(TESTBED, [[0, 1], [1]])
  with pytest.raises(ConfigError, match="unknown allocation policy 'XY'"):
    allocate(TESTBED, "XY")
  with pytest.raises(ConfigError, match="ED gives every virtual worker one GPU of each type"):
    allocate(get_cluster("v100_t4").__class__("odd", TESTBED.gpus[:5]), "ED")


@pytest.fixture(scope="module")
def vgg19():
  return full_size_profiles("vgg19", 32)


def test_ed_local_placement_keeps_ps_traffic_inside_nodes(vgg19):
  local = plan_cluster(TESTBED, vgg19, "ED", "local", costs=CostContext(optimizer_slots=1))
  default = plan_cluster(TESTBED, vgg19, "ED", "default", costs=CostContext(optimizer_slots=1))
  assert all(ps_cross_node_bytes(vgg19, vw, local.shard_nodes, 4) == 0 for vw in local.layout.vws)
  assert all(ps_cross_node_bytes(vgg19, vw, default.shard_nodes, 4) > 0 for vw in default.layout.vws)
  assert len({tuple(p.cuts) for p in local.vws}) == 1  # ED: one shared partition plan
  assert len(set(default.shard_nodes)) == 4  # default spreads the shards over every node
  striped = plan_cluster(TESTBED, vgg19, "ED", "striped", costs=CostContext(optimizer_slots=1))
  assert all(ps_cross_node_bytes(vgg19, vw, striped.shard_nodes, 4) == sum(u.param_bytes * 3 // 4 for u in vgg19)
             for vw in striped.layout.vws)  # 3/4 of every unit leaves the node, whichever node runs it


@pytest.mark.parametrize("policy", ["NP", "ED", "HD"])
def test_plans_fit_memory_and_json_has_the_contract_fields(vgg19, policy):
  plan = plan_cluster(TESTBED, vgg19, policy, "default", costs=CostContext(optimizer_slots=1))
  doc = plan_to_json(TESTBED, vgg19, plan, "vgg19", 32)
  assert {"model", "batch_size", "policy", "placement", "vws", "layers", "links"} <= set(doc)
  for vw in doc["vws"]:
    assert {"devices", "nm", "stages", "bottleneck_s", "throughput"} <= set(vw)
    assert vw["bottleneck_s"] == max(s["time_s"] for s in vw["stages"])
    for s in vw["stages"]:
      assert s["memory_bytes"] <= s["memory_limit_bytes"]
      assert {"device", "first_layer", "last_layer", "time_s"} <= set(s)
    assert vw["stages"][0]["first_layer"] == 0 and vw["stages"][-1]["last_layer"] == 18
  assert {"name", "time_s", "param_bytes", "activation_bytes", "kept_bytes"} <= set(doc["layers"][0])
  assert set(doc["layers"][0]["time_s"]) == {"TITAN V", "TITAN RTX", "RTX 2060", "Quadro P4000"}


def test_horovod_uses_the_gpus_that_hold_the_whole_model():
  resnet152 = full_size_profiles("resnet152", 32)
  need = stage_memory_bytes(resnet152, 1, CostContext(weight_mode="latest", optimizer_slots=1))
  assert 8 << 30 < need < 12 << 30  # ~11.8 GiB: the 12 and 24 GB cards hold it, the 6 and 8 GB ones not
  gpus = horovod_gpus(TESTBED, resnet152, CostContext(optimizer_slots=1))
  assert {g.type.name for g in gpus} == {"TITAN V", "TITAN RTX"} and len(gpus) == 8


def test_cluster_toml(tmp_path):
  path = tmp_path / "lab.toml"
  path.write_text('name = "lab"\n[links]\nintra_node = "nvlink2"\ninter_node = {gbytes_per_s = 3, '
                  'latency_us = 8}\n[gpu_types.Mine]\nmemory_gib = 4\nfp32_tflops = 2.5\n'
                  'bandwidth_gbytes_per_s = 200\n[[nodes]]\ngpus = ["V100", "V100"]\n'
                  '[[nodes]]\ngpus = ["Mine"]\n')
  lab = get_cluster(str(path))
  assert lab.name == "lab" and lab.num_gpus == 3 and lab.num_nodes == 2
  assert lab.gpus[2].type.memory_bytes == 4 << 30 and lab.inter_node.bytes_per_s == 3e9
  assert lab.link(lab.gpus[0], lab.gpus[1]).name == "nvlink2"


@pytest.mark.parametrize("text,pattern", [
    ('[[nodes]]\ngpus = ["GTX 9090"]\n', r"nodes\[0\] has unknown GPU type 'GTX 9090' \(did you mean 'RTX 3090'\?\); "
     r"known: .*gpu_types"),
    ('name = "x"\n', r"no \[\[nodes\]\]"),
    ('[gpu_types.G]\nmemory_gib = -1\nfp32_tflops = 1\nbandwidth_gbytes_per_s = 1\n[[nodes]]\ngpus = ["G"]\n',
     r"gpu_types.'G'.memory_gib = -1; it must be a finite positive number \(GiB\)"),
    ('[links]\ninter_node = "carrier_pigeon"\n[[nodes]]\ngpus = ["T4"]\n',
     r"links.inter_node = 'carrier_pigeon' is not a known link"),
    ('nodes = [\n', "is not valid TOML"),
])
def test_bad_cluster_files(tmp_path, text, pattern):
  path = tmp_path / "bad.toml"
  path.write_text(text)
  with pytest.raises(ConfigError, match=pattern):
    get_cluster(str(path))
