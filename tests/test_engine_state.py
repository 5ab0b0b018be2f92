"""The engine's host state is one NamedTuple (``Engine.state``) that a checkpoint saves and restores whole:
every field round-trips, including one added to it, and a resume goes on as the run would have (with
numerics: tests/test_checkpoint.py)."""

import dataclasses
from typing import Any, NamedTuple

import pytest

from hetpipe_jax.core import wsp
from hetpipe_jax.core.engine import Engine, EngineState
from hetpipe_jax.core.server import ClockServer
from hetpipe_jax.core.trace import Trace
from hetpipe_jax.core.worker import Progress, Shape, virtual_workers
from hetpipe_jax.errors import ProtocolError
from hetpipe_jax.runtime.numerics.checkpoint import Checkpointer
from hetpipe_jax.runtime.numerics.loops import Checkpointing, VirtualClock, run_virtual

from helpers import assert_trace_ok, meta

STAGES, NMS, D, WAVES = (2, 3), (2, 3), 1, 6
COST = lambda task: (1.0 + task.vw) * (1.0 if task.kind == "fwd" else 2.0)
# What an engine holds besides its state: what it was built with, and a cache of no meaning across runs.
NOT_STATE = {"vws", "server", "trace", "comm", "_batches", "_on_wave", "_rejoin", "_staged", "_glob_lists", "_seq_only",
             "state"}


class _Stop(Exception):
  """Raised right after the checkpoint under test is saved."""


def _engine(failures=None) -> Engine:
  vws = virtual_workers([Shape(k, nm) for k, nm in zip(STAGES, NMS)], WAVES)
  trace = Trace()
  trace.emit(**meta(len(STAGES), NMS, D, STAGES))
  return Engine(vws, ClockServer(len(STAGES), D), trace, failures=failures, rejoin=True)


def _checkpointer(path) -> Checkpointer:
  return Checkpointer(str(path), every=1, keep=3, identity={"test": "engine_state"})


def _run_to_checkpoint(engine: Engine, ck: Checkpointer, step: int) -> None:
  """Runs ``engine`` on the virtual clock until the global clock reaches ``step``, saves its state, the
  server's clock, the trace's length and the executor's clock there, and stops."""

  def save(clock: VirtualClock) -> None:
    ck.save(step, {"engine": engine.state, "clock": engine.server.clock, "events": len(engine.trace.events),
                   "executor": dataclasses.asdict(clock)}, {})
    raise _Stop

  with pytest.raises(_Stop):
    run_virtual(engine, COST, between=Checkpointing(lambda: wsp.c_global(engine.server.clock) >= step, save))


def _restored(ck: Checkpointer, step: int) -> tuple[Engine, dict[str, Any]]:
  saved, _ = ck.restore(step)
  engine = _engine()
  engine.restore(saved["engine"])
  engine.server._clock = saved["clock"]  # type: ignore[attr-defined]  # (the clock-only server saves nothing)
  return engine, saved


def test_a_mid_run_engine_state_round_trips_field_by_field_and_resumes_as_the_run_goes_on(tmp_path):
  # A failure and a replacement in the first waves: zombies, generations, faults pending and joins are in use.
  failures = {1: [1, 4]}
  whole = _engine(failures)
  run_virtual(whole, COST)
  assert_trace_ok(whole.trace.events)
  engine, ck = _engine(failures), _checkpointer(tmp_path)
  _run_to_checkpoint(engine, ck, 2)
  restored, saved = _restored(ck, 2)
  assert type(restored.state) is EngineState
  for name in EngineState._fields:  # every field, whatever fields there are
    before, after = getattr(engine.state, name), getattr(restored.state, name)
    assert after == before, name
  assert restored.state.failures == {1: {4}}  # the fault at wave 1 fired, the one at wave 4 is pending
  assert restored.state.generation == [0, 1]
  for vw, progress in zip(restored.vws, restored.state.workers, strict=True):
    assert vw.progress is progress  # the virtual workers read the restored state
  for before, after in zip(engine.state.workers, restored.state.workers, strict=True):
    assert [getattr(after, f.name) for f in dataclasses.fields(Progress)] == \
        [getattr(before, f.name) for f in dataclasses.fields(Progress)]
  # Resumed, it writes what the uninterrupted run wrote after the cut.
  run_virtual(restored, COST, resume=VirtualClock(**saved["executor"]))
  assert restored.trace.events[1:] == whole.trace.events[saved["events"]:]
  assert any(e["ev"] == "join" for e in whole.trace.events[saved["events"]:])  # the cut was mid-run


class _Grown(NamedTuple):
  """The engine's state with one field more, as a developer would add one to EngineState."""

  workers: Any
  running: Any
  candidates: Any
  pulling: Any
  pulled: Any
  waiting_since: Any
  stage_wait: Any
  failures: Any
  zombies: Any
  generation: Any
  awaiting_join: Any
  added: Any


def test_a_field_added_to_the_state_is_saved_and_restored_with_no_other_edit(tmp_path):
  assert _Grown._fields[:-1] == EngineState._fields, "keep _Grown as EngineState's fields + one"
  engine, ck = _engine(), _checkpointer(tmp_path)
  engine.begin()
  engine.state = _Grown(*engine.state, added={"vw": {0: (1, {2, 3})}})  # type: ignore[assignment]
  ck.save(1, {"engine": engine.state}, {})
  saved, _ = ck.restore(1)
  restored = _engine()
  restored.restore(saved["engine"])
  assert restored.state.added == {"vw": {0: (1, {2, 3})}}  # type: ignore[attr-defined]
  assert restored.state == engine.state


def test_the_engine_keeps_no_run_state_outside_its_state():
  """A mutable attribute added to the engine itself would not reach a checkpoint: it belongs in EngineState."""
  engine = _engine({1: [2]})
  run_virtual(engine, COST)
  extra = set(vars(engine)) - NOT_STATE
  assert not extra, f"Engine attributes {sorted(extra)} are not in EngineState: a checkpoint would lose them"


def test_a_state_of_another_run_is_refused():
  small = Engine(virtual_workers([Shape(2, 2)], 1), ClockServer(1, 0), Trace())
  with pytest.raises(ProtocolError, match="an engine state of 2 virtual workers restored into an engine of 1"):
    small.restore(_engine().state)

