"""One row of the scaling study timed on its own (issue 42): ResNet-152's tuned 64-GPU configuration replicated
on mixed<N>x8, the whole row (:func:`hetpipe_jax.studies.scale.scale_row`: planning, the simulations of its
placement, striped and default, and their checks), its check's share and the peak memory. One row per process, so
each peak is its own; the 64-GPU tuning is done once and saved::

  PYTHONPATH=. .venv/bin/python benchmarks/scale_row.py tune            # writes outputs/scale_row/tuned64.pkl
  PYTHONPATH=. .venv/bin/python benchmarks/scale_row.py 1024            # RESULT gpus=1024 row=... check=...
  PYTHONPATH=. .venv/bin/python benchmarks/scale_row.py 1024 1          # the same, one simulation at a time
  PYTHONPATH=. .venv/bin/python benchmarks/scale_row.py check 1024 3    # RESULT gpus=1024 events=... us_per_event=...
  PYTHONPATH=. .venv/bin/python benchmarks/scale_row.py check 1024 3 pickled   # the trace read back first
  PYTHONPATH=. .venv/bin/python benchmarks/scale_row.py noisy 1024 default     # RESULT gpus=1024 ... us_per_event=...

``check GPUS ROUNDS`` times the check alone, per event: the striped placement's version-2 trace is simulated and
kept, then :func:`hetpipe_jax.core.check.check_trace` reads it ``ROUNDS`` times; the best is printed (the trace at
16,384 GPUs holds 5.4M events: several GB). With ``pickled`` the events are saved with pickle and read back before
they are checked, as a trace read from a file is: laid out afresh, not scattered over the simulation's memory.

``noisy GPUS PLACEMENT [NOISE]`` times the simulation alone, per event, of one placement (``striped`` or
``default``) under noise (default ``default,seed=3``: GPUs and links varying, so flows start and land at nearly every
event and the links are re-shared as often; the row's runs move in step). Its events are counted, not kept or checked.

The second argument is the study's ``jobs`` (default 0: one simulation per core, side by side in forked
processes). ``peak_mb`` is the most memory this process and those it forked held together, sampled every 0.5 s:
the sum of their proportional set sizes (a page they share counts once), or the peak of this process or of one it
forked where that is larger (a peak between two samples). A sample reads /proc/<pid>/smaps_rollup of each process,
about 4.5 ms a process, on the cores the row runs on: every 0.2 s it took 3% of them.

With ``PYTHONPATH`` at a checkout of older code it times that code (where the study checked inside its
simulations, the check is timed apart by wrapping ``require_wsp``): the side-by-side figures of BUILD_NOTES.md.
"""

import contextlib
import dataclasses
import gc
import glob
import math
import os
import pickle
import resource
import sys
import threading
import time

from hetpipe_jax.core.check import check_trace
from hetpipe_jax.core.trace import Trace
from hetpipe_jax.cost.context import CostContext
from hetpipe_jax.sim.simulate import simulate_fast
from hetpipe_jax.studies import scale
from hetpipe_jax.tune import RunSetting

TUNED = os.path.join("outputs", "scale_row", "tuned64.pkl")


class PeakMemory(threading.Thread):
  """Samples, every ``every_s``, the memory of this process and every process below it (the sum of their
  proportional set sizes, /proc/<pid>/smaps_rollup) and keeps the largest sum, in MB."""

  def __init__(self, every_s: float = 0.5):
    super().__init__(daemon=True)
    self.every_s, self.peak_mb, self._on = every_s, 0.0, True

  def run(self) -> None:
    while self._on:
      self.peak_mb = max(self.peak_mb, sum(_pss_mb(pid) for pid in _tree(os.getpid())))
      time.sleep(self.every_s)

  def stop(self) -> float:
    self._on = False
    self.join()
    return max(self.peak_mb, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
               resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024)


def _tree(pid: int) -> list[int]:
  """``pid`` and every process below it."""
  pids = [pid]
  for task in glob.glob(f"/proc/{pid}/task/*/children"):
    with contextlib.suppress(OSError), open(task) as f:
      for child in f.read().split():
        pids.extend(_tree(int(child)))
  return pids


def _pss_mb(pid: int) -> float:
  with contextlib.suppress(OSError), open(f"/proc/{pid}/smaps_rollup") as f:
    for line in f:
      if line.startswith("Pss:"):
        return int(line.split()[1]) / 1024
  return 0.0  # (gone meanwhile)


def check_per_event(config: scale.ScaleConfig, tuned, profiles, setting: RunSetting, n: int, rounds: int,
                    pickled: bool) -> None:
  """The check of the striped placement's version-2 trace at ``n`` GPUs, alone: the best of ``rounds``, per event
  (``pickled``: the events saved with pickle and read back first)."""
  cluster = scale.mixed_cluster(n, config.per_node)
  candidate = scale.replicate(tuned, cluster, profiles, setting=setting)
  trace = Trace(version=2)
  simulate_fast(candidate.job(cluster, profiles, config.waves, placement="striped", precision="fp32"), trace)
  events = pickle.loads(pickle.dumps(trace.events)) if pickled else trace.events  # noqa: S301 (our own bytes)
  del trace
  best = math.inf
  for _ in range(rounds):
    gc.collect()
    t0 = time.perf_counter()
    violations = check_trace(events)
    best = min(best, time.perf_counter() - t0)
    assert not violations, violations[:3]
  print(f"RESULT gpus={n} events={len(events)} check={best:.2f} us_per_event={best / len(events) * 1e6:.2f}",
        flush=True)


class _Count:
  """A trace sink that counts the events."""

  def __init__(self):
    self.events = 0

  def __call__(self, event) -> None:
    del event
    self.events += 1

  def fresh(self) -> "_Count":
    return self


def noisy_per_event(config: scale.ScaleConfig, tuned, profiles, setting: RunSetting, n: int, placement: str,
                    noise: str) -> None:
  """One simulation of ``placement`` at ``n`` GPUs under ``noise``, alone: its seconds per event."""
  cluster = scale.mixed_cluster(n, config.per_node)
  job = scale.replicate(tuned, cluster, profiles, setting=setting).job(cluster, profiles, config.waves,
                                                                       placement=placement, precision="fp32")
  job = job._replace(options=dataclasses.replace(job.options, noise=noise))
  count = _Count()
  t0 = time.perf_counter()
  simulated = simulate_fast(job, Trace(keep=False, version=2, sink=count))[0]
  wall = time.perf_counter() - t0
  print(f"RESULT gpus={n} placement={placement} events={count.events} sim={wall:.2f} "
        f"us_per_event={wall / count.events * 1e6:.2f} simulated_s={simulated!r}", flush=True)


def main(argv: list[str]) -> None:
  setting = RunSetting(CostContext(optimizer_slots=1.0, precision="fp32"))
  profiles = scale.full_size_profiles("resnet152", 32, seq_len=None)
  config = scale.ScaleConfig(models=("resnet152",), sizes=(64,))
  jobs = int(argv[2]) if len(argv) > 2 else 0
  if hasattr(config, "jobs"):
    config = dataclasses.replace(config, jobs=jobs)
  if argv[1] == "tune":
    os.makedirs(os.path.dirname(TUNED), exist_ok=True)
    with open(TUNED, "wb") as f:
      pickle.dump(scale.tune_bases(config, "resnet152", profiles, setting)[64], f)
    return
  with open(TUNED, "rb") as f:
    tuned = pickle.load(f)  # noqa: S301 (our own file)
  if argv[1] == "check":
    if argv[4:] not in ([], ["pickled"]):
      raise SystemExit(f"check GPUS ROUNDS [pickled]: {' '.join(argv[4:])!r} is not 'pickled'; give it or nothing")
    return check_per_event(config, tuned, profiles, setting, int(argv[2]), int(argv[3]) if len(argv) > 3 else 3,
                           argv[4:] == ["pickled"])
  if argv[1] == "noisy":
    if len(argv) not in (4, 5) or argv[3] not in ("striped", "default"):
      raise SystemExit(f"noisy GPUS PLACEMENT [NOISE]: {' '.join(argv[2:])!r}; PLACEMENT is striped or default")
    return noisy_per_event(config, tuned, profiles, setting, int(argv[2]), argv[3],
                           argv[4] if len(argv) > 4 else "default,seed=3")
  checked = [0.0]
  if hasattr(scale, "require_wsp"):  # older code: the check inside each simulation
    inner = scale.require_wsp

    def timed(*args, **kwargs):
      t0 = time.perf_counter()
      inner(*args, **kwargs)
      checked[0] += time.perf_counter() - t0

    scale.require_wsp = timed
  n = int(argv[1])
  memory = PeakMemory()
  memory.start()
  t0 = time.perf_counter()
  row = scale.scale_row(config, "resnet152", n, tuned, profiles, setting)
  wall = time.perf_counter() - t0
  peak = memory.stop()
  print(f"RESULT gpus={n} row={wall:.2f} check={getattr(row, 'check_seconds', checked[0]):.2f} "
        f"plan={row.plan_seconds:.2f} printed={row.plan_sim_seconds:.2f} peak_mb={peak:.0f} eff={row.efficiency:.4f} "
        f"striped={row.items_per_sec_striped:.1f} per_unit={row.items_per_sec_per_unit:.1f}", flush=True)


if __name__ == "__main__":
  main(sys.argv)
