"""The parameter server: global weights sharded by unit, WSP clocks, optax apply on push, blocking pulls.

In HetPipe (Park et al., USENIX ATC 2020) every virtual worker pushes the sum of a wave's updates, each
stage to the shard that holds its layers, and the PS applies it at once without waiting for the others.
Here a shard is a model unit (so virtual workers cut differently still meet at the same shards), the
apply rule is an optax GradientTransformation over the pushed update (default ``optax.identity()``: add
the wave's update as is), and the clock and gate are the pure functions of :mod:`hetpipe_jax.core.wsp`.
The whole state is one pytree, :class:`ServerState`. In-process and thread-safe: one condition variable
guards it. A push updates the weights and the optax state in place (their buffers are donated to the
apply program: a fresh 400 MB allocation per push cost 5-30x the add itself, erratically), so the server
hands out copies (:attr:`ParameterServer.params`) or snapshots that are valid until the next push
(:meth:`ParameterServer.pull`: a stage copies them at once). (A server without weights is
:class:`hetpipe_jax.core.server.ClockServer`.)
"""

from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from hetpipe_jax.core import wsp
from hetpipe_jax.core.server import Snapshot
from hetpipe_jax.errors import ConfigError, NonFiniteUpdate, ProtocolError
from hetpipe_jax.runtime.numerics.mixed import all_finite
from hetpipe_jax.runtime.numerics.stage import Device, put_arrays

ON_NONFINITE = ("stop", "skip")  # what a push with NaN or Inf does: stop the run, or drop that wave's update


def _as_weights(updates: Any, params: Any) -> Any:
  """A pushed update in its weights' dtype (a 16-bit push of mixed precision, added in fp32; in fp32 a
  no-op: no cast enters the program)."""
  return jax.tree.map(lambda u, p: u.astype(p.dtype), updates, params)


_finite_shards = jax.jit(lambda shards: jnp.stack([all_finite(shard) for shard in shards]))


def nonfinite_units(shards: Sequence[Any]) -> list[int]:
  """The indices of the entries of ``shards`` (one update per unit) that hold NaN or Inf."""
  return [int(u) for u in np.flatnonzero(~np.asarray(_finite_shards(tuple(shards))))]


class ServerState(NamedTuple):
  """The global weights (one entry per shard), the apply rule's optax state, and the WSP clocks."""

  params: tuple[Any, ...]
  opt_state: Any
  clock: wsp.ClockState


class ParameterServer:
  """Global parameters and WSP clocks shared by all virtual workers.

  Args:
    params: initial global parameters, one entry per unit (shard).
    num_vws: number of virtual workers.
    d: the clock distance bound D >= 0.
    tx: optax transformation applied to every pushed wave update (default: add as is); it gets the pushing
      virtual worker as the extra argument ``vw`` (``optax.GradientTransformationExtraArgs``; a plain
      transformation ignores it).
    device: where the global weights live (default: this process's host CPU device: as in the paper, the
      shards live in host memory; on a GPU host a push is a device-to-host copy and the apply runs on the
      host).
    on_nonfinite: a push with NaN or Inf: "stop" (raise :class:`~hetpipe_jax.errors.NonFiniteUpdate`) or
      "skip" (drop that wave's update; see :meth:`push`).
    update_dtype: the dtype pushes arrive in (None: the weights'; mixed precision pushes 16-bit updates,
      which the apply adds to the fp32 weights), to compile the apply for them in :meth:`warm_up`.

  Example::

    ps = ParameterServer(params, num_vws=2, d=0)
    ps.push(0, wave=0, updates={0: u0, 1: u1})   # VW 0 pushed wave 0 of all units
    snap = ps.pull(1)                            # waits until VW 1 passes the gate
  """

  def __init__(self, params: Sequence[Any], num_vws: int, d: int,
               tx: optax.GradientTransformation | None = None, device: Device | None = None,
               on_nonfinite: str = "stop", update_dtype: Any = None):
    if on_nonfinite not in ON_NONFINITE:
      raise ConfigError(f"on_nonfinite={on_nonfinite!r}; choose one of {', '.join(ON_NONFINITE)}")
    self.d, self.on_nonfinite, self._update_dtype = d, on_nonfinite, update_dtype
    self.dropped: dict[tuple[int, int], list[int]] = {}
    self.device = device or jax.local_devices(backend="cpu")[0]
    self.num_shards = len(params)
    self._tx = optax.with_extra_args_support(tx or optax.identity())  # every rule gets the pusher (``vw``)
    self._cond = threading.Condition()
    self.restart(params, num_vws)
    self._apply = jax.jit(self._apply_fn, donate_argnums=(0, 1))  # in place: see the module docstring
    self._apply_checked = jax.jit(self._apply_checked_fn, donate_argnums=(0, 1))  # (its producer checked it)
    self._copy = jax.jit(lambda tree: jax.tree.map(jnp.copy, tree))  # one dispatch for every leaf

  def _apply_fn(self, params, opt_state, updates, vw):
    """(weights, optax state, whether each shard's update is finite): the new state if every shard's
    update is finite, else the old one unchanged (in one program: the check costs one more read)."""
    finite = jnp.stack([all_finite(shard) for shard in updates])
    updates = _as_weights(updates, params)
    new_updates, new_opt_state = self._tx.update(updates, opt_state, params, vw=vw)
    keep = lambda new, old: jnp.where(jnp.all(finite), new, old)
    return (jax.tree.map(keep, optax.apply_updates(params, new_updates), params),
            jax.tree.map(keep, new_opt_state, opt_state), finite)

  def _apply_checked_fn(self, params, opt_state, updates, vw):
    """(weights, optax state) after an update whose producer found it finite: one pass, no check."""
    updates = _as_weights(updates, params)
    new_updates, new_opt_state = self._tx.update(updates, opt_state, params, vw=vw)
    return optax.apply_updates(params, new_updates), new_opt_state

  def restart(self, params: Sequence[Any], num_vws: int) -> None:
    """Starts from ``params`` for ``num_vws`` virtual workers, compiled as it is: fresh optax state, clocks from 0,
    nothing dropped (at construction, and for the next part of a run in the same processes)."""
    params = tuple(jax.device_put(tuple(params), self.device, may_alias=False))  # its own: pushes donate them
    with self._cond:
      self._state = ServerState(params, jax.device_put(self._tx.init(params), self.device), wsp.init(num_vws))
      self.dropped = {}

  def warm_up(self) -> None:
    """Compiles the apply programs on zero updates, and the serves' copy (results discarded), before a
    timed run."""
    with self._cond:
      for apply in (self._apply, self._apply_checked):
        params, opt_state = jax.tree.map(jnp.copy, (self._state.params, self._state.opt_state))  # donated
        zeros = jax.tree.map(lambda p: jnp.zeros_like(p, dtype=self._update_dtype), params)
        jax.block_until_ready(apply(params, opt_state, zeros, np.int32(0)))
      jax.block_until_ready(self._copy(self._state.params))

  @property
  def state(self) -> ServerState:
    with self._cond:
      return self._state

  @property
  def clock(self) -> wsp.ClockState:
    return self.state.clock

  def checkpoint_state(self) -> dict[str, Any]:
    """Weights, optax state, clocks and dropped waves (copies), for a checkpoint."""
    with self._cond:
      s = self._state
      copy = lambda tree: jax.tree.map(jnp.copy, tree)
      return {"state": s._replace(params=copy(s.params), opt_state=copy(s.opt_state)), "dropped": dict(self.dropped)}

  def restore_checkpoint_state(self, state: dict[str, Any]) -> None:
    """Puts back what :meth:`checkpoint_state` returned (arrays anywhere; placed on the server's device)."""
    with self._cond:
      s = state["state"]
      self._state = ServerState(put_arrays(s.params, self.device), put_arrays(s.opt_state, self.device), s.clock)
      self.dropped = dict(state["dropped"])

  @property
  def params(self) -> tuple[Any, ...]:
    """A copy of the global weights (later pushes do not change it)."""
    with self._cond:
      return self._copy(self._state.params)

  def push(self, vw: int, wave: int, updates: Mapping[int, Any], nonfinite: Sequence[int] | None = None
           ) -> wsp.ClockState:
    """Applies VW ``vw``'s wave ``wave``: ``updates`` maps every shard (unit) index to its summed update.

    Returns the clock state after the push.

    A wave whose update holds NaN or Inf is refused before it touches the weights: with
    ``on_nonfinite="stop"`` the push raises; with ``"skip"`` the wave counts (its clock ticks) but its
    update is dropped, and ``dropped[(vw, wave)]`` names the units that were not finite. The server checks
    the update itself, in the apply's program (a second read of the update), unless its producer did:
    ``nonfinite``, the shard indices it found not finite (:func:`nonfinite_units`; empty: all finite), and the
    apply is one pass.

    Raises:
      ProtocolError: when the wave is not the VW's next one or does not cover every shard exactly once.
      NonFiniteUpdate: for a non-finite update with ``on_nonfinite="stop"`` (nothing changed).
    """
    if sorted(updates) != list(range(self.num_shards)):
      raise ProtocolError(f"VW {vw} pushed wave {wave} for shards {sorted(updates)}; a push must cover all "
                          f"{self.num_shards} shards exactly once")
    full = jax.device_put(tuple(updates[u] for u in range(self.num_shards)), self.device)
    with self._cond:
      clock = wsp.push(self._state.clock, vw, wave)  # raises before anything is applied
      if nonfinite is None:
        params, opt_state, finite = self._apply(self._state.params, self._state.opt_state, full, np.int32(vw))
        self._state = self._state._replace(params=params, opt_state=opt_state)  # the old buffers were donated
        bad = [int(u) for u in np.flatnonzero(~np.asarray(finite))]  # then the weights were left as they were
      else:
        bad = sorted(int(u) for u in nonfinite)
        if not bad:
          params, opt_state = self._apply_checked(self._state.params, self._state.opt_state, full, np.int32(vw))
          self._state = self._state._replace(params=params, opt_state=opt_state)
      if bad and self.on_nonfinite == "stop":
        raise NonFiniteUpdate(vw, wave, bad, wsp.c_global(self._state.clock))
      if bad:  # skip: the wave counts (the clock ticks), its update is dropped
        self.dropped[(vw, wave)] = bad
      self._state = self._state._replace(clock=clock)
      self._cond.notify_all()
      return clock

  def skip(self, vw: int, wave: int, units: list[int]) -> wsp.ClockState:
    """VW ``vw``'s wave ``wave`` counts (its clock ticks) but its update is dropped, because ``units``
    were not finite (``dropped[(vw, wave)]`` says so); returns the clock state after it."""
    with self._cond:
      clock = wsp.push(self._state.clock, vw, wave)
      self.dropped[(vw, wave)] = units
      self._state = self._state._replace(clock=clock)
      self._cond.notify_all()
      return clock

  def leave(self, vw: int) -> wsp.ClockState:
    """``vw`` left: its clock no longer counts in the global clock (gates may open); its waves stay."""
    with self._cond:
      self._state = self._state._replace(clock=wsp.leave(self._state.clock, vw))
      self._cond.notify_all()
      return self._state.clock

  def join(self, vw: int) -> wsp.ClockState:
    """``vw`` (re)joins with c_local = the current global clock."""
    with self._cond:
      self._state = self._state._replace(clock=wsp.join(self._state.clock, vw))
      self._cond.notify_all()
      return self._state.clock

  def try_pull(self, vw: int) -> Snapshot | None:
    """The global weights if ``vw`` passes the gate (c_local - c_global <= D) now, else None."""
    return self.pull(vw, block=False)

  def pull(self, vw: int, block: bool = True, timeout: float | None = None) -> Snapshot | None:
    """Returns the global weights once ``vw`` passes the gate (c_local - c_global <= D).

    The snapshot's weights are the server's own buffers, valid until the next push: copy them at once
    (a computation already enqueued on them is safe; the push waits for it).

    With ``block=False`` returns None at once if the gate is closed.

    Raises:
      TimeoutError: when the gate stays closed for ``timeout`` seconds.
    """
    open_ = lambda: wsp.gate_open(self._state.clock, vw, self.d)
    with self._cond:
      if not open_():
        if not block:
          return None
        if not self._cond.wait_for(open_, timeout):
          raise TimeoutError(f"VW {vw} waited {timeout}s at the gate; clocks {self._state.clock.c_local}")
      return Snapshot(self._state.params, self._state.clock.c_local, self._state.clock.seq)
