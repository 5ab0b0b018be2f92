"""The GPU types and links of published measurements (issue 24): every name resolves, in Python and in TOML."""

import pytest

from hetpipe_jax import ConfigError
from hetpipe_jax.cluster import CATALOGUE, GIB, LINKS, get_cluster

GPU_NAMES = ("K80", "P100", "P100 SXM2", "P40", "GTX 1080 Ti", "RTX 2080 Ti", "V100", "V100 SXM2", "A100")
NEW_GPUS = ("K80", "P100", "P100 SXM2", "P40", "GTX 1080 Ti", "RTX 2080 Ti", "V100 SXM2")
LINK_NAMES = ("nvlink1", "nvlink2", "pcie3", "pcie3_nop2p", "eth10", "eth25", "eth40", "eth100", "roce25", "roce100",
              "ib_fdr56", "ib_edr100", "ib_hdr200")


@pytest.mark.parametrize("name", GPU_NAMES)
def test_gpu_names_resolve(name):
  assert CATALOGUE[name].name == name


@pytest.mark.parametrize("name", LINK_NAMES)
def test_link_names_resolve(name):
  link = LINKS[name]
  assert link.name == name and link.bytes_per_s > 0 and link.latency_s > 0


@pytest.mark.parametrize("name", NEW_GPUS)
def test_new_gpu_peaks_are_sane(name):
  gpu = CATALOGUE[name]
  assert gpu.memory_bytes > 0 and gpu.mem_bytes_per_s > 0
  assert 0 < gpu.fp32_flops <= gpu.fp16_flops
  assert not gpu.bf16 and gpu.peak_flops("bf16") == gpu.fp32_flops
  families = dict(gpu.family_efficiency)  # fitted on the published one-GPU figures (experiments.validate_published)
  assert gpu.efficiency == families.get("resnet", 1.0) and all(0 < e <= 4 for e in families.values())


def test_new_figures():
  k80, p100, p40, ti = (CATALOGUE[n] for n in ("K80", "P100", "P40", "GTX 1080 Ti"))
  assert k80.memory_bytes == 12 * GIB and k80.fp32_flops == pytest.approx(4.37e12) and k80.mem_bytes_per_s == 240e9
  assert p100.fp16_flops == pytest.approx(2 * p100.fp32_flops, rel=0.01)  # packed FP16x2
  assert p40.fp16_flops == p40.fp32_flops and ti.fp16_flops == ti.fp32_flops  # FP32 maths, not the 1/64 rate
  assert CATALOGUE["V100 SXM2"].memory_bytes == 16 * GIB and CATALOGUE["V100"].memory_bytes == 32 * GIB
  assert LINKS["nvlink1"].bytes_per_s < LINKS["nvlink2"].bytes_per_s
  assert LINKS["pcie3_nop2p"].bytes_per_s < LINKS["pcie3"].bytes_per_s
  assert LINKS["eth40"].bytes_per_s < 40e9 / 8 and LINKS["eth100"].bytes_per_s < 100e9 / 8
  assert LINKS["ib_hdr200"].bytes_per_s > LINKS["ib_edr100"].bytes_per_s


def test_toml_cluster_names_new_types_and_links(tmp_path):
  path = tmp_path / "turing.toml"
  path.write_text('name = "turing"\n[links]\nintra_node = "pcie3_nop2p"\ninter_node = "eth100"\n'
                  '[[nodes]]\ngpus = ["RTX 2080 Ti", "RTX 2080 Ti"]\n'
                  '[[nodes]]\ngpus = ["P100 SXM2", "GTX 1080 Ti"]\n')
  cluster = get_cluster(str(path))
  assert cluster.name == "turing" and cluster.num_gpus == 4 and cluster.num_nodes == 2
  assert [g.type for g in cluster.gpus] == [CATALOGUE[n] for n in ("RTX 2080 Ti", "RTX 2080 Ti", "P100 SXM2",
                                                                    "GTX 1080 Ti")]
  assert cluster.gpus[0].name == "n0.RTX_2080_Ti.0"
  assert cluster.link(cluster.gpus[0], cluster.gpus[1]) == LINKS["pcie3_nop2p"]
  assert cluster.link(cluster.gpus[1], cluster.gpus[2]) == LINKS["eth100"]


@pytest.mark.parametrize("text,pattern", [
    ('[[nodes]]\ngpus = ["RTX 2080"]\n', r"nodes\[0\] has unknown GPU type 'RTX 2080' \(did you mean '[^']+'\?\); "
     r"known: .*RTX 2080 Ti"),
    ('[links]\nintra_node = "nvlink9"\n[[nodes]]\ngpus = ["K80"]\n',
     r"links.intra_node = 'nvlink9' is not a known link \(did you mean 'nvlink2'\?\); use one of .*nvlink1.*ib_hdr200"),
])
def test_unknown_names_give_one_line_config_error(tmp_path, text, pattern):
  path = tmp_path / "bad.toml"
  path.write_text(text)
  with pytest.raises(ConfigError, match=pattern) as err:
    get_cluster(str(path))
  assert "\n" not in str(err.value)
