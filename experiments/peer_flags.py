"""The systems' knobs as absl flags, declared once from :class:`hetpipe_jax.baselines.knobs.PeerKnobs` (one
default each, the record's), with ``--systems_module`` (:mod:`experiments.system_flags`).

``experiments.baseline``, ``experiments.throughput`` and ``experiments.convergence`` import this module; a study
that wants another default says so in one place with :func:`override_defaults` (the studies: ``--h_by_speed``).
"""

from __future__ import annotations

from typing import Any

from absl import flags

from experiments import system_flags
from hetpipe_jax.baselines.knobs import WORKER_KINDS, PeerKnobs
from hetpipe_jax.plan.tensor_groups import parse_tp
from hetpipe_jax.sim.noise import HELP as NOISE_HELP
from hetpipe_jax.sim.options import ADAPT

_DEFAULTS = PeerKnobs()
HELP = {
    "fusion_mb": "Fusion buffer in MiB (Horovod's default 64; 0: every tensor alone).",
    "cycle_ms": "How often ready tensors are collected, ms (Horovod's default 1).",
    "global_batch": "hetero_dp: examples per step over all GPUs (0: batch_size x GPUs); gpipe: its mini-batch (0: "
                    "batch_size x its microbatches).",
    "microbatches": "sync_pipeline: microbatches per iteration over all pipelines, split by speed (0: automatic); "
                    "gpipe: its microbatches per step.",
    "policy": "sync_pipeline, local_sgd with vw workers, hetpipe: NP, ED, HD, a grouping '0,1;2,3', or best (the "
              "fastest of NP, ED, HD).",
    "local_steps": "local_sgd: H, local steps between synchronisations (of the fastest worker with --h_by_speed).",
    "h_by_speed": "local_sgd: each worker's H in proportion to its speed.",
    "local_workers": "local_sgd: workers are GPUs or pipelines (auto: GPUs where one holds the model, else "
                     "pipelines).",
    "outer_lr": "local_sgd: outer Nesterov learning rate (DiLoCo's 0.7; no effect on time).",
    "outer_momentum": "local_sgd: outer Nesterov momentum (DiLoCo's 0.9; no effect on time).",
    "rounds": "Rounds of a peer simulated (0: 2 without noise, where every round is the same; 16 under --noise).",
    "adapt": "The peers re-size their workers' work at every barrier from measured times, as their authors do "
             "(hetero_dp its batch split, local_sgd with --h_by_speed its H, sync_pipeline its microbatches): on, "
             "off, or auto (under --noise).",
    "nm_rule": "hetpipe (experiments.baseline --system=hetpipe, a study's --systems=hetpipe): its Nm rule, max_fit "
               "(the largest Nm that fits), best (the modelled fastest) or speed (waves sized to each virtual "
               "worker's speed).",
    "shard_state": "hetero_dp: shard the gradient and the optimizer state over its GPUs (ZeRO stage 2), or the "
                   "weights too (ZeRO stage 3, as Cephalo runs it), whichever is fastest, so a GPU too small for the "
                   "replicated state takes part.",
    "noise": "Every system on the simulator: the GPUs' variance (hetpipe_jax.sim.noise): " + NOISE_HELP + ".",
    "staleness": "hetpipe: the staleness control inside a virtual worker: per_minibatch (the paper's), 2bw:k=K "
                 "(PipeDream-2BW; k=0: K = Nm), predict (PipeOptim), pipemare:warmup=T (PipeMare).",
    "tp": "sync_pipeline, local_sgd with vw workers, hetpipe: GPUs of one node and type each pipeline stage is split "
          "over by tensor parallelism (1: none; auto: the planner's fastest of 1, 2, 4, 8 that divide the nodes; "
          "per_type: the fastest degree per GPU type found).",
}
_DEFINE = {float: flags.DEFINE_float, int: flags.DEFINE_integer, bool: flags.DEFINE_bool, str: flags.DEFINE_string}

for _name in PeerKnobs._fields:
  _value = getattr(_DEFAULTS, _name)
  if _name == "local_workers":
    flags.DEFINE_enum(_name, _value, list(WORKER_KINDS), HELP[_name])
  elif _name == "adapt":
    flags.DEFINE_enum(_name, _value, list(ADAPT), HELP[_name])
  elif _name == "tp":  # a number, auto or per_type
    flags.DEFINE_string(_name, str(_value), HELP[_name])
  else:
    _DEFINE[type(_value)](_name, _value, HELP[_name])


def override_defaults(**defaults: Any) -> None:
  """A study's own defaults for some knobs (``h_by_speed=True``): the one place it states them."""
  for name, value in defaults.items():
    if name not in PeerKnobs._fields:
      raise KeyError(f"{name} is not a knob; knobs: {', '.join(PeerKnobs._fields)}")
    flags.FLAGS.set_default(name, value)


def knobs_from_flags(values: flags.FlagValues, **overrides: Any) -> PeerKnobs:
  """The knobs the flags give (``overrides`` replace some), validated; the modules of ``--systems_module``
  imported first.

  Raises:
    ConfigError: for a knob out of range, or a module that cannot be imported.
  """
  system_flags.import_from_flags(values)
  knobs = {name: values[name].value for name in PeerKnobs._fields}
  return PeerKnobs(**{**knobs, "tp": parse_tp(str(knobs["tp"])), **overrides}).validate()
