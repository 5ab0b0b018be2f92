"""hetpipe_jax: HetPipe (Park et al., USENIX ATC 2020) in JAX.

Virtual workers run pipelined model parallelism over heterogeneous devices and train one model in data
parallel through a parameter server under Wave Synchronous Parallel (WSP). The public API is what this
module exports; the packages below show the layers (``core`` < ``cluster``/``cost`` < ``plan`` <
``runtime``/``sim`` < ``api``; see BUILD_NOTES.md, "Map of the code").
"""

from hetpipe_jax.api import RunConfig, RunResult, plan_hetpipe, plan_table, run_hetpipe
from hetpipe_jax.cluster import Cluster, Gpu, GpuType, ensure_cpu_devices, get_cluster
from hetpipe_jax.core import wsp
from hetpipe_jax.core.check import check_trace
from hetpipe_jax.core.trace import read_trace, staleness_stats
from hetpipe_jax.data import Dataset, MinibatchStreams, load_dataset, synthetic
from hetpipe_jax.errors import ConfigError, ProtocolError
from hetpipe_jax.models import LayeredModel, from_module, from_modules, get_model
from hetpipe_jax.plan.layout import Layout, VWLayout
from hetpipe_jax.runtime.numerics.ps import ParameterServer

__all__ = [
    "Cluster", "ConfigError", "Dataset", "Gpu", "GpuType", "LayeredModel", "Layout", "MinibatchStreams",
    "ParameterServer", "ProtocolError", "RunConfig", "RunResult", "VWLayout", "check_trace",
    "ensure_cpu_devices", "from_module", "from_modules", "get_cluster", "get_model", "load_dataset",
    "plan_hetpipe", "plan_table", "read_trace", "run_hetpipe", "staleness_stats", "synthetic", "wsp",
]
