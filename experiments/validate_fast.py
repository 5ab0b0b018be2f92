r"""Checks the ``sim`` executor's fast mode against the full event simulation (issue 12).

For every configuration of a scaling study (``scale.json`` of ``python -m experiments.scale``: each model
and cluster size with its grouping, cuts, Nm, D, placement and transfer model) up to ``--max_gpus``, runs
the full event simulation of all ``--waves`` waves and the fast mode (:mod:`hetpipe_jax.sim.steady`), and
reports the throughput error of the fast mode and the host seconds of both; both traces pass the WSP
checker. Writes validate_fast.json / .csv, prints a table, and exits with status 1 when an error is
above ``--max_error``::

  python -m experiments.scale && python -m experiments.validate_fast
  python -m experiments.validate_fast --study=outputs/scale/scale.json --max_gpus=256
"""

from __future__ import annotations

import json
import os
import time

from absl import flags

from experiments import common

FLAGS = flags.FLAGS
flags.DEFINE_string("study", "outputs/scale/scale.json", "The scaling study whose configurations to check.")
flags.DEFINE_integer("max_gpus", 1024, "Check the configurations of clusters up to this many GPUs.")
flags.DEFINE_integer("waves", 100, "Waves per virtual worker of both simulations.")
flags.DEFINE_float("max_error", 0.02, "Largest relative throughput error of the fast mode that passes.")
flags.DEFINE_string("out_dir", "outputs/validate_fast", "Where the JSON and CSV go.")


def layout_of(cluster, setting: dict):
  """The layout a study row ran: its GPUs in pipeline order, cuts, Nm and window per virtual worker."""
  from hetpipe_jax.plan.layout import Layout, VWLayout
  windows = setting.get("window") or setting["nm"]
  return Layout(tuple(VWLayout(tuple(cluster.gpus[i] for i in group), tuple(cuts), nm, w)
                      for group, cuts, nm, w in zip(setting["policy"], setting["cuts"], setting["nm"], windows)))


def check(row: dict) -> dict:
  """Both simulations of one study row: rates, error, host seconds."""
  from hetpipe_jax import get_cluster
  from hetpipe_jax.core.trace import Trace
  from hetpipe_jax.cost.profile import full_size_profiles
  from hetpipe_jax.sim import SimJob, SimOptions, simulate, simulate_fast
  setting = row["setting"]
  cluster = get_cluster(setting["cluster"])
  profiles = full_size_profiles(row["model"], setting["batch_size"], seq_len=setting["seq_len"])
  layout = layout_of(cluster, setting)
  options = SimOptions(overlap_transfers=setting["overlap_transfers"], staged_ps=setting.get("staged_ps", False))
  job = SimJob(cluster, profiles, layout, setting["d"], FLAGS.waves, setting["placement"],
               precision=setting["precision"], options=options)
  out = {"model": row["model"], "gpus": row["gpus"], "configuration": row["configuration"]}
  for mode in ("full", "fast"):
    trace = Trace()
    t0 = time.perf_counter()
    if mode == "full":
      seconds, _, _ = simulate(job, trace)
      out["full_simulated_waves"] = FLAGS.waves
    else:
      seconds, _, _, info = simulate_fast(job, trace)
      out["fast_method"], out["fast_simulated_waves"] = info["method"], max(info["simulated_waves"])
    out[f"{mode}_host_seconds"] = time.perf_counter() - t0
    common.require_wsp(trace.events, f"{mode} simulation of {row['model']} on {cluster.name}")
    out[f"{mode}_minibatches_per_sec"] = sum(layout.nms) * FLAGS.waves / seconds
  out["error"] = out["fast_minibatches_per_sec"] / out["full_minibatches_per_sec"] - 1
  return out


def main(argv):
  del argv
  if not os.path.exists(FLAGS.study):
    raise common.config_error(f"--study={FLAGS.study} does not exist; run `python -m experiments.scale` first "
                              "(it writes outputs/scale/scale.json) or point --study at its scale.json")
  with open(FLAGS.study, encoding="utf-8") as f:
    rows = [r for r in json.load(f)["rows"] if r["gpus"] <= FLAGS.max_gpus]
  if not rows:
    raise common.config_error(f"--max_gpus={FLAGS.max_gpus}: no configuration of {FLAGS.study} is that small")
  results = []
  for row in rows:
    common.progress("checking %s on %d GPUs", row["model"], row["gpus"])
    results.append(check(row))
    r = results[-1]
    common.progress("  error %+.3f%% (fast %s after %d waves, %.2f s; full %.2f s)", 100 * r["error"],
                    r["fast_method"], r["fast_simulated_waves"], r["fast_host_seconds"], r["full_host_seconds"])
  fields = ["model", "gpus", "error", "full_minibatches_per_sec", "fast_minibatches_per_sec", "fast_method",
            "fast_simulated_waves", "full_host_seconds", "fast_host_seconds", "configuration"]
  json_out = common.write_json(common.output_path(FLAGS.out_dir, "validate_fast.json"),
                               {"study": FLAGS.study, "waves": FLAGS.waves, "max_error": FLAGS.max_error,
                                "results": results})
  csv_out = common.write_csv(common.output_path(FLAGS.out_dir, "validate_fast.csv"), fields,
                             [[r[f] for f in fields] for r in results])
  print(f"{'model':>12} {'GPUs':>5} {'error':>8} {'method':>12} {'waves':>5} {'full s':>7} {'fast s':>7}")
  for r in results:
    print(f"{r['model']:>12} {r['gpus']:>5} {100 * r['error']:>+7.3f}% {r['fast_method']:>12} "
          f"{r['fast_simulated_waves']:>5} {r['full_host_seconds']:>7.2f} {r['fast_host_seconds']:>7.2f}")
  common.print_outputs([("json", json_out), ("csv", csv_out)])
  worst = max(results, key=lambda r: abs(r["error"]))
  print(f"max_abs_error={abs(worst['error']):.4f} ({worst['model']}, {worst['gpus']} GPUs) over "
        f"{len(results)} configurations; limit {FLAGS.max_error}")
  return 0 if abs(worst["error"]) <= FLAGS.max_error else 1


cli = common.console(main)

if __name__ == "__main__":
  cli()
