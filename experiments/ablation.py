r"""What costs HetPipe its examples (:mod:`hetpipe_jax.studies.ablation`): examples to a fixed test accuracy
against the number of virtual workers N, the wave length Nm and the clock distance bound D, one at a time
around a base point, with the parameter server's pushes summed (``add``, the paper's rule) or averaged
(``avg``), each point at the best local learning rate of one log-spaced grid.

Writes ablation.json (every point and every run with its curve), ablation.csv (the points) and ablation.png
(examples to target against each factor, one line per rule), and prints one table::

  python -m experiments.ablation
  python -m experiments.ablation --seeds=0,1,2 --epochs=2 --out_dir=outputs/ablation_3seeds
"""

from __future__ import annotations

from absl import flags

from experiments import common, run_flags
from hetpipe_jax import get_cluster
from hetpipe_jax.studies.ablation import FACTORS, RULES, AblationConfig, AblationResult, run_ablation
from hetpipe_jax.studies.convergence_config import TARGET_METRICS
from hetpipe_jax.studies.convergence_target import Target

FLAGS = flags.FLAGS
# The run settings the ablation takes (experiments.run_flags), at its defaults: the MLP on Fashion-MNIST with
# plain SGD (cheap enough for every point at every rate), the paper's 16-GPU testbed.
run_flags.define(["model", "dataset", "cluster", "batch_size", "optimizer"],
                 overrides={"model": "mlp", "cluster": "paper_testbed", "optimizer": "sgd"})
flags.adopt_module_key_flags(run_flags)  # --help lists them
_DEFAULTS = AblationConfig(get_cluster("paper_testbed"))
flags.DEFINE_float("epochs", _DEFAULTS.epochs, "Examples every run sees, in epochs.")
flags.DEFINE_list("seeds", list(map(str, _DEFAULTS.seeds)), "Every point once per seed.")
flags.DEFINE_list("lrs", list(map(str, _DEFAULTS.lrs)), "The local learning rates every point is trained at.")
flags.DEFINE_float("target_accuracy", _DEFAULTS.target_accuracy, "The test accuracy whose examples are counted "
                   "(--target_metric=loss: the test loss).")
flags.DEFINE_enum("target_metric", _DEFAULTS.target_metric, list(TARGET_METRICS), "What the target is on: the test "
                  "accuracy, or the test loss (language models).")
flags.DEFINE_integer("smooth", _DEFAULTS.smooth, "Evaluations in the trailing mean of the accuracy.")
flags.DEFINE_integer("eval_examples", _DEFAULTS.eval_examples, "Evaluate about every this many examples.")
flags.DEFINE_integer("eval_test_examples", _DEFAULTS.eval_test_examples, "Test examples each evaluation takes, "
                     "evenly spread over the test split (0: all of it).")
flags.DEFINE_list("base", [str(_DEFAULTS.base_vws), str(_DEFAULTS.base_nm), str(_DEFAULTS.base_d)],
                  "The base point: N,Nm,D.")
flags.DEFINE_list("vws", list(map(str, _DEFAULTS.vws)), "Virtual workers N of the N sweep (one GPU each).")
flags.DEFINE_list("nms", list(map(str, _DEFAULTS.nms)), "Wave lengths Nm of the Nm sweep.")
flags.DEFINE_list("ds", list(map(str, _DEFAULTS.ds)), "Clock distance bounds D of the D sweep.")
flags.DEFINE_string("rules", ";".join(RULES), "The rules compared, separated by ';': --ps_optimizer specs (add: "
                    "summed; avg: x its share; delayed_nesterov; heloco; keys as in --ps_optimizer), or local_sgd"
                    "[:lr=0.7,momentum=0.9] (synchronous local SGD at the point: N workers of H = Nm steps).")
flags.DEFINE_string("out_dir", "outputs/ablation", "Where the JSON, CSV and plot go.")


def flags_to_config() -> AblationConfig:
  """The ablation's configuration from the flags (a bad value refused in one line)."""
  base = common.parse_ints("base", FLAGS.base)
  if len(base) != 3:
    raise common.config_error(f"--base={','.join(FLAGS.base)}; give N,Nm,D, e.g. 4,4,0")
  return AblationConfig(
      get_cluster(FLAGS.cluster), model=FLAGS.model, dataset=FLAGS.dataset, batch_size=FLAGS.batch_size,
      optimizer=FLAGS.optimizer, epochs=FLAGS.epochs, seeds=tuple(common.parse_ints("seeds", FLAGS.seeds)),
      lrs=common.parse_floats("lrs", FLAGS.lrs, "numbers, e.g. 0.01,0.02,0.04"),
      target_accuracy=FLAGS.target_accuracy, target_metric=FLAGS.target_metric, smooth=FLAGS.smooth,
      eval_examples=FLAGS.eval_examples, eval_test_examples=FLAGS.eval_test_examples,
      base_vws=base[0], base_nm=base[1], base_d=base[2],
      vws=tuple(common.parse_ints("vws", FLAGS.vws)), nms=tuple(common.parse_ints("nms", FLAGS.nms)),
      ds=tuple(common.parse_ints("ds", FLAGS.ds)), rules=tuple(r.strip() for r in FLAGS.rules.split(";") if r.strip()))


def main(argv):
  del argv
  config = flags_to_config()
  common.ensure_devices(config.cluster.num_gpus)
  result = run_ablation(config, lambda line: common.progress("%s", line))
  paths = write_outputs(result, FLAGS.out_dir)
  report(result)
  common.print_outputs(paths, width=5)


def write_outputs(result: AblationResult, out_dir: str) -> list[tuple[str, str]]:
  """ablation.json, ablation.csv (the points) and ablation.png: (kind, path) of each."""
  json_path = common.write_json(common.output_path(out_dir, "ablation.json"), result.to_json())
  fields = list(result.points[0]._fields) if result.points else []
  csv_path = common.write_csv(common.output_path(out_dir, "ablation.csv"), fields,
                              ([getattr(p, f) for f in fields] for p in result.points))
  png_path = common.output_path(out_dir, "ablation.png")
  plot(result, png_path)
  return [("json", json_path), ("csv", csv_path), ("plot", png_path)]


def report(result: AblationResult) -> None:
  """The table: per factor and value, each rule's examples to target at its best learning rate."""
  c = result.config
  print(f"examples to {c.target_accuracy:g} {Target(c.target_metric).what} ({result.dataset}, {c.model}, smoothed "
        f"over {c.smooth} evaluations; {c.epochs:g} epochs; seeds {list(c.seeds)}; base N={c.base_vws} "
        f"Nm={c.base_nm} D={c.base_d}; each point at its best learning rate of {', '.join(f'{x:g}' for x in c.lrs)})")
  print(f"{'factor':>6} {'value':>5}  " + "  ".join(f"{rule + ': examples (lr)':>24}" for rule in c.rules))
  for factor in FACTORS:
    values = dict.fromkeys(p.value for p in result.points if p.factor == factor)
    for value in values:
      cells = []
      for rule in c.rules:
        p = next(p for p in result.points if (p.factor, p.value, p.rule) == (factor, value, rule))
        got = (f"{p.examples_to_target:.0f}" if p.examples_to_target is not None else
               f"missed ({p.final_smoothed:.3f})")
        cells.append(f"{got + f' ({p.best_lr:g})':>24}")
      print(f"{factor:>6} {value:>5}  " + "  ".join(cells))
  print("missed: no learning rate of the grid reached the target on every seed (the best final smoothed value)")


def plot(result: AblationResult, path: str) -> None:
  """Examples to target against each factor (log x), one line per rule; a point that missed the target is an x
  on the line of the run's budget (it needs more examples than every run sees)."""
  plt = common.pyplot()
  fig, axes = plt.subplots(1, len(FACTORS), figsize=(5 * len(FACTORS), 4))
  labels = {"vws": "virtual workers N", "nm": "wave length Nm", "d": "clock distance bound D"}
  for ax, factor in zip(axes, FACTORS, strict=True):
    for rule in result.config.rules:
      points = [p for p in result.points if p.factor == factor and p.rule == rule]
      reached = [p for p in points if p.examples_to_target is not None]
      line, = ax.plot([p.value for p in reached], [p.examples_to_target for p in reached], "o-", label=rule)
      missed = [p.value for p in points if p.examples_to_target is None]
      ax.plot(missed, [result.budget] * len(missed), "x", color=line.get_color(), ms=9)
    ax.axhline(result.budget, color="grey", lw=0.8, ls=":", label="every run's examples (x: missed)")
    ax.set(xlabel=labels[factor], ylabel="examples to target (best learning rate)", xscale="symlog")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
  c = result.config
  fig.suptitle(f"{c.model} on {result.dataset}, target {c.target_accuracy:g}; {c.cluster.name}", fontsize=9)
  common.save_figure(fig, path)


cli = common.console(main)

if __name__ == "__main__":
  cli()
