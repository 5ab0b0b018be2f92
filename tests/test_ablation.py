"""The ablation of what costs HetPipe its examples (:mod:`hetpipe_jax.studies.ablation`): its sweeps go through
the base point, each point is reported at its best learning rate, bad settings are one line, and a small
ablation runs with every trace checked."""

import pytest

from hetpipe_jax import ConfigError, get_cluster
from hetpipe_jax.optim import PSOptimizer
from hetpipe_jax.studies.ablation import AblationConfig, AblationRun, best_point, is_local, outer_of, run_ablation
from hetpipe_jax.studies.convergence_target import Target

TESTBED = get_cluster("paper_testbed")


def test_each_sweep_varies_one_factor_around_the_base():
  config = AblationConfig(TESTBED, base_vws=4, base_nm=2, base_d=1, vws=(1, 4), nms=(2, 8), ds=(0,))
  assert config.points() == [("vws", 1, 1, 2, 1), ("vws", 4, 4, 2, 1), ("nm", 2, 4, 2, 1), ("nm", 8, 4, 8, 1),
                             ("d", 0, 4, 2, 0)]


@pytest.mark.parametrize("change, message", [
    ({"seeds": ()}, r"^--seeds=; give one or more seeds$"),
    ({"lrs": (0.1, 0.0)}, r"^--lrs=0.1,0.0; give one or more learning rates > 0$"),
    ({"vws": (1, 32)}, r"^--vws=1,32: 32 virtual workers of one GPU each need 32 GPUs and cluster 'paper_testbed' "
                       r"has 16; give smaller counts or a larger --cluster$"),
    ({"rules": ("add", "sum")}, r"^--rules: ps_optimizer='sum': unknown optimizer 'sum'; choose one of add, .*; give "
                                r"ps_optimizer specs or local_sgd\[:lr=X,momentum=M\], separated by ';'$"),
    ({"rules": ("local_sgd:lr=0",)}, r"^--rules: ps_optimizer='nesterov:lr=0': lr=0.0; the outer learning rate"),
    ({"target_accuracy": 1.5}, r"^--target_accuracy=1.5; give in \(0, 1\] for an accuracy, > 0 for a loss$"),
    ({"target_accuracy": -1.0, "target_metric": "loss"}, r"^--target_accuracy=-1.0; give in \(0, 1\] for an"),
    ({"target_metric": "perplexity"}, r"^--target_metric=perplexity; give one of accuracy, loss$"),
    ({"ds": (-1,)}, r"^--ds=-1; give bounds D >= 0$"),
    ({"eval_test_examples": -5}, r"^--eval_test_examples=-5; give >= 0 \(0: all of it\)$"),
])
def test_bad_settings_are_one_line(change, message):
  with pytest.raises(ConfigError, match=message):
    AblationConfig(TESTBED, **change)


def _run(lr, seed, examples, final=0.8):
  return AblationRun(4, 4, 0, "add", lr, seed, examples, final, 0.0, [])


def test_a_rule_is_a_ps_optimizer_spec_or_local_sgd_with_its_outer_step():
  assert outer_of("delayed_nesterov:lr=0.5") == PSOptimizer("delayed_nesterov", 0.5, 0.9)
  assert outer_of("local_sgd") == PSOptimizer("nesterov", 0.7, 0.9)  # DiLoCo's outer step by default
  assert outer_of("local_sgd:lr=1,momentum=0") == PSOptimizer("nesterov", 1.0, 0.0)
  assert is_local("local_sgd:lr=1") and not is_local("avg")


def test_a_point_is_its_best_rate_among_those_every_seed_reached_the_target_with():
  runs = [_run(0.01, 0, 900.0), _run(0.01, 1, 1100.0),  # mean 1000, both seeds
          _run(0.02, 0, 500.0), _run(0.02, 1, None),  # faster on seed 0, missed on seed 1
          _run(0.04, 0, 800.0), _run(0.04, 1, 1000.0)]  # mean 900: the best of those both seeds reached
  point = best_point("vws", 4, runs)
  assert (point.best_lr, point.examples_to_target, point.missed) == (0.04, 900.0, 0)


def test_a_loss_target_ranks_the_rates_that_missed_by_the_lowest_final_loss():
  runs = [_run(0.01, 0, None, 2.1), _run(0.02, 0, None, 1.9), _run(0.04, 0, None, 2.4)]
  assert best_point("d", 0, runs, Target("loss")).best_lr == 0.02
  assert best_point("d", 0, runs).best_lr == 0.04  # (an accuracy: the highest)


def test_a_point_no_rate_reached_is_reported_at_its_best_final_accuracy():
  point = best_point("d", 0, [_run(0.01, 0, None, 0.6), _run(0.02, 0, None, 0.7), _run(0.04, 0, None, 0.65)])
  assert (point.best_lr, point.examples_to_target, point.missed, point.final_smoothed) == \
      (0.02, None, 1, 0.7)


@pytest.mark.slow
def test_a_small_ablation_counts_examples_to_target_and_shares_the_base_run():
  config = AblationConfig(get_cluster("hetero4"), dataset="digits", epochs=2.0, lrs=(0.1,), target_accuracy=0.5,
                          eval_examples=200, base_vws=2, base_nm=2, vws=(1, 2), nms=(2,), ds=(0, 1),
                          rules=("add", "avg", "local_sgd"))
  result = run_ablation(config)
  # 3 rules x the points N=1, the base (N=2, Nm=2, D=0: in every sweep, trained once per rule) and D=1, which
  # local SGD does not have (its D=1 point is its base run)
  assert len(result.runs) == 8 and len(result.points) == 15
  local = [p for p in result.points if p.rule == "local_sgd"]
  assert {p.d for p in local} == {0} and all(p.examples_to_target is not None for p in local)
  single = [p for p in result.points if p.vws == 1 and p.rule != "local_sgd"]
  assert single[0].examples_to_target == single[1].examples_to_target  # one virtual worker: avg is add
  assert all(p.examples_to_target is not None for p in result.points)
  assert result.to_json()["points"][0]["factor"] == "vws"


@pytest.mark.slow
def test_a_run_that_diverges_is_a_miss_not_the_end_of_the_ablation():
  config = AblationConfig(get_cluster("hetero4"), dataset="digits", epochs=1.0, lrs=(1e6, 0.1), target_accuracy=0.5,
                          eval_examples=200, base_vws=2, base_nm=2, vws=(2,), nms=(2,), ds=(0,), rules=("add",))
  result = run_ablation(config)
  diverged = [r for r in result.runs if r.lr == 1e6]
  assert len(diverged) == 1 and diverged[0].diverged and diverged[0].examples_to_target is None
  assert all(p.best_lr == 0.1 and p.examples_to_target is not None for p in result.points)
