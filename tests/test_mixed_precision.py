"""Mixed precision (docs/PROTOCOL.md section 3.10): what a stage holds against what the planner charges, the
16-bit tensors between stages and in pushes, fp16's recorded skipped steps, and runs that train (checked)."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from hetpipe_jax import RunConfig, check_trace, get_model, read_trace, run_hetpipe, synthetic
from hetpipe_jax.cost.context import CostContext
from hetpipe_jax.cost.memory import nbytes, optimizer_slots_of, stage_memory_bytes
from hetpipe_jax.cost.profile import profile_units
from hetpipe_jax.runtime.numerics import mixed
from hetpipe_jax.runtime.numerics.stage import Stage, StageOptions

from helpers import TWO_NODES, assert_trace_ok, train_cli

MODEL = get_model("mlp")  # 4 units
DATA = synthetic(num_train=512, num_test=64)
BATCH = 16


def _held_bytes(stage: Stage) -> int:
  """Bytes of every buffer the stage holds between tasks (weights, optimizer state, wave accumulators, loss
  scale, what its forwards keep for their backwards), each buffer once (in fp32 a stashed version may be
  the weights' own buffer)."""
  held = stage.checkpoint_state()
  leaves = [x for x in jax.tree.leaves(held) if isinstance(x, jax.Array)]
  return sum(x.nbytes for x in {x.unsafe_buffer_pointer(): x for x in leaves}.values())


def stage_inputs():
  """A minibatch's input to units 2.. of MODEL (fp16) and its labels."""
  params = MODEL.init(jax.random.key(0), DATA.x_train[:BATCH])
  x = MODEL.apply(params[:2], jnp.asarray(DATA.x_train[:BATCH]), 0, 2)
  return x.astype(jnp.float16), jnp.asarray(DATA.y_train[:BATCH])


def _stage_at_peak(precision, weight_mode, first=1, last=4, nm=3):
  """A stage of units first..last-1 with Adam, driven to its peak: Nm minibatches in flight and an open wave
  accumulator (forwards 1..Nm, backward 1, forward Nm+1, as 1F1B's steady state)."""
  params = MODEL.init(jax.random.key(0), DATA.x_train[:BATCH])
  device = jax.devices()[0]
  tx = optax.adam(1e-3)
  stage = Stage(MODEL, range(first, last), params[first:last], device, tx, nm, StageOptions(weight_mode, precision))
  x = MODEL.apply(params[:first], jnp.asarray(DATA.x_train[:BATCH]), 0, first)
  x = x if stage.dtype is None else mixed.cast_floats(x, stage.dtype)
  labels = jnp.asarray(DATA.y_train[:BATCH])
  out = stage.warm_up(x, labels if stage.is_last else None)
  g = None if stage.is_last else stage.gradient_like(out)
  for mb in range(1, nm + 1):
    stage.forward(mb, x, labels)
  stage.backward(1, g)
  stage.forward(nm + 1, x, labels)
  costs = CostContext(weight_mode, optimizer_slots_of(tx, params[first:last]), precision)
  charged = stage_memory_bytes(profile_units(MODEL, DATA.x_train[:BATCH], cache_dir=None)[first:last], nm, costs)
  return stage, charged, nbytes(params[first:last])


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.slow
def test_a_stash_stage_holds_what_the_planner_charges(precision):
  """The bytes a stage really holds at its peak (Nm = 3 in flight, an open wave) against cost.memory's charge:
  fp32 weights, fp32 wave accumulator, Adam's fp32 slots, and Nm stashed weight versions in the compute
  precision (each forward's closure holds its own). The tolerance is 2% (measured 0.3% in fp32, 1.1% in
  bf16: the last stage's loss residuals, which it keeps in fp32, and the masks and labels the profile
  counts otherwise), against a stashed version of these units at 8.3% (bf16) and 12.4% (fp32) of the
  charge: one version more or less would fail it."""
  stage, charged, p = _stage_at_peak(precision, "stash")
  held = _held_bytes(stage)
  assert abs(held - charged) <= 0.02 * charged, (held, charged, p)


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.slow
def test_a_latest_stage_holds_less_than_the_planner_charges(precision):
  """``latest`` mode keeps each forward's input, not its activations (the backward recomputes): the planner,
  which charges Nm x the kept activations, is an upper bound there."""
  stage, charged, _ = _stage_at_peak(precision, "latest")
  assert _held_bytes(stage) <= charged


def test_a_bf16_stage_keeps_16_bit_activations_and_pushes_16_bit_updates():
  stage, _, _ = _stage_at_peak("bf16", "stash", first=0, last=2, nm=1)
  out = stage.forward(9, jnp.asarray(DATA.x_train[:BATCH]), None)
  assert out.dtype == jnp.bfloat16  # the activation the next stage receives
  floats = [x for x in jax.tree.leaves((stage.params, stage.state.opt_state)) if jnp.issubdtype(x.dtype, jnp.floating)]
  assert {x.dtype for x in floats} == {jnp.dtype(jnp.float32)}  # fp32 master weights and Adam moments
  update = stage.take_wave(0)
  assert {x.dtype for x in jax.tree.leaves(update)} == {jnp.dtype(jnp.bfloat16)}


def test_fp16_overflow_skips_the_update_and_halves_the_scale():
  stage, _, _ = _stage_at_peak("fp16", "stash", first=2, last=4, nm=2)  # the last stage; mbs 2, 3 in flight
  gx = stage.backward(2, None)  # at the initial scale: clean
  assert np.isfinite(np.asarray(gx[0], np.float32)).all() and float(gx[1]) == mixed.INITIAL_SCALE
  assert stage.take_skipped(0) == 0 and stage.take_wave(0) is not None
  held = lambda: [np.asarray(x) for x in jax.tree.leaves((stage.params, stage.state.opt_state))]
  before = held()
  stage.state = stage.state._replace(scale=mixed.LossScale(jnp.float32(2.0 ** 127), jnp.int32(0)))
  gx = stage.backward(3, None)  # the loss x 2^127 overflows fp16
  assert not np.isfinite(np.asarray(gx[0], np.float32)).all()  # sent on: the stages before skip it too
  assert float(stage.state.scale.scale) == 2.0 ** 126
  assert all(np.array_equal(a, b) for a, b in zip(before, held()))  # weights and Adam state untouched
  stage.forward(4, *stage_inputs())
  stage.backward(4, None)  # at 2^126: still an overflow
  update = stage.take_wave(1)  # the wave holds Nm = 2 updates, both zero
  assert all(not np.asarray(u).any() for u in jax.tree.leaves(update))
  assert stage.take_skipped(1) == 2 and float(stage.state.scale.scale) == 2.0 ** 125


@pytest.mark.slow
def test_mixed_precision_trains_on_every_single_process_executor_and_the_trace_checks():
  base = dict(cluster="hetero4", batch_size=BATCH, seed=0, learning_rate=0.05, num_vws=2, stages=(2, 2),
              nm=(2, 2), d=1, waves=3, eval_every=3)
  for executor, extra in (("virtual", {}), ("wall", {"time_scale": 3e3})):
    result = run_hetpipe(MODEL, DATA, RunConfig.of(**base, executor=executor, precision="bf16", **extra))
    assert check_trace(result.events) == []
    assert result.events[0]["precision"] == "bf16"
    assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(result.params))  # the PS holds fp32
    assert np.isfinite([r["train_loss"] for r in result.metrics]).all()


@pytest.mark.slow
def test_fp16_records_skipped_steps_in_the_trace():
  """At the initial scale 2^16 this MLP's gradients overflow fp16 in its first waves (Adam at lr 0.05): the
  pushes say how many updates were skipped, and the checker accepts them (an fp16 run, at most stages x Nm
  per wave)."""
  result = run_hetpipe(MODEL, DATA, RunConfig.of(cluster="hetero4", batch_size=BATCH, seed=0, optimizer="adam",
                                                 learning_rate=0.05, num_vws=2, stages=(2, 3), nm=(2, 3), d=1,
                                                 waves=2, eval_every=2, precision="fp16"))
  assert check_trace(result.events) == []
  skipped = [ev.get("skipped", 0) for ev in result.events if ev["ev"] == "push"]
  assert sum(skipped) > 0, skipped


@pytest.mark.slow  # (two processes per run, started and compiled: 15-40 s each on this machine)
@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_mixed_precision_across_two_processes_is_the_single_process_run(tmp_path, precision):
  """One virtual worker whose 2 stages sit in 2 processes, Nm = 1, D = 0: its stages run the same programs
  in the same order as in one process, so every loss and, in fp16, every push's count of skipped updates
  are the single process's. The 16-bit activations and gradients (fp16: with the loss scale) cross between
  processes; the skipped counts reach the push line through the update messages and the copies' ``have``.
  Adam at lr 0.05 overflows fp16 at its initial scale in the first waves."""
  flags = [f"--precision={precision}", "--num_vws=1", "--stages=2", "--nm=1", "--d=0", "--waves=8",
           f"--batch_size={BATCH}", "--seed=0", "--optimizer=adam", "--learning_rate=0.05", "--eval_every=8"]
  proc = train_cli(tmp_path, "--executor=multiprocess", "--dataset=synthetic", "--model=mlp",
                   f"--cluster={TWO_NODES}", *flags)
  assert proc.returncode == 0, proc.stderr[-3000:]
  events = read_trace(str(tmp_path / "trace.jsonl"))
  assert_trace_ok(events)
  assert events[0]["precision"] == precision and {e["process"] for e in events if e["ev"] == "bwd"} == {0, 1}
  single = run_hetpipe(MODEL, synthetic(), RunConfig.of(
      cluster="uniform8", num_vws=1, stages=2, nm=1, d=0, waves=8, batch_size=BATCH, seed=0, optimizer="adam",
      learning_rate=0.05, eval_every=8, precision=precision, cuts=[events[0]["cuts"][0]]))
  skipped = lambda evs: [e.get("skipped", 0) for e in evs if e["ev"] == "push"]
  assert skipped(events) == skipped(single.events)
  assert (sum(skipped(events)) > 0) == (precision == "fp16")
  summary = json.loads((tmp_path / "summary.json").read_text())
  assert summary["skipped_steps"] == sum(skipped(events))
  rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
  np.testing.assert_allclose([r["train_loss"] for r in rows], [r["train_loss"] for r in single.metrics], rtol=1e-6)


@pytest.mark.slow  # (two processes per run, twice)
def test_a_checkpointed_fp16_run_across_two_processes_resumed_is_the_uninterrupted_one(tmp_path):
  """The same fp16 run in parts of 4 waves (a checkpoint at clock 4): run to its end, then resumed from that
  checkpoint in the same directory (the trace cut back to it, waves 4 to 7 run again). With Nm = 1 and D = 0 the
  numerics do not depend on timing, so the resumed run's losses and skipped counts are the uninterrupted one's,
  and its trace (one file over both parts: the part after the boundary starts with the pull of its weights)
  checks."""
  flags = ["--precision=fp16", "--num_vws=1", "--stages=2", "--nm=1", "--d=0", "--waves=8", f"--batch_size={BATCH}",
           "--seed=0", "--optimizer=adam", "--learning_rate=0.05", "--eval_every=8",
           f"--checkpoint_dir={tmp_path / 'ck'}", "--checkpoint_every=4"]
  run = lambda *more: train_cli(tmp_path, "--executor=multiprocess", "--dataset=synthetic", "--model=mlp",
                                f"--cluster={TWO_NODES}", *flags, *more)
  seen = []
  for more in ((), ("--resume",)):
    proc = run(*more)
    assert proc.returncode == 0, proc.stderr[-3000:]
    events = read_trace(str(tmp_path / "trace.jsonl"))
    assert_trace_ok(events)
    losses = {e["mb"]: e["loss"] for e in events if e["ev"] == "fwd" and "loss" in e}
    seen.append((losses, [e.get("skipped", 0) for e in events if e["ev"] == "push"]))
  assert "checkpoints: resumed from global clock 4" in proc.stdout
  assert sorted(seen[0][0]) == list(range(1, 9)) and sum(seen[0][1]) > 0, seen[0]
  assert seen[1] == seen[0]
