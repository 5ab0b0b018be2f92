"""A lost virtual worker (issue 10): it leaves, the others go on under WSP over the live members, its
pushed waves stay and its unpushed updates are dropped; a replacement can join. Every trace is checked."""

import time

import pytest

from hetpipe_jax import RunConfig, check_trace, get_model, run_hetpipe, synthetic
from hetpipe_jax.runtime.numerics.stage import Stage

from helpers import assert_trace_ok

MODEL, DATA = get_model("mlp"), synthetic()


def run(**kw):
  base = dict(cluster="hetero4", num_vws=3, stages=2, nm=2, d=1, waves=24)
  return run_hetpipe(MODEL, DATA, RunConfig.of(**{**base, **kw}))


def events_of(result, kind, vw=None):
  return [e for e in result.events if e["ev"] == kind and (vw is None or e["vw"] == vw)]


@pytest.mark.parametrize("executor", ["virtual", "wall", "sim"])
@pytest.mark.slow
def test_a_failed_vw_leaves_and_the_others_finish(executor):
  result = run(failures=[(1, 6)], executor=executor)
  assert_trace_ok(result.events)
  (leave,) = events_of(result, "leave")
  assert leave["vw"] == 1 and leave["pushed"] in (5, 6) and leave["reason"] == "fault injected at wave 6"
  assert [e["wave"] for e in events_of(result, "push", 1)] == list(range(leave["pushed"]))  # they stay
  for i in (0, 2):  # the others run every wave: nobody waits at the gate for the lost one
    assert [e["wave"] for e in events_of(result, "push", i)] == list(range(24))
  late = [e for e in result.events[result.events.index(leave):] if e.get("vw") == 1]
  assert late == [leave]  # nothing of VW 1 after it left
  if executor != "sim":
    assert result.metrics[-1]["global_clock"] == 24  # the global clock counts the live ones


@pytest.mark.parametrize("executor", ["virtual", "wall"])
@pytest.mark.slow
def test_a_replacement_joins_at_the_global_clock_and_pulls_first(executor):
  result = run(failures=[(1, 6), (0, 15)], rejoin=True, executor=executor, d=0)
  assert_trace_ok(result.events)
  for vw in (1, 0):
    (leave,) = events_of(result, "leave", vw)
    (join,) = events_of(result, "join", vw)
    i = result.events.index(join)
    assert join["clock"] >= leave["pushed"]  # it enters where the live ones are, never below its old clock
    assert result.events[i + 1]["ev"] == "pull" and result.events[i + 1]["vw"] == vw
    assert [e["wave"] for e in events_of(result, "push", vw)] == [*range(leave["pushed"]), *range(join["clock"], 24)]
  assert all(vw.completed == 24 * 2 for vw in result.vws)


def test_an_exception_in_a_task_is_a_failure(monkeypatch):
  forward = Stage.forward

  def broken(self, mb, x, labels):
    if self.first == 0 and mb == 9 and self.device.id == 2:  # VW 1's first stage on device 2
      raise RuntimeError("GPU fell off the bus")
    return forward(self, mb, x, labels)

  monkeypatch.setattr(Stage, "forward", broken)
  result = run(executor="virtual")
  assert_trace_ok(result.events)
  (leave,) = events_of(result, "leave")
  assert leave["vw"] == 1 and leave["reason"] == "RuntimeError: GPU fell off the bus"
  assert leave["dropped_updates"] > 0


def test_the_checker_replays_membership():
  events = [dict(e) for e in run(failures=[(1, 6)], rejoin=True).events]
  assert check_trace(events) == []
  leave = next(i for i, e in enumerate(events) if e["ev"] == "leave")
  ghost = next(e for e in events[:leave] if e["ev"] == "fwd" and e["vw"] == 1)
  rules = lambda evs: {v.rule for v in check_trace(evs)}
  assert "member" in rules(events[:leave + 1] + [{**ghost, "t0": events[leave]["t"], "t1": events[leave]["t"]}]
                           + events[leave + 1:])  # a task of a VW that left
  join = next(i for i, e in enumerate(events) if e["ev"] == "join")
  assert "member" in rules(events[:join] + [{**events[join], "clock": events[join]["clock"] - 1}]
                           + events[join + 1:])  # a join below the global clock


@pytest.mark.slow
def test_a_long_sim_run_with_failures_and_rejoins_passes_the_checker():
  t = time.perf_counter()
  failures = [(vw, wave) for wave in range(500, 10_000, 1500) for vw in range(3)]
  result = run(executor="sim", waves=10_000, failures=failures, rejoin=True)
  assert_trace_ok(result.events)
  assert len(events_of(result, "leave")) == len(failures) == len(events_of(result, "join"))
  assert all(vw.completed == 10_000 * 2 for vw in result.vws)
  print(f"10,000 waves x 3 VWs, {len(failures)} failures: {time.perf_counter() - t:.1f} s")


@pytest.mark.parametrize("executor", ["virtual", "sim"])
def test_a_run_whose_every_vw_fails_before_pushing_stops_in_one_line(executor):
  from hetpipe_jax.errors import RunStopped
  with pytest.raises(RunStopped, match=r"^every virtual worker failed before pushing a wave"):
    run(failures=[(0, 0), (1, 0), (2, 0)], executor=executor)
