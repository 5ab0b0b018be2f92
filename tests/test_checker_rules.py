"""Every rule of the trace checker fires on the fault it exists for (hetpipe_jax/core/check.py; docs/PROTOCOL.md §9).

Each test plants one fault in a sound literal trace and asserts which rules fire, at which lines, with which
messages. Where the protocol makes another rule fire with it (a forward that misses own updates is also a
rebase that lost them), the test says why and asserts the whole set, so that disabling any one check of the
checker fails at least one test here. The checker is pure Python: this file runs in about a second.

Sound traces:
* ``small_trace()``: 2 virtual workers, k = 1, Nm = 1, D = 0, two minibatches each;
* ``pipeline_trace()``: 2 virtual workers, k = 2, Nm = 2, D = 0, three waves each. VW 1 runs at half the
  speed of VW 0, which waits at the gate twice; up to Nm minibatches overlap in each pipeline, and pulls
  land while minibatches are in flight (VW 0 injects minibatches 4 and 5 right after its first pull);
* ``latest_trace()``: the pipeline trace in ``latest`` mode (each backward uses the stage's current
  version: the updates applied so far and the virtual worker's last pull).
"""

import collections

from hetpipe_jax import check_trace

SHARDS = 2


def meta(nm, stages, d=0, weight_mode="stash"):
  return dict(ev="meta", version=1, num_vws=len(nm), nm=list(nm), d=d, stages=list(stages),
              weight_mode=weight_mode, executor="virtual", shards=SHARDS)


def inject(vw, mb, t):
  return dict(ev="inject", vw=vw, mb=mb, t=t)


def fwd(vw, stage, mb, t0, t1, own, glob):
  return dict(ev="fwd", vw=vw, stage=stage, mb=mb, t0=t0, t1=t1, own=own, glob=list(glob))


def bwd(vw, stage, mb, t0, t1, own, glob):
  return dict(ev="bwd", vw=vw, stage=stage, mb=mb, t0=t0, t1=t1, own=own, glob=list(glob))


def complete(vw, mb, t):
  return dict(ev="complete", vw=vw, mb=mb, t=t)


def push(vw, wave, t, shards=SHARDS):
  return dict(ev="push", vw=vw, wave=wave, t=t, shards=shards)


def pull(vw, t, glob):
  return dict(ev="pull", vw=vw, t=t, glob=list(glob))


def wait(vw, t0, t1):
  return dict(ev="wait", vw=vw, t0=t0, t1=t1)


def small_trace():
  """2 VWs, k = 1, Nm = 1, D = 0, two minibatches each; VW 0 waits for VW 1 at the gate."""
  return [
      meta(nm=[1, 1], stages=[1, 1]),
      inject(0, 1, 0), inject(1, 1, 0),
      fwd(0, 0, 1, 0, 1, 0, [0, 0]), bwd(0, 0, 1, 1, 2, 0, [0, 0]), complete(0, 1, 2), push(0, 0, 2),
      fwd(1, 0, 1, 0, 2, 0, [0, 0]), bwd(1, 0, 1, 2, 4, 0, [0, 0]), complete(1, 1, 4), push(1, 0, 4),
      pull(1, 4, [1, 1]), inject(1, 2, 4), wait(0, 2, 4), pull(0, 4, [1, 1]), inject(0, 2, 4),
      fwd(0, 0, 2, 4, 5, 1, [1, 1]), bwd(0, 0, 2, 5, 6, 1, [1, 1]), complete(0, 2, 6), push(0, 1, 6),
      fwd(1, 0, 2, 4, 6, 1, [1, 1]), bwd(1, 0, 2, 6, 8, 1, [1, 1]), complete(1, 2, 8), push(1, 1, 8),
  ]


def pipeline_trace(d=0):
  """2 VWs, k = 2, Nm = 2, three waves each; VW 1 is half as fast (see the module docstring)."""
  return [
      meta(nm=[2, 2], stages=[2, 2], d=d),
      inject(0, 1, 0), inject(0, 2, 0), inject(1, 1, 0), inject(1, 2, 0), fwd(0, 0, 1, 0, 1, 0, [0, 0]),
      fwd(1, 0, 1, 0, 2, 0, [0, 0]), fwd(0, 0, 2, 1, 2, 0, [0, 0]), fwd(0, 1, 1, 1, 2, 0, [0, 0]),
      bwd(0, 1, 1, 2, 4, 0, [0, 0]), fwd(1, 0, 2, 2, 4, 0, [0, 0]), fwd(1, 1, 1, 2, 4, 0, [0, 0]),
      fwd(0, 1, 2, 4, 5, 1, [0, 0]), bwd(0, 0, 1, 4, 6, 0, [0, 0]), complete(0, 1, 6), inject(0, 3, 6),
      bwd(0, 1, 2, 5, 7, 1, [0, 0]), fwd(0, 0, 3, 6, 7, 1, [0, 0]), bwd(1, 1, 1, 4, 8, 0, [0, 0]),
      fwd(0, 1, 3, 7, 8, 2, [0, 0]), bwd(0, 0, 2, 7, 9, 0, [0, 0]), complete(0, 2, 9), push(0, 0, 9),
      bwd(0, 1, 3, 8, 10, 2, [0, 0]), fwd(1, 1, 2, 8, 10, 1, [0, 0]), bwd(1, 0, 1, 8, 12, 0, [0, 0]),
      complete(1, 1, 12), inject(1, 3, 12), bwd(0, 0, 3, 10, 12, 1, [0, 0]), complete(0, 3, 12),
      bwd(1, 1, 2, 10, 14, 1, [0, 0]), fwd(1, 0, 3, 12, 14, 1, [0, 0]), fwd(1, 1, 3, 14, 16, 2, [0, 0]),
      bwd(1, 0, 2, 14, 18, 0, [0, 0]), complete(1, 2, 18), push(1, 0, 18), wait(0, 9, 18),
      pull(0, 18, [1, 1]), inject(0, 4, 18), inject(0, 5, 18), pull(1, 18, [1, 1]), inject(1, 4, 18),
      fwd(0, 0, 4, 18, 19, 3, [1, 1]), bwd(1, 1, 3, 16, 20, 2, [0, 0]), fwd(1, 0, 4, 18, 20, 2, [1, 1]),
      fwd(0, 0, 5, 19, 20, 3, [1, 1]), fwd(0, 1, 4, 19, 20, 3, [1, 1]), bwd(0, 1, 4, 20, 22, 3, [1, 1]),
      fwd(1, 1, 4, 20, 22, 3, [1, 1]), fwd(0, 1, 5, 22, 23, 4, [1, 1]), bwd(1, 0, 3, 20, 24, 1, [0, 0]),
      complete(1, 3, 24), inject(1, 5, 24), bwd(0, 0, 4, 22, 24, 3, [1, 1]), complete(0, 4, 24),
      push(0, 1, 24), bwd(0, 1, 5, 23, 25, 4, [1, 1]), bwd(1, 1, 4, 22, 26, 3, [1, 1]),
      fwd(1, 0, 5, 24, 26, 3, [1, 1]), bwd(0, 0, 5, 25, 27, 3, [1, 1]), complete(0, 5, 27),
      fwd(1, 1, 5, 26, 28, 4, [1, 1]), bwd(1, 0, 4, 26, 30, 2, [1, 1]), complete(1, 4, 30), push(1, 1, 30),
      wait(0, 24, 30), pull(0, 30, [2, 2]), inject(0, 6, 30), pull(1, 30, [2, 2]), inject(1, 6, 30),
      fwd(0, 0, 6, 30, 31, 5, [2, 2]), bwd(1, 1, 5, 28, 32, 4, [1, 1]), fwd(1, 0, 6, 30, 32, 4, [2, 2]),
      fwd(0, 1, 6, 31, 32, 5, [2, 2]), bwd(0, 1, 6, 32, 34, 5, [2, 2]), fwd(1, 1, 6, 32, 34, 5, [2, 2]),
      bwd(1, 0, 5, 32, 36, 3, [1, 1]), complete(1, 5, 36), bwd(0, 0, 6, 34, 36, 5, [2, 2]),
      complete(0, 6, 36), push(0, 2, 36), bwd(1, 1, 6, 34, 38, 5, [2, 2]), bwd(1, 0, 6, 38, 42, 4, [2, 2]),
      complete(1, 6, 42), push(1, 2, 42),
  ]


def latest_trace():
  """The pipeline trace in latest mode: a backward uses the stage's updates so far and its VW's last pull."""
  events = pipeline_trace()
  events[0]["weight_mode"] = "latest"
  applied, pulled = collections.Counter(), {0: [0, 0], 1: [0, 0]}
  for e in events[1:]:
    if e["ev"] == "pull":
      pulled[e["vw"]] = e["glob"]
    elif e["ev"] == "bwd":
      e["own"], e["glob"] = applied[(e["vw"], e["stage"])], list(pulled[e["vw"]])
      applied[(e["vw"], e["stage"])] += 1
  return events


# --- helpers -------------------------------------------------------------------------------------------

def find(events, **match) -> int:
  """The index of the only event with these fields."""
  hits = [n for n, e in enumerate(events) if all(e.get(k) == v for k, v in match.items())]
  assert len(hits) == 1, (match, hits)
  return hits[0]


def line(events, **match) -> int:
  """The 1-based trace line of the only event with these fields (what a violation reports)."""
  return find(events, **match) + 1


def task(events, kind, vw, stage, mb) -> dict:
  return events[find(events, ev=kind, vw=vw, stage=stage, mb=mb)]


def set_version(events, vw, stage, mb, own=None, glob=None) -> None:
  """Changes the weight version of a forward and its backward alike (so the stash rule stays quiet)."""
  for kind in ("fwd", "bwd"):
    e = task(events, kind, vw, stage, mb)
    if own is not None:
      e["own"] = own
    if glob is not None:
      e["glob"] = list(glob)


def move(events, what: dict, before: dict) -> None:
  """Moves the event matching ``what`` to just before the event matching ``before``."""
  e = events.pop(find(events, **what))
  events.insert(find(events, **before), e)


def expect(events, want: dict) -> None:
  """Asserts that the checker reports exactly the rules in ``want``, and for each rule a violation at every
  (line, text) listed: at that 1-based line (None: any line) with ``text`` in its message."""
  found = check_trace(events)
  report = "\n".join(map(str, found))
  assert {v.rule for v in found} == set(want), report
  for rule, where in want.items():
    for at, text in where:
      assert any(v.rule == rule and at in (None, v.line) and text in v.message for v in found), (
          f"no [{rule}] violation at line {at} saying {text!r} in:\n{report}")


# --- sound traces --------------------------------------------------------------------------------------

def test_sound_traces_pass():
  assert check_trace(small_trace()) == []
  assert check_trace(pipeline_trace()) == []
  assert check_trace(pipeline_trace(d=1)) == []  # a looser D accepts what a tighter one does
  latest = latest_trace()
  assert check_trace(latest) == []
  # Latest mode: backwards that do not use their forward's version are fine there (10 in this trace).
  moved = [e for e in latest if e["ev"] == "bwd"
           and (e["own"], e["glob"]) != (task(latest, "fwd", e["vw"], e["stage"], e["mb"])["own"],
                                         task(latest, "fwd", e["vw"], e["stage"], e["mb"])["glob"])]
  assert len(moved) == 10


def test_extra_event_kinds_and_fields_are_allowed():
  t = pipeline_trace()
  t.insert(5, dict(ev="note", vw=0, t=0, text="anything"))
  t[find(t, ev="push", vw=0, wave=0)]["gap"] = 1
  assert check_trace(t) == []


# --- format --------------------------------------------------------------------------------------------

def test_format_meta_line():
  first = "the first line must be the meta event"
  assert [(v.line, v.rule, v.message) for v in check_trace(pipeline_trace()[1:])] == [(1, "format", first)]
  assert [(v.line, v.rule, v.message) for v in check_trace([])] == [(1, "format", first)]
  t = pipeline_trace()
  t[0]["ev"] = "header"  # every meta field, but not the meta event
  assert [(v.line, v.rule, v.message) for v in check_trace(t)] == [(1, "format", first)]
  t = pipeline_trace()
  del t[0]["nm"]
  found = check_trace(t)
  assert [(v.line, v.rule) for v in found] == [(1, "format")] and "lacks ['nm']" in found[0].message


def test_format_virtual_worker_out_of_range():
  t = pipeline_trace()
  t.append(wait(2, 42, 42))
  expect(t, {"format": [(len(t), "virtual worker 2 out of range 0..1")]})


def test_format_stage_out_of_range():
  t = pipeline_trace()
  t.insert(find(t, ev="inject", vw=0, mb=2), fwd(0, 2, 1, 0, 0, 0, [0, 0]))  # VW 0 has stages 0 and 1
  expect(t, {"format": [(line(t, ev="fwd", vw=0, stage=2), "stage out of range")]})


def test_format_missing_field():
  t = pipeline_trace()
  del task(t, "fwd", 1, 1, 6)["own"]
  expect(t, {"format": [(line(t, ev="fwd", vw=1, stage=1, mb=6), "fwd event lacks field 'own'")]})


def test_format_task_glob_of_the_wrong_length():
  t = pipeline_trace()
  set_version(t, 1, 0, 6, glob=[2])
  expect(t, {"format": [(line(t, ev="fwd", vw=1, stage=0, mb=6), "glob has 1 entries for 2")]})


def test_format_pull_glob_of_the_wrong_length():
  t = pipeline_trace()
  t[find(t, ev="pull", vw=1, t=30)]["glob"] = [2]
  # The bad pull does not count as a pull: the gated injection after it did not pull, and the forwards
  # after it use a global base VW 1 never pulled.
  expect(t, {"format": [(line(t, ev="pull", vw=1, t=30), "pull of VW 1: glob has 1 entries")],
             "gate": [(line(t, ev="inject", vw=1, mb=6), "without pulling")],
             "global": [(line(t, ev="fwd", vw=1, stage=0, mb=6), "never pulled")]})


# --- time ----------------------------------------------------------------------------------------------

def test_time_task_ends_before_it_starts():
  t = pipeline_trace()
  e = task(t, "fwd", 0, 0, 1)
  e["t0"], e["t1"] = 1, 0
  expect(t, {"time": [(line(t, ev="fwd", vw=0, stage=0, mb=1), "fwd ends before it starts")]})


def test_time_goes_back():
  t = pipeline_trace()
  t[find(t, ev="push", vw=0, wave=0)]["t"] = 8.5  # written after an event at t = 9
  expect(t, {"time": [(line(t, ev="push", vw=0, wave=0), "push at t=8.5 after an event at t=9")]})


# --- order ---------------------------------------------------------------------------------------------

def test_order_injection_out_of_order():
  t = pipeline_trace()
  move(t, dict(ev="inject", vw=0, mb=2), before=dict(ev="inject", vw=0, mb=1))
  expect(t, {"order": [(line(t, ev="inject", vw=0, mb=2), "injected minibatch 2 after 0"),
                       (line(t, ev="inject", vw=0, mb=1), "injected minibatch 1 after 2")]})


def test_order_injection_beyond_the_nm_window():
  t = pipeline_trace()
  move(t, dict(ev="inject", vw=0, mb=3), before=dict(ev="complete", vw=0, mb=1))
  expect(t, {"order": [(line(t, ev="inject", vw=0, mb=3), "before minibatch 1 completed (Nm=2 in flight")]})


def test_order_forward_before_the_previous_stage():
  t = pipeline_trace()
  del t[find(t, ev="fwd", vw=0, stage=0, mb=3)]
  expect(t, {"order": [(line(t, ev="fwd", vw=0, stage=1, mb=3), "minibatch 3 at stage 1 before stage 0")]})


def test_order_backward_before_the_next_stage():
  t = pipeline_trace()
  del t[find(t, ev="bwd", vw=1, stage=1, mb=6)]
  expect(t, {"order": [(line(t, ev="bwd", vw=1, stage=0, mb=6), "before bwd at stage 1")]})


def test_order_last_stage_backward_before_its_forward():
  t = pipeline_trace()
  del t[find(t, ev="fwd", vw=1, stage=1, mb=6)]
  expect(t, {"order": [(line(t, ev="bwd", vw=1, stage=1, mb=6), "before fwd at stage 1")]})


def test_order_task_twice():
  t = pipeline_trace()
  t.append(fwd(1, 1, 6, 42, 43, 6, [2, 2]))  # a sound version, on a free device: only the repeat is wrong
  expect(t, {"order": [(len(t), "ran twice")]})


def test_order_task_of_a_minibatch_not_injected():
  t = pipeline_trace()
  t.append(fwd(0, 0, 7, 42, 43, 6, [2, 2]))
  expect(t, {"order": [(len(t), "minibatch not injected")]})


def test_order_completion_out_of_order():
  t = pipeline_trace()
  del t[find(t, ev="complete", vw=0, mb=5)]
  expect(t, {"order": [(line(t, ev="complete", vw=0, mb=6), "completed minibatch 6 after 4")]})


def test_order_completion_before_the_stage_0_backward():
  t = pipeline_trace()
  move(t, dict(ev="complete", vw=0, mb=6), before=dict(ev="bwd", vw=0, stage=0, mb=6))
  expect(t, {"order": [(line(t, ev="complete", vw=0, mb=6), "before its backward at stage 0")]})


# --- device --------------------------------------------------------------------------------------------

def test_device_runs_one_task_at_a_time():
  t = pipeline_trace()
  task(t, "fwd", 0, 0, 2)["t0"] = 0.5  # VW 0 stage 0 runs the forward of minibatch 1 until t = 1
  expect(t, {"device": [(line(t, ev="fwd", vw=0, stage=0, mb=2), "at 0.5 while busy until 1")]})


# --- local and rebase ----------------------------------------------------------------------------------

def test_local_staleness_bound():
  t = pipeline_trace()
  set_version(t, 0, 1, 3, own=0)  # minibatch 3 needs own update 1 (Nm = 2); the stage had applied 2
  # Own updates 1 .. p - Nm were applied at the stage before p's forward (the window and the task order
  # ensure it), so weights that miss one also lost an applied update: the rebase rule fires with it.
  at = line(t, ev="fwd", vw=0, stage=1, mb=3)
  expect(t, {"local": [(at, "includes 0 own updates; needs >= 1 (Nm=2)")],
             "rebase": [(at, "0 own updates, but the stage has applied 2")]})


def test_rebase_lost_local_update():
  t = pipeline_trace()
  set_version(t, 0, 1, 3, own=1)  # within the local bound, but one applied update is missing
  at = line(t, ev="fwd", vw=0, stage=1, mb=3)
  expect(t, {"rebase": [(at, "1 own updates, but the stage has applied 2")]})


def test_rebase_double_counted_local_update():
  t = pipeline_trace()
  set_version(t, 1, 1, 4, own=4)  # VW 1 stage 1 had applied 3 when minibatch 4 ran there
  at = line(t, ev="fwd", vw=1, stage=1, mb=4)
  expect(t, {"rebase": [(at, "4 own updates, but the stage has applied 3 (lost or double-counted")]})


def test_rebase_latest_backward():
  t = latest_trace()
  task(t, "bwd", 0, 1, 5)["own"] += 1
  expect(t, {"rebase": [(line(t, ev="bwd", vw=0, stage=1, mb=5),
                         "backward of VW 0 minibatch 5 at stage 1 uses weights with 5 own updates, but the "
                         "stage has applied 4")]})


# --- global --------------------------------------------------------------------------------------------

def test_global_lower_bound_last_minibatch_of_a_wave():
  t = pipeline_trace()
  set_version(t, 0, 0, 6, glob=[1, 1])  # a base VW 0 did pull, but minibatch 6 ends wave 2: D = 0 needs 2
  at = line(t, ev="fwd", vw=0, stage=0, mb=6)
  expect(t, {"global": [(at, "includes 1 waves of VW 0; WSP with D=0 needs >= 2"),
                        (at, "includes 1 waves of VW 1; WSP with D=0 needs >= 2")]})


def test_global_lower_bound_inside_a_wave():
  t = pipeline_trace()
  set_version(t, 1, 0, 5, glob=[0, 0])  # minibatch 5 (wave 2, not its last) needs 1 wave of each VW
  # Forwards run in order at a stage, and the one before (minibatch 4) needed as much as this one, so the
  # base also goes back.
  at = line(t, ev="fwd", vw=1, stage=0, mb=5)
  expect(t, {"global": [(at, "includes 0 waves of VW 0; WSP with D=0 needs >= 1"),
                        (at, "older than an earlier forward's [1, 1]")]})


def test_global_lower_bound_latest_backward():
  t = latest_trace()
  task(t, "bwd", 0, 0, 6)["glob"] = [1, 1]
  expect(t, {"global": [(line(t, ev="bwd", vw=0, stage=0, mb=6), "backward of VW 0 minibatch 6 (wave 2) at "
                         "stage 0 includes 1 waves of VW 0; WSP with D=0 needs >= 2")]})


def test_global_pull_of_waves_not_pushed():
  t = small_trace()
  t[find(t, ev="pull", vw=1)]["glob"] = [2, 1]  # VW 0 had pushed one wave
  set_version(t, 1, 0, 2, glob=[2, 1])  # runs after VW 0's second push: the forward itself is sound
  expect(t, {"global": [(line(t, ev="pull", vw=1), "VW 1 pulled 2 waves of VW 0, which had pushed 1")]})


def test_global_forward_with_waves_not_pushed():
  t = pipeline_trace()
  t[find(t, ev="pull", vw=1, t=18)]["glob"] = [2, 1]
  for stage in (0, 1):
    for mb in (4, 5):
      set_version(t, 1, stage, mb, glob=[2, 1])
  # A forward can only use a pulled base, so a forward ahead of the pushes follows a pull ahead of them.
  expect(t, {"global": [
      (line(t, ev="pull", vw=1, t=18), "VW 1 pulled 2 waves of VW 0, which had pushed 1"),
      (line(t, ev="fwd", vw=1, stage=0, mb=4), "includes 2 waves of VW 0, which had pushed only 1"),
      (line(t, ev="fwd", vw=1, stage=1, mb=4), "includes 2 waves of VW 0, which had pushed only 1")]})


def test_global_base_never_pulled():
  t = pipeline_trace()
  set_version(t, 1, 0, 3, glob=[1, 0])  # VW 0 had pushed wave 0, but VW 1 never pulled it
  expect(t, {"global": [(line(t, ev="fwd", vw=1, stage=0, mb=3), "[1, 0], which VW 1 never pulled")]})


def test_global_never_pulled_latest_backward():
  t = latest_trace()
  task(t, "bwd", 0, 0, 5)["glob"] = [2, 1]  # pushed by then, within the bounds, but never pulled
  expect(t, {"global": [(line(t, ev="bwd", vw=0, stage=0, mb=5), "backward of VW 0 minibatch 5 at stage 0 "
                         "has global base [2, 1], which VW 0 never pulled")]})


def test_global_base_goes_back():
  # With D = 1 the bounds let minibatch 5 use the initial weights, but not after minibatch 4 used newer ones.
  t = pipeline_trace(d=1)
  set_version(t, 0, 0, 5, glob=[0, 0])
  expect(t, {"global": [(line(t, ev="fwd", vw=0, stage=0, mb=5),
                         "global base [0, 0], older than an earlier forward's [1, 1]")]})


# --- gate ----------------------------------------------------------------------------------------------

def test_gate_injection_without_a_pull():
  t = pipeline_trace()
  move(t, dict(ev="inject", vw=0, mb=4), before=dict(ev="pull", vw=0, t=18))  # the pull comes too late
  expect(t, {"gate": [(line(t, ev="inject", vw=0, mb=4), "injected gated minibatch 4 without pulling")]})


def test_gate_injection_beyond_d():
  """VW 0 does not wait for VW 1: it pulls and injects at distance 1 > D, then runs 2 > D + 1 ahead."""
  t = [
      meta(nm=[1, 1], stages=[1, 1]),
      inject(0, 1, 0), inject(1, 1, 0),
      fwd(0, 0, 1, 0, 1, 0, [0, 0]), bwd(0, 0, 1, 1, 2, 0, [0, 0]), complete(0, 1, 2), push(0, 0, 2),
      pull(0, 2, [1, 0]), inject(0, 2, 2),
      fwd(0, 0, 2, 2, 3, 1, [1, 0]), bwd(0, 0, 2, 3, 4, 1, [1, 0]), complete(0, 2, 4), push(0, 1, 4),
      fwd(1, 0, 1, 0, 5, 0, [0, 0]), bwd(1, 0, 1, 5, 6, 0, [0, 0]), complete(1, 1, 6), push(1, 0, 6),
  ]
  # Passing the gate at distance > D means pulling weights that miss the waves the lower bound demands.
  expect(t, {"gate": [(line(t, ev="pull", vw=0), "VW 0 pulled at clock 1 with global clock 0"),
                      (line(t, ev="inject", vw=0, mb=2), "minibatch 2 at c_local - c_global = 1 > D = 0"),
                      (line(t, ev="push", vw=0, wave=1), "VW 0 runs 2 waves ahead of the slowest")],
             "global": [(line(t, ev="fwd", vw=0, stage=0, mb=2), "needs >= 1")]})


# --- push ----------------------------------------------------------------------------------------------

def test_push_wave_twice():
  t = pipeline_trace()
  t[find(t, ev="push", vw=1, wave=2)]["wave"] = 1  # wave 1 again, where wave 2 was due
  expect(t, {"push": [(len(t), "VW 1 pushed wave 1 but had pushed 2 waves")]})


def test_push_before_the_wave_completed():
  t = pipeline_trace()
  move(t, dict(ev="push", vw=0, wave=0), before=dict(ev="complete", vw=0, mb=2))
  expect(t, {"push": [(line(t, ev="push", vw=0, wave=0), "with 1 minibatches completed; the wave ends at "
                       "minibatch 2")]})


def test_push_to_some_shards_only():
  t = pipeline_trace()
  t[find(t, ev="push", vw=1, wave=1)]["shards"] = 1
  expect(t, {"push": [(line(t, ev="push", vw=1, wave=1), "to 1 shards of 2")]})


def test_push_skipped_updates_only_in_fp16_and_at_most_stages_times_nm():
  t = pipeline_trace()
  t[find(t, ev="push", vw=0, wave=0)]["skipped"] = 1
  expect(t, {"push": [(line(t, ev="push", vw=0, wave=0), "only an fp16 run skips (this is fp32)")]})
  t[0]["precision"] = "fp16"
  assert check_trace(t) == []
  most = t[0]["stages"][0] * t[0]["nm"][0]
  t[find(t, ev="push", vw=0, wave=0)]["skipped"] = most + 1
  expect(t, {"push": [(line(t, ev="push", vw=0, wave=0), f"1 to stages x Nm = {most} per wave")]})


# --- stash ---------------------------------------------------------------------------------------------

def test_stash_backward_uses_its_forwards_version():
  t = pipeline_trace()
  task(t, "bwd", 0, 0, 4)["glob"] = [0, 0]
  expect(t, {"stash": [(line(t, ev="bwd", vw=0, stage=0, mb=4), "but its forward used 3, [1, 1]")]})
  t = pipeline_trace()
  task(t, "bwd", 0, 1, 3)["own"] = 3  # the update of minibatch 2, applied after the forward, is not stashed
  expect(t, {"stash": [(line(t, ev="bwd", vw=0, stage=1, mb=3), "used weights (own, glob) = 3, [0, 0]")]})


# --- end -----------------------------------------------------------------------------------------------

def test_end_minibatch_never_completed():
  t = pipeline_trace()
  del t[find(t, ev="push", vw=1, wave=2)]
  del t[find(t, ev="complete", vw=1, mb=6)]
  expect(t, {"end": [(len(t), "VW 1 injected 6 minibatches but completed 5")]})


def test_end_wave_never_pushed():
  t = pipeline_trace()
  del t[find(t, ev="push", vw=1, wave=2)]
  expect(t, {"end": [(len(t), "VW 1 completed 3 waves but pushed 2")]})


def test_format_event_without_a_time():
  t = pipeline_trace()
  t.append({"ev": "wait", "vw": 1})
  expect(t, {"format": [(len(t), "wait event has no time (t, or t0 and t1)")]})


# --- applied -------------------------------------------------------------------------------------------

def applied(vw, owner, units, waves, t):
  return dict(ev="applied", vw=vw, owner=owner, units=list(units), waves=waves, t=t)


def with_copies(t, counts=((3, 3), (3, 3))):
  """The pipeline trace with a decentralised run's last lines: two copies (processes 0 and 1), each of both
  units, saying how many waves of each VW they applied (``counts[copy][vw]``)."""
  end = t[-1].get("t1", t[-1].get("t", 0.0)) + 1.0
  return t + [applied(vw, owner, range(SHARDS), waves, end) for owner, row in enumerate(counts)
              for vw, waves in enumerate(row)]


def test_applied_copies_that_applied_every_pushed_wave_pass():
  assert check_trace(with_copies(pipeline_trace())) == []


def test_applied_a_copy_that_missed_or_repeated_a_wave():
  t = with_copies(pipeline_trace(), counts=((3, 3), (3, 2)))
  expect(t, {"applied": [(len(t), f"line {len(t)}: the copy of units [0, 1] in process 1 applied 2 waves of VW 1, "
                                   "which pushed 3")]})
  t = with_copies(pipeline_trace(), counts=((4, 3), (3, 3)))
  expect(t, {"applied": [(len(t), f"line {len(t) - 3}: the copy of units [0, 1] in process 0 applied 4 waves")]})
  t = with_copies(pipeline_trace())
  move(t, dict(ev="applied", vw=1, owner=1), dict(ev="push", vw=1, wave=2))  # placed before the last push
  moved = t[find(t, ev="applied", vw=1, owner=1)]
  moved["waves"], moved["t"] = 2, t[find(t, ev="push", vw=1, wave=2)]["t"]  # (right there, wrong at the end)
  expect(t, {"applied": [(len(t), "in process 1 applied 2 waves of VW 1, which pushed 3")]})


def test_applied_a_unit_no_copy_reports():
  t = with_copies(pipeline_trace())
  for e in t[-4:]:
    e["units"] = [0]
  expect(t, {"applied": [(len(t), "no copy of the PS shards of units [1] says what it applied of VW 0"),
                         (len(t), "no copy of the PS shards of units [1] says what it applied of VW 1")]})
