"""The parameter server: global weights sharded by unit, WSP clocks, optax apply on push, blocking pulls.

In HetPipe (Park et al., USENIX ATC 2020) every virtual worker pushes the sum of a wave's updates, each
stage to the shard that holds its layers, and the PS applies it at once without waiting for the others.
Here a shard is a model unit (so virtual workers cut differently still meet at the same shards), the
apply rule is an optax GradientTransformation over the pushed update (default ``optax.identity()``: add
the wave's update as is), and the clock and gate are the pure functions of :mod:`hetpipe_jax.core.wsp`.
In-process and thread-safe: one condition variable guards the weights and the clocks.
"""

from __future__ import annotations

import threading
from typing import Any, NamedTuple, Sequence

import jax
import optax

from hetpipe_jax.core import wsp


class Snapshot(NamedTuple):
  """What a pull returns: the global weights of some units and the waves of each VW they contain."""

  params: tuple[Any, ...]
  waves: tuple[int, ...]


class ParameterServer:
  """Global parameters and WSP clocks shared by all virtual workers.

  Args:
    params: initial global parameters, one entry per unit (shard); None for a clock-only server.
    num_vws: number of virtual workers.
    d: the clock distance bound D >= 0.
    tx: optax transformation applied to every pushed wave update (default: add as is).
    device: where the global weights live (default: the first JAX device).
    num_shards: the shard count of a clock-only server.

  Example::

    ps = ParameterServer(params, num_vws=2, d=0)
    ps.push(0, wave=0, updates={0: u0, 1: u1})   # VW 0 pushed wave 0 of all units
    snap = ps.pull(1)                            # waits until VW 1 passes the gate
  """

  def __init__(self, params: Sequence[Any] | None, num_vws: int, d: int,
               tx: optax.GradientTransformation | None = None, device: jax.Device | None = None,
               num_shards: int = 0):
    self.d = d
    self._clock = wsp.init(num_vws)
    self._cond = threading.Condition()
    if params is None:  # clocks only (the sim executor): pushes carry no numbers
      self.num_shards, self._params = num_shards, None
      return
    self.device = device or jax.devices()[0]
    self.num_shards = len(params)
    self._tx = tx or optax.identity()
    self._params = tuple(jax.device_put(tuple(params), self.device))
    self._opt_state = jax.device_put(self._tx.init(self._params), self.device)
    self._apply = jax.jit(self._apply_fn)

  def _apply_fn(self, params, opt_state, updates):
    updates, opt_state = self._tx.update(updates, opt_state, params)
    return optax.apply_updates(params, updates), opt_state

  def warm_up(self) -> None:
    """Compiles the apply program on zero updates (results discarded) before a timed run."""
    if self._params is not None:
      zeros = jax.tree.map(jax.numpy.zeros_like, self._params)
      jax.block_until_ready(self._apply(self._params, self._opt_state, zeros))

  @property
  def clock(self) -> wsp.ClockState:
    with self._cond:
      return self._clock

  @property
  def params(self) -> tuple[Any, ...]:
    with self._cond:
      return self._params

  def push(self, vw: int, wave: int, updates: dict[int, Any]) -> wsp.ClockState:
    """Applies VW ``vw``'s wave ``wave``: ``updates`` maps every shard (unit) index to its summed update.

    Returns the clock state after the push.

    Raises:
      ValueError: when the wave is not the VW's next one or does not cover every shard exactly once.
    """
    if self._params is not None:
      if sorted(updates) != list(range(self.num_shards)):
        raise ValueError(f"VW {vw} pushed wave {wave} for shards {sorted(updates)}; a push must cover all "
                         f"{self.num_shards} shards exactly once")
      full = jax.device_put(tuple(updates[u] for u in range(self.num_shards)), self.device)
    with self._cond:
      if wave != self._clock.c_local[vw]:
        raise ValueError(f"VW {vw} pushed wave {wave} but its clock is {self._clock.c_local[vw]}; waves "
                         "are pushed once each, in order")
      if self._params is not None:
        self._params, self._opt_state = self._apply(self._params, self._opt_state, full)
      self._clock = wsp.push(self._clock, vw)
      self._cond.notify_all()
      return self._clock

  def gate_open(self, vw: int) -> bool:
    with self._cond:
      return wsp.gate_open(self._clock, vw, self.d)

  def pull(self, vw: int, block: bool = True, timeout: float | None = None) -> Snapshot | None:
    """Returns the global weights once ``vw`` passes the gate (c_local - c_global <= D).

    With ``block=False`` returns None at once if the gate is closed; with a ``timeout`` raises
    TimeoutError when it stays closed that long.
    """
    with self._cond:
      if not wsp.gate_open(self._clock, vw, self.d):
        if not block:
          return None
        if not self._cond.wait_for(lambda: wsp.gate_open(self._clock, vw, self.d), timeout):
          raise TimeoutError(f"VW {vw} waited {timeout}s at the gate; clocks {self._clock.c_local}")
      return Snapshot(self._params, self._clock.c_local)
