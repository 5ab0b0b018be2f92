r"""Validates the ``multiprocess`` executor against the ``sim`` executor's prediction, on loopback.

Each configuration runs as a real multi-process job (``experiments.train --executor=multiprocess``: one
process per node, decentralised: activations, gradients, pushes, pulls and the clock's control messages
through the transport) with every task padded to its emulated duration (``--time_scale=1``), and the
``sim`` executor predicts the same plan (same cluster, policy, Nm and D, so the same layout and cost
model). The configurations cover NP, ED and HD layouts, D = 0 and D > 0, 2 and 4 processes. The emulated
GPUs are slow enough that a task lasts tens of milliseconds, so the schedule, the Nm window and the WSP
gate set the pace, and what the prediction leaves out is the runtime's own overhead (each message's trip
between processes, the clock's and the owners' work on a push and a pull). Links are fast in the cluster
files (100 GB/s): loopback has no network to compare the contention model with. Every trace is checked
against the WSP guarantees.

Writes a CSV, a JSON and a PNG (measured vs. predicted images/s) and prints their paths; the last line is
``worst_error=<fraction>`` (goal: <= 0.10)::

  python -m experiments.validate_multiprocess
  python -m experiments.validate_multiprocess --speedup=3   # tasks 3x shorter (~2-80 ms)
"""

from __future__ import annotations

import os
import time

from absl import flags

from experiments import common

FLAGS = flags.FLAGS
flags.DEFINE_integer("waves", 12, "Waves per virtual worker in every configuration.")
flags.DEFINE_string("out_dir", "outputs/validate_multiprocess", "Directory for every output.")
flags.DEFINE_float("timeout", 600, "Seconds before one configuration's job is killed.")
flags.DEFINE_float("speedup", 1.0, "The emulated GPUs this many times faster (tasks this many times shorter: "
                   "the runtime's own cost weighs more).")

GOAL = 0.10  # the largest acceptable relative error of a prediction
NM = "max_fit"  # the planner's Nm rule in both runs (the train CLI's default with --policy)

# Emulated GPU types (flop/s; memory is no limit for the MLP): a stage task lasts ~5-240 ms.
TYPES = {"fast": 2.4e7, "mid": 1.8e7, "slow": 1.2e7, "whimpy": 0.9e7}
# name -> the GPU types of each node (one process per node)
CLUSTERS = {
    "two": [["fast", "fast"], ["slow", "slow"]],
    "four": [["fast", "fast"], ["mid", "mid"], ["slow", "slow"], ["whimpy", "whimpy"]],
}
# (cluster, policy, D)
CONFIGS = [
    ("two", "NP", 0),
    ("two", "ED", 1),
    ("four", "NP", 1),
    ("four", "ED", 0),
    ("four", "ED", 2),
    ("four", "HD", 0),
    ("four", "HD", 1),
]


def cluster_toml(name: str, nodes: list[list[str]]) -> str:
  """A cluster file: the emulated types, fast links, ``nodes``."""
  lines = [f'name = "{name}"', "[links]", 'intra_node = {gbytes_per_s = 100, latency_us = 1}',
           'inter_node = {gbytes_per_s = 100, latency_us = 1}']
  if not FLAGS.speedup > 0:
    raise common.config_error(f"--speedup={FLAGS.speedup}: give a factor > 0")
  for gpu, flops in TYPES.items():
    tflops = flops * FLAGS.speedup / 1e12
    lines += [f"[gpu_types.{gpu}]", "memory_gib = 8", f"fp32_tflops = {tflops!r}", f"fp16_tflops = {tflops!r}",
              "bandwidth_gbytes_per_s = 1000", "efficiency = 1.0"]
  for gpus in nodes:
    lines += ["[[nodes]]", "gpus = [" + ", ".join(f'"{g}"' for g in gpus) + "]"]
  return "\n".join(lines) + "\n"


def run_job(cluster_path: str, policy: str, d: int, out_dir: str) -> dict:
  """One multi-process job on loopback; returns its summary (raises SystemExit with its error if it failed)."""
  return common.run_train_job(
      ["--executor=multiprocess", f"--cluster={cluster_path}", f"--policy={policy}", f"--nm={NM}", f"--d={d}",
       f"--waves={FLAGS.waves}", "--time_scale=1", "--model=mlp", "--dataset=synthetic",
       f"--eval_every={FLAGS.waves}"], out_dir, FLAGS.timeout)


def plot(rows: list[dict], path: str) -> None:
  plt = common.pyplot()
  fig, ax = plt.subplots(figsize=(8, 3.6))
  xs = range(len(rows))
  ax.bar([x - 0.2 for x in xs], [r["measured"] for r in rows], 0.4, label="measured (multiprocess, padded)")
  ax.bar([x + 0.2 for x in xs], [r["predicted"] for r in rows], 0.4, label="predicted (sim)")
  ax.set_xticks(list(xs), [f"{r['processes']}p {r['policy']} D={r['d']}" for r in rows], fontsize=8)
  ax.set_ylabel("images/s (emulated speeds)")
  ax.legend(fontsize=8)
  ax.grid(alpha=0.3, axis="y")
  common.save_figure(fig, path)


def main(argv):
  del argv
  from hetpipe_jax import RunConfig, get_model, read_trace, run_hetpipe, synthetic
  from hetpipe_jax.plan.allocation import parse_policy

  os.makedirs(FLAGS.out_dir, exist_ok=True)
  paths = {}
  for name, nodes in CLUSTERS.items():
    paths[name] = os.path.join(FLAGS.out_dir, f"{name}.toml")
    with open(paths[name], "w", encoding="utf-8") as f:
      f.write(cluster_toml(name, nodes))
  model, data = get_model("mlp"), synthetic()
  print(f"{'procs':>5} {'policy':>6} {'D':>2} {'VWs x stages':>14} {'Nm':>8} {'measured':>9} {'predicted':>9} "
        f"{'error':>7}")
  rows, worst = [], 0.0
  for i, (name, policy, d) in enumerate(CONFIGS):
    common.progress("configuration %d/%d: %s, %s, D=%d", i + 1, len(CONFIGS), name, policy, d)
    job_dir = os.path.join(FLAGS.out_dir, f"{name}_{policy}_d{d}")
    t = time.perf_counter()
    summary = run_job(paths[name], policy, d, job_dir)
    host = time.perf_counter() - t
    events = read_trace(os.path.join(job_dir, "trace.jsonl"))
    common.require_wsp(events, f"multiprocess run {name} {policy} D={d}")
    predicted = run_hetpipe(model, data, RunConfig.of(
        cluster=paths[name], policy=parse_policy(policy), nm=NM, d=d, waves=FLAGS.waves, executor="sim"))
    common.require_wsp(predicted.events, f"sim run {name} {policy} D={d}")
    planned = (predicted.events[0]["cuts"], predicted.events[0]["nm"])
    if planned != (summary["cuts"], summary["nm"]):
      raise SystemExit(f"error: the sim planned (cuts, Nm) {planned}, the job ran {summary['cuts'], summary['nm']}")
    measured = summary["images_per_second"]
    error = abs(predicted.images_per_second - measured) / measured
    worst = max(worst, error)
    row = {"cluster": name, "processes": len(CLUSTERS[name]), "policy": policy, "d": d,
           "stages": summary["stages"], "nm": summary["nm"], "measured": measured,
           "predicted": predicted.images_per_second, "error": error, "host_seconds": host}
    rows.append(row)
    print(f"{row['processes']:>5} {policy:>6} {d:>2} {len(row['stages']):>5} x {str(row['stages']):>6} "
          f"{str(row['nm']):>8} {measured:9.1f} {predicted.images_per_second:9.1f} {error:7.1%}", flush=True)
  outputs = [("csv", common.write_dict_csv(os.path.join(FLAGS.out_dir, "validate_multiprocess.csv"), rows)),
             ("json", common.write_json(os.path.join(FLAGS.out_dir, "validate_multiprocess.json"),
                                        {"waves": FLAGS.waves, "goal": GOAL, "worst_error": worst, "rows": rows})),
             ("plot", os.path.join(FLAGS.out_dir, "validate_multiprocess.png"))]
  plot(rows, outputs[-1][1])
  print(f"images/s at the emulated speeds (multiprocess: CPU processes on loopback, tasks padded to the "
        f"emulated durations); goal: every error <= {GOAL:.0%} ({'met' if worst <= GOAL else 'MISSED'})")
  common.print_outputs(outputs)
  print(f"worst_error={worst:.4f}")


cli = common.console(main)

if __name__ == "__main__":
  cli()
