"""The peers as the studies run them: simulated on the study's cluster and time model
(:mod:`hetpipe_jax.baselines`), then trained with their real numerics
(:mod:`hetpipe_jax.baselines.numerics`) on the clock of their own simulated round.

Shared by ``experiments.convergence`` (time to accuracy), ``experiments.throughput`` (images/s) and the
tuner's peer search (``experiments.tune``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

from experiments import common

BASE_LR_PER_32 = 0.02  # the learning-rate rule's base: 0.02 per update of a 32-example minibatch
LR_SCALINGS = ("linear", "sqrt")  # how the rule scales with the examples of an update (:func:`rule_lr`)
REACHES, MISSES, NOT_TRAINED = "reaches", "misses", "not trained"  # goodput marks (:func:`goodput`)


def rule_lr(update_examples: int, base: float = BASE_LR_PER_32, scaling: str = "linear") -> float:
  """The learning-rate rule's centre for an update of ``update_examples`` examples: ``base`` per 32-example
  update, scaled linearly with the examples (SGD: Goyal et al. 2017) or with their square root (Adam: Malladi
  et al. 2022)."""
  ratio = update_examples / 32
  return base * (ratio if scaling == "linear" else ratio ** 0.5)


class PeerSpec(NamedTuple):
  """A peer of a study.

  Attributes:
    system: its name in :data:`hetpipe_jax.baselines.systems.SYSTEMS`.
    name: its row's name.
    run: the simulated run, or None when the system cannot run on the cluster (``reason``).
    reason: why it cannot run (None when it can).
  """

  system: str
  name: str
  run: Any
  reason: str | None

  @property
  def batch_sizes(self) -> list[int]:
    """Each worker's examples per local step."""
    return [w.batch for w in self.run.job.workers]

  @property
  def local_steps(self) -> list[int]:
    """Each worker's local steps per round (1 for the synchronous peers)."""
    return [w.local_steps for w in self.run.job.workers]

  @property
  def update_examples(self) -> int:
    """Examples behind one update of the weights: the global batch (synchronous), a worker's step (local SGD:
    the largest)."""
    if self.system == "local_sgd":
      return max(self.batch_sizes)
    return sum(self.batch_sizes)


def peer_specs(cluster, profiles, batch_size: int, costs, knobs, systems: Sequence[str], exclude: str = "",
               model: str = "") -> list[PeerSpec]:
  """Every peer of ``systems`` simulated on ``cluster`` (without the GPUs of type ``exclude``).

  Returns:
    One spec per system, in order; a system the cluster cannot run (no GPU holds the model, ...) with its
    reason instead of a run.
  """
  from hetpipe_jax import ConfigError
  from hetpipe_jax.baselines.systems import simulate_peer
  from hetpipe_jax.cluster import make_cluster
  if exclude:
    kept = [[g.type for g in cluster.node_gpus(n)] for n in sorted({g.node for g in cluster.gpus})
            if cluster.node_gpus(n)[0].type.name != exclude]
    cluster = make_cluster(f"{cluster.name}-no-{exclude.replace(' ', '_')}", kept, cluster.intra_node,
                           cluster.inter_node)
  specs = []
  for system in systems:
    try:
      run = simulate_peer(system, cluster, profiles, batch_size, knobs, costs, model)
      name = f"{system} ({len({g.index for w in run.job.workers for g in w.gpus})} GPUs)"
      specs.append(PeerSpec(system, name, run, None))
      common.progress("%s: %.1f images/s (simulated), efficiency %.3f", name, run.images_per_sec, run.efficiency)
    except ConfigError as e:
      specs.append(PeerSpec(system, system, None, str(e)))
      common.progress("%s cannot run here: %s", system, e)
  return specs


def train_peer(model, dataset, spec: PeerSpec, seed: int, lr: float, optimizer: str, epochs: float,
               eval_examples: int, knobs) -> list[list[float]]:
  """Trains ``spec`` with its numerics for ``epochs`` epochs (synchronous SGD at its global batch with each
  worker's gradient weighted by its share; local SGD with its H and outer Nesterov step).

  Returns:
    The curve: ``[time s, examples so far / batch size, test accuracy, train loss, test loss]`` at every
    evaluation, on the clock of the peer's simulated round.
  """
  from hetpipe_jax.baselines.numerics import train_local_sgd, train_weighted_sync
  from hetpipe_jax.optim import make_optimizer
  run = spec.run
  per_round = run.examples_per_round
  rounds = max(1, int(epochs * len(dataset.x_train) // per_round))
  every = max(1, round(eval_examples / per_round))
  what = f"{spec.name}, seed {seed}"
  if spec.system == "local_sgd":
    rows = train_local_sgd(model, dataset, make_optimizer(optimizer, lr), spec.batch_sizes, spec.local_steps, rounds,
                           run.round_seconds, knobs.outer_lr, knobs.outer_momentum, True, seed, every, what=what)
  else:
    rows = train_weighted_sync(model, dataset, make_optimizer(optimizer, lr), spec.batch_sizes, rounds,
                               run.round_seconds, seed, every, what=what)
  batch = run.timeline["meta"]["batch_size"]
  return [[r["time"], r["examples"] / batch, r["test_accuracy"], r["train_loss"], r["test_loss"]] for r in rows
          if "test_accuracy" in r]


def run_signature(run: dict) -> list:
  """What identifies a convergence run's configuration: a HetPipe run's Nm per virtual worker and D, a peer's
  batch per worker and local steps (the throughput study's entries carry the same)."""
  if run.get("system") == "hetpipe":
    return [list(run.get("nm") or []), run.get("d")]
  return [list(run.get("batch_sizes") or []), list(run.get("local_steps") or [])]


def goodput(docs: list[dict], row: str, signature: list | None = None) -> tuple[str, float | None]:
  """(the mark of ``row`` in the first of ``docs`` that trained it, its mean time to target). A convergence
  study that trained this row in another configuration (another ``signature``) does not mark it."""
  for doc in docs:
    runs = [r for r in doc.get("runs", []) if r.get("row") == row]
    if signature is not None and runs and "nm" in runs[0]:
      runs = [r for r in runs if run_signature(r) == signature]
      if not runs:
        return f"{NOT_TRAINED} (the convergence study trained another configuration)", None
    if runs:
      times = [r.get("time_to_target_s") for r in runs]
      if any(t is None for t in times):
        return MISSES, None
      return REACHES, sum(times) / len(times)
    entry = next((v for v in doc["summary"].values() if isinstance(v, dict) and v.get("row") == row), None)
    if entry is not None:
      missed = entry.get("missed", 0)
      missed = len(missed) if isinstance(missed, list) else int(missed)
      return (MISSES if missed else REACHES), entry.get("mean_time_to_target_s")
  return NOT_TRAINED, None
