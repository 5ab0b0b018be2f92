"""HetPipe's adaptation live across processes: the ``multiprocess`` executor under ``--adapt=on`` (issue 39).

The run goes in *parts* of ``--replan_every`` waves, one after another in the same processes, each a decentralised
WSP run of its own (:class:`~hetpipe_jax.runtime.processes.job.DecentralJob`; every virtual worker runs the
part's waves, so every part ends drained, and no wave is lost). After each part, process 0 measures what happened:
each stage's seconds (its tasks' ``t1 - t0`` on its own process's clock, an injected delay included) over what its
emulated duration (``--time_scale`` x the cost model) says, the *slowness* of the stage's GPUs; never the ``--slow``
spec itself. It plans again on that measured view with the ``sim`` executor's rule
(:func:`~hetpipe_jax.sim.replan.better_layout`: same virtual workers, re-cut, Nm by the layout's rule or kept; taken
when modelled ``gain`` faster and the saving over the waves left beats the modelled cost), publishes what it
decided in the key-value store and sends every process the gathered global weights; every process builds the next
part from them, its minibatch streams going on where the last part left off, its ``--slow`` windows still counted
from the run's start. Every process keeps what it compiled (stages and PS copies, by what they hold: a layout that
ran before starts at once); a new layout is *prepared*: compiled in the background while the next part trains on
the running layout, and run from the boundary after it if it still pays then (:class:`_Decider`).

What a part boundary costs, and is counted: the drain (the last wave of every virtual worker finishes before the
next part's first starts), process 0's decision, the weights' trip to every process, any compiling not finished
in the background, and the start barrier; the run's seconds are process 0's from the first part's start to the
last one's end. What it does not carry: the stages' local optimizer state starts afresh in each part (a PS rule
with state of its own is refused: it would be lost at every boundary).

Each part's trace is checked on its own (the WSP guarantees hold within each; every part starts every virtual
worker from the same weights); the first is at the trace path, its meta line listing every part (``segments``), the
next ones beside it (``TRACE.layout2.jsonl``, ...: docs/PROTOCOL.md section 7.5).
"""

from __future__ import annotations

import collections
import dataclasses
import json
import time
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
from absl import logging

from hetpipe_jax.cluster import Cluster
from hetpipe_jax.core.check import require_wsp
from hetpipe_jax.core.schedule import Task
from hetpipe_jax.core.trace import write_trace
from hetpipe_jax.errors import ConfigError, RunStopped
from hetpipe_jax.evaluate import make_evaluator
from hetpipe_jax.plan.layout import Layout
from hetpipe_jax.run.config import RunConfig
from hetpipe_jax.run.executors.parts import PartAt, Ran, RunPart, hand_out, handed, part_metrics, shifted_rows
from hetpipe_jax.run.executors.sim import job as sim_job
from hetpipe_jax.run.executors.sim import replanning
from hetpipe_jax.run.result import RunResult
from hetpipe_jax.run.session import trained_images
from hetpipe_jax.run.setup import Setup
from hetpipe_jax.runtime.transport.node import Node
from hetpipe_jax.sim.replan import Replanning, better_layout, measured_view, modelled_rate, segment_path

NEXT_KEY = "adapt/next"  # (scoped to the part just ended) the next part's layout, published by process 0


class _Part(NamedTuple):
  """A part as the run went: its setup (layout, waves), process 0's :class:`Ran` (None elsewhere), and the waves and
  each virtual worker's minibatches done before it."""

  setup: Setup
  ran: Ran | None
  done: int
  taken: tuple[int, ...]


class Next(NamedTuple):
  """What process 0 decided after a part: the next part's layout, and a layout every process compiles while that
  part trains (None: none), to switch to at the boundary after it if it still pays then."""

  layout: Layout
  prepare: Layout | None


def check(config: RunConfig) -> None:
  """Refuses what the live adaptation cannot run, in one line."""
  c = config
  if c.wall.time_scale <= 0:
    raise ConfigError("adapt=on on the multiprocess executor measures each task against its emulated duration: give "
                      "--time_scale > 0 (tasks padded to the cost model), or --adapt=off")
  if c.layout.time_model is not None:
    raise ConfigError(f"adapt=on re-plans the layout that trains; time_model={c.layout.time_model!r} times another: "
                      "drop --time_model, or --adapt=off")
  if c.layout.tp != 1:
    raise ConfigError(f"adapt=on re-plans layouts without tensor parallelism; tp={c.layout.tp}: give --tp=1, or "
                      "--adapt=off")
  if c.optim.ps_tx is not None or c.optim.ps_spec != "add":
    raise ConfigError(f"adapt=on on the multiprocess executor starts each part from the gathered weights, and the "
                      f"parameter server's rule {c.optim.ps_optimizer!r} keeps state that would be lost at every "
                      "part: give --ps_optimizer=add, or --adapt=off")


def measured_slowness(events: Sequence[dict[str, Any]], cost: Callable[[Task], float], time_scale: float,
                      layout: Layout) -> dict[int, float]:
  """Each GPU's slowness in a part: its stage's tasks' seconds (``t1 - t0``) over their emulated seconds x
  ``time_scale`` (a split stage's: each of its GPUs')."""
  timed: dict[tuple[int, int], float] = collections.defaultdict(float)
  emulated: dict[tuple[int, int], float] = collections.defaultdict(float)
  for ev in events:
    if ev["ev"] in ("fwd", "bwd"):
      key = (ev["vw"], ev["stage"])
      timed[key] += ev["t1"] - ev["t0"]
      emulated[key] += cost(Task(ev["vw"], ev["stage"], ev["ev"], ev["mb"])) * time_scale
  return {g.index: timed[key] / seconds for key, seconds in emulated.items() if seconds > 0
          for g in layout.vws[key[0]].stage_gpus(key[1])}


def _candidate(setup: Setup, slowness: dict[int, float], rule: Replanning, waves_left: int) -> Layout | None:
  """Process 0: the layout the rule gives on what the part measured (None: the running one stays)."""
  better = better_layout(sim_job(setup), setup.costs, rule, slowness, waves_left)
  logging.info("adapt: measured slowness %s; %s", {g: round(s, 3) for g, s in sorted(slowness.items())},
               "the layout pays as it is" if better is None else f"cuts {better.cuts}, Nm {better.nms} pay")
  return better


class _Decider:
  """Process 0's decisions. A layout every process has compiled (it ran before, or was prepared) runs at once; the
  best of them on the measured view is taken when the rule's layout is not modelled ``gain`` faster than it (so a
  run goes back to a layout it left without compiling anew). A new layout that pays is prepared during the next
  part (compiled in the background: the compiling is hidden behind training) and runs at the boundary after it if
  it still pays then."""

  def __init__(self, layout: Layout):
    self.compiled = {_signature(layout): layout}

  def __call__(self, setup: Setup, ran: Ran, rule: Replanning, waves_left: int) -> Next:
    slowness = measured_slowness(ran.events, setup.task_cost, setup.config.wall.time_scale, setup.layout)
    better = _candidate(setup, slowness, rule, waves_left)
    if better is None:
      return Next(setup.layout, None)
    view = measured_view(setup.cluster, slowness, rule.resolution)
    rate = lambda layout: modelled_rate(view, setup.clock_profiles, layout, setup.costs)
    known = max(self.compiled.values(), key=rate)
    known_rate = rate(known)
    if rate(better) <= (1 + rule.gain) * known_rate:
      return Next(known if known_rate > (1 + rule.gain) * rate(setup.layout) else setup.layout, None)
    if waves_left <= rule.every:  # the next part is the last: nothing could switch to it
      return Next(setup.layout, None)
    self.compiled[_signature(better)] = better
    return Next(setup.layout, better)


def _signature(layout: Layout) -> str:
  """What the compiled stages of a layout depend on: its GPUs in order, cuts and Nm."""
  return json.dumps([[[g.index for g in gpus] for gpus in layout.gpus], layout.cuts, layout.nms])


def _spec(layout: Layout | None) -> dict[str, Any] | None:
  return None if layout is None else {"gpus": [[g.index for g in gpus] for gpus in layout.gpus], "cuts": layout.cuts,
                                      "nm": layout.nms, "window": layout.windows}


def _layout(spec: dict[str, Any] | None, like: Layout, cluster: Cluster) -> Layout | None:
  """``like`` as ``spec`` says: its virtual workers' GPUs in the order given (a re-plan may order a group's GPUs
  anew), cuts, Nm and windows (None: none)."""
  if spec is None:
    return None
  windows, by_index = spec["window"] or [None] * like.num_vws, {g.index: g for g in cluster.gpus}
  return Layout(tuple(dataclasses.replace(vw, gpus=tuple(by_index[g] for g in gpus), cuts=tuple(c), nm=nm,
                                          window=w)
                      for vw, gpus, c, nm, w in zip(like.vws, spec["gpus"], spec["cuts"], spec["nm"], windows)))


def _receive(node: Node, layout: Layout, cluster: Cluster) -> tuple[Next, tuple[Any, ...]]:
  """Any other process: what process 0 decided (``layout`` re-planned) and the next part's weights."""
  spec, params = handed(node, NEXT_KEY)
  return Next(_layout(spec["next"], layout, cluster) or layout, _layout(spec["prepare"], layout, cluster)), params


def run_adapting(setup: Setup, node: Node, init_params: tuple[Any, ...], run_part: RunPart) -> RunResult:
  """The run in parts (see the module docstring); process 0 returns the run's result, the others an empty one.

  Raises:
    RunStopped: when a process was lost in a part (the next part's layout would need its GPUs).
    ProtocolError: when a part's trace breaks a WSP guarantee (naming the part).
  """
  c, rule, t_host = setup.config, replanning(setup.config), time.perf_counter()
  params, done, taken = init_params, 0, [0] * setup.layout.num_vws
  parts: list[_Part] = []
  decide, prepare = _Decider(setup.layout), None
  while done < c.waves:
    node.scope = f"part{len(parts)}/" if parts else ""
    waves = min(rule.every, c.waves - done)
    part = dataclasses.replace(setup, config=dataclasses.replace(c, waves=waves, trace_path=None))
    ran = run_part(part, params, taken, done + waves == c.waves, prepare, PartAt())
    if ran is not None and ran.missing and done + waves < c.waves:
      raise RunStopped(f"processes {list(ran.missing)} were lost in a part of an adapting run, whose next layout "
                       "needs their GPUs: run with --adapt=off to go on without them")
    parts.append(_Part(part, ran, done, tuple(taken)))
    taken = [t + waves * nm for t, nm in zip(taken, part.layout.nms)]
    done += waves
    if done == c.waves:
      break
    if node.process == 0:
      assert ran is not None
      decided, params = decide(part, ran, rule, c.waves - done), ran.gathers[-1]
      hand_out(node, NEXT_KEY, {"next": _spec(decided.layout), "prepare": _spec(decided.prepare)}, params)
    else:
      decided, params = _receive(node, part.layout, setup.cluster)
    setup, prepare = dataclasses.replace(setup, layout=decided.layout, clock_layout=decided.layout), decided.prepare
  if node.process != 0:
    return RunResult(None, None, [], [], 0.0, 0.0, [], setup.layout.cuts, 0)
  return _result(setup, init_params, parts, rule, time.perf_counter() - t_host)


def _result(setup: Setup, init_params, parts: list[_Part], rule: Replanning, host_seconds: float) -> RunResult:
  """Process 0: every part's trace checked and written, the rows on the run's count, the first trace's meta line
  listing the parts."""
  c, rows, images = setup.config, [], 0
  evaluate = make_evaluator(setup.model, setup.data, jax.local_devices()[0])
  sent = sum(x.nbytes for x in jax.tree.leaves(init_params)) * (setup.cluster.num_nodes - 1)  # weights to each
  listed = []
  for k, (part, ran, done, taken) in enumerate(parts):
    assert ran is not None
    require_wsp(ran.events, f"adapt, part {k + 1}")
    rows += shifted_rows(part_metrics(part, ran).finish(ran.gathers[-1], evaluate), done, taken, ran.start)
    part_images = trained_images(ran.events, c.batch_size)
    images += part_images
    listed.append({"start": ran.start, "end": ran.end, "minibatches": part_images // c.batch_size,
                   "moved_bytes": float(sent if k else 0), "nm": part.layout.nms, "cuts": part.layout.cuts,
                   "gpus": [[g.name for g in gpus] for gpus in part.layout.gpus]})
  first = parts[0].ran
  assert first is not None
  events = first.events
  events[0] = dict(events[0], segments=listed, replan_every=rule.every)
  if c.trace_path:
    for k, part in enumerate(parts):
      assert part.ran is not None
      write_trace(segment_path(c.trace_path, k), events if k == 0 else part.ran.events)
  last_part, last = parts[-1].setup, parts[-1].ran
  assert last is not None
  return RunResult(init_params, last.gathers[-1], events, rows, last.end, host_seconds,
                   last_part.virtual_workers(), last_part.layout.cuts, images)
