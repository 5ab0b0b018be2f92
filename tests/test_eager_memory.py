"""The memory model's two charges for the activations a unit keeps: this runtime's (every residual of
``jax.vjp``) and an eager framework's (PyTorch, TensorFlow without XLA: ``activations="eager"``), counted by hand,
carried through batch sizes and tensor-parallel splits, and held against published rows that ran."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import pytest

from hetpipe_jax import ConfigError
from hetpipe_jax.baselines.gpipe import stage_memory
from hetpipe_jax.baselines.knobs import PeerKnobs
from hetpipe_jax.cluster import CATALOGUE, make_cluster
from hetpipe_jax.cost.batch import BatchProfiles, fixed
from hetpipe_jax.cost.context import CostContext
from hetpipe_jax.cost.memory import kept, stage_memory_bytes
from hetpipe_jax.cost.profile import profile_units
from hetpipe_jax.cost.unit import UnitProfile
from hetpipe_jax.models.base import LayeredModel
from hetpipe_jax.models.gpt import gpt
from hetpipe_jax.systems import get_system

EAGER = CostContext(activations="eager")


class _Mlp(nn.Module):
  @nn.compact
  def __call__(self, x):
    return nn.Dense(3)(nn.relu(nn.Dense(8)(x)))


class _ConvNormRelu(nn.Module):
  @nn.compact
  def __call__(self, x):
    return nn.relu(nn.GroupNorm(num_groups=2)(nn.Conv(4, (3, 3), use_bias=False)(x)))


def _profile(unit: nn.Module, shape: tuple[int, ...]) -> UnitProfile:
  model = LayeredModel("hand", (unit,), ("unit",))
  (profile,) = profile_units(model, jax.ShapeDtypeStruct(shape, jnp.float32), cache_dir=None)
  return profile


def _near(measured: int, hand: int, params: int) -> None:
  assert hand - params <= measured <= hand, (measured, hand, params)


def test_eager_keeps_the_inputs_of_the_matmuls_and_the_nonlinearities_outputs():
  # Dense(5 -> 8), ReLU, Dense(8 -> 3) on 2 examples: the input (first matmul's), the first matmul's output (ReLU's
  # derivative) and ReLU's output (the second matmul's input): 2 x (5 + 8 + 8) floats
  # (a profile subtracts every parameter's bytes from the residuals', and the backward keeps all but the last
  # bias: the count is exact to the bytes of the parameters the backward does not need)
  mlp = _profile(_Mlp(), (2, 5))
  _near(kept(mlp, EAGER), 2 * (5 + 8 + 8) * 4, mlp.param_bytes)
  assert mlp.kept_bytes >= kept(mlp, EAGER)  # (never charged above the runtime's)
  # conv -> GroupNorm -> ReLU: the input and the convolution's output (the norm's input), as PyTorch keeps them
  # (ReLU's output is the next unit's input, kept there); the norm's intermediates (centred, normalised, their
  # statistics) and ReLU's mask are the runtime's alone
  conv = _profile(_ConvNormRelu(), (2, 6, 6, 3))
  _near(kept(conv, EAGER), 2 * 6 * 6 * (3 + 4) * 4, conv.param_bytes)
  assert conv.kept_bytes > 1.5 * kept(conv, EAGER)


def test_the_memory_model_charges_what_costs_name():
  unit = _profile(_ConvNormRelu(), (2, 6, 6, 3))
  assert kept(unit) == unit.kept_bytes and kept(unit, EAGER) == unit.eager_kept_bytes
  assert unit.eager_kept_bytes is not None
  assert stage_memory_bytes([unit], 3, EAGER) - stage_memory_bytes([unit], 3) == 3 * (
      unit.eager_kept_bytes - unit.kept_bytes)
  # under recomputation a unit keeps what its policy keeps, in any framework; a hand-made profile without the
  # eager figure is charged its kept bytes
  full = unit.under("full")
  assert kept(full, EAGER) == full.kept_bytes
  bare = UnitProfile("bare", 1.0, 2.0, 1.0, 2.0, 10, 4, 100)
  assert kept(bare, EAGER) == 100
  with pytest.raises(ConfigError, match="activations='torch'.*use jax"):
    kept(unit, CostContext(activations="torch"))


def test_the_eager_figure_scales_with_the_batch_and_splits_with_the_other_activations():
  unit = _profile(_ConvNormRelu(), (2, 6, 6, 3))
  at, eager = fixed([unit], 2), kept(unit, EAGER)
  assert kept(at.at(6)[0], EAGER) == 3 * eager
  assert kept(at.at(3)[0], EAGER) == pytest.approx(1.5 * eager, abs=1)
  assert kept(unit.split(2), EAGER) == eager  # (no tensor-parallel rule: whole on each)
  # a GPT block splits what it keeps over the stage's devices, but the LayerNorms' inputs, as the runtime's
  block = profile_units(gpt(vocab_size=32, layers=1, width=32, heads=4, context=16, name="tiny_gpt"),
                        jax.ShapeDtypeStruct((4, 16), jnp.int32), cache_dir=None)[1]
  assert block.tp is not None
  whole, eager = block.tp.whole_kept_bytes, kept(block, EAGER)
  assert whole < eager < block.kept_bytes
  assert kept(block.split(2), EAGER) == whole + (eager - whole) // 2


def test_gpipe_stages_hold_their_weights_every_microbatch_input_and_one_microbatch():
  units = [UnitProfile(f"u{i}", 1.0, 2.0, 1.0, 2.0, 100 * (i + 1), 10 * (i + 1), 1000, eager_kept_bytes=400)
           for i in range(4)]
  # two stages of two units, 5 microbatches, a first input of 7 bytes, plain SGD in fp32 (weights +
  # accumulator): weights x 2, 4 stage inputs, one microbatch's activations (eager: 400 per unit)
  need = stage_memory(units, (0, 2, 4), 5, 7, EAGER)
  assert need == [300 * 2 + 4 * 7 + 800, 700 * 2 + 4 * 20 + 800]
  assert stage_memory(units, (0, 2, 4), 5, 7) == [300 * 2 + 4 * 7 + 2000, 700 * 2 + 4 * 20 + 2000]


def test_a_peer_charged_as_its_framework_runs_where_the_runtime_s_charge_refuses():
  # ResNet-101 at 64 per GPU on 16 GB P100s ran with Horovod (its README's 128-GPU figures): the runtime's
  # residuals do not fit (16.1 GiB), what TensorFlow keeps does (7.8 GiB)
  cluster = make_cluster("p100x2", [[CATALOGUE["P100"]] * 2])
  profiles, horovod = BatchProfiles.full_size("resnet101", 64), get_system("horovod")
  with pytest.raises(ConfigError, match="no worker"):
    horovod.simulate(cluster, profiles, 64, PeerKnobs(rounds=1), CostContext(), "resnet101")
  run = horovod.simulate(cluster, profiles, 64, PeerKnobs(rounds=1), EAGER, "resnet101")
  assert run.images_per_sec > 0
