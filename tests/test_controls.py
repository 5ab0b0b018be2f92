"""Staleness controls inside a virtual worker (hetpipe_jax/core/controls.py), each worked by hand on one stage whose
gradients are known in closed form, then checked by the checker, charged by the memory model, and carried by a
checkpoint (a resume is bit-identical). The numeric oracle (tests/test_oracle.py) replays each on whole runs.

The stage: one linear unit without bias, loss = mean over the batch of x @ w. With every input entry equal to p (the
minibatch's number) the loss is p x sum(w) and its gradient is p in every entry of w, whatever w is: a forward's
loss tells the weights it ran on, and the weights after each backward follow by hand."""

import json

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from hetpipe_jax import ConfigError, RunConfig, check_trace, get_model, read_trace, run_hetpipe, synthetic
from hetpipe_jax.core.controls import parse_control
from hetpipe_jax.cost.context import CostContext
from hetpipe_jax.cost.memory import param_copies
from hetpipe_jax.errors import ProtocolError
from hetpipe_jax.models.base import LayeredModel
from hetpipe_jax.runtime.numerics.stage import Stage, StageOptions

from helpers import TWO_NODES, assert_resumes_bit_identical, assert_trace_ok, train_cli

LR, W0 = 0.1, 1.0  # SGD's rate; every weight starts at 1
LINEAR = LayeredModel("linear", (nn.Dense(1, use_bias=False),), ("dense",), loss=lambda y, labels: jnp.mean(y))


def _stage(control: str, nm: int, weight_mode: str = "stash") -> Stage:
  params = ({"kernel": jnp.full((3, 1), W0, jnp.float32)},)
  options = StageOptions(weight_mode=weight_mode, control=parse_control(control))
  return Stage(LINEAR, range(0, 1), params, jax.devices()[0], optax.sgd(LR), nm, options)


def _x(p: int) -> jax.Array:
  return jnp.full((2, 3), float(p), jnp.float32)


def _w(stage: Stage) -> float:
  """Every weight of the stage (they stay equal)."""
  w = np.asarray(stage.params[0]["kernel"])
  assert np.all(w == w.flat[0])
  return float(w.flat[0])


def _forward(stage: Stage, p: int) -> float:
  """The weight the forward of minibatch p ran on, read off its loss p x 3 x w."""
  return float(stage.forward(p, _x(p), None)) / (3 * p)


def test_per_minibatch_applies_one_update_per_minibatch_on_stashed_weights():
  stage = _stage("per_minibatch", nm=3)
  assert [_forward(stage, p) for p in (1, 2, 3)] == pytest.approx([1.0] * 3)
  for p in (1, 2, 3):
    stage.backward(p, None)
  assert _w(stage) == pytest.approx(W0 - LR * (1 + 2 + 3))
  assert float(stage.take_wave(0)[0]["kernel"][0, 0]) == pytest.approx(-LR * 6)


def test_2bw_applies_one_update_of_the_groups_mean_gradient_at_its_last_minibatch():
  stage = _stage("2bw:k=3", nm=6)
  for p in (1, 2, 3):
    _forward(stage, p)
  stage.backward(1, None)
  stage.backward(2, None)
  assert _w(stage) == W0  # nothing applied before the group's last minibatch
  stage.backward(3, None)
  assert _w(stage) == pytest.approx(W0 - LR * (1 + 2 + 3) / 3)  # one step on the mean gradient, 2
  # The next group's forwards run on the one version; its update lands after its third backward.
  assert [_forward(stage, p) for p in (4, 5, 6)] == pytest.approx([W0 - 0.2] * 3)
  for p in (4, 5, 6):
    stage.backward(p, None)
  assert _w(stage) == pytest.approx(W0 - 0.2 - LR * 5)
  acc = stage.state.waves[0]
  assert acc.count == 6 and float(acc.update[0]["kernel"][0, 0]) == pytest.approx(-0.2 - 0.5)


def test_2bw_refuses_a_group_applied_out_of_order():
  stage = _stage("2bw:k=2", nm=2)
  _forward(stage, 1)
  _forward(stage, 2)
  with pytest.raises(ProtocolError, match="expected k=2"):
    stage.backward(2, None)  # the group's last minibatch, before its first


def test_predict_runs_a_forward_on_the_weights_its_backward_will_find():
  """w + s x u: s the stage's forwards in flight before it, u its last update (SGD's: -lr x the last gradient)."""
  stage = _stage("predict", nm=4)
  assert _forward(stage, 1) == pytest.approx(W0)  # no update yet: u = 0
  stage.backward(1, None)  # u = -0.1
  w1 = W0 - LR * 1
  assert _forward(stage, 2) == pytest.approx(w1)  # nothing in flight: s = 0
  assert _forward(stage, 3) == pytest.approx(w1 - LR)  # s = 1: one update ahead
  stage.backward(2, None)  # u = -0.2
  w2 = w1 - LR * 2
  assert _w(stage) == pytest.approx(w2)  # a prediction is no update
  assert _forward(stage, 4) == pytest.approx(w2 - 1 * 0.2)  # s = 1 (3 in flight), u = -0.2
  stage.backward(3, None)  # on its stashed predicted weights; its gradient is 3 wherever it is taken
  assert _w(stage) == pytest.approx(w2 - LR * 3)


def test_pipemare_warms_a_delayed_updates_rate_up_by_its_delay():
  """tau^-(1 - min(t / T, 1)): tau the forwards in flight before it (at least 1), t the updates so far, T = 4."""
  stage = _stage("pipemare:warmup=4", nm=3, weight_mode="latest")
  for p in (1, 2, 3):  # delays 0, 1, 2
    _forward(stage, p)
  expected = W0
  for p, tau, t in ((1, 1, 0), (2, 1, 1), (3, 2, 2)):
    stage.backward(p, None)
    expected -= LR * p * tau ** -(1 - min(t / 4, 1))
    assert _w(stage) == pytest.approx(expected)
  assert expected == pytest.approx(W0 - 0.1 - 0.2 - 0.3 / np.sqrt(2))


@pytest.mark.parametrize("spec, message", [("2bw:k=3", "does not divide"), ("bogus", "unknown control"),
                                           ("2bw:q=1", "takes the keys k"), ("pipemare:warmup=0", "warmup must be"),
                                           ("2bw:k=x", "not a whole number"),
                                           ("2bw:k=2,k=4", "k is given twice")])
def test_a_bad_control_is_one_clear_error(spec, message):
  config = RunConfig.of(cluster="hetero4", num_vws=1, stages=2, nm=4, waves=2, staleness=spec)
  with pytest.raises(ConfigError, match=message):
    run_hetpipe(get_model("mlp"), synthetic(num_train=128, num_test=32), config)


def test_the_memory_model_charges_2bws_groups_not_every_minibatch():
  """stash keeps one weight version per minibatch in flight; 2BW the groups they span, ceil(W / k) + 1 (2 with
  k = Nm), beside one fp32 gradient sum; predict keeps its last update."""
  copies = lambda spec, window: param_copies(window, CostContext(optimizer_slots=2, control=parse_control(spec)))
  assert copies("per_minibatch", 8) == 2 + 2 + 8
  assert copies("2bw", 8) == 2 + 2 + 1 + 2
  assert copies("2bw:k=4", 8) == 2 + 2 + 1 + 3
  assert copies("2bw:k=1", 8) == 2 + 2 + 1 + 8
  assert copies("predict", 8) == 2 + 2 + 1 + 8
  assert copies("2bw", 1) == 2 + 2 + 1 + 1


def _run(**kw):
  config = dict(cluster="hetero4", num_vws=2, stages=(3, 2), nm=(4, 2), d=1, waves=4, batch_size=16,
                optimizer="adam", learning_rate=3e-3, eval_every=100)
  return run_hetpipe(get_model("mlp"), synthetic(num_train=512, num_test=64), RunConfig.of(**{**config, **kw}))


def test_the_checker_reads_each_virtual_workers_k_from_the_meta_line():
  """A 2BW run's trace passes; the same events read as one update per minibatch, or a per-minibatch run's read as
  2BW, break the checker's count of the updates each stage applied."""
  bw = _run(staleness="2bw")
  assert bw.events[0]["staleness"] == "2bw:k=0" and bw.events[0]["accumulate"] == [4, 2]
  assert_trace_ok(bw.events)
  own = [(e["mb"], e["own"]) for e in bw.events if e["ev"] == "fwd" and e["vw"] == 0 and e["stage"] == 0]
  assert {o for _, o in own} <= {0, 4, 8, 12}  # whole groups of 4 only
  assert any(p - o > 4 - 1 for p, o in own)  # beyond per-minibatch's local bound: what 2BW allows
  relabelled = [{k: v for k, v in bw.events[0].items() if k != "accumulate"}, *bw.events[1:]]
  assert {v.rule for v in check_trace(relabelled)} >= {"rebase"}
  plain = _run()
  assert {v.rule for v in check_trace([{**plain.events[0], "accumulate": [2, 2]}, *plain.events[1:]])} >= {"rebase"}
  assert check_trace([{**plain.events[0], "accumulate": [3, 2]}, *plain.events[1:]])[0].rule == "format"


def test_a_version_2_trace_under_2bw_checks_rule_by_rule():
  """The checker's fast path for version-2 traces assumes one update per minibatch; a 2BW trace takes the rules."""
  bw = _run(staleness="2bw:k=2", trace_version=2)
  assert bw.events[0]["version"] == 2 and bw.events[0]["accumulate"] == [2, 2]
  assert_trace_ok(bw.events)
  relabelled = [{k: v for k, v in bw.events[0].items() if k != "accumulate"}, *bw.events[1:]]
  assert "rebase" in {v.rule for v in check_trace(relabelled)}


def test_a_forward_missing_a_finished_group_breaks_the_local_rule():
  """Lower one forward's own updates below K x floor((p - Nm) / K): the local rule (and the rebase rule) say so."""
  events = [dict(e) for e in _run(staleness="2bw:k=2").events]
  forward = next(e for e in events if e["ev"] == "fwd" and e["vw"] == 0 and e["mb"] == 9)
  forward["own"] = 2  # minibatches 1..4 completed before 9 entered (Nm 4): groups 1-2 and 3-4 must be in
  assert "local" in {v.rule for v in check_trace(events)}


@pytest.mark.slow  # three runs of three controls
@pytest.mark.parametrize("spec", ["2bw:k=2", "predict", "pipemare:warmup=6"])
def test_a_stopped_run_under_a_control_resumes_bit_identical(tmp_path, monkeypatch, spec):
  """The control's state (a half-summed group, the last update, the updates so far, each minibatch's delay) is in
  the checkpoint: a run stopped right after one resumes to the same bits."""
  def config(out, **kw):
    return RunConfig.of(cluster="hetero4", num_vws=2, stages=2, nm=(4, 2), d=1, waves=8, batch_size=16,
                        optimizer="momentum", learning_rate=0.02, staleness=spec, trace_path=str(out / "t.jsonl"),
                        checkpoint_dir=str(out / "ck"), checkpoint_every=2, eval_every=100, **kw)

  model, data = get_model("mlp"), synthetic(num_train=512, num_test=64)
  assert_resumes_bit_identical(monkeypatch, tmp_path, lambda c: run_hetpipe(model, data, c), config, step=4)


@pytest.mark.slow  # (two multi-process runs of two processes: about 30 s)
@pytest.mark.parametrize("spec", ["2bw:k=2", "predict"])
def test_the_multiprocess_runtime_computes_each_control_as_the_oracle_replays_it(tmp_path, spec):
  """One virtual worker whose 2 stages sit in 2 processes, Nm 4: the numeric oracle replays the merged trace from
  the protocol and the control's paper alone, and every wave's training loss is the runtime's."""
  from test_oracle import replay  # (the oracle lives with its own tests)

  flags = ("--num_vws=1", "--stages=2", "--nm=4", "--d=0", "--waves=6", "--batch_size=16", "--seed=3",
           "--optimizer=momentum", "--learning_rate=0.02", f"--staleness={spec}")
  proc = train_cli(tmp_path, "--executor=multiprocess", "--dataset=synthetic", "--model=mlp", f"--cluster={TWO_NODES}",
                   *flags, timeout=300)
  assert proc.returncode == 0, proc.stderr[-3000:]
  events = read_trace(str(tmp_path / "trace.jsonl"))
  assert_trace_ok(events)
  assert events[0]["staleness"] == str(parse_control(spec))
  data, model = synthetic(), get_model("mlp")
  init_params = model.init(jax.random.key(3), jnp.asarray(data.x_train[:16]))
  oracle = replay(events, init_params, "momentum", 0.02, dataset=data, batch_size=16, seed=3)
  rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
  losses = {(r["vw"], r["wave"]): r["train_loss"] for r in rows if r.get("train_loss") is not None}
  assert set(losses) == set(oracle["losses"]) and len(losses) == 6
  for key, loss in oracle["losses"].items():
    assert losses[key] == pytest.approx(loss, rel=1e-5), key
