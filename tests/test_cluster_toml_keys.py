"""A cluster file's typos are refused with the nearest valid key or name, at every level (issue 36)."""

import pytest

from hetpipe_jax import ConfigError
from hetpipe_jax.cluster import LINKS, get_cluster, load_cluster_toml

GOOD = '''name = "lab"
[links]
intra_node = "pcie3"
inter_node = "eth10"
[gpu_types.MyGPU]
memory_gib = 8
fp32_tflops = 5.0
bandwidth_gbytes_per_s = 300
[[nodes]]
gpus = ["V100", "MyGPU"]
'''


def _load(tmp_path, text):
  path = tmp_path / "c.toml"
  path.write_text(text)
  return load_cluster_toml(str(path))


def test_good_file_uses_its_links(tmp_path):
  cluster = _load(tmp_path, GOOD)
  assert cluster.inter_node == LINKS["eth10"] and cluster.intra_node == LINKS["pcie3"]


@pytest.mark.parametrize("old, new, pattern", [
    ('inter_node = "eth10"', 'inter_nodes = "eth10"', r"unknown key 'links.inter_nodes' \(did you "
     r"mean 'inter_node'\?\)"),
    ('name = "lab"', 'nmae = "lab"', r"unknown key 'nmae' \(did you mean 'name'\?\)"),
    ("[links]", "[link]", r"unknown key 'link' \(did you mean 'links'\?\)"),
    ("memory_gib = 8", "memory_gb = 8", r"unknown key \"gpu_types.'MyGPU'.memory_gb\" \(did you mean 'memory_gib'\?\)"),
    ('gpus = ["V100", "MyGPU"]', 'gpus = ["V100", "MyGPU"]\ngpu = ["T4"]', r"unknown key 'nodes\[0\].gpu' \(did you "
     r"mean 'gpus'\?\)"),
    ('inter_node = "eth10"', 'inter_node = {gbytes_per_s = 1, latncy_us = 3}',
     r"unknown key 'links.inter_node.latncy_us' \(did you mean 'latency_us'\?\)"),
    ('inter_node = "eth10"', 'inter_node = "ib_fdr"', r"links.inter_node = 'ib_fdr' is not a known link \(did you "
     r"mean 'ib_fdr56'\?\)"),
    ('"V100", "MyGPU"', '"V1OO", "MyGPU"', r"unknown GPU type 'V1OO' \(did you mean 'V100'\?\)"),
])
def test_typos_name_the_nearest(tmp_path, old, new, pattern):
  assert old in GOOD
  with pytest.raises(ConfigError, match=pattern) as raised:
    _load(tmp_path, GOOD.replace(old, new))
  assert "\n" not in str(raised.value)


def test_unknown_preset_names_the_nearest():
  with pytest.raises(ConfigError, match=r"unknown cluster 'paper_testbd' \(did you mean 'paper_testbed'\?\)"):
    get_cluster("paper_testbd")
