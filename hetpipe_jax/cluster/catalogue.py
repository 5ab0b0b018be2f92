"""The GPU catalogue and the links between GPUs: what one device and one wire can do.

HetPipe (Park et al., USENIX ATC 2020, section 5 of HETPIPE.md) trains on GPUs of several generations;
its testbed has TITAN V, TITAN RTX, GeForce RTX 2060 and Quadro P4000 cards, PCIe inside a node and
56 Gb/s InfiniBand between nodes. Catalogue figures are the vendors' published peak numbers (sources in
BUILD_NOTES.md); the ``efficiency`` of a type is the fraction of its roofline a training kernel reaches
(fitted by :func:`hetpipe_jax.cost.roofline.calibrate_efficiency`). A link is a bandwidth per direction
and a latency per transfer; the time of a transfer is :func:`hetpipe_jax.cost.transfer.link_seconds`.
"""

from __future__ import annotations

import dataclasses

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
    efficiency: fraction of the roofline that training kernels reach.
  """

  name: str
  memory_bytes: int
  fp32_flops: float
  fp16_flops: float
  mem_bytes_per_s: float
  efficiency: float = 0.5

  def peak_flops(self, precision: str = "fp32") -> float:
    """Peak flop/s at a precision.

    Args:
      precision: "fp16", or anything else for fp32.

    Returns:
      Flop/s.
    """
    return self.fp16_flops if precision == "fp16" else self.fp32_flops


@dataclasses.dataclass(frozen=True)
class Link:
  """A kind of link: bandwidth per direction (bytes/s) and a fixed latency per transfer (s)."""

  name: str
  bytes_per_s: float
  latency_s: float


def _gpu(name, mem_gib, fp32_tflops, fp16_tflops, bw_gbytes, efficiency=0.5):
  return GpuType(name, int(mem_gib * GIB), fp32_tflops * T, fp16_tflops * T, bw_gbytes * G, efficiency)


# Vendor peak figures (boost clocks): memory, FP32, FP16 (tensor cores where present), memory bandwidth.
CATALOGUE = {t.name: t for t in (
    _gpu("TITAN V", 12, 14.9, 110.0, 652.8),
    _gpu("TITAN RTX", 24, 16.3, 130.5, 672.0),
    _gpu("RTX 2060", 6, 6.45, 51.6, 336.0),
    _gpu("Quadro P4000", 8, 5.3, 0.083, 243.3),  # Pascal GP104: FP16 at 1/64 rate, no tensor cores
    _gpu("V100", 32, 15.7, 125.0, 900.0),  # SXM2
    _gpu("A100", 80, 19.5, 312.0, 2039.0),  # SXM4 80 GB
    _gpu("H100", 80, 67.0, 989.4, 3350.0),  # SXM5, dense FP16
    _gpu("RTX 3090", 24, 35.6, 71.0, 936.2),
    _gpu("T4", 16, 8.1, 65.0, 320.0),
    # Emulation classes for small CPU runs: four speeds, not vendor data.
    _gpu("A", 24, 8.0, 16.0, 600.0, 1.0),
    _gpu("B", 12, 5.0, 10.0, 400.0, 1.0),
    _gpu("C", 8, 3.0, 6.0, 300.0, 1.0),
    _gpu("D", 6, 2.0, 4.0, 200.0, 1.0),
)}
CLASS_A, CLASS_B, CLASS_C, CLASS_D = (CATALOGUE[n] for n in "ABCD")
SPEED_CLASSES = (CLASS_A, CLASS_B, CLASS_C, CLASS_D)
PAPER_TYPES = ("TITAN V", "TITAN RTX", "RTX 2060", "Quadro P4000")  # the testbed's four types

LINKS = {link.name: link for link in (
    Link("pcie3", 12e9, 5e-6),  # PCIe 3.0 x16, achievable
    Link("pcie4", 24e9, 5e-6),
    Link("nvlink2", 100e9, 3e-6),
    Link("ib_fdr56", 56e9 / 8, 2e-6),  # InfiniBand FDR 4x: 56 Gb/s
    Link("ib_edr100", 100e9 / 8, 2e-6),
    Link("eth10", 10e9 / 8, 20e-6),
    Link("eth25", 25e9 / 8, 15e-6),
)}
