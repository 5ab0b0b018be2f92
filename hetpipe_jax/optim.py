"""The local optimizers by name, and how much state each keeps per parameter (its memory cost).

One registry serves the runtime (which builds the optax transformation), the planner and the memory
model (which charge ``slots`` parameter-sized copies of optimizer state per stage), and the experiment
scripts (which list the names)::

  tx = make_optimizer("momentum", 0.05)      # optax.sgd(0.05, momentum=0.9)
  optimizer_slots("adam")                    # 2: first and second moments
  make_optimizer("muon", 0.02)               # Muon on matrices, Adam on the rest (optax.contrib.muon)
  make_optimizer("adam", parse_lr_schedule("cosine:warmup=0.05,final=0.1").rate(1e-3, updates=500))

The parameter server's outer optimizer (``--ps_optimizer``, applied to every pushed wave's summed update)
is built here from its spec too::

  make_ps_optimizer("add")                             # None: the server's default, W <- W + delta
  make_ps_optimizer("nesterov:lr=0.7,momentum=0.9")    # DiLoCo's outer Nesterov step on -delta
  make_ps_optimizer("avg", num_vws=4)                  # W <- W + delta / 4: each push scaled by 1/N
  make_ps_optimizer("delayed_nesterov", num_vws=4)     # one Nesterov step per 4 pushes (Async Local-SGD)
  make_ps_optimizer("heloco", num_vws=4)               # averaged, stale pushes turned toward the momentum
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from hetpipe_jax.errors import ConfigError


class Optimizer(NamedTuple):
  """A named optax optimizer: its factory (learning rate -> transformation) and its state size."""

  make: Callable[[float | optax.Schedule], optax.GradientTransformation]
  slots: int  # parameter-sized arrays of state per parameter


WEIGHT_DECAY = 0.01  # AdamW's decoupled decay (ours: Loshchilov & Hutter's range 0.005-0.05 x its rate's scale)


def _matrices(params: Any) -> Any:
  """True for the weights of two or more dimensions (AdamW decays those, not biases or norms' scales)."""
  return jax.tree.map(lambda p: jnp.ndim(p) >= 2, params)


def adamw(learning_rate: float | optax.Schedule) -> optax.GradientTransformation:
  """AdamW (Loshchilov & Hutter, "Decoupled weight decay regularization", ICLR 2019): Adam with the weights decayed
  by ``WEIGHT_DECAY`` x the rate apart from the gradient, on matrices only."""
  return optax.adamw(learning_rate, weight_decay=WEIGHT_DECAY, mask=_matrices)


def muon(learning_rate: float | optax.Schedule) -> optax.GradientTransformation:
  """Muon (Jordan et al. 2024; "Muon is scalable for LLM training", arXiv 2502.16982): momentum whose update of a
  matrix is orthogonalised by 5 Newton-Schulz steps; the other parameters take Adam at the same rate (optax's
  ``contrib.muon`` defaults: Nesterov momentum 0.95)."""
  return optax.contrib.muon(learning_rate)


OPTIMIZERS: dict[str, Optimizer] = {
    "sgd": Optimizer(optax.sgd, 0),
    "momentum": Optimizer(lambda lr: optax.sgd(lr, momentum=0.9), 1),
    "adam": Optimizer(optax.adam, 2),
    "adamw": Optimizer(adamw, 2),
    "muon": Optimizer(muon, 1),  # (a matrix's momentum: + 1 per parameter of another shape, Adam's; a run measures it)
}


class LrSchedule(NamedTuple):
  """A learning-rate schedule over a run's optimizer updates (``--lr_schedule``): a linear warm-up over the first
  ``warmup`` fraction of them (Goyal et al. 2017, "Accurate, large minibatch SGD"), then a cosine decay to ``final``
  x the peak rate at the last one (Loshchilov & Hutter 2017, "SGDR"). ``constant`` (warm-up 0, final 1) is the rate
  as given: the transformation takes the float, as before any schedule existed, so its runs are unchanged.

  The fractions are of the optimizer's own updates over its run (:meth:`rate`'s ``updates``): a stage of HetPipe
  counts its local updates, a synchronous peer its steps, a local-SGD worker its inner steps; so every system warms
  up and decays over the same share of the examples it trains on, whatever its examples per update.
  """

  warmup: float = 0.0
  final: float = 1.0

  @property
  def constant(self) -> bool:
    return self.warmup == 0.0 and self.final == 1.0

  def __str__(self) -> str:
    """The canonical spec: ``constant`` or ``cosine:warmup=W,final=F``."""
    return "constant" if self.constant else f"cosine:warmup={self.warmup!r},final={self.final!r}"

  def factor(self, update: Any, updates: int) -> Any:
    """The factor on the peak rate of update number ``update`` (from 0) of ``updates``: t / W for the t-th update
    (from 1) of the W = round(warmup x updates) of the warm-up, then final + (1 - final)(1 + cos(pi p)) / 2, p going
    from 0 at the W-th update to 1 at the last."""
    warm = max(1, round(self.warmup * updates)) if self.warmup > 0 else 1  # the update at the peak, from 1
    t = jnp.asarray(update, jnp.float32) + 1.0
    ramp = jnp.minimum(1.0, t / warm)
    progress = jnp.clip((t - warm) / max(1, updates - warm), 0.0, 1.0)  # 0 at the peak, 1 at the last update
    return ramp * (self.final + (1.0 - self.final) * 0.5 * (1.0 + jnp.cos(jnp.pi * progress)))

  def rate(self, lr: float, updates: int) -> float | optax.Schedule:
    """``lr`` itself when constant, else the schedule of ``updates`` optimizer updates at peak ``lr``."""
    if self.constant:
      return lr
    return lambda count: lr * self.factor(count, max(1, int(updates)))


CONSTANT = LrSchedule()
LR_SCHEDULE_EXAMPLE = "cosine:warmup=0.05,final=0.1"


def parse_lr_schedule(spec: str) -> LrSchedule:
  """Parses ``constant`` or ``cosine[:warmup=W,final=F]`` (defaults: warm-up 0.05 of the updates, final 0.1).

  Raises:
    ConfigError: (one line) for another name, an unknown or repeated key, a warm-up outside [0, 1) or a final
      factor outside [0, 1].
  """
  name, _, rest = str(spec).strip().partition(":")
  if name.strip() == "constant" and not rest.strip():
    return CONSTANT
  if name.strip() != "cosine":
    raise ConfigError(f"lr_schedule={spec!r}; give constant or cosine:warmup=W,final=F (e.g. {LR_SCHEDULE_EXAMPLE})")
  values: dict[str, float] = {}
  for item in filter(None, (part.strip() for part in rest.split(","))):
    key, _, text = (x.strip() for x in item.partition("="))
    if key not in ("warmup", "final") or key in values:
      raise ConfigError(f"lr_schedule={spec!r}: {key!r} is unknown or given twice; its keys are warmup and final, "
                        "each once")
    try:
      values[key] = float(text)
    except ValueError:
      raise ConfigError(f"lr_schedule={spec!r}: {item!r} is not KEY=NUMBER; write e.g. {LR_SCHEDULE_EXAMPLE}") from None
  parsed = LrSchedule(values.get("warmup", 0.05), values.get("final", 0.1))
  if not (0 <= parsed.warmup < 1 and 0 <= parsed.final <= 1):
    raise ConfigError(f"lr_schedule={spec!r}: warmup={parsed.warmup:g}, final={parsed.final:g}; the warm-up is a "
                      "fraction of the updates in [0, 1) and the final rate a fraction of the peak in [0, 1]")
  return parsed


def _get(name: str) -> Optimizer:
  if name not in OPTIMIZERS:
    raise ConfigError(f"unknown optimizer {name!r}; choose one of {', '.join(OPTIMIZERS)}")
  return OPTIMIZERS[name]


def make_optimizer(name: str, learning_rate: float | optax.Schedule) -> optax.GradientTransformation:
  """The optax transformation of optimizer ``name`` at ``learning_rate`` (a float, or a schedule of the update
  count: :meth:`LrSchedule.rate`).

  Raises:
    ConfigError: for an unknown name.
  """
  return _get(name).make(learning_rate)


def optimizer_slots(name: str) -> int:
  """Parameter-sized copies of state that optimizer ``name`` keeps (sgd 0, momentum 1, adam and adamw 2, muon 1).

  Raises:
    ConfigError: for an unknown name.
  """
  return _get(name).slots


# --- the parameter server's outer optimizer (--ps_optimizer) --------------------------------------------------

# name -> its keys and their defaults. The push is a wave's summed weight change delta; the outer gradient
# is -delta (DiLoCo, arXiv 2311.08105), so SGD with learning rate lr on it adds lr x delta.
# N is the number of virtual workers (``num_vws`` of :func:`make_ps_optimizer`).
PS_OPTIMIZERS: dict[str, dict[str, float]] = {
    "add": {},                                 # W <- W + delta: the paper's rule (the default)
    "sgd": {"lr": 1.0},                        # W <- W + lr x delta
    "momentum": {"lr": 0.7, "momentum": 0.9},  # heavy ball on -delta
    "nesterov": {"lr": 0.7, "momentum": 0.9},  # Nesterov momentum on -delta: DiLoCo's outer step
    "avg": {"lr": 1.0, "share": 1.0},          # W <- W + lr x delta x (its share of a round's examples)
    "delayed_nesterov": {"lr": 0.7, "momentum": 0.9, "share": 1.0},  # one Nesterov step per N pushes (Async Local-SGD)
    # averaged pushes, each block of a stale one turned toward the outer momentum's direction (HeLoCo)
    "heloco": {"lr": 1.0, "momentum": 0.9, "share": 1.0, "keep": 0.5, "shrink": 1.0, "cap": 1.0, "turn": 0.5,
               "kappa": 1.0},
}
PS_OPTIMIZER_EXAMPLE = "nesterov:lr=0.7,momentum=0.9"
BY_ROUND = ("avg", "delayed_nesterov", "heloco")  # the rules whose step depends on N (and on each push's share)


class PSOptimizer(NamedTuple):
  """A parsed ``--ps_optimizer`` spec: its name and its keys (``momentum`` is 0 where the name has none;
  ``share`` 1: a push weighs its virtual worker's share of a round's examples, 0: 1 / N each)."""

  name: str
  lr: float = 1.0
  momentum: float = 0.0
  share: float = 1.0
  keep: float = 0.5  # HeLoCo's knobs (:func:`heloco`)
  shrink: float = 1.0
  cap: float = 1.0
  turn: float = 0.5
  kappa: float = 1.0

  def __str__(self) -> str:
    """The canonical spec (what the trace's meta line records): ``add``, ``sgd:lr=0.5``, ..."""
    keys = PS_OPTIMIZERS[self.name]
    return self.name + (":" + ",".join(f"{k}={getattr(self, k)!r}" for k in keys) if keys else "")

  @property
  def slots(self) -> int:
    """Parameter-sized arrays of state the parameter server keeps for it (the momentum's trace; Delayed
    Nesterov's buffer of the round's pushes too)."""
    return 2 if self.name == "delayed_nesterov" else int("momentum" in PS_OPTIMIZERS[self.name])  # (HeLoCo: 1)


def parse_ps_optimizer(spec: str) -> PSOptimizer:
  """Parses ``NAME[:KEY=VALUE,...]``: ``add``, ``sgd:lr=0.5``, ``momentum:lr=0.7,momentum=0.9``,
  ``nesterov:lr=0.7,momentum=0.9`` (keys left out take :data:`PS_OPTIMIZERS`' defaults).

  Raises:
    ConfigError: (one line) for an unknown name or key, a value that is not a number, lr <= 0 or not
      finite, momentum outside [0, 1).
  """
  if not isinstance(spec, str):
    raise ConfigError(f"ps_optimizer={spec!r}; give a string such as add or {PS_OPTIMIZER_EXAMPLE}")
  name, _, rest = spec.strip().partition(":")
  name = name.strip()
  if name not in PS_OPTIMIZERS:
    raise ConfigError(f"ps_optimizer={spec!r}: unknown optimizer {name!r}; choose one of {', '.join(PS_OPTIMIZERS)} "
                      f"(e.g. {PS_OPTIMIZER_EXAMPLE})")
  keys, values = PS_OPTIMIZERS[name], {}
  for item in filter(None, (part.strip() for part in rest.split(","))):
    key, eq, text = (s.strip() for s in item.partition("="))
    if key not in keys:
      known = f"its keys are {', '.join(keys)}" if keys else "it takes no keys"
      raise ConfigError(f"ps_optimizer={spec!r}: {name} has no key {key!r}; {known}")
    if key in values:
      raise ConfigError(f"ps_optimizer={spec!r}: {key} is given twice; give each key once")
    try:
      values[key] = float(text) if eq else float("")
    except ValueError:
      raise ConfigError(f"ps_optimizer={spec!r}: {item!r} is not KEY=NUMBER; write e.g. "
                        f"{PS_OPTIMIZER_EXAMPLE}") from None
  parsed = PSOptimizer(name, **{**keys, **values})
  if "lr" in keys and not (math.isfinite(parsed.lr) and parsed.lr > 0):
    raise ConfigError(f"ps_optimizer={spec!r}: lr={parsed.lr}; the outer learning rate must be a finite number "
                      "> 0 (1 with momentum 0 is the plain add; DiLoCo uses 0.7)")
  if "momentum" in keys and not 0 <= parsed.momentum < 1:
    raise ConfigError(f"ps_optimizer={spec!r}: momentum={parsed.momentum}; the outer momentum must be in [0, 1) "
                      "(DiLoCo uses 0.9)")
  for key in ("keep", "shrink", "cap", "turn", "kappa"):
    limits = (-1.0, 1.0) if key == "keep" else (0.0, math.inf)
    value = getattr(parsed, key)
    if key in keys and not (math.isfinite(value) and limits[0] <= value <= limits[1]):
      raise ConfigError(f"ps_optimizer={spec!r}: {key}={value}; HeLoCo's {key} must be a finite number in "
                        f"[{limits[0]:g}, {limits[1]:g}] (default {keys[key]:g})")
  if "share" in keys and parsed.share not in (0.0, 1.0):
    raise ConfigError(f"ps_optimizer={spec!r}: share={parsed.share}; give share=1 (each push weighs its virtual "
                      "worker's share of a round's examples, the default) or share=0 (each push 1 / N)")
  return parsed


class DelayedNesterovState(NamedTuple):
  """Delayed Nesterov's state: pushes so far, the momentum, and the buffer of the pushes since its last step."""

  count: Any
  momentum: Any
  buffer: Any


def _share_of(shares: tuple[float, ...] | None, every: int, vw: Any) -> Any:
  """A push's weight: its virtual worker's entry of ``shares``, or 1 / ``every`` without shares."""
  return 1.0 / every if shares is None else jnp.asarray(shares, jnp.float32)[vw]


def weighted_average(lr: float, num_vws: int, shares: tuple[float, ...] | None = None
                     ) -> optax.GradientTransformationExtraArgs:
  """Averaged pushes, as Async Local-SGD scales them (Liu et al. 2024, "Asynchronous Local-SGD Training for Language
  Modeling", arXiv 2401.09135, section 3): ``W <- W + lr x s_i x delta`` for a push of virtual worker i (the
  extra argument ``vw``), ``s_i`` its share of a round's examples (``shares``; None: 1 / ``num_vws`` for every
  push, ``optax.scale(lr / num_vws)`` exactly). With waves of equal examples the shares are 1 / N, and N pushes
  move the weights as far as one synchronous round of averaged local SGD; with waves sized to speed a push counts
  as many examples as it carries (FedAvg's weighting, McMahan et al. 2017)."""
  if shares is None:
    return optax.with_extra_args_support(optax.scale(lr / num_vws))

  def update(updates, state, params=None, *, vw=0, **extra):
    del params, extra
    w = lr * _share_of(shares, num_vws, vw)
    return jax.tree.map(lambda u: u * w.astype(u.dtype), updates), state

  return optax.GradientTransformationExtraArgs(lambda params: optax.EmptyState(), update)


def delayed_nesterov(lr: float, momentum: float, every: int, shares: tuple[float, ...] | None = None
                     ) -> optax.GradientTransformationExtraArgs:
  """Delayed Nesterov, the outer step of Async Local-SGD (Liu et al. 2024, "Asynchronous Local-SGD Training for
  Language Modeling", arXiv 2401.09135, Algorithm 2 with c = 0), on pushed updates delta (outer gradient -delta).

  A push of virtual worker i (the extra argument ``vw``) weighs s_i, its share of a round's examples (``shares``;
  None: 1 / ``every`` each). It adds ``lr x s_i x delta`` at once; the weighted pushes are also summed in a buffer,
  and every ``every``-th push (one round: ``every`` pushes) the momentum takes one step on the buffer (the round's
  weighted mean) and its Nesterov term is added too::

    b <- b + s_i delta
    push k % every != 0:  W <- W + lr x s_i delta
    push k % every == 0:  m <- momentum x m + b;  W <- W + lr x (s_i delta + momentum x m);  b <- 0

  So momentum moves once per round, never on each stale push, which is what breaks plain Nesterov under
  asynchrony; with ``every`` = 1 it is Nesterov momentum (``nesterov`` here) exactly. Without shares the buffer
  sums the raw pushes and is divided by ``every`` at the step (the same sum in exact arithmetic).
  """

  def init(params):  # (two trees of zeros, not one twice: the server donates the state's buffers)
    return DelayedNesterovState(jnp.zeros([], jnp.int32), jax.tree.map(jnp.zeros_like, params),
                                jax.tree.map(jnp.zeros_like, params))

  def update(updates, state, params=None, *, vw=0, **extra):
    del params, extra
    count = state.count + 1
    step = count % every == 0
    if shares is None:  # (the raw sum, divided once: the rule as first built, bit for bit)
      weighted, added, mean = (lambda u: u / every), (lambda u: u), (lambda b: b / every)
    else:
      w = _share_of(shares, every, vw)
      weighted = added = lambda u: u * w.astype(u.dtype)
      mean = lambda b: b
    buffer = jax.tree.map(lambda b, u: b + added(u), state.buffer, updates)
    m = jax.tree.map(lambda m, b: jnp.where(step, momentum * m + mean(b), m), state.momentum, buffer)
    out = jax.tree.map(lambda u, m: lr * (weighted(u) + jnp.where(step, momentum * m, jnp.zeros_like(m))), updates, m)
    buffer = jax.tree.map(lambda b: jnp.where(step, jnp.zeros_like(b), b), buffer)
    return out, DelayedNesterovState(count, m, buffer)

  return optax.GradientTransformationExtraArgs(init, update)


class HeLoCoState(NamedTuple):
  """HeLoCo's state: the outer momentum (an exponential mean of the corrected, weighted pushes)."""

  momentum: Any


def _turn_block(u: Any, m: Any, spec: PSOptimizer) -> Any:
  """One tensor block ``u`` of a push, corrected against the outer momentum's block ``m`` (:func:`heloco`)."""
  eps = 1e-12
  nu, nm = jnp.linalg.norm(u.ravel()), jnp.linalg.norm(m.ravel())
  v = m / jnp.maximum(nm, eps)  # the momentum's direction
  cos = jnp.vdot(u.ravel(), v.ravel()) / jnp.maximum(nu, eps)
  conf = nu / (nu + spec.kappa * nm + eps)
  beta = jnp.minimum(spec.shrink * -cos * conf, spec.cap)
  shrunk = u - beta * cos * nu * v  # a fraction beta of its projection on -v removed
  lam = jnp.minimum(spec.turn * (1 - cos) * conf, 1.0)
  turned = (1 - lam) * u / jnp.maximum(nu, eps) + lam * v  # its direction moved toward v; its norm kept
  turned = nu * turned / jnp.maximum(jnp.linalg.norm(turned.ravel()), eps)
  corrected = jnp.where(cos < 0, shrunk, turned)
  return jnp.where((nm <= eps) | (nu <= eps) | (cos >= spec.keep), u, corrected).astype(u.dtype)


def heloco(spec: PSOptimizer, num_vws: int, shares: tuple[float, ...] | None = None
           ) -> optax.GradientTransformationExtraArgs:
  """HeLoCo's direction-aware correction of stale pushes (Asif et al. 2026, "HeLoCo: Efficient asynchronous
  low-communication training under data and device heterogeneity", arXiv 2606.00271), on pushed updates delta.

  The outer momentum m is the reference for the current direction. Per tensor block b (a leaf of the update), with
  c the cosine between delta_b and m_b, conf = |delta_b| / (|delta_b| + kappa |m_b|), v = m_b / |m_b|:
  c >= ``keep``: kept; c < 0 (against the momentum): ``delta_b - beta c |delta_b| v`` with beta = min(``shrink``
  x -c x conf, ``cap``); 0 <= c < ``keep``: its direction turned toward v by lam = min(``turn`` x (1 - c) x conf,
  1), its norm kept. A block passes unchanged while the momentum is zero (the first push). Then, with the push's
  weight s_i (its virtual worker's share of a round's examples, ``shares``; None: 1 / N) and G = s_i x the
  corrected push::

    m <- momentum x m + (1 - momentum) x G;   W <- W + lr x (G + momentum x m)

  The update is written from the method's published description; its defaults (keep 0.5, shrink 1, cap 1,
  turn 0.5, kappa 1) are this project's choices, as the values the paper uses were not available to us.
  """

  def init(params):
    return HeLoCoState(jax.tree.map(jnp.zeros_like, params))

  def update(updates, state, params=None, *, vw=0, **extra):
    del params, extra
    w = _share_of(shares, num_vws, vw)
    g = jax.tree.map(lambda u, m: _turn_block(u, m, spec) * jnp.asarray(w, u.dtype), updates, state.momentum)
    m = jax.tree.map(lambda m, g: spec.momentum * m + (1 - spec.momentum) * g, state.momentum, g)
    return jax.tree.map(lambda g, m: spec.lr * (g + spec.momentum * m), g, m), HeLoCoState(m)

  return optax.GradientTransformationExtraArgs(init, update)


def push_shares(wave_examples: Sequence[int]) -> tuple[float, ...] | None:
  """Each virtual worker's share of a round's examples (one wave each), from the examples its wave carries; None
  when all are equal (every share 1 / N).

  Raises:
    ConfigError: for a count < 1.
  """
  if any(n < 1 for n in wave_examples):
    raise ConfigError(f"wave_examples={list(wave_examples)}; every virtual worker's wave carries >= 1 example")
  total = sum(wave_examples)
  return None if len(set(wave_examples)) <= 1 else tuple(n / total for n in wave_examples)


@functools.cache
def _ps_transformation(spec: PSOptimizer, num_vws: int, shares: tuple[float, ...] | None
                       ) -> optax.GradientTransformation | None:
  if spec.name == "add":
    return None
  shares = shares if spec.share else None
  if spec.name == "avg":
    return weighted_average(spec.lr, num_vws, shares)
  if spec.name == "delayed_nesterov":
    return delayed_nesterov(spec.lr, spec.momentum, num_vws, shares)
  if spec.name == "heloco":
    return heloco(spec, num_vws, shares)
  scale = optax.scale(spec.lr)
  if spec.name == "sgd":
    return scale
  return optax.chain(optax.trace(decay=spec.momentum, nesterov=spec.name == "nesterov"), scale)


def make_ps_optimizer(spec: str | PSOptimizer, num_vws: int = 1, wave_examples: Sequence[int] | None = None
                      ) -> optax.GradientTransformation | None:
  """The parameter server's apply rule of a ``--ps_optimizer`` spec (:func:`parse_ps_optimizer`) for ``num_vws``
  virtual workers whose waves carry ``wave_examples`` examples each (None: the same for all); None for ``add``
  (the server's default, ``optax.identity()``: bit-identical to the runs before the flag).

  The transformation takes the pushed wave's summed update delta (its outer gradient is -delta) and returns
  what the server adds to the weights: ``sgd`` lr x delta; ``momentum`` lr x m_t with m_t = delta + momentum x
  m_{t-1}; ``nesterov`` lr x (delta + momentum x m_t), i.e. ``optax.chain(optax.trace(momentum, nesterov=True),
  optax.scale(lr))`` (= ``optax.sgd(lr, momentum, nesterov=True)`` on -delta, DiLoCo's outer step); ``avg``
  :func:`weighted_average`, ``delayed_nesterov`` :func:`delayed_nesterov` with a round of N pushes, ``heloco``
  :func:`heloco` (a stale push's blocks corrected against the outer momentum): all three weigh a push by its
  virtual worker's share of a round's examples (``share=1``, the default; 1 / N with waves of equal examples) or
  by 1 / N (``share=0``), and take the pushing virtual worker as the extra argument ``vw``
  (``optax.GradientTransformationExtraArgs``; the server passes it to every rule). One spec, N and
  ``wave_examples`` give one object (cached), so configs with the same spec compare equal.

  Raises:
    ConfigError: for a bad spec (see :func:`parse_ps_optimizer`), ``num_vws`` < 1, or ``wave_examples`` not one
      count >= 1 per virtual worker.
  """
  if num_vws < 1:
    raise ConfigError(f"num_vws={num_vws}; the parameter server's rule needs at least 1 virtual worker")
  if wave_examples is not None and len(wave_examples) != num_vws:
    raise ConfigError(f"wave_examples={list(wave_examples)} for {num_vws} virtual workers; give one count per "
                      "virtual worker")
  parsed = spec if isinstance(spec, PSOptimizer) else parse_ps_optimizer(spec)
  by_round = parsed.name in BY_ROUND
  shares = push_shares(wave_examples) if by_round and wave_examples is not None else None
  return _ps_transformation(parsed, num_vws if by_round else 1, shares)
