"""The executors by name: each one a module with what it builds and how it runs (its
:class:`~hetpipe_jax.run.executors.base.Executor` entry). A new executor is one module here and one entry
in :data:`EXECUTORS`.

=============  ==========================================  =========================================
executor       clock                                       numerics
=============  ==========================================  =========================================
virtual        the emulated cluster's (virtual time)       yes, deterministic: same seed, same bits
wall           wall time (optionally padded)               yes, dispatched asynchronously
multiprocess   wall time of process 0                      yes, one process per node
sim            the cost model with shared links            no
=============  ==========================================  =========================================
"""

from __future__ import annotations

from hetpipe_jax.errors import ConfigError
from hetpipe_jax.run.executors import multiprocess, sim, virtual, wall
from hetpipe_jax.run.executors.base import Executor

EXECUTORS: dict[str, Executor] = {e.name: e for e in (virtual.EXECUTOR, wall.EXECUTOR, sim.EXECUTOR,
                                                      multiprocess.EXECUTOR)}


def get_executor(name: str) -> Executor:
  """The registry entry of ``name``.

  Raises:
    ConfigError: for an unknown name, listing the known ones.
  """
  if name not in EXECUTORS:
    raise ConfigError(f"unknown executor {name!r}; choose one of {', '.join(EXECUTORS)}")
  return EXECUTORS[name]
