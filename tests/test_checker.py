"""The trace checker accepts sound traces and catches every kind of broken guarantee.

Two sources of bad traces: literal hand-made ones, and real runs with a fault injected into the runtime
(a gate that never closes, a rebase that drops local updates, stashing switched off, a wave pushed twice).
"""

import json
import subprocess
import sys

import jax
import pytest

from hetpipe_jax import RunConfig, check_trace, get_model, run_hetpipe, synthetic
from hetpipe_jax.core.engine import Engine
from hetpipe_jax.core.server import ClockServer, Snapshot
from hetpipe_jax.runtime.numerics.stage import Stage

from helpers import assert_trace_ok, schedule_only


def E(ev, vw, **kw):
  return dict(ev=ev, vw=vw, **kw)


def good_trace():
  """Two virtual workers, k = 1, Nm = 1, D = 0, two minibatches each; VW 0 waits for VW 1 at the gate."""
  return [
      dict(ev="meta", version=1, num_vws=2, nm=[1, 1], d=0, stages=[1, 1], weight_mode="stash",
           executor="virtual", shards=1),
      E("inject", 0, mb=1, t=0), E("inject", 1, mb=1, t=0),
      E("fwd", 0, stage=0, mb=1, t0=0, t1=1, own=0, glob=[0, 0]),
      E("bwd", 0, stage=0, mb=1, t0=1, t1=2, own=0, glob=[0, 0]),
      E("complete", 0, mb=1, t=2), E("push", 0, wave=0, t=2, shards=1),
      E("fwd", 1, stage=0, mb=1, t0=0, t1=2, own=0, glob=[0, 0]),
      E("bwd", 1, stage=0, mb=1, t0=2, t1=4, own=0, glob=[0, 0]),
      E("complete", 1, mb=1, t=4), E("push", 1, wave=0, t=4, shards=1),
      E("pull", 1, t=4, glob=[1, 1]), E("inject", 1, mb=2, t=4),
      E("wait", 0, t0=2, t1=4), E("pull", 0, t=4, glob=[1, 1]), E("inject", 0, mb=2, t=4),
      E("fwd", 0, stage=0, mb=2, t0=4, t1=5, own=1, glob=[1, 1]),
      E("bwd", 0, stage=0, mb=2, t0=5, t1=6, own=1, glob=[1, 1]),
      E("complete", 0, mb=2, t=6), E("push", 0, wave=1, t=6, shards=1),
      E("fwd", 1, stage=0, mb=2, t0=4, t1=6, own=1, glob=[1, 1]),
      E("bwd", 1, stage=0, mb=2, t0=6, t1=8, own=1, glob=[1, 1]),
      E("complete", 1, mb=2, t=8), E("push", 1, wave=1, t=8, shards=1),
  ]


def rules(events):
  return {v.rule for v in check_trace(events)}


def _find(events, **match):
  return next(n for n, e in enumerate(events) if all(e.get(k) == v for k, v in match.items()))


def test_hand_made_good_trace_passes():
  assert_trace_ok(good_trace())


def test_hand_made_missing_gate():
  t = good_trace()
  inject = t.pop(_find(t, ev="inject", vw=0, mb=2))
  del t[_find(t, ev="pull", vw=0)]
  del t[_find(t, ev="wait", vw=0)]
  t.insert(_find(t, ev="push", vw=0, wave=0) + 1, dict(inject, t=2))
  assert "gate" in rules(t)


def test_hand_made_lost_rebase():
  t = good_trace()
  t[_find(t, ev="fwd", vw=0, mb=2)]["own"] = 0  # the pull dropped VW 0's first update
  t[_find(t, ev="bwd", vw=0, mb=2)]["own"] = 0
  assert {"rebase", "local"} <= rules(t)


def test_hand_made_broken_stash():
  t = good_trace()
  t[_find(t, ev="bwd", vw=0, mb=2)]["glob"] = [0, 0]
  assert "stash" in rules(t)


def test_hand_made_double_push():
  t = good_trace()
  n = _find(t, ev="push", vw=0, wave=0)
  t.insert(n + 1, dict(t[n]))
  assert "push" in rules(t)


def test_hand_made_unpushed_waves_in_global_base():
  t = good_trace()
  t[_find(t, ev="pull", vw=1)]["glob"] = [2, 1]  # VW 0 had pushed one wave only
  assert "global" in rules(t)


def test_hand_made_format_errors():
  assert rules(good_trace()[1:]) == {"format"}
  t = good_trace()
  del t[_find(t, ev="fwd", vw=1, mb=2)]["own"]
  assert "format" in rules(t)


# --- faults injected into real runs --------------------------------------------------------------------

class NoGateServer(ClockServer):
  """A server whose gate never closes."""

  def try_pull(self, vw):
    return Snapshot(None, self.clock.c_local)


class DoublePushEngine(Engine):
  """Writes every push twice, as a runtime that re-sent a wave would."""

  def _push(self, vw, wave, updates, losses, t, skipped=0):
    self.trace.emit(ev="push", vw=vw.index, wave=wave, t=t, shards=self.server.num_shards)
    super()._push(vw, wave, updates, losses, t, skipped)


def test_fault_gate_never_closes():
  assert "gate" in rules(schedule_only([2, 2], [2, 2], d=0, waves=6, slowdown=(1, 3), ps_class=NoGateServer))


def test_fault_stash_switched_off():
  events = schedule_only([3], [3], d=0, waves=4, slowdown=(1,), weight_mode="latest")
  assert "stash" in rules(events)


def test_fault_double_push():
  events = schedule_only([2, 2], [2, 2], d=0, waves=4, slowdown=(1, 3), engine_class=DoublePushEngine)
  assert "push" in rules(events)


def test_fault_rebase_drops_local_updates(monkeypatch):
  def lossy_rebase(self, global_params):
    # forgets the updates of waves not pushed yet
    self.state = self.state._replace(params=jax.device_put(tuple(global_params), self.device))
    return 0

  monkeypatch.setattr(Stage, "rebase", lossy_rebase)
  result = run_hetpipe(get_model("mlp"), synthetic(num_train=512, num_test=64), RunConfig.of(
      cluster="hetero4", num_vws=2, stages=4, nm=4, d=0, waves=4, batch_size=16, eval_every=100))
  assert "rebase" in rules(result.events)


@pytest.mark.slow  # 10-16 s: the fast suite keeps under 10 minutes
def test_check_cli(tmp_path):
  good, bad = tmp_path / "good.jsonl", tmp_path / "bad.jsonl"
  good.write_text("".join(json.dumps(e) + "\n" for e in good_trace()))
  t = good_trace()
  t[_find(t, ev="bwd", vw=0, mb=2)]["glob"] = [0, 0]
  bad.write_text("".join(json.dumps(e) + "\n" for e in t))
  ok = subprocess.run([sys.executable, "-m", "hetpipe_jax.check", str(good)], capture_output=True,
                      text=True, timeout=120)
  assert ok.returncode == 0, ok.stderr
  assert "OK" in ok.stdout and "max_global_staleness" in ok.stdout
  fail = subprocess.run([sys.executable, "-m", "hetpipe_jax.check", str(bad)], capture_output=True,
                        text=True, timeout=120)
  assert fail.returncode == 1
  assert "[stash]" in fail.stdout and "FAILED" in fail.stdout
