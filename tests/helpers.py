"""Helpers shared by the tests: schedule-only runs, small numeric runs, trace assertions."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Sequence

import jax
import numpy as np
import pytest

from hetpipe_jax import check_trace, read_trace, staleness_stats
from hetpipe_jax.core.check import as_version_1
from hetpipe_jax.core.engine import Engine
from hetpipe_jax.core.server import ClockServer
from hetpipe_jax.core.trace import Trace
from hetpipe_jax.core.worker import Shape, virtual_workers
from hetpipe_jax.runtime.numerics.checkpoint import Checkpointer
from hetpipe_jax.runtime.numerics.loops import run_virtual, run_wall
from hetpipe_jax.runtime.transport.launch import child_environment

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TWO_NODES = os.path.join(ROOT, "tests", "data", "two_nodes.toml")  # a cluster of 2 nodes: 2 processes
F32_U = 2.0 ** -24  # float32's unit roundoff


def reorder_bound(n: int) -> float:
  """How far two float32 sums of the same ``n`` terms in different orders may differ, relative to the sum of the
  terms' magnitudes: 2 gamma_n, gamma_n = n u / (1 - n u) the bound of one sum in any order (Higham, Accuracy and
  Stability of Numerical Algorithms, 2002, section 3.1). Another device layout, or another machine's vector width
  (AVX2 against AVX-512), sums a dot product in another order: a tolerance between two such runs is this bound
  carried through the computation, not one machine's difference."""
  return 2 * n * F32_U / (1 - n * F32_U)


def train_cli(out_dir, *flags: str, timeout: float = 300) -> subprocess.CompletedProcess:
  """``python -m experiments.train --out_dir=out_dir *flags`` as a subprocess with a timeout (how the tests
  start a multi-process run: the CLI launches one process per node, each setting its own device count)."""
  return subprocess.run([sys.executable, "-m", "experiments.train", f"--out_dir={out_dir}", *flags],
                        capture_output=True, text=True, timeout=timeout, env=child_environment(), cwd=ROOT)


def assert_trace_ok(events) -> dict:
  """Asserts the trace satisfies every WSP guarantee; returns its staleness statistics (of either version)."""
  violations = check_trace(events)
  assert not violations, "\n".join(map(str, violations[:20]))
  return staleness_stats(as_version_1(events))


def meta(n, nm, d, stages, weight_mode="stash", executor="virtual", version=1):
  return dict(ev="meta", version=version, num_vws=n, nm=list(nm), d=d, stages=list(stages),
              weight_mode=weight_mode, executor=executor, shards=0)


def schedule_only(stages: Sequence[int], nms: Sequence[int], d: int, waves: int, slowdown: Sequence[float],
                  executor: str = "virtual", schedule: str = "1f1b", fwd: float = 1.0, bwd: float = 2.0,
                  time_scale: float = 1e-4, weight_mode: str = "stash", ps_class=ClockServer,
                  engine_class=Engine, version: int = 1) -> list[dict]:
  """Runs the protocol without numerics; VW i's tasks last ``slowdown[i]`` x (fwd, bwd).

  ``weight_mode`` is what the workers do; the trace's meta line always says "stash". ``version``: the trace
  format's (2: tasks and pulls name their global base by seq).
  """
  n = len(stages)
  vws = virtual_workers([Shape(k, nm) for k, nm in zip(stages, nms)], waves, schedule, weight_mode)
  trace = Trace(version=version)
  trace.emit(**meta(n, nms, d, stages, executor=executor, version=version))
  engine = engine_class(vws, ps_class(n, d), trace)
  cost = lambda t: slowdown[t.vw] * (fwd if t.kind == "fwd" else bwd)
  if executor == "virtual":
    run_virtual(engine, cost)
  else:
    run_wall(engine, cost, time_scale)
  return trace.events


def one_minibatch_trace() -> list[dict]:
  """A sound trace: one virtual worker, one stage, Nm = 1, D = 0, one minibatch."""
  return [
      {"ev": "meta", "version": 1, "num_vws": 1, "nm": [1], "d": 0, "stages": [1], "weight_mode": "stash",
       "executor": "virtual"},
      {"ev": "inject", "vw": 0, "mb": 1, "t": 0},
      {"ev": "fwd", "vw": 0, "stage": 0, "mb": 1, "t0": 0, "t1": 1, "own": 0, "glob": [0]},
      {"ev": "bwd", "vw": 0, "stage": 0, "mb": 1, "t0": 1, "t1": 2, "own": 0, "glob": [0]},
      {"ev": "complete", "vw": 0, "mb": 1, "t": 2},
      {"ev": "push", "vw": 0, "wave": 0, "t": 2},
  ]


class Stopped(Exception):
  """Raised right after a chosen checkpoint: the run stops there, as if killed once it was written."""


def assert_resumes_bit_identical(monkeypatch, tmp_path, run, config, step: int) -> list[int]:
  """``run(config(out))`` whole in ``tmp_path/whole``; in ``tmp_path/stopped`` the same stopped right after its
  checkpoint ``step``, then ``run(config(out, resume=True))``: asserts the resumed run ends with the whole one's
  weights (bit for bit), events, metrics and trace file, and that its trace keeps the WSP guarantees. Returns the
  checkpoint steps the stopped run had left."""
  whole_dir, stopped_dir = tmp_path / "whole", tmp_path / "stopped"
  whole_dir.mkdir()
  stopped_dir.mkdir()
  whole = run(config(whole_dir))
  assert_trace_ok(whole.events)
  save = Checkpointer.save

  def save_then_stop(self, at, state, extra):
    save(self, at, state, extra)
    if at == step:
      raise Stopped

  monkeypatch.setattr(Checkpointer, "save", save_then_stop)
  with pytest.raises(Stopped):
    run(config(stopped_dir))
  monkeypatch.undo()
  left = sorted(int(name) for name in os.listdir(stopped_dir / "ck") if name.isdigit())
  resumed = run(config(stopped_dir, resume=True))
  assert resumed.checkpoints["resumed_from"] == step
  for a, b in zip(jax.tree.leaves(whole.params), jax.tree.leaves(resumed.params), strict=True):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  assert resumed.events == whole.events and resumed.metrics == whole.metrics
  assert (stopped_dir / "t.jsonl").read_bytes() == (whole_dir / "t.jsonl").read_bytes()
  assert_trace_ok(read_trace(str(stopped_dir / "t.jsonl")))
  return left
