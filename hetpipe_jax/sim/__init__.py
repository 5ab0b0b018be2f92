"""The ``sim`` executor: the engine on a cost model with shared links and PS transfers, no numerics."""

from hetpipe_jax.sim.network import SimComm, Simulator
from hetpipe_jax.sim.options import SimOptions
from hetpipe_jax.sim.simulate import SimJob, simulate, simulate_fast

__all__ = ["SimComm", "SimJob", "SimOptions", "Simulator", "simulate", "simulate_fast"]
