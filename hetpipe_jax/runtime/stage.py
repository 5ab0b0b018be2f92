"""One pipeline stage on one device: jitted forward, backward (jax.vjp) and local optax update.

A stage holds units ``first .. last-1`` of a :class:`~hetpipe_jax.models.LayeredModel` on one JAX device,
its local optimizer state, and one update accumulator per open wave (HETPIPE.md section 2):

* forward of minibatch p: in ``stash`` mode the jitted forward returns the output and the ``jax.vjp``
  closure, whose residuals hold exactly the weights the forward used (PipeDream-style weight stashing at
  no extra code); in ``latest`` mode it keeps the input and the backward recomputes with the weights the
  stage holds then.
* backward of p: gradient -> optax update -> applied to the local weights at once -> added to the
  accumulator of p's wave, all in one jitted call.
* rebase on pull: weights <- global weights + every local update the PS has not seen yet.

Every stage program is traced once per shape; ``Stage.traces`` counts the traces so tests can prove it.
"""

from __future__ import annotations

import collections
from typing import Any

import jax
import jax.numpy as jnp
import optax

from hetpipe_jax.core import wsp
from hetpipe_jax.models.base import LayeredModel, cross_entropy

WEIGHT_MODES = ("stash", "latest")


class Stage:
  """Units ``first .. last-1`` of ``model`` on ``device``.

  Args:
    model: the layered model.
    first, last: the unit range.
    params: this stage's unit parameters (a tuple, one per unit), anywhere; copied to ``device``.
    device: the JAX device that runs the stage.
    tx: the virtual worker's local optimizer (per-stage state).
    nm: the virtual worker's Nm (to find a minibatch's wave).
    weight_mode: "stash" or "latest".
  """

  def __init__(self, model: LayeredModel, first: int, last: int, params, device: jax.Device,
               tx: optax.GradientTransformation, nm: int, weight_mode: str = "stash"):
    self.model, self.first, self.last, self.device = model, first, last, device
    self.is_first, self.is_last = first == 0, last == model.num_units
    self.nm, self.weight_mode, self.tx = nm, weight_mode, tx
    self.params = jax.device_put(tuple(params), device)
    self.opt_state = jax.device_put(tx.init(self.params), device)
    self.waves: dict[int, list] = {}  # wave -> [summed update, number of updates]
    self._saved: dict[int, Any] = {}  # mb -> vjp closure (stash) or (x, labels) (latest)
    self.traces: collections.Counter = collections.Counter()
    self._fwd = jax.jit(self._fwd_impl)
    self._bwd_first = jax.jit(self._bwd_first_impl)
    self._bwd_acc = jax.jit(self._bwd_acc_impl)
    self._add = jax.jit(self._add_impl)

  # --- traced programs -------------------------------------------------------------------------------

  def _apply(self, params, x, labels):
    y = self.model.apply(params, x, self.first, self.last)
    return cross_entropy(y, labels) if self.is_last else y

  def _vjp(self, params, x, labels):
    if self.is_first:  # no gradient for the input data
      return jax.vjp(lambda p: self._apply(p, x, labels), params)
    return jax.vjp(lambda p, xx: self._apply(p, xx, labels), params, x)

  def _fwd_impl(self, params, x, labels):
    self.traces["fwd"] += 1
    if self.weight_mode == "stash":
      return self._vjp(params, x, labels)
    return self._apply(params, x, labels), None

  def _grads(self, saved, g, params):
    vjp = saved if self.weight_mode == "stash" else self._vjp(params, *saved)[1]
    out = vjp(jnp.ones((), jnp.float32) if self.is_last else g)
    return (out[0], None) if self.is_first else out

  def _update(self, grads, params, opt_state):
    updates, opt_state = self.tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, updates

  def _bwd_first_impl(self, saved, g, params, opt_state):
    self.traces["bwd_first"] += 1
    grads, gx = self._grads(saved, g, params)
    params, opt_state, updates = self._update(grads, params, opt_state)
    return gx, params, opt_state, updates

  def _bwd_acc_impl(self, saved, g, params, opt_state, acc):
    self.traces["bwd_acc"] += 1
    grads, gx = self._grads(saved, g, params)
    params, opt_state, updates = self._update(grads, params, opt_state)
    return gx, params, opt_state, jax.tree.map(jnp.add, acc, updates)

  def _add_impl(self, a, b):
    self.traces["add"] += 1
    return jax.tree.map(jnp.add, a, b)

  # --- host side -------------------------------------------------------------------------------------

  def forward(self, mb: int, x: jax.Array, labels: jax.Array | None) -> jax.Array:
    """Dispatches the forward pass of ``mb``; returns its output (the loss on the last stage)."""
    out, vjp = self._fwd(self.params, x, labels)
    self._saved[mb] = vjp if self.weight_mode == "stash" else (x, labels)
    return out

  def backward(self, mb: int, g: jax.Array | None) -> jax.Array | None:
    """Dispatches the backward pass of ``mb``, applies its update and adds it to its wave's accumulator.

    Returns the gradient for the previous stage (None on the first stage). The gradient uses the weights
    of the forward pass in ``stash`` mode, the weights the stage holds now in ``latest`` mode.
    """
    saved = self._saved.pop(mb)
    wave = wsp.wave_of(mb, self.nm)
    if wave in self.waves:
      acc, count = self.waves[wave]
      gx, self.params, self.opt_state, acc = self._bwd_acc(saved, g, self.params, self.opt_state, acc)
      self.waves[wave] = [acc, count + 1]
    else:
      gx, self.params, self.opt_state, update = self._bwd_first(saved, g, self.params, self.opt_state)
      self.waves[wave] = [update, 1]
    return gx

  def warm_up(self, x: jax.Array, labels: jax.Array | None) -> jax.Array:
    """Compiles every program of the stage on inputs shaped like ``x``; returns an output-shaped array.

    Runs each program once and discards the results: weights, optimizer state and accumulators stay.
    """
    x = jax.device_put(x, self.device)
    out, vjp = self._fwd(self.params, x, labels)
    saved = vjp if self.weight_mode == "stash" else (x, labels)
    g = None if self.is_last else jnp.ones_like(out)
    _, _, _, update = self._bwd_first(saved, g, self.params, self.opt_state)
    jax.block_until_ready(self._bwd_acc(saved, g, self.params, self.opt_state, update))
    jax.block_until_ready(self._add(self.params, update))
    return out

  def take_wave(self, wave: int):
    """Removes and returns the summed update of a finished wave (one entry per unit)."""
    acc, count = self.waves.pop(wave)
    if count != self.nm:
      raise RuntimeError(f"wave {wave} of stage [{self.first},{self.last}) holds {count} updates, "
                         f"expected Nm={self.nm}")
    return acc

  def rebase(self, global_params) -> int:
    """Pull: weights <- global weights + the local updates of waves not pushed yet.

    Returns how many local minibatch updates it added back on top of the global weights.
    """
    params = jax.device_put(tuple(global_params), self.device)
    added = 0
    for wave in sorted(self.waves):
      acc, count = self.waves[wave]
      params = self._add(params, acc)
      added += count
    self.params = params
    return added
