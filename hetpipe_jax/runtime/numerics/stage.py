"""One pipeline stage on one device: jitted forward, backward (jax.vjp) and local optax update.

A stage holds units ``first .. last-1`` of a :class:`~hetpipe_jax.models.LayeredModel` on one JAX device,
its local optimizer state, and one update accumulator per open wave (docs/PROTOCOL.md section 2):

* forward of minibatch p: in ``stash`` mode the jitted forward returns the output and the ``jax.vjp``
  closure, whose residuals hold exactly the weights the forward used (PipeDream-style weight stashing at
  no extra code); in ``latest`` mode it keeps the input and the backward recomputes with the weights the
  stage holds then.
* backward of p: gradient -> optax update -> applied to the local weights at once -> added to the
  accumulator of p's wave, all in one jitted call.
* rebase on pull: weights <- global weights + every local update the PS has not seen yet.
* the staleness control (:mod:`hetpipe_jax.core.controls`): under ``2bw`` a backward adds its gradient to the
  stage's sum and only a group's k-th applies one update of the mean; under ``predict`` a forward runs on
  w + s x (the last update), s the stage's forwards in flight before it; under ``pipemare`` an update is scaled by
  its delay's warm-up factor.
* activation recomputation (:mod:`hetpipe_jax.recompute`): each unit's apply under ``jax.checkpoint`` with the
  stage's policy, so the ``jax.vjp`` closure keeps only what the policy saves and the backward recomputes the
  rest; the numerics are those without it, within rounding.
* tensor parallelism (:mod:`hetpipe_jax.tensor`): a stage given several devices (of one node) keeps each weight
  of a unit with a rule split across them, its input and output whole on each; XLA's SPMD partitioner inserts
  the all-reduces. The numerics are those of one device, within rounding.

At ``precision`` fp16 or bf16 the stage trains in mixed precision (:mod:`hetpipe_jax.runtime.numerics.mixed`): fp32
weights and optimizer state, 16-bit compute, activations, input gradients, stashed weight copies and pushed
updates; fp16 scales the loss per stage and skips (and counts) a minibatch update whose gradient overflows.
In fp32 no cast or scale enters any program.

The stage's state is a pytree, :class:`StageState` (weights, local optimizer state, open wave
accumulators), that a checkpointer can save. Every stage program is traced once per shape;
``Stage.traces`` counts the traces per stage so tests can prove it (``chex.assert_max_traces`` keys its
count on where a function is defined, so it would add up the traces of every stage together).
"""

from __future__ import annotations

import collections
from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding, PartitionSpec

from hetpipe_jax.core import wsp
from hetpipe_jax.core.controls import PER_MINIBATCH, Control, delay_scale
from hetpipe_jax.errors import ConfigError, ProtocolError
from hetpipe_jax.models.base import LayeredModel
from hetpipe_jax.recompute import MODES, check_recompute
from hetpipe_jax.runtime.numerics import mixed
from hetpipe_jax.tensor import onto_mesh, param_shardings, stage_mesh

Device = Any  # a jax.Device (a name pyright cannot use as a type)


def put_arrays(tree: Any, device: Device) -> Any:
  """``tree`` with its arrays (numpy or JAX) on ``device`` as fresh buffers; other leaves (Python
  numbers such as an accumulator's count) stay as they are."""
  is_array = lambda x: isinstance(x, (jax.Array, np.ndarray, np.generic))
  return jax.tree.map(lambda x: jax.device_put(x, device, may_alias=False) if is_array(x) else x, tree)


class WaveAccumulator(NamedTuple):
  """The summed local updates of one open wave (one entry per unit) and how many minibatches they are
  (and, in fp16, how many of those updates were skipped by a loss-scale overflow: a device int32)."""

  update: Any
  count: int
  skipped: Any = None


class StageState(NamedTuple):
  """Everything a stage holds between tasks, as a pytree.

  Attributes:
    params: the stage's weights (a tuple, one entry per unit).
    opt_state: the local optimizer's state.
    waves: wave -> accumulator of the local updates not pushed yet.
    scale: fp16's dynamic loss scale (:class:`hetpipe_jax.runtime.numerics.mixed.LossScale`); None otherwise.
    grads: ``2bw``: the sum of the gradients of the current group not applied yet (fp32, like the weights); None
      under the other controls.
    pending: ``2bw``: how many gradients ``grads`` holds.
    last: ``predict``: the stage's last local update (zeros before one); None otherwise.
    steps: local updates the stage has applied (``pipemare``'s warm-up reads it).
  """

  params: Any
  opt_state: Any
  waves: dict[int, WaveAccumulator]
  scale: Any = None
  grads: Any = None
  pending: int = 0
  last: Any = None
  steps: int = 0


class StageOptions(NamedTuple):
  """How a stage computes.

  Attributes:
    weight_mode: "stash" or "latest".
    precision: "fp32", or "bf16"/"fp16": mixed precision (see the module docstring).
    recompute: the activation recomputation of its units: "none", "selective" or "full"
      (:mod:`hetpipe_jax.recompute`).
    control: the staleness control (:mod:`hetpipe_jax.core.controls`).
  """

  weight_mode: str = "stash"
  precision: str = "fp32"
  recompute: str = "none"
  control: Control = PER_MINIBATCH


DEFAULT_OPTIONS = StageOptions()  # fp32, stash, no recomputation


class Stage:
  """Units ``first .. last-1`` of ``model`` on ``device``.

  Args:
    model: the layered model.
    units: the unit range ``range(first, last)``.
    params: this stage's unit parameters (a tuple, one per unit), anywhere; copied to ``device``.
    device: the JAX device that runs the stage, or a sequence of them: the stage split over them by tensor
      parallelism (:attr:`device` is then the whole-on-each sharding of its input and output).
    tx: the virtual worker's local optimizer (per-stage state).
    nm: the virtual worker's Nm (to find a minibatch's wave).
    options: how it computes (:class:`StageOptions`: weight mode, precision, recomputation).
  """

  def __init__(self, model: LayeredModel, units: range, params, device: Device, tx: optax.GradientTransformation,
               nm: int, options: StageOptions = DEFAULT_OPTIONS):
    first, last = units.start, units.stop
    weight_mode, precision = options.weight_mode, options.precision
    self.recompute = check_recompute(options.recompute, MODES)
    self.model, self.first, self.last = model, first, last
    self._place(device, params)
    self.is_first, self.is_last = first == 0, last == model.num_units
    self.nm, self.weight_mode, self.tx = nm, weight_mode, tx
    self.control, self.k = options.control, options.control.accumulate(nm)
    if self.k > 1 and precision in mixed.SCALED:
      raise ConfigError(f"staleness={self.control} with precision={precision}: a loss-scaled gradient sum over "
                        "minibatches is not built; use precision=bf16 or fp32, or another staleness control")
    self.precision, self.dtype = precision, mixed.compute_dtype(precision)  # dtype None: fp32, no casts
    self.scaled = precision in mixed.SCALED
    self.skipped: dict[int, Any] = {}  # fp16: wave -> its skipped updates (device int32), until read
    self.state = self._fresh_state(params)
    self._saved: dict[int, Any] = {}  # mb -> vjp closure (stash) or (x, labels) (latest)
    self._delays: dict[int, int] = {}  # mb -> forwards in flight before it (pipemare)
    self.traces: collections.Counter = collections.Counter()
    self._fwd = jax.jit(self._fwd_impl)
    self._fwd_pred = jax.jit(self._fwd_pred_impl)
    self._accum = jax.jit(self._accum_impl)
    self._bwd_first = jax.jit(self._bwd_first_impl)
    self._bwd_acc = jax.jit(self._bwd_acc_impl)
    self._add = jax.jit(self._add_impl)

  def _place(self, device, params) -> None:
    """Sets :attr:`device` (where inputs and outputs live), :attr:`tp` and where each parameter lives."""
    devices = tuple(device) if isinstance(device, (list, tuple)) else (device,)
    self.tp, self._lead = len(devices), devices[0]
    if self.tp == 1:
      self.device = self._params_at = devices[0]
      return
    mesh = stage_mesh(devices)
    self.device = NamedSharding(mesh, PartitionSpec())
    self._params_at = param_shardings(self.model.units[self.first:self.last], params, mesh)

  def _put_params(self, params):
    """A fresh copy of ``params`` (a tuple, one entry per unit) where this stage keeps its weights: a split
    stage's through the host (a ``device_put`` onto a sharding keeps the source's buffer as the shard on its
    device despite ``may_alias=False``, and the parameter server donates its buffers)."""
    if self.tp == 1:
      return jax.device_put(tuple(params), self._params_at, may_alias=False)
    return jax.device_put(jax.device_get(tuple(params)), self._params_at)

  def _fresh_state(self, params) -> StageState:
    params = self._put_params(params)
    scale = jax.device_put(mixed.init_scale(), self.device) if self.scaled else None
    zeros = lambda: self._put_params(jax.tree.map(jnp.zeros_like, params))
    grads, last = zeros() if self.k > 1 else None, zeros() if self.control.predicts else None
    opt_state = self.tx.init(params)
    opt_state = jax.device_put(opt_state, self.device) if self.tp == 1 else onto_mesh(opt_state, self.device)
    return StageState(params, opt_state, {}, scale, grads, 0, last, 0)  # (split: the state as the weights)

  # --- traced programs -------------------------------------------------------------------------------

  def _apply(self, params, x, labels):
    if self.dtype is None:
      y = self.model.apply(params, x, self.first, self.last, self.recompute)
      return self.model.loss(y, labels) if self.is_last else y
    y = self.model.apply(mixed.cast_floats(params, self.dtype), mixed.cast_floats(x, self.dtype), self.first,
                         self.last, self.recompute)
    return self.model.loss(y.astype(jnp.float32), labels) if self.is_last else mixed.cast_floats(y, self.dtype)

  def _vjp(self, params, x, labels):
    if self.is_first:  # no gradient for the input data
      return jax.vjp(lambda p: self._apply(p, x, labels), params)
    return jax.vjp(lambda p, xx: self._apply(p, xx, labels), params, x)

  def _fwd_impl(self, params, x, labels):
    self.traces["fwd"] += 1
    if self.weight_mode == "stash":
      return self._vjp(params, x, labels)
    return self._apply(params, x, labels), None

  def _fwd_pred_impl(self, params, last, s, x, labels):
    """The forward on the weights predicted ``s`` local updates ahead: w + s x the last update (``predict``)."""
    self.traces["fwd_pred"] += 1
    return self._fwd_impl(jax.tree.map(lambda w, u: w + s * u, params, last), x, labels)

  def _grads(self, saved, ct, params):
    """(weight gradient, input gradient or None) of the backward at cotangent ``ct`` of the output."""
    vjp = saved if self.weight_mode == "stash" else self._vjp(params, *saved)[1]
    out = vjp(ct)
    return (out[0], None) if self.is_first else out

  def _update(self, grads, params, opt_state, ctl):
    """(weights, optimizer state, update) of one local update; ``ctl`` the control's inputs: ``gsum`` (``2bw``: the
    group's other gradients, averaged in) and ``factor`` (``pipemare``: the update's scale)."""
    if "gsum" in ctl:
      grads = jax.tree.map(lambda s, g: (s + g) / self.k, ctl["gsum"], grads)
    updates, opt_state = self.tx.update(grads, opt_state, params)
    if "factor" in ctl:
      updates = jax.tree.map(lambda u: ctl["factor"] * u, updates)
    return optax.apply_updates(params, updates), opt_state, updates

  def _ctl_out(self, ctl, updates):
    """What the control keeps of a local update: ``2bw`` an empty gradient sum, ``predict`` the update."""
    out = {"gsum": jax.tree.map(jnp.zeros_like, ctl["gsum"])} if "gsum" in ctl else {}
    return {**out, "last": updates} if self.control.predicts else out

  def _accum_impl(self, saved, g, params, gsum):
    """``2bw`` before a group's last minibatch: (input gradient, the group's gradient sum with this one)."""
    self.traces["accum"] += 1
    grads, gx = self._grads(saved, jnp.ones((), jnp.float32) if self.is_last else g, params)
    return gx, jax.tree.map(jnp.add, gsum, grads)

  def _step(self, saved, g, params, opt_state, scale, ctl):
    """(input gradient, weights, optimizer state, update, loss scale, skipped, the control's outputs) of one
    backward that applies an update."""
    if not self.scaled:
      grads, gx = self._grads(saved, jnp.ones((), jnp.float32) if self.is_last else g, params)
      params, opt_state, updates = self._update(grads, params, opt_state, ctl)
      return gx, params, opt_state, updates, scale, None, self._ctl_out(ctl, updates)
    # fp16: the backward at this stage's scale S (the incoming gradient carries its sender's S_in).
    s = scale.scale
    ct = s if self.is_last else (g[0].astype(jnp.float32) * (s / g[1])).astype(self.dtype)
    grads, gx = self._grads(saved, ct, params)
    finite = mixed.all_finite((grads, gx))
    new_params, new_opt_state, updates = self._update(jax.tree.map(lambda x: x / s, grads), params, opt_state, ctl)
    keep = lambda new, old: jax.tree.map(lambda a, b: jnp.where(finite, a, b), new, old)
    updates = jax.tree.map(lambda u: jnp.where(finite, u, jnp.zeros_like(u)), updates)
    return (None if gx is None else (gx, s), keep(new_params, params), keep(new_opt_state, opt_state), updates,
            mixed.next_scale(scale, finite), (~finite).astype(jnp.int32), self._ctl_out(ctl, updates))

  def _bwd_first_impl(self, saved, g, params, opt_state, scale, ctl):
    self.traces["bwd_first"] += 1
    return self._step(saved, g, params, opt_state, scale, ctl)

  def _bwd_acc_impl(self, saved, g, params, opt_state, scale, acc, skipped, ctl):
    self.traces["bwd_acc"] += 1
    gx, params, opt_state, updates, scale, skip, out = self._step(saved, g, params, opt_state, scale, ctl)
    skipped = None if skip is None else skipped + skip
    return gx, params, opt_state, jax.tree.map(jnp.add, acc, updates), scale, skipped, out

  def _add_impl(self, a, b):
    self.traces["add"] += 1
    return jax.tree.map(jnp.add, a, b)

  # --- host side -------------------------------------------------------------------------------------

  def drop(self) -> None:
    """Forgets what forwards kept for their backwards and the open wave accumulators (a failure)."""
    self._saved, self._delays = {}, {}
    grads = None if self.state.grads is None else jax.tree.map(jnp.zeros_like, self.state.grads)
    self.state = self.state._replace(waves={}, grads=grads, pending=0)

  def restart(self, global_params) -> None:
    """A replacement of a failed stage, or the next part of a run (in the same processes, compiled as it is): the
    global weights, a fresh local optimizer, nothing open or skipped."""
    self._saved, self.skipped, self._delays = {}, {}, {}
    self.state = self._fresh_state(global_params)

  def checkpoint_state(self) -> dict[str, Any]:
    """The stage's state and what its forwards keep for their backwards (as arrays), for a checkpoint."""
    return {"state": self.state, "saved": {mb: jax.tree.leaves(s) for mb, s in self._saved.items()},
            "delays": dict(self._delays)}

  def restore_checkpoint_state(self, state: dict[str, Any]) -> None:
    """Puts back what :meth:`checkpoint_state` returned (arrays anywhere; placed where this stage keeps them).
    Needs :meth:`warm_up` first (it learns the structure of a forward's saved values)."""
    self._delays = {int(mb): int(s) for mb, s in state["delays"].items()}
    if self.tp == 1:
      put = lambda tree: put_arrays(tree, self.device)
      self.state = put(state["state"])
      self._saved = {mb: jax.tree.unflatten(self.saved_treedef, put(leaves)) for mb, leaves in state["saved"].items()}
      return
    self.state = self._put_state(state["state"])
    self._saved = {mb: jax.tree.unflatten(self.saved_treedef, jax.device_put(leaves, self._saved_at))
                   for mb, leaves in state["saved"].items()}

  def _put_state(self, state: StageState) -> StageState:
    """``state`` placed as a tensor-parallel stage keeps it: weights, updates and optimizer state split alike."""
    whole = lambda tree: put_arrays(tree, self.device)
    opt_at = jax.tree.map(lambda a: a.sharding, self.state.opt_state)
    waves = {w: WaveAccumulator(self._put_params(acc.update), acc.count, whole(acc.skipped))
             for w, acc in state.waves.items()}
    split = lambda tree: None if tree is None else self._put_params(tree)
    return StageState(self._put_params(state.params), jax.device_put(state.opt_state, opt_at), waves,
                      whole(state.scale), split(state.grads), state.pending, split(state.last), state.steps)

  @property
  def params(self):
    """The weights the stage holds now."""
    return self.state.params

  @property
  def lead(self) -> Device:
    """The stage's first device: where what it sends to another process leaves from (a split stage's arrays
    gathered onto it: :meth:`on_lead`)."""
    return self._lead

  def on_lead(self, tree: Any) -> Any:
    """``tree``'s arrays on :attr:`lead` (a split stage's shards gathered; unsplit: as they are)."""
    if self.tp == 1:
      return tree
    return jax.tree.map(lambda a: jax.device_put(a, self.lead) if isinstance(a, jax.Array) else a, tree)

  def forward(self, mb: int, x: jax.Array, labels: jax.Array | None) -> jax.Array:
    """Dispatches the forward pass of ``mb``; returns its output (the loss on the last stage). Under ``predict``
    it runs on the predicted weights (the module docstring)."""
    in_flight = len(self._saved)  # the local updates this stage applies before mb's backward
    out, vjp = self._dispatch_fwd(in_flight, x, labels)
    self._saved[mb] = vjp if self.weight_mode == "stash" else (x, labels)
    if self.control.delay_scaled:
      self._delays[mb] = in_flight
    return out

  def _dispatch_fwd(self, in_flight: int, x: jax.Array, labels: jax.Array | None):
    """(output, what the backward needs) of a forward on the stage's weights, under ``predict`` on those predicted
    ``in_flight`` local updates ahead."""
    if self.control.predicts:
      return self._fwd_pred(self.state.params, self.state.last, jnp.float32(in_flight), x, labels)
    return self._fwd(self.state.params, x, labels)

  def backward(self, mb: int, g: jax.Array | None) -> jax.Array | None:
    """Dispatches the backward pass of ``mb``, applies its update and adds it to its wave's accumulator
    (under ``2bw``: adds its gradient to the group's sum, and applies the group's update at its last minibatch).

    Returns the gradient for the previous stage (None on the first stage). The gradient uses the weights
    of the forward pass in ``stash`` mode, the weights the stage holds now in ``latest`` mode.

    Raises:
      ProtocolError: under ``2bw``, when a group's last backward finds another count of its gradients than k - 1.
    """
    saved = self._saved.pop(mb)
    state = self.state
    if self.k > 1 and mb % self.k:
      gx, grads = self._accum(saved, g, state.params, state.grads)
      self.state = state._replace(grads=grads, pending=state.pending + 1)
      return gx
    if self.k > 1 and state.pending != self.k - 1:
      raise ProtocolError(f"stage [{self.first},{self.last}) applies the group of minibatch {mb} with "
                          f"{state.pending + 1} gradients, expected k={self.k}")
    delayed = self.control.delay_scaled
    factor = delay_scale(self._delays.pop(mb), state.steps, self.control.warmup) if delayed else 1.0
    return self._apply_update(saved, g, wsp.wave_of(mb, self.nm), self._ctl(factor))

  def _ctl(self, factor: float) -> dict[str, Any]:
    """The control's inputs to an update (:meth:`_update`): ``2bw``'s gradient sum, ``pipemare``'s factor."""
    ctl: dict[str, Any] = {} if self.k == 1 else {"gsum": self.state.grads}
    if self.control.delay_scaled:
      ctl["factor"] = jnp.float32(factor)
    return ctl

  def _apply_update(self, saved, g, wave: int, ctl: dict[str, Any]):
    """Runs the backward that applies an update to the weights and adds it to ``wave``'s accumulator; returns the
    input gradient."""
    params, opt_state, waves, scale = self.state[:4]
    if wave in waves:
      acc = waves[wave]
      gx, params, opt_state, update, scale, skipped, out = self._bwd_acc(saved, g, params, opt_state, scale,
                                                                         acc.update, acc.skipped, ctl)
      acc = WaveAccumulator(update, acc.count + self.k, skipped)
    else:
      gx, params, opt_state, update, scale, skipped, out = self._bwd_first(saved, g, params, opt_state, scale, ctl)
      acc = WaveAccumulator(update, self.k, skipped)
    self.state = StageState(params, opt_state, {**waves, wave: acc}, scale, out.get("gsum"), 0, out.get("last"),
                            self.state.steps + 1)
    return gx

  def warm_up(self, x: jax.Array, labels: jax.Array | None) -> jax.Array:
    """Compiles every program of the stage on inputs shaped like ``x``; returns an output-shaped array.

    Runs each program once and discards the results: weights, optimizer state and accumulators stay.
    """
    x = jax.device_put(x, self.device)
    out, vjp = self._dispatch_fwd(0, x, labels)
    saved = vjp if self.weight_mode == "stash" else (x, labels)
    self.saved_treedef = jax.tree.structure(saved)  # what a forward keeps for its backward, for a restore
    self._saved_at = [leaf.sharding for leaf in jax.tree.leaves(saved)]
    g = None if self.is_last else self.gradient_like(out)
    params, opt_state, _, scale = self.state[:4]
    ctl = self._ctl(1.0)
    if self.k > 1:
      jax.block_until_ready(self._accum(saved, g, params, self.state.grads))
    _, _, _, update, _, skipped, _ = self._bwd_first(saved, g, params, opt_state, scale, ctl)
    jax.block_until_ready(self._bwd_acc(saved, g, params, opt_state, scale, update, skipped, ctl))
    jax.block_until_ready(self._add(params, update))
    return out

  def gradient_like(self, out: jax.Array) -> Any:
    """What this stage's backward receives for an output like ``out`` (ones): the gradient, and in fp16
    with the scale it carries."""
    return (jnp.ones_like(out), jnp.ones((), jnp.float32)) if self.scaled else jnp.ones_like(out)

  def gradient_arrays(self, gx: Any) -> list[Any]:
    """The arrays of a gradient :meth:`backward` returned, as a message between processes carries them:
    the gradient, then in fp16 the scale it is at (:meth:`gradient_from` reads them)."""
    return list(gx) if self.scaled else [gx]

  def gradient_from(self, arrays: Sequence[Any]) -> Any:
    """The gradient :meth:`backward` takes, from the arrays of its message (:meth:`gradient_arrays`)."""
    return tuple(arrays) if self.scaled else arrays[0]

  def take_wave(self, wave: int):
    """Removes and returns the summed update of a finished wave (one entry per unit): what a push sends,
    in 16 bits in mixed precision (the fp32 sum rounded once); fp16 keeps its skipped count in
    :attr:`skipped` for :meth:`take_skipped`.

    Raises:
      ProtocolError: when the wave does not hold exactly Nm updates.
    """
    waves = dict(self.state.waves)
    acc = waves.pop(wave)
    if acc.count != self.nm:
      raise ProtocolError(f"wave {wave} of stage [{self.first},{self.last}) holds {acc.count} updates, "
                          f"expected Nm={self.nm}")
    self.state = self.state._replace(waves=waves)
    if acc.skipped is not None:
      self.skipped[wave] = acc.skipped
    return acc.update if self.dtype is None else mixed.cast_floats(acc.update, self.dtype)

  def take_skipped(self, wave: int) -> int:
    """How many of the pushed wave's minibatch updates fp16 skipped at this stage (0 in bf16 and fp32)."""
    skipped = self.skipped.pop(wave, None)
    return 0 if skipped is None else int(skipped)

  def rebase(self, global_params) -> int:
    """Pull: weights <- global weights + the local updates of waves not pushed yet.

    Returns how many local minibatch updates it added back on top of the global weights.
    """
    params = self._put_params(global_params)  # a copy: the PS donates its own
    added = 0
    for wave in sorted(self.state.waves):
      acc = self.state.waves[wave]
      params = self._add(params, acc.update)
      added += acc.count
    self.state = self.state._replace(params=params)
    return added
