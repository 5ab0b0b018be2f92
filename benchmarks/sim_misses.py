"""Instructions and last-level cache misses per simulated event, counted by cachegrind (valgrind): the same
numbers on every run, where this machine's clock drifts by 1.5x within hours and has no hardware counters. The
striped placement of the scaling study's row (ResNet-152's tuned 64-GPU configuration replicated on mixed<N>x8,
``outputs/scale_row/tuned64.pkl`` from ``benchmarks/scale_row.py tune``) is simulated without a check; a second
run that stops before the simulation is subtracted, so imports and planning drop out::

  PYTHONPATH=. .venv/bin/python benchmarks/sim_misses.py 1024            # RESULT gpus=1024 ... ir_per_event=...
  PYTHONPATH=. .venv/bin/python benchmarks/sim_misses.py 1024 1048576    # a last-level cache of 1 MB

A smaller last-level cache than the machine's 32 MB stands in for a larger cluster (the misses per event grow
with the cluster at a given cache: BUILD_NOTES.md gives the figures), so a change to what a task reads can be judged
in minutes. Each of the two runs takes about 50x the native time (2-4 minutes at 256-1,024 GPUs); they run side by
side. Needs valgrind (Debian: ``apt-get install valgrind``).
"""

import os
import pickle
import shutil
import subprocess
import sys
import tempfile

TUNED = os.path.join("outputs", "scale_row", "tuned64.pkl")
LL_DEFAULT = 1 << 20  # bytes


def simulate(n: int, run: bool) -> None:
  """Plans the row's striped placement at ``n`` GPUs and, when ``run``, simulates it; prints its events."""
  from hetpipe_jax.core.trace import Trace
  from hetpipe_jax.cost.context import CostContext
  from hetpipe_jax.sim.simulate import simulate_fast
  from hetpipe_jax.studies import scale
  from hetpipe_jax.tune import RunSetting

  setting = RunSetting(CostContext(optimizer_slots=1.0, precision="fp32"))
  profiles = scale.full_size_profiles("resnet152", 32, seq_len=None)
  config = scale.ScaleConfig(models=("resnet152",), sizes=(64,))
  with open(TUNED, "rb") as f:
    tuned = pickle.load(f)  # noqa: S301 (our own file)
  cluster = scale.mixed_cluster(n, config.per_node)
  job = scale.replicate(tuned, cluster, profiles, setting=setting).job(cluster, profiles, config.waves,
                                                                       placement="striped", precision="fp32")
  if run:
    events = [0]

    class Count:
      def __call__(self, _):
        events[0] += 1

      def fresh(self):
        return self

    simulate_fast(job, Trace(keep=False, version=2, sink=Count()))
    print(f"EVENTS {events[0]}", flush=True)


def summary(path: str) -> dict[str, int]:
  """The totals of a cachegrind output file, by event name."""
  names, totals = [], []
  with open(path) as f:
    for line in f:
      if line.startswith("events:"):
        names = line.split()[1:]
      elif line.startswith("summary:"):
        totals = [int(v) for v in line.split()[1:]]
  return dict(zip(names, totals))


def main(argv: list[str]) -> None:
  if argv[1:2] == ["child"]:
    return simulate(int(argv[2]), argv[3] == "sim")
  if len(argv) not in (2, 3) or not all(a.isdigit() for a in argv[1:]):
    raise SystemExit(f"usage: sim_misses.py GPUS [LL_BYTES]; got {' '.join(argv[1:])!r}")
  if shutil.which("valgrind") is None:
    raise SystemExit("valgrind is not installed; install it (Debian: apt-get install valgrind) to count misses")
  if not os.path.exists(TUNED):
    raise SystemExit(f"{TUNED} is missing; write it first: PYTHONPATH=. .venv/bin/python benchmarks/scale_row.py tune")
  n, ll = int(argv[1]), int(argv[2]) if len(argv) == 3 else LL_DEFAULT
  with tempfile.TemporaryDirectory() as tmp:
    runs = {}
    for what in ("setup", "sim"):
      out = os.path.join(tmp, what)
      cmd = ["valgrind", "--tool=cachegrind", "--cache-sim=yes", f"--LL={ll},16,64", f"--cachegrind-out-file={out}",
             sys.executable, __file__, "child", str(n), what]
      runs[what] = (out, subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True))
    printed = {what: proc.communicate(timeout=3600)[0] for what, (_, proc) in runs.items()}
    for what, (_, proc) in runs.items():
      if proc.returncode:
        raise SystemExit(f"the {what} run under valgrind failed (exit {proc.returncode})")
    events = int(printed["sim"].split("EVENTS")[1].split()[0])
    setup, sim = summary(runs["setup"][0]), summary(runs["sim"][0])
  per = {k: (sim[k] - setup[k]) / events for k in sim}
  print(f"RESULT gpus={n} ll_bytes={ll} events={events} ir_per_event={per['Ir']:.0f} "
        f"d1_misses_per_event={per['D1mr'] + per['D1mw']:.1f} ll_misses_per_event={per['DLmr'] + per['DLmw']:.2f}",
        flush=True)


if __name__ == "__main__":
  main(sys.argv)
