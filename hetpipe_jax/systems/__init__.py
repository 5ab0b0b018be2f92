"""The training systems a user compares, HetPipe and its peers, each one object behind one interface
(:class:`~hetpipe_jax.systems.base.System`), found by name in the registry
(:mod:`~hetpipe_jax.systems.registry`).

A new system: a module with a :class:`~hetpipe_jax.systems.base.System` subclass (a peer on the synchronous
simulator: a :class:`~hetpipe_jax.systems.peer.Peer` naming its ``*_job`` builder) and ``register(MySystem())``;
the studies, the tuner and ``experiments.baseline`` take it by name (``--systems_module=package.module`` imports
a module outside this package).
"""

from hetpipe_jax.systems.base import (
  KINDS,
  LOCAL,
  SYNCHRONOUS,
  WSP,
  Curve,
  CurvePoint,
  System,
  SystemRun,
  TrainSetting,
)
from hetpipe_jax.systems.gpipe import GPipe
from hetpipe_jax.systems.hetero_dp import HeteroDP
from hetpipe_jax.systems.hetpipe import HetPipe
from hetpipe_jax.systems.horovod import Horovod
from hetpipe_jax.systems.local_sgd import LocalSGD
from hetpipe_jax.systems.peer import Peer
from hetpipe_jax.systems.ps_sync import PSReplicated, PSSync
from hetpipe_jax.systems.registry import get_system, import_systems, register, systems, unregister
from hetpipe_jax.systems.runs import BASE_LR_PER_32, LR_SCALINGS, SystemSpec, rule_lr, simulate_systems
from hetpipe_jax.systems.sync_pipeline import SyncPipeline
from hetpipe_jax.systems.tf_replicated import TFReplicated, TFReplicatedCopy

for _system in (Horovod(), HeteroDP(), SyncPipeline(), LocalSGD(), PSSync(), PSReplicated(), TFReplicated(), GPipe(),
                TFReplicatedCopy(), HetPipe()):
  register(_system)

__all__ = [
    "BASE_LR_PER_32", "KINDS", "LOCAL", "LR_SCALINGS", "SYNCHRONOUS", "WSP", "Curve", "CurvePoint", "GPipe",
    "HetPipe", "HeteroDP", "Horovod", "LocalSGD", "PSReplicated", "PSSync", "Peer", "SyncPipeline", "System",
    "SystemRun", "SystemSpec", "TFReplicated", "TFReplicatedCopy", "TrainSetting", "get_system", "import_systems",
    "register", "rule_lr", "simulate_systems", "systems", "unregister",
]
