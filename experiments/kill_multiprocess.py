r"""Kills one process of a decentralised ``multiprocess`` job at a random moment, ``--trials`` times, and checks
what the others did (CPU processes on loopback, one per node of ``--cluster``).

Each trial starts ``experiments.train --executor=multiprocess`` (no ``--fail``: the run is decentralised,
every PS shard with a backup in the next process), draws a process other than 0 (which hosts the
coordination service) and a number of lines, and SIGKILLs that process once its trace part holds that many
events. The trial passes when the job still ends with exit 0, its merged trace passes the checker, the
victim's virtual workers left and every other one pushed every wave, and every live copy of the PS shards
applied each pushed wave exactly once (the trace's ``applied`` lines equal the pushes, and no wave was pushed
twice). Draws come from ``--seed``, so a run is repeatable up to where the kill lands in the run's timing.

Writes a CSV and a JSON (one row per trial) and prints their paths; the last line is
``survived=<trials passed>/<trials>``::

  python -m experiments.kill_multiprocess --policy=NP --trials=8
  python -m experiments.kill_multiprocess --policy=HD --trials=4
"""

from __future__ import annotations

import collections
import dataclasses
import json
import os
import random
import signal
import subprocess
import sys
import time

from absl import flags

from experiments import common
from hetpipe_jax import check_trace, read_trace
from hetpipe_jax.cluster.lookup import get_cluster
from hetpipe_jax.runtime.transport.launch import child_environment

FLAGS = flags.FLAGS
flags.DEFINE_string("cluster", "hetero4", "Cluster preset or TOML file (one process per node).")
flags.DEFINE_string("policy", "NP", "Allocation policy of every trial (NP, ED or HD).")
flags.DEFINE_integer("trials", 8, "Trials, each one job with one process killed.")
flags.DEFINE_integer("waves", 30, "Waves per virtual worker in every job.")
flags.DEFINE_integer("d", 1, "WSP staleness bound D.")
flags.DEFINE_integer("max_lines", 160, "The kill comes once the victim's trace part holds 10 to this many events.")
flags.DEFINE_integer("seed", 0, "Seed of the draws (victim, moment).")
flags.DEFINE_float("timeout", 300, "Seconds before a job is killed for good (the trial fails).")
flags.DEFINE_string("out_dir", "outputs/kill_multiprocess", "Directory for every output.")


@dataclasses.dataclass(frozen=True)
class Job:
  """The training job of every trial (the flags of the same names)."""

  cluster: str
  policy: str
  d: int
  waves: int
  timeout: float


def trial(job_setting: Job, out_dir: str, victim: int, lines: int) -> dict:
  """One job with process ``victim`` SIGKILLed once its part holds ``lines`` events; returns its row."""
  cmd = [sys.executable, "-m", "experiments.train", "--executor=multiprocess", f"--cluster={job_setting.cluster}",
         "--dataset=synthetic", "--model=mlp", f"--policy={job_setting.policy}", f"--d={job_setting.d}",
         f"--waves={job_setting.waves}", f"--out_dir={out_dir}"]
  part = os.path.join(out_dir, f"trace.jsonl.part{victim}")
  job = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=child_environment())
  written = 0
  try:
    deadline = time.monotonic() + job_setting.timeout
    while time.monotonic() < deadline and job.poll() is None:
      if os.path.exists(part):
        with open(part, encoding="utf-8") as f:
          written = sum(1 for _ in f)
        if written >= lines:
          break
      time.sleep(0.05)
    pids = subprocess.run(["pgrep", "-f", "--", f"--out_dir={out_dir} .*--process_id={victim}"],
                          capture_output=True, text=True).stdout.split()
    killed = bool(pids) and job.poll() is None
    if killed:
      os.kill(int(pids[0]), signal.SIGKILL)
    _, err = job.communicate(timeout=job_setting.timeout)
  except subprocess.TimeoutExpired:
    err = "the job did not end in time"
  finally:
    job.kill()
    job.wait(timeout=30)
  row = {"victim": victim, "lines": written, "killed": killed, "exit": job.returncode, "checker": "", "left": [],
         "pushes": {}, "applied_once": False, "passed": False}
  trace = os.path.join(out_dir, "trace.jsonl")
  if job.returncode != 0 or not os.path.exists(trace):
    row["error"] = next((line for line in err.splitlines() if line.startswith("error")), err[-300:])
    return row
  events = read_trace(trace)
  violations = check_trace(events)
  pushes = collections.Counter(e["vw"] for e in events if e["ev"] == "push")
  waves = [(e["vw"], e["wave"]) for e in events if e["ev"] == "push"]
  applied = [e for e in events if e["ev"] == "applied"]
  left = sorted(e["vw"] for e in events if e["ev"] == "leave")
  row.update(checker="OK" if not violations else f"{len(violations)} violations: {violations[0]}", left=left,
             pushes={str(vw): n for vw, n in sorted(pushes.items())},
             applied_once=bool(applied) and len(waves) == len(set(waves))
             and all(e["waves"] == pushes[e["vw"]] for e in applied))
  live_done = all(n == job_setting.waves for vw, n in pushes.items() if vw not in left)
  row["passed"] = killed and not violations and bool(left) and live_done and row["applied_once"]
  return row


def main(argv):
  del argv
  rng = random.Random(FLAGS.seed)
  os.makedirs(FLAGS.out_dir, exist_ok=True)
  setting = Job(FLAGS.cluster, FLAGS.policy, FLAGS.d, FLAGS.waves, FLAGS.timeout)
  processes = get_cluster(FLAGS.cluster).num_nodes
  if processes < 2:
    raise SystemExit(f"error: --cluster={FLAGS.cluster} has {processes} node; a kill needs at least 2 (one "
                     "process per node, process 0 is never killed)")
  rows = []
  for t in range(FLAGS.trials):
    victim, lines = rng.randrange(1, processes), rng.randrange(10, FLAGS.max_lines + 1)
    row = trial(setting, os.path.join(FLAGS.out_dir, f"trial{t}"), victim, lines)
    rows.append({"trial": t, **row})
    print(f"trial {t}: process {victim} killed at {row['lines']} lines: exit {row['exit']}, checker "
          f"{row['checker'] or '-'}, left {row['left']}, pushes {row['pushes']}, every copy applied each pushed "
          f"wave once: {row['applied_once']} -> {'passed' if row['passed'] else 'FAILED'}", flush=True)
  header = ["trial", "victim", "lines", "exit", "checker", "left", "pushes", "applied_once", "passed"]
  csv_path = common.write_csv(os.path.join(FLAGS.out_dir, "kill_multiprocess.csv"), header,
                              ([json.dumps(r[k]) if isinstance(r[k], (list, dict)) else r[k] for k in header]
                               for r in rows))
  json_path = common.write_json(os.path.join(FLAGS.out_dir, "kill_multiprocess.json"),
                                {"cluster": FLAGS.cluster, "policy": FLAGS.policy, "waves": FLAGS.waves,
                                 "d": FLAGS.d, "seed": FLAGS.seed, "trials": rows})
  common.print_outputs([("csv", csv_path), ("json", json_path)], width=5)
  print(f"survived={sum(r['passed'] for r in rows)}/{len(rows)}")


cli = common.console(main)

if __name__ == "__main__":
  cli()
