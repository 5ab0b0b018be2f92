"""The GPU catalogue and the links between GPUs: what one device and one wire can do.

HetPipe (Park et al., USENIX ATC 2020, section 5 of docs/PROTOCOL.md) trains on GPUs of several generations;
its testbed has TITAN V, TITAN RTX, GeForce RTX 2060 and Quadro P4000 cards, PCIe inside a node and
56 Gb/s InfiniBand between nodes. Catalogue figures are the vendors' published peak numbers (sources in
BUILD_NOTES.md). A link is a bandwidth per direction and a latency per transfer; the time of a transfer is
:func:`hetpipe_jax.cost.transfer.link_seconds`.

The ``efficiency`` of a type scales its roofline (:mod:`hetpipe_jax.cost.roofline`) to published training
throughput: efficiency = the model's forward + backward time by the roofline at efficiency 1 / the
measured time per minibatch. It is a correction factor, not a utilisation: it can exceed 1, because the
profiles count each unit's memory traffic without operator fusion, and because cuDNN runs 3x3
convolutions as Winograd (and Ampere's "FP32" as TF32 on tensor cores), beating the FP32 peak. It differs
by model family, so a type holds one value per family (``vgg``, ``resnet``) and a default for other
models; :func:`model_family` names a model's family. Every figure below is cited beside it; where no
measurement was published, the estimate says how it was derived.
"""

from __future__ import annotations

import dataclasses

from hetpipe_jax.precision import check_precision

GIB = 1 << 30
T = 1e12
G = 1e9


def format_bytes(num_bytes: float) -> str:
  """A byte count for messages, with enough digits to tell a need from a capacity.

  Args:
    num_bytes: a number of bytes.

  Returns:
    ``"12.00 GiB"``, ``"22.9 MiB"`` or ``"97.7 KiB"``.
  """
  if num_bytes >= GIB:
    return f"{num_bytes / GIB:.2f} GiB"
  if num_bytes >= 1 << 20:
    return f"{num_bytes / (1 << 20):.1f} MiB"
  return f"{num_bytes / 1024:.1f} KiB"


@dataclasses.dataclass(frozen=True)
class GpuType:
  """A GPU model.

  Attributes:
    name: e.g. ``"TITAN V"``.
    memory_bytes: device memory.
    fp32_flops / fp16_flops: peak flop/s (fp16: tensor cores where the GPU has them).
    mem_bytes_per_s: peak memory bandwidth.
    efficiency: the roofline's correction factor for models of no listed family (see the module docstring).
    family_efficiency: ``(family, efficiency)`` pairs: the factor for the models of that family.
    bf16: whether its tensor cores run bfloat16 at the fp16 rate (Ampere and later); without them bf16
      runs at the fp32 peak.
  """

  name: str
  memory_bytes: int
  fp32_flops: float
  fp16_flops: float
  mem_bytes_per_s: float
  efficiency: float = 0.5
  family_efficiency: tuple[tuple[str, float], ...] = ()
  bf16: bool = False

  def efficiency_for(self, family: str = "default") -> float:
    """The correction factor for a model family (the default one for a family not listed)."""
    return dict(self.family_efficiency).get(family, self.efficiency)

  def peak_flops(self, precision: str = "fp32") -> float:
    """Peak flop/s at a precision.

    Args:
      precision: "fp32", "fp16", or "bf16" (the fp16 peak where the type has bf16 tensor cores, else
        the fp32 peak).

    Returns:
      Flop/s.

    Raises:
      ConfigError: for an unknown precision.
    """
    if check_precision(precision) == "fp16" or (precision == "bf16" and self.bf16):
      return self.fp16_flops
    return self.fp32_flops


@dataclasses.dataclass(frozen=True)
class Link:
  """A kind of link: bandwidth per direction (bytes/s) and a fixed latency per transfer (s)."""

  name: str
  bytes_per_s: float
  latency_s: float


def _gpu(name, mem_gib, fp32_tflops, fp16_tflops, bw_gbytes, efficiency=1.0, bf16=False, **families):
  return GpuType(name, int(mem_gib * GIB), fp32_tflops * T, fp16_tflops * T, bw_gbytes * G, efficiency,
                 tuple(sorted(families.items())), bf16)


FAMILIES = ("vgg", "resnet", "inception")


def model_family(model_name: str) -> str:
  """The family whose efficiency a model's units take: "vgg", "resnet", "inception", or "default"."""
  return next((f for f in FAMILIES if model_name.lower().startswith(f)), "default")


# Vendor peak figures (boost clocks): memory, FP32, FP16 (tensor cores where present), memory bandwidth;
# then the efficiency: default (= resnet where measured), and per family; bf16=True where the tensor cores
# run bfloat16 at the FP16 rate (Ampere and Hopper: NVIDIA's A100, H100 and GA102 whitepapers; Volta,
# Turing and Pascal have no bf16 tensor cores). Sources of the measurements
# (every one is tabled, with batch size, framework and date, in BUILD_NOTES.md "A calibrated catalogue"):
#   [LB] Lambda, "RTX 2080 Ti Deep Learning Benchmarks with TensorFlow" (TF 1.12, FP32, synthetic data,
#        March 2019), https://lambdalabs.com/blog/2080-ti-deep-learning-benchmarks
#   [LT] lambdal/lambda-tensorflow-benchmark, tf-train-throughput-fp32.csv and logs/ (tf_cnn_benchmarks,
#        synthetic data, 2020-21; "FP32" on Ampere runs as TF32)
#   [LP] lambdal/deeplearning-benchmark, pytorch/pytorch-train-throughput-fp32.csv (NGC PyTorch, 2022-23)
#   [JJ] jcjohnson/cnn-benchmarks method as in dmikushin/cnn-benchmarks README (Torch7, cuDNN 5.1, GTX 1080)
# efficiency = roofline time at efficiency 1 of that model and batch / measured seconds per minibatch.
# Sources of the issue-24 types' peaks (K80 ... V100 SXM2):
#   [V1] AnandTech, "NVIDIA Launches Tesla K80, GK210 GPU", https://www.anandtech.com/show/8729
#   [V2] cnews.cz, Tesla K80 (240 GB/s per GPU), https://cnews.cz/clanky/nvidia-uvadi-nove-gpu-generace-kepler-
#        gk210-bezi-v-dualni-karte-tesla-k80/
#   [V3] Tom's Hardware, Tesla P100 PCIe, https://www.tomshardware.com/news/nvidia-tesla-p100-pcie-gpu,32119.html
#   [V4] Microway, Tesla P100 PCI-E 16GB, https://www.microway.com/hpc-tech-tips/nvidia-tesla-p100-pci-e-16gb-gpu-
#        accelerator-pascal-gp100-close/
#   [V5] Microway, Tesla P100 NVLink (SXM2), https://microway.com/hpc-tech-tips/nvidia-tesla-p100-nvlink-16gb-gpu-
#        accelerator-pascal-gp100-sxm2-close
#   [V6] sysrqmts, Tesla P40 (1531 MHz boost, 11.76 TFLOPS), https://sysrqmts.com/gpus/nvidia/tesla/p40
#   [V7] omegaco.ae, NVIDIA P40 (24 GB GDDR5, 346 GB/s), https://omegaco.ae/shop/gpu-cards-edge-ai/nvidia-p40
#   [V8] Vortez, GTX 1080 Ti review p.2 (3584 cores, 1582 MHz, 484 GB/s),
#        https://www.vortez.net/articles_pages/nvidia_gtx_1080_ti_review,2.html ; 11.34 TFLOPS:
#        https://spearblade.com/rtx-2080-ti-teraflops
#   [V9] RTX 2080 Ti (TechPowerUp-style data: 13.45 FP32, 616 GB/s) and bit-tech's Turing table (544 tensor
#        cores, 1545 MHz boost), https://www.bit-tech.net/features/tech/graphics/nvidias-turing-architecture-
#        explained/1/
#   [V10] CUDA C Programming Guide, "Throughput of Native Arithmetic Instructions" (FP16: N/A on cc 3.x, 2
#        results/clock/SM on cc 6.1 vs 128 FP32, 128 vs 64 on cc 6.0)
#   [V11] V100 spec sheet (15.7 FP32, 125 tensor, 900 GB/s, 1530 MHz), https://huggingface.co/datasets/
#        lukeleeai/kernelbench-rag-content/blob/main/V100.md ; Dell EMC "Ready Solutions for AI" guide p.17
#        (V100-SXM2 vs P100-SXM2: 1530 MHz, 900 GB/s)
#   [V12] NVIDIA, "Programming Tensor Cores in CUDA 9", https://developer.nvidia.com/programming-tensor-cores-cuda-9-0
CATALOGUE = {t.name: t for t in (
    # ResNet-152 107 img/s, batch 32 [LB]; VGG: no published figure, derived: 0.92 x the V100's VGG/ResNet
    # ratio (1.357, [LT] VGG-16 / ResNet-152, same GV100 chip)
    _gpu("TITAN V", 12, 14.9, 110.0, 652.8, 0.92, resnet=0.92, vgg=1.25),
    # ResNet-152 129 img/s, batch 32 [LB]; VGG derived as for TITAN V (1.08 x 1.357)
    _gpu("TITAN RTX", 24, 16.3, 130.5, 672.0, 1.08, resnet=1.08, vgg=1.46),
    # no published training figure: estimate, the TITAN RTX's factors (same Turing architecture; likely
    # optimistic: 6 GB forces small batches)
    _gpu("RTX 2060", 6, 6.45, 51.6, 336.0, 1.08, resnet=1.08, vgg=1.46),
    # Pascal GP104: FP16 at 1/64 rate, no tensor cores. No published training figure: estimate, the factors
    # fitted on the GTX 1080 (same GP104 chip) applied to the P4000's peaks: ResNet-152 50.9 img/s and
    # VGG-19 76.1 img/s at batch 16 [JJ]
    _gpu("Quadro P4000", 8, 5.3, 0.083, 243.3, 0.89, resnet=0.89, vgg=1.04),
    # SXM2. ResNet-152 155 img/s, batch 32 [LB] (32 GB card); VGG-16 249 img/s, batch 192, TF 2.2 [LT]
    _gpu("V100", 32, 15.7, 125.0, 900.0, 1.01, resnet=1.01, vgg=1.48),
    # SXM4 80 GB. ResNet-152 390 img/s (batch 112), VGG-16 504 img/s (batch 224), TF32, measured on the
    # PCIe 40 GB card [LT] (the SXM4 card is ~10% faster on ResNet-50 [LP])
    _gpu("A100", 80, 19.5, 312.0, 2039.0, 1.52, bf16=True, resnet=1.52, vgg=2.36),
    # SXM5, dense FP16. Only ResNet-50 is published (1753 img/s, batch 640, TF32 [LP]): derived with the
    # A100's ResNet-152/ResNet-50 (0.96) and VGG-16/ResNet-50 (1.49) ratios [LT]
    _gpu("H100", 80, 67.0, 989.4, 3350.0, 1.39, bf16=True, resnet=1.39, vgg=2.16),
    # ResNet-152 212 img/s, VGG-16 325 img/s, both batch 48, TF 2.4, TF32 [LT]
    _gpu("RTX 3090", 24, 35.6, 71.0, 936.2, 1.26, bf16=True, resnet=1.26, vgg=0.92),
    # no published training figure: estimate, the TITAN RTX's factors (Turing; likely optimistic for a
    # 70 W card)
    _gpu("T4", 16, 8.1, 65.0, 320.0, 1.08, resnet=1.08, vgg=1.46),
    # Types of published single-GPU and cluster measurements (issue 24): vendor peaks at boost clock, sources
    # [V1]-[V12] above. Kepler and GP102 Pascal (K80, P40, GTX 1080 Ti) have no usable FP16 arithmetic (none
    # on cc 3.7, 1/64 rate on cc 6.1 [V10]): mixed precision runs its maths in FP32 there (FP16 storage, FP32
    # accumulation), so fp16 = the fp32 rate, not the 1/64 one. GP100 (P100) runs packed FP16x2: 2x FP32.
    # Volta and Turing: tensor-core FP16 peak. None has bf16 tensor cores.
    # efficiency per family fitted on the published single-GPU figures of resnet50, vgg16 and inception_v3 (every
    # setup together: `python -m experiments.validate_published --fit=type`, 2026-12-05; the rows are
    # hetpipe_jax.studies.published.CATALOGUE_FIT_ROWS, and the ratio of each one-GPU figure inside a multi-GPU
    # row); the default is resnet's where measured, else 1.0 (no figure)
    # ONE GK210 device, half a K80 board: 2496 cores x 2 x 0.875 GHz = 4.37 (board 8.74) [V1]; 240 GB/s [V2]
    _gpu("K80", 12, 4.37, 4.37, 240.0, 0.603, resnet=0.603, inception=0.336),
    # PCIe 16 GB: 9.3 FP32, 18.7 FP16 [V3,V4]; 732 GB/s [V4]
    _gpu("P100", 16, 9.3, 18.7, 732.0, 1.0, inception=0.608),
    # SXM2 16 GB: 10.6 FP32, 21.2 FP16 [V3,V5]; 732 GB/s [V5]
    _gpu("P100 SXM2", 16, 10.6, 21.2, 732.0, 1.0, vgg=1.298),
    # 24 GB: 3840 cores x 2 x 1.531 GHz = 11.76 [V6]; 346 GB/s [V7]; fp16 = fp32 (1/64 rate, see above)
    _gpu("P40", 24, 11.76, 11.76, 346.0, 1.0),
    # 11 GB: 3584 cores x 2 x 1.582 GHz = 11.34 [V8]; 484 GB/s [V8]; fp16 = fp32 (1/64 rate, see above)
    _gpu("GTX 1080 Ti", 11, 11.34, 11.34, 484.0, 1.181, resnet=1.181, vgg=1.038, inception=0.673),
    # 11 GB, reference 1545 MHz: 13.45 FP32, 616 GB/s [V9]; tensor FP16 with FP32 accumulation (what mixed
    # precision training uses; GeForce runs it at half the FP16-accumulate rate): 544 TCs x 64 FMA x 2 x
    # 1.545 GHz / 2 = 53.8 (107.6 with FP16 accumulation; the RTX 2060 entry above takes that convention)
    _gpu("RTX 2080 Ti", 11, 13.45, 53.8, 616.0, 1.432, resnet=1.432, vgg=1.327, inception=0.869),
    # SXM2 16 GB (the "V100" entry above is the 32 GB card, same peaks): 15.7 FP32, 125 tensor FP16, 900 GB/s
    # [V11,V12]
    _gpu("V100 SXM2", 16, 15.7, 125.0, 900.0, 1.266, resnet=1.266),
    # Emulation classes for small CPU runs: four speeds, not vendor data.
    _gpu("A", 24, 8.0, 16.0, 600.0, 1.0),
    _gpu("B", 12, 5.0, 10.0, 400.0, 1.0),
    _gpu("C", 8, 3.0, 6.0, 300.0, 1.0),
    _gpu("D", 6, 2.0, 4.0, 200.0, 1.0),
)}
CLASS_A, CLASS_B, CLASS_C, CLASS_D = (CATALOGUE[n] for n in "ABCD")
SPEED_CLASSES = (CLASS_A, CLASS_B, CLASS_C, CLASS_D)
PAPER_TYPES = ("TITAN V", "TITAN RTX", "RTX 2060", "Quadro P4000")  # the testbed's four types
# The scaling clusters' eight types (issue 12): the testbed's four, then four newer or cloud ones.
SCALE_TYPES = PAPER_TYPES + ("V100", "A100", "T4", "RTX 3090")

# The issue-24 links (nvlink1, pcie3_nop2p, eth40, eth100, roce25, roce100, ib_hdr200) take achievable
# figures: measured where a measurement was published, else the line rate times a published ceiling. Sources:
#   [L1] Dell EMC C4130 p2pBandwidthLatencyTest (P100-SXM2: 18.31 GB/s one way for a pair on one NVLink,
#        36.39 on two, 73.06 aggregate of 80; V100-SXM2: 47.9 per 2-link pair, 143.7 aggregate of 150),
#        http://www.manualshelf.com/manual/dell/high-performance-computing-solution-resources/reference-guide-
#        english/page-17.html
#   [L2] NVIDIA/cuda-samples issue 230: p2pBandwidthLatencyTest latencies, P2P over NVLink 1.8-2.3 us
#   [L3] Anthony-Hoo/Anthony-Hoo.github.io, posts/AutoDL_Multi-GPU_Interconnection_Test.md: 2x RTX 2080 Ti on a
#        PCIe 3.0 x16 switch without P2P, p2pBandwidthLatencyTest 5.71 / 5.70 GB/s one way, 14.76 / 13.95 us
#   [L4] a2o.si, "Ethernet/IP/TCP bitrate vs packet size ... efficiency": TCP payload at MTU 1500 = 1460 B of
#        1538 B on the wire = 94.9%, https://blog.a2o.si/2015/06/26/ethernetiptcp-bitrate-vs-packet-size-vs-
#        segment-size-vs-efficiency-vs-speed/
#   [L5] ESnet fasterdata, "Performance Expectations for a 100G Host" (2024): ~90 Gb/s with parallel streams
#        untuned, one stream 15-35 Gb/s, https://fasterdata.es.net/performance-testing/performance-expectations-
#        for-a-100g-host/
#   [L6] kentino.com, "Latency Dissection ... AI Cluster Network": kernel TCP one way 10-30 us; RDMA one way
#        about 1 us, RTT ~2 us through one switch
#   [L7] J. Synchrotron Rad. 2020, PMC7842203 Table 2: RoCE v2 on 100 GbE, WRITE 97.5 Gb/s at 4 KiB
#   [L8] infiniband.jp speed table: HDR 4x 200 Gb/s data rate (64b/66b); NVIDIA developer forum "Theoretical
#        Bandwidth and Latency of NIC": EDR 4x ib_write_bw ceiling 96.6 of 100 Gb/s (96.6%)
#   [L9] D. Potter, master's thesis, tables/mtu_performance.tex: ib_send_lat (RC, 32 B) 0.81-0.83 us on EDR
#   [L10] open-mpi/hwloc issue 574: NVLink per sub-link per direction: v1 20 GB/s, v2 25 GB/s
LINKS = {link.name: link for link in (
    Link("pcie3", 12e9, 5e-6),  # PCIe 3.0 x16, achievable
    Link("pcie4", 24e9, 5e-6),
    # V100 (NVLink 2): a GPU has 6 links of 25 GB/s per direction, 150 GB/s in all [L1,L10]; 100e9 stands for
    # 4 of them (2/3 of the aggregate: a GPU exchanging with several peers at once), not one pair, which in a
    # DGX-1V hybrid cube mesh has 1 or 2 links (25 or 50 GB/s; 47.9 measured on 2 [L1])
    Link("nvlink2", 100e9, 3e-6),
    Link("ib_fdr56", 56e9 / 8, 2e-6),  # InfiniBand FDR 4x: 56 Gb/s
    Link("ib_edr100", 100e9 / 8, 2e-6),
    Link("eth10", 10e9 / 8, 20e-6),
    Link("eth25", 25e9 / 8, 15e-6),
    # P100 (NVLink 1): a GPU has 4 links of 20 GB/s per direction [L10]; in a DGX-1's hybrid cube mesh a GPU
    # pair shares one link: the measured 18.3 GB/s one way of a single-link pair [L1]; latency ~2 us [L2]
    Link("nvlink1", 18.3e9, 2e-6),
    # PCIe 3.0 without peer-to-peer, copies staged through host memory: measured 5.7 GB/s one way, ~14 us [L3]
    Link("pcie3_nop2p", 5.7e9, 14e-6),
    # TCP with multiple parallel streams (one stream falls well short at 40 and 100 Gb/s [L5]), one way ~15 us
    # [L6]. 40 GbE: line rate x the 94.9% TCP framing ceiling [L4] (no published measurement); 100 GbE: the
    # measured ~90 Gb/s [L5]
    Link("eth40", 40e9 / 8 * 0.949, 15e-6),
    Link("eth100", 90e9 / 8, 15e-6),
    # RoCE v2: 97.5% of line rate, measured on 100 GbE at 4 KiB messages [L7] (the same fraction taken for
    # 25 GbE, unmeasured); one way ~2 us, RDMA through an Ethernet switch [L6]
    Link("roce25", 25e9 / 8 * 0.975, 2e-6),
    Link("roce100", 100e9 / 8 * 0.975, 2e-6),
    # InfiniBand HDR 4x: 200 Gb/s data rate x the 96.6% ib_write_bw ceiling measured on EDR [L8]; ~1 us one
    # way (0.83 us ib_send_lat on EDR [L9])
    Link("ib_hdr200", 200e9 / 8 * 0.966, 1e-6),
)}
