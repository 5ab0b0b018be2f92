"""What the benchmarks time, built through the package's public-ish functions: the one module to adapt.

Each benchmark times one :class:`Workload`: ``setup()`` (not timed) returns fresh arguments, ``run(*args)``
(timed) is the hot path, ``check(*args)`` (not timed, after the last round) makes sure the run did the real
work and may add figures to the benchmark's ``extra_info``.

The benchmark files run against older trees of the package too (``benchmarks/compare.py`` runs them on a
git ref through ``PYTHONPATH``), whose modules were laid out differently (``hetpipe_jax.engine`` became
``hetpipe_jax.core.engine``, ``simulate`` took GPUs and cuts before it took a layout, then a ``SimJob``).
So each builder looks its API up by the names known, newest first (:func:`_attr`), and raises
:class:`Unavailable` when a tree has none of them: the benchmark then skips, saying why.

Package APIs used (newest first where they moved):

* ``hetpipe_jax``: ``RunConfig`` (``RunConfig.of`` where the fields are nested), ``run_hetpipe``,
  ``synthetic``, ``MinibatchStreams``, ``get_cluster``, ``get_model``, ``check_trace``, ``ParameterServer``
  (``push``, ``warm_up``, ``state.params`` or ``params``), ``ensure_cpu_devices``;
* ``hetpipe_jax.models.base``: ``LayeredModel``, ``DenseUnit``;
* ``hetpipe_jax.core.engine`` | ``hetpipe_jax.engine``: ``Engine(vws, server, trace)``, ``.vws``, ``.done``,
  ``.trace``;
* ``hetpipe_jax.core.worker`` | ``hetpipe_jax.pipeline``: ``VirtualWorker.create(...)`` (with a ``Shape`` where
  there is one) | ``VirtualWorker(...)``,
  ``.stages`` (each with ``forward``, ``backward``, ``device``, ``is_last``, ``params``);
* ``hetpipe_jax.core.server.ClockServer`` | ``ParameterServer(None, ...)``: the clock-only server;
* ``hetpipe_jax.runtime.numerics.loops`` | ``hetpipe_jax.runtime.executors`` | ``hetpipe_jax.executors``:
  ``run_virtual``, ``run_wall`` (the wall benchmark lets ``run_hetpipe`` build and compile the run, catches the
  engine at its ``run_wall`` call and times that call alone);
* ``hetpipe_jax.core.trace`` | ``hetpipe_jax.trace``: ``Trace``;
* ``hetpipe_jax.cost.profile.full_size_profiles`` | ``hetpipe_jax.profile.profile_units``;
* ``hetpipe_jax.plan.allocation`` | ``hetpipe_jax.allocation``: ``plan_cluster`` (``.layout`` | ``.vws``);
* ``hetpipe_jax.sim.simulate`` | ``hetpipe_jax.sim``: ``simulate`` (and ``SimJob``);
* ``hetpipe_jax.plan.partition`` | ``hetpipe_jax.partition``: ``partition``, ``plan_virtual_worker``,
  ``search_states`` (its presence says the partitioner reaches 16 GPUs);
* ``hetpipe_jax.cluster``: ``make_cluster``, ``CATALOGUE``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gzip
import importlib
import inspect
import json
import os
import sys
from collections.abc import Callable
from typing import Any

GOLDEN_TRACE = os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, "tests", "golden",
                            "full_default.trace.jsonl.gz")
OPTIMIZER_SLOTS = 1  # momentum's: what the planner benchmarks of experiments/ assume


class Unavailable(Exception):
  """This tree of the package has no API for the workload (the benchmark skips with this message)."""


@dataclasses.dataclass
class Workload:
  """``setup()`` -> args (not timed); ``run(*args)`` (timed); ``check(*args)`` -> extra figures (not timed)."""

  setup: Callable[[], tuple]
  run: Callable[..., Any]
  check: Callable[..., dict[str, Any] | None] | None = None
  info: dict[str, Any] = dataclasses.field(default_factory=dict)


def _attr(name: str, *modules: str) -> Any:
  """``name`` from the first of ``modules`` that exists and has it.

  Raises:
    Unavailable: when none has it.
  """
  for module in modules:
    try:
      found = importlib.import_module(module)
    except ModuleNotFoundError as e:
      if e.name is None or not module.startswith(e.name):
        raise  # the module exists but imports something missing: a real error
      continue
    if hasattr(found, name):
      return getattr(found, name)
  raise Unavailable(f"this tree has no {name} in {' or '.join(modules)}")


def _check_trace(events) -> list:
  return _attr("check_trace", "hetpipe_jax")(events)


def _require_sound(events, what: str) -> None:
  violations = _check_trace(events)
  assert not violations, f"{what}: the trace breaks WSP: {[str(v) for v in violations[:3]]}"


def ensure_devices(count: int = 8) -> None:
  """At least ``count`` CPU devices (the test suite's count), before JAX starts."""
  os.environ.setdefault("JAX_PLATFORMS", "cpu")
  flags = os.environ.get("XLA_FLAGS", "")
  if "xla_force_host_platform_device_count" not in flags:
    os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={count}".strip()
  with contextlib.suppress(Unavailable):
    _attr("ensure_cpu_devices", "hetpipe_jax")(count)


def compilation_cache(directory: str) -> None:
  """Compiled programs from JAX's persistent cache in ``directory`` (JAX's own options: any tree)."""
  jax = importlib.import_module("jax")
  jax.config.update("jax_compilation_cache_dir", directory)
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
  jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


def compilation_cache_dir() -> str:
  return importlib.import_module("jax").config.jax_compilation_cache_dir


def package_dir() -> str:
  """Where the ``hetpipe_jax`` being benchmarked lives."""
  return os.path.dirname(os.path.abspath(importlib.import_module("hetpipe_jax").__file__ or ""))


def make_config(**fields: Any):
  """A RunConfig from flat field names (``RunConfig.of`` where the fields are nested)."""
  run_config = _attr("RunConfig", "hetpipe_jax")
  return getattr(run_config, "of", run_config)(**fields)


def _tasks(stages, nms, waves: int) -> int:
  return sum(2 * k * nm * waves for k, nm in zip(stages, nms))


# 1. The engine: the protocol without numerics on the virtual clock; the wall executor with real numerics.

def _clock_server(num_vws: int, d: int):
  try:
    return _attr("ClockServer", "hetpipe_jax.core.server")(num_vws, d)
  except Unavailable:
    return _attr("ParameterServer", "hetpipe_jax")(None, num_vws, d)  # before ClockServer: params None


def engine_virtual(waves: int) -> Workload:
  """Three virtual workers (2, 3, 4 stages; Nm 2, 3, 4; D = 1; 1x, 1.5x, 2x slower), no numerics."""
  engine_cls = _attr("Engine", "hetpipe_jax.core.engine", "hetpipe_jax.engine")
  worker_cls = _attr("VirtualWorker", "hetpipe_jax.core.worker", "hetpipe_jax.pipeline")
  run_virtual = _attr("run_virtual", "hetpipe_jax.runtime.numerics.loops", "hetpipe_jax.runtime.executors",
                      "hetpipe_jax.executors")
  trace_cls = _attr("Trace", "hetpipe_jax.core.trace", "hetpipe_jax.trace")
  stages, nms, slowdown, d = (2, 3, 4), (2, 3, 4), (1.0, 1.5, 2.0), 1
  n = len(stages)
  create = getattr(worker_cls, "create", worker_cls)
  try:  # a VirtualWorker.create that takes a shape (k, nm, window) rather than k and nm
    shape = _attr("Shape", "hetpipe_jax.core.worker")
    create = lambda i, k, nm, total, n, schedule, weight_mode, make=create: make(
        i, shape(k, nm), total, n, schedule=schedule, weight_mode=weight_mode)
  except Unavailable:
    pass
  cost = lambda task: slowdown[task.vw] * (1.0 if task.kind == "fwd" else 2.0)

  def setup():
    vws = [create(i, stages[i], nms[i], waves * nms[i], n, "1f1b", "stash") for i in range(n)]
    trace = trace_cls()
    trace.emit(ev="meta", version=1, num_vws=n, nm=list(nms), d=d, stages=list(stages), weight_mode="stash",
               executor="virtual", shards=0)
    return engine_cls(vws, _clock_server(n, d), trace), cost

  def check(engine, _):
    assert engine.done, "the engine did not run every minibatch"
    _require_sound(engine.trace.events, "engine_virtual")
    return {"events": len(engine.trace.events)}

  return Workload(setup, run_virtual, check, {"waves": waves, "tasks": _tasks(stages, nms, waves)})


class _Caught(BaseException):
  """Raised by the stand-in run_wall: the run is built, its engine caught (BaseException: no handler
  of the package turns it into another error)."""


def _tiny_mlp():
  layered, dense = (_attr(n, "hetpipe_jax.models.base") for n in ("LayeredModel", "DenseUnit"))
  return layered("tiny", tuple(dense(16) for _ in range(3)) + (dense(10, relu=False),), ("d0", "d1", "d2", "logits"))


def _caught_wall_run(waves: int, nm: int):
  """``run_hetpipe`` builds and compiles a wall run of the tiny 4-stage MLP; returns (run_wall, its args,
  its kwargs) as the package would have called it, without running it."""
  run_wall = _attr("run_wall", "hetpipe_jax.runtime.numerics.loops", "hetpipe_jax.runtime.executors",
                   "hetpipe_jax.executors")
  optax = importlib.import_module("optax")
  config = make_config(cluster="uniform8", num_vws=1, stages=4, nm=nm, d=0, waves=waves, batch_size=8,
                       tx=optax.sgd(0.05), executor="wall", eval_every=waves)  # evaluate once, at the end
  data = _attr("synthetic", "hetpipe_jax")(num_train=512, num_test=64)
  calls = []

  def stand_in(*args, **kwargs):
    calls.append((args, kwargs))
    raise _Caught

  # Every module of the package that holds run_wall (as an attribute of the executors module or imported
  # by name) calls the stand-in while run_hetpipe builds the run.
  holders = [m for name, m in list(sys.modules.items())
             if name.startswith("hetpipe_jax") and getattr(m, "run_wall", None) is run_wall]
  for module in holders:
    module.run_wall = stand_in
  try:
    _attr("run_hetpipe", "hetpipe_jax")(_tiny_mlp(), data, config)
  except _Caught:
    pass
  finally:
    for module in holders:
      module.run_wall = run_wall
  if not calls:
    raise Unavailable("run_hetpipe ran the wall executor without calling run_wall through a module attribute; "
                      "adapt benchmarks/workloads.py")
  return run_wall, calls[0][0], calls[0][1], data


def wall_executor(waves: int, nm: int = 4) -> Workload:
  """The wall executor (one host thread per device) on a tiny 4-stage MLP, 1 virtual worker: the host
  overhead per task of experiments/bench_overhead.py (CPU emulation)."""

  def setup():
    run_wall, args, kwargs, _ = _caught_wall_run(waves, nm)
    return run_wall, args, kwargs

  def check(_run_wall, args, _kwargs):
    engine = args[0]
    assert engine.done, "the wall executor did not run every minibatch"
    _require_sound(engine.trace.events, "wall_executor")
    return None

  return Workload(setup, lambda run_wall, args, kwargs: run_wall(*args, **kwargs), check,
                  {"waves": waves, "tasks": _tasks((4,), (nm,), waves)})


def wall_stage_programs(waves: int, nm: int = 4) -> Workload:
  """The same stage programs as :func:`wall_executor`'s called back to back in a plain loop (fwd 0..3,
  bwd 3..0 per minibatch): the baseline its per-task overhead is measured against."""
  _, args, _, data = _caught_wall_run(waves, nm)
  vws = args[0].vws
  batches = _attr("MinibatchStreams", "hetpipe_jax")(data, 8, num_vws=1, seed=0)
  loop = _attr("plain_stage_loop_seconds", "experiments.bench_overhead")  # the tree under test's own loop
  total = nm * waves
  return Workload(lambda: (vws, batches), lambda vws, batches: loop(vws, batches, total), None,
                  {"waves": waves, "tasks": _tasks((4,), (nm,), waves)})


# 2. The simulator: the paper's testbed on the sim executor.

def full_size_profiles(name: str, batch_size: int = 32):
  """Profiles of VGG-19 or ResNet-152 at 224x224 (no cache: each tree profiles with its own code)."""
  try:
    return _attr("full_size_profiles", "hetpipe_jax.cost.profile")(name, batch_size, cache_dir=None)
  except Unavailable:
    jax, jnp = importlib.import_module("jax"), importlib.import_module("jax.numpy")
    profile_units = _attr("profile_units", "hetpipe_jax.profile")
    model = _attr("get_model", "hetpipe_jax")(name, 1000)
    return profile_units(model, jax.ShapeDtypeStruct((batch_size, 224, 224, 3), jnp.float32), cache_dir=None)


def _slots_kwargs(fn) -> dict:
  """The optimizer's slots as ``fn`` takes them: in a cost context (issue 22 on), or as ``optimizer_slots``."""
  if "costs" in inspect.signature(fn).parameters:
    return {"costs": _attr("CostContext", "hetpipe_jax.cost.context")(optimizer_slots=OPTIMIZER_SLOTS)}
  return {"optimizer_slots": OPTIMIZER_SLOTS}


def simulator(waves: int) -> Workload:
  """``waves`` waves of VGG-19 (batch 32) on ``paper_testbed`` under ED: 4 virtual workers x 4 stages,
  Nm = 4, D = 0 (experiments/bench_sim.py's run)."""
  cluster = _attr("get_cluster", "hetpipe_jax")("paper_testbed")
  profiles = full_size_profiles("vgg19")
  plan_cluster = _attr("plan_cluster", "hetpipe_jax.plan.allocation", "hetpipe_jax.allocation")
  plan = plan_cluster(cluster, profiles, "ED", nm_policy=4, **_slots_kwargs(plan_cluster))
  simulate = _attr("simulate", "hetpipe_jax.sim.simulate", "hetpipe_jax.sim")
  trace_cls = _attr("Trace", "hetpipe_jax.core.trace", "hetpipe_jax.trace")
  params = inspect.signature(simulate).parameters
  if "job" in params:
    job = _attr("SimJob", "hetpipe_jax.sim.simulate", "hetpipe_jax.sim")(cluster, profiles, plan.layout, 0, waves)
    call = lambda trace: simulate(job, trace)
  elif "layout" in params:
    call = lambda trace: simulate(cluster, profiles, plan.layout, 0, waves, trace)
  elif "gpus" in params:
    gpus, cuts, nms = [p.gpus for p in plan.vws], [p.cuts for p in plan.vws], [p.nm for p in plan.vws]
    call = lambda trace: simulate(cluster, profiles, gpus, cuts, nms, 0, waves, trace)
  else:
    raise Unavailable(f"simulate{inspect.signature(simulate)} is a signature benchmarks/workloads.py does not know")

  def check(trace):
    _require_sound(trace.events, "simulator")
    return {"events": len(trace.events)}

  return Workload(lambda: (trace_cls(),), call, check, {"waves": waves})


# 3. The partitioner on full-size profiles.

def _partition_module(name: str):
  return _attr(name, "hetpipe_jax.plan.partition", "hetpipe_jax.partition")


def plan_vw(cluster_name: str) -> Workload:
  """ResNet-152 (batch 32) over every GPU of a cluster preset as one virtual worker, Nm by max_fit, the
  GPUs' order searched (``paper_mini``: 4 GPUs of 4 types; ``paper_half``: 8, 2 per type and node)."""
  cluster = _attr("get_cluster", "hetpipe_jax")(cluster_name)
  profiles, plan = full_size_profiles("resnet152"), _partition_module("plan_virtual_worker")
  gpus = list(cluster.gpus)
  return Workload(lambda: (), lambda: plan(cluster, profiles, gpus, "max_fit", **_slots_kwargs(plan)))


def partition_16gpu() -> Workload:
  """ResNet-152 (batch 32) over 16 GPUs of 8 types, 2 per type on one node (4 nodes of 4), Nm = 1."""
  try:
    _partition_module("search_states")
  except Unavailable:
    raise Unavailable("this tree's partitioner has no search_states: it enumerates the GPU orders, and 16 GPUs of "
                      "8 types (16!/2^8 orders) are out of its reach") from None
  make_cluster, catalogue = (_attr(n, "hetpipe_jax.cluster") for n in ("make_cluster", "CATALOGUE"))
  names = ["TITAN V", "TITAN RTX", "RTX 2060", "Quadro P4000", "V100", "A100", "T4", "RTX 3090"]
  cluster = make_cluster("16gpu_8types", [[catalogue[names[(4 * node + i) // 2]] for i in range(4)]
                                          for node in range(4)])
  profiles, partition = full_size_profiles("resnet152"), _partition_module("partition")
  gpus = list(cluster.gpus)
  return Workload(lambda: (), lambda: partition(cluster, profiles, gpus, 1, **_slots_kwargs(partition)))


# 4. The parameter server applying pushed waves.

def ps_push(pushes: int, units: int = 8, width: int = 256) -> Workload:
  """Two virtual workers push ``pushes`` waves in turn to a server of ``units`` shards of a
  ``width`` x ``width`` kernel and a bias each (default apply rule: add the wave's update)."""
  jax, jnp = importlib.import_module("jax"), importlib.import_module("jax.numpy")
  server_cls = _attr("ParameterServer", "hetpipe_jax")
  shard = lambda value: {"kernel": jnp.full((width, width), value, jnp.float32),
                         "bias": jnp.full((width,), value, jnp.float32)}
  server = server_cls(tuple(shard(0.01) for _ in range(units)), 2, 0)
  server.warm_up()
  updates = {u: shard(1e-6) for u in range(units)}
  waves = [0, 0]
  weights = (lambda: server.state.params) if isinstance(getattr(type(server), "state", None), property) \
      else (lambda: server.params)

  def run():
    for p in range(pushes):
      vw = p % 2
      server.push(vw, waves[vw], updates)
      waves[vw] += 1
    jax.block_until_ready(weights())

  return Workload(lambda: (), run, None, {"pushes": pushes, "bytes_per_push": units * (width + 1) * width * 4})


# 5. The trace checker on a recorded trace.

def checker(path: str = GOLDEN_TRACE) -> Workload:
  """``check_trace`` on a recorded trace (the working tree's tests/golden/full_default: 5,272 events)."""
  if not os.path.exists(path):
    raise Unavailable(f"no recorded trace at {os.path.normpath(path)}")
  with gzip.open(path, "rt", encoding="utf-8") as f:
    events = [json.loads(line) for line in f if line.strip()]
  violations = _check_trace(events)
  if violations:
    raise Unavailable(f"this tree's checker finds {len(violations)} violations in {os.path.basename(path)} "
                      f"(first: {violations[0]}): its trace contract differs, the timings would not compare")
  return Workload(lambda: (events,), _check_trace, None, {"events": len(events)})
