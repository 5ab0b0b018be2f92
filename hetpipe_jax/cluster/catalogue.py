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


FAMILIES = ("vgg", "resnet")


def model_family(model_name: str) -> str:
  """The family whose efficiency a model's units take: "vgg", "resnet", or "default"."""
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

LINKS = {link.name: link for link in (
    Link("pcie3", 12e9, 5e-6),  # PCIe 3.0 x16, achievable
    Link("pcie4", 24e9, 5e-6),
    Link("nvlink2", 100e9, 3e-6),
    Link("ib_fdr56", 56e9 / 8, 2e-6),  # InfiniBand FDR 4x: 56 Gb/s
    Link("ib_edr100", 100e9 / 8, 2e-6),
    Link("eth10", 10e9 / 8, 20e-6),
    Link("eth25", 25e9 / 8, 15e-6),
)}
