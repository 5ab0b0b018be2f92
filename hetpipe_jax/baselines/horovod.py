"""Baselines: Horovod-style synchronous data parallelism, as a cost model.

Every GPU holds the whole model and trains its own minibatch; gradients are summed with ring all-reduce
every step. One iteration on GPUs G (HETPIPE.md section 5's baseline):

  T = max_{g in G} (forward + backward of the whole model on g's type) + T_allreduce(S)

for S = the model's parameter bytes. Ring all-reduce over p GPUs on one kind of link (bandwidth B,
latency a) moves 2 (p-1)/p S bytes per GPU in 2 (p-1) steps:

  T_ring(p, S, link) = 2 (p-1) a + 2 (p-1)/p * S / B

Across nodes it is hierarchical (NCCL/Horovod's hierarchical all-reduce): a ring reduce-scatter inside
each node (g = most GPUs of one node), a ring all-reduce of the S/g shards across the n nodes, a ring
all-gather inside each node:

  T = 2 (g-1) a_intra + 2 (g-1)/g * S / B_intra + T_ring(n, S/g, inter-node link)

Throughput = |G| x batch / T images per second.
"""

from __future__ import annotations

from collections.abc import Sequence

from hetpipe_jax.cluster.topology import Cluster, Gpu, Link
from hetpipe_jax.cost.profile import UnitProfile


def ring_allreduce_seconds(p: int, num_bytes: float, link: Link) -> float:
  """Ring all-reduce of ``num_bytes`` over ``p`` participants on one kind of link."""
  if p <= 1:
    return 0.0
  return 2 * (p - 1) * link.latency_s + 2 * (p - 1) / p * num_bytes / link.bytes_per_s


def allreduce_seconds(cluster: Cluster, gpus: Sequence[Gpu], num_bytes: float) -> float:
  """All-reduce time over ``gpus``: a flat ring inside one node, hierarchical across nodes."""
  per_node: dict[int, int] = {}
  for g in gpus:
    per_node[g.node] = per_node.get(g.node, 0) + 1
  if len(per_node) == 1:
    return ring_allreduce_seconds(len(gpus), num_bytes, cluster.intra_node)
  g = max(per_node.values())
  intra = ring_allreduce_seconds(g, num_bytes, cluster.intra_node)  # reduce-scatter + all-gather
  return intra + ring_allreduce_seconds(len(per_node), num_bytes / g, cluster.inter_node)


def horovod_iteration_seconds(cluster: Cluster, profiles: Sequence[UnitProfile], gpus: Sequence[Gpu],
                              precision: str = "fp32") -> float:
  """One synchronous step: the slowest GPU's forward + backward, then the gradient all-reduce."""
  compute = max(sum(sum(u.seconds(g.type, precision)) for u in profiles) for g in gpus)
  return compute + allreduce_seconds(cluster, gpus, sum(u.param_bytes for u in profiles))


def horovod_images_per_second(cluster: Cluster, profiles: Sequence[UnitProfile], gpus: Sequence[Gpu],
                              batch_size: int, precision: str = "fp32") -> float:
  return len(gpus) * batch_size / horovod_iteration_seconds(cluster, profiles, gpus, precision)


def train_data_parallel(model, dataset, tx, num_workers: int, steps: int, batch_size: int,
                        step_seconds: float, seed: int = 0, eval_every: int = 10,
                        device=None) -> list[dict]:
  """Horovod-style synchronous data parallelism, numerically: every step each of ``num_workers`` workers
  computes the gradient of its own minibatch, the gradients are averaged (the all-reduce) and one
  update is applied. The clock advances ``step_seconds`` per step (from the cost model).

  Returns metrics rows like the HetPipe runs': ``{"vw": 0, "wave": step-1, "step", "time",
  "train_loss"}`` per step, with ``test_accuracy`` every ``eval_every`` steps and at the end.
  """
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  import optax  # pylint: disable=g-import-not-at-top
  from absl import logging  # pylint: disable=g-import-not-at-top

  from hetpipe_jax.api import make_evaluator  # pylint: disable=g-import-not-at-top
  from hetpipe_jax.data import MinibatchStreams  # pylint: disable=g-import-not-at-top
  from hetpipe_jax.models.base import cross_entropy  # pylint: disable=g-import-not-at-top

  device = device or jax.devices()[0]
  streams = MinibatchStreams(dataset, batch_size, num_workers, seed)
  params = jax.device_put(model.init(jax.random.key(seed), jnp.asarray(dataset.x_train[:batch_size])), device)
  opt_state = tx.init(params)
  loss_fn = lambda p, x, y: cross_entropy(model.apply(p, x), y)

  @jax.jit
  def step(params, opt_state, xs, ys):
    # The average of the workers' gradients (the all-reduce) is the gradient of the mean loss over
    # their minibatches together (all have the same size), computed here as one batch.
    loss, grads = jax.value_and_grad(loss_fn)(params, xs.reshape((-1,) + xs.shape[2:]), ys.reshape(-1))
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  evaluate = make_evaluator(model, dataset, device)
  rows, losses = [], []
  for s in range(1, steps + 1):
    batch = [streams(w, s) for w in range(num_workers)]
    xs = jax.device_put(np.stack([b[0] for b in batch]), device)
    ys = jax.device_put(np.stack([b[1] for b in batch]), device)
    params, opt_state, loss = step(params, opt_state, xs, ys)
    losses.append(loss)
    rows.append({"vw": 0, "wave": s - 1, "step": s, "time": s * step_seconds})
    if s % eval_every == 0 or s == steps:
      rows[-1]["test_accuracy"] = evaluate(params)
      logging.info("data parallel (%d workers): step %d/%d  t=%.4gs  test accuracy %.4f", num_workers, s,
                   steps, rows[-1]["time"], rows[-1]["test_accuracy"])
  for row, loss in zip(rows, jax.device_get(losses)):
    row["train_loss"] = float(loss)
  return rows
