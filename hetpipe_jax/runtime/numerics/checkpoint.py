"""Checkpoints of a run, with orbax-checkpoint: save everything a run needs to continue, and restore it.

A checkpoint is taken at a global clock tick, between two events of the executor (every task due at
that moment finished, none started yet): a consistent cut of the whole run. It holds

* the arrays: the parameter server's weights, optax state and clocks, every stage's weights, local
  optimizer state and open wave accumulators, what each forward keeps for its backward (in flight), the
  activations and gradients between stages, the losses not pushed yet;
* the host state: the engine's :class:`~hetpipe_jax.core.engine.EngineState`, whole, the executor's clock and its
  queue of running tasks, the metrics rows so far (evaluated), the number of trace events written;
* the run's identity (model, data, cluster, layout, protocol, optimizer, seed...), as JSON, so that a
  resume with flags that change any of them is refused with one line naming the difference.

Arrays are saved as numpy arrays by orbax (``StandardSave``); the host state is a pickled skeleton of
plain Python values (NamedTuples, dicts, sets) in which every array is replaced by its index, stored as
bytes beside them (only checkpoints this code wrote are read back: a checkpoint is trusted like code).
Orbax writes a checkpoint to a temporary directory and renames it when complete, so a checkpoint
interrupted while being written is never listed, and it keeps the newest ``keep`` (older ones are
deleted). Data order and RNG need no state: minibatch p of virtual worker i is a pure function of the
seed (:class:`~hetpipe_jax.data.MinibatchStreams`).
"""

from __future__ import annotations

import dataclasses
import json
import os
import pickle
import time
from typing import Any

import jax
import numpy as np

from hetpipe_jax.errors import ConfigError

FORMAT = 5  # bump when what a checkpoint holds changes: older ones are refused (5: the staleness control state)


@dataclasses.dataclass(frozen=True)
class _ArrayRef:
  """Where an array was in the host state: its index among the saved arrays."""

  index: int


def _is_array(x: Any) -> bool:
  return isinstance(x, (jax.Array, np.ndarray, np.generic))


def split(state: Any) -> tuple[bytes, dict[str, np.ndarray]]:
  """(pickled skeleton with arrays replaced by references, the arrays as numpy by index)."""
  leaves, treedef = jax.tree.flatten(state)
  arrays: dict[str, np.ndarray] = {}
  refs = []
  host = jax.device_get([x for x in leaves if _is_array(x)])
  it = iter(host)
  for x in leaves:
    if _is_array(x):
      arrays[str(len(arrays))] = np.asarray(next(it))
      refs.append(_ArrayRef(len(arrays) - 1))
    else:
      refs.append(x)
  return pickle.dumps(jax.tree.unflatten(treedef, refs)), arrays


def join(skeleton: bytes, arrays: dict[str, np.ndarray]) -> Any:
  """The state :func:`split` took apart (arrays as numpy: the owners place them on their devices)."""
  tree = pickle.loads(skeleton)  # noqa: S301  (our own checkpoint)
  return jax.tree.map(lambda x: arrays[str(x.index)] if isinstance(x, _ArrayRef) else x, tree)


class Checkpointer:
  """Saves and finds the checkpoints of one run directory.

  Args:
    directory: where the checkpoints live (one subdirectory per step, step = global clock).
    every: save every this many global clock ticks.
    keep: how many of the newest checkpoints to keep.
    identity: what the run is (JSON-able); a resume must match it.
  """

  def __init__(self, directory: str, every: int, keep: int, identity: dict[str, Any]):
    import orbax.checkpoint as ocp  # imported on use: only runs that checkpoint need it

    if every < 1:
      raise ConfigError(f"checkpoint_every={every}; save every 1 or more global clock ticks")
    if keep < 1:
      raise ConfigError(f"keep_checkpoints={keep}; keep at least 1 checkpoint")
    self._ocp, self.every, self.identity = ocp, every, identity
    self.directory = os.path.abspath(directory)
    try:
      os.makedirs(self.directory, exist_ok=True)
      probe = os.path.join(self.directory, ".hetpipe_write_test")
      with open(probe, "w", encoding="utf-8"):
        pass
      os.remove(probe)
    except OSError as e:
      raise ConfigError(f"checkpoint_dir={directory!r} is not writable ({e.strerror}); choose another "
                        "directory") from None
    # Written by this process alone: in a multi-process job, process 0 gathers the state and saves it.
    alone = ocp.options.MultiprocessingOptions(primary_host=jax.process_index(),
                                               active_processes={jax.process_index()})
    options = ocp.CheckpointManagerOptions(max_to_keep=keep, enable_async_checkpointing=False,
                                           multiprocessing_options=alone, create=False)  # made above
    self._manager = ocp.CheckpointManager(self.directory, options=options, item_names=("arrays", "meta"))
    self._next = every  # the global clock at which the next checkpoint is due
    self.seconds: list[float] = []  # per save
    self.bytes: list[int] = []

  def due(self, global_clock: int) -> bool:
    """Whether a checkpoint is due at this global clock (it reached the next multiple of ``every``)."""
    return global_clock >= self._next

  def _saved_at(self, step: int) -> None:
    self._next = (step // self.every + 1) * self.every

  def save(self, step: int, state: Any, extra: dict[str, Any]) -> None:
    """Saves ``state`` (any tree of plain values and arrays) as checkpoint ``step``; ``extra`` (JSON)
    goes beside the identity."""
    t = time.perf_counter()
    skeleton, arrays = split(state)
    arrays["host"] = np.frombuffer(skeleton, dtype=np.uint8)
    meta = {"format": FORMAT, "step": step, "identity": self.identity, **extra}
    ocp = self._ocp
    self._manager.save(step, args=ocp.args.Composite(arrays=ocp.args.StandardSave(arrays),
                                                     meta=ocp.args.JsonSave(meta)), force=True)
    self._manager.wait_until_finished()
    self._saved_at(step)
    self.seconds.append(time.perf_counter() - t)
    self.bytes.append(sum(a.nbytes for a in arrays.values()))

  def latest(self) -> int | None:
    """The newest complete checkpoint's step (None when there is none)."""
    self._manager.reload()
    return self._manager.latest_step()

  def restore(self, step: int) -> tuple[Any, dict[str, Any]]:
    """(the state, the meta) of checkpoint ``step``.

    Raises:
      ConfigError: for a checkpoint that cannot be read (corrupted, truncated, another format) or that
        belongs to another run (naming the first difference).
    """
    ocp = self._ocp
    where = os.path.join(self.directory, str(step))
    try:
      restored = self._manager.restore(step, args=ocp.args.Composite(arrays=ocp.args.StandardRestore(),
                                                                     meta=ocp.args.JsonRestore()))
      meta = dict(restored["meta"])
      arrays = {k: np.asarray(v) for k, v in restored["arrays"].items()}
      skeleton = arrays.pop("host").tobytes()
    except Exception as e:  # orbax, tensorstore and json raise many kinds on a damaged checkpoint
      raise ConfigError(f"checkpoint {where} cannot be read ({type(e).__name__}: {str(e).splitlines()[0][:160]}); "
                        "delete it to resume from an older one, or start afresh without --resume") from None
    if meta.get("format") != FORMAT:
      raise ConfigError(f"checkpoint {where} has format {meta.get('format')}, this version reads {FORMAT}; "
                        "start afresh without --resume")
    for key, value in self.identity.items():
      saved = meta["identity"].get(key)
      if json.loads(json.dumps(value)) != saved:
        raise ConfigError(f"cannot resume: the checkpoint in {self.directory} was made with {key}={saved}, "
                          f"this run has {key}={value}; use the same value or another --checkpoint_dir")
    try:
      state = join(skeleton, arrays)
    except Exception as e:  # a damaged host state
      raise ConfigError(f"checkpoint {where} cannot be read (host state: {type(e).__name__}); delete it to "
                        "resume from an older one") from None
    self._saved_at(step)
    return state, meta

  def close(self) -> None:
    self._manager.close()
