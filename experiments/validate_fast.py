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

from absl import flags

from experiments import common
from hetpipe_jax.studies.scale import row_from_json
from hetpipe_jax.studies.validate_fast import FastCheck, FastConfig, validate_fast, worst

FLAGS = flags.FLAGS
flags.DEFINE_string("study", "outputs/scale/scale.json", "The scaling study whose configurations to check.")
flags.DEFINE_integer("max_gpus", FastConfig.max_gpus, "Check the configurations of clusters up to this many GPUs.")
flags.DEFINE_integer("waves", FastConfig.waves, "Waves per virtual worker of both simulations.")
flags.DEFINE_float("max_error", FastConfig.max_error, "Largest relative throughput error of the fast mode that "
                   "passes.")
flags.DEFINE_string("out_dir", "outputs/validate_fast", "Where the JSON and CSV go.")

FIELDS = ("model", "gpus", "error", "full_minibatches_per_sec", "fast_minibatches_per_sec", "fast_method",
          "fast_simulated_waves", "full_host_seconds", "fast_host_seconds", "configuration")


def config_from_flags() -> FastConfig:
  """The check's configuration: the rows of --study and the flags."""
  if not os.path.exists(FLAGS.study):
    raise common.config_error(f"--study={FLAGS.study} does not exist; run `python -m experiments.scale` first "
                              "(it writes outputs/scale/scale.json) or point --study at its scale.json")
  with open(FLAGS.study, encoding="utf-8") as f:
    rows = tuple(row_from_json(r) for r in json.load(f)["rows"])
  return FastConfig(rows, max_gpus=FLAGS.max_gpus, waves=FLAGS.waves, max_error=FLAGS.max_error,
                    study=FLAGS.study)


def print_table(checks: list[FastCheck]) -> None:
  print(f"{'model':>12} {'GPUs':>5} {'error':>8} {'method':>12} {'waves':>5} {'full s':>7} {'fast s':>7}")
  for c in checks:
    print(f"{c.model:>12} {c.gpus:>5} {100 * c.error:>+7.3f}% {c.fast_method:>12} "
          f"{c.fast_simulated_waves:>5} {c.full_host_seconds:>7.2f} {c.fast_host_seconds:>7.2f}")


def main(argv):
  del argv
  config = config_from_flags()
  checks = validate_fast(config)
  json_out = common.write_json(common.output_path(FLAGS.out_dir, "validate_fast.json"),
                               {"study": FLAGS.study, "waves": config.waves, "max_error": config.max_error,
                                "results": [c._asdict() for c in checks]})
  csv_out = common.write_csv(common.output_path(FLAGS.out_dir, "validate_fast.csv"), FIELDS,
                             [[getattr(c, f) for f in FIELDS] for c in checks])
  print_table(checks)
  common.print_outputs([("json", json_out), ("csv", csv_out)])
  w = worst(checks)
  print(f"max_abs_error={abs(w.error):.4f} ({w.model}, {w.gpus} GPUs) over {len(checks)} configurations; "
        f"limit {config.max_error}")
  return 0 if abs(w.error) <= config.max_error else 1


cli = common.console(main)

if __name__ == "__main__":
  cli()
