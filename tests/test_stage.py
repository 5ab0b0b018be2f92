"""Stages: placed on their devices, every program traced once, stash vs latest weight versions."""

import jax
import numpy as np

from hetpipe_jax import RunConfig, get_model, run_hetpipe, synthetic

from helpers import assert_trace_ok

DATA = synthetic(num_train=512, num_test=64)


def test_stage_programs_trace_once_and_live_on_their_devices():
  result = run_hetpipe(get_model("mlp"), DATA, RunConfig.of(
      cluster="hetero4", num_vws=2, stages=(2, 4), nm=(3, 2), d=1, waves=8, batch_size=16,
      eval_every=100))
  assert_trace_ok(result.events)
  used = set()
  for vw in result.vws:
    for stage in vw.stages:
      # fwd, bwd (first of a wave and accumulating) and the rebase add: once each, for 8 waves.
      assert set(stage.traces) <= {"fwd", "bwd_first", "bwd_acc", "add"}
      assert all(count == 1 for count in stage.traces.values()), stage.traces
      assert {"fwd", "bwd_first", "bwd_acc"} <= set(stage.traces)
      devices = {d for x in jax.tree.leaves(stage.params) for d in x.devices()}
      assert devices == {stage.device}
      used.add(stage.device)
  assert len(used) == 6  # one device per stage


def test_latest_and_stash_differ_only_in_numerics():
  runs = {mode: run_hetpipe(get_model("mlp"), DATA, RunConfig.of(
      cluster="hetero4", num_vws=1, stages=4, nm=4, d=0, waves=4, batch_size=16, weight_mode=mode,
      eval_every=100)) for mode in ("stash", "latest")}
  for result in runs.values():
    assert_trace_ok(result.events)
  schedule = lambda r: [(e["ev"], e.get("stage"), e.get("mb")) for e in r.events[1:]]
  assert schedule(runs["stash"]) == schedule(runs["latest"])
  assert not np.allclose(runs["stash"].metrics[-1]["train_loss"], runs["latest"].metrics[-1]["train_loss"],
                         rtol=1e-7)
