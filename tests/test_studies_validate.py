"""hetpipe_jax.studies' validations as library calls: the sim executor against padded wall runs (one small case),
the multi-process validation's plumbing with a job run in process (the sim itself, so every error is 0), and
the published validation's JSON records."""

import os

import pytest

from hetpipe_jax import ConfigError, RunConfig, get_cluster, get_model, run_hetpipe, synthetic
from hetpipe_jax.errors import RunStopped
from hetpipe_jax.plan.allocation import parse_policy
from hetpipe_jax.studies import published as vp
from hetpipe_jax.studies.validate_multiprocess import (
  CASES,
  CLUSTERS,
  TYPES,
  MultiprocessCase,
  MultiprocessCheck,
  MultiprocessConfig,
  cluster_toml,
  validate_multiprocess,
)
from hetpipe_jax.studies.validate_sim import SPEEDS, SimCase, SimCheck, SimValidationConfig, case_cluster, validate_sim


@pytest.mark.slow  # a padded wall run: its stage programs compile, its tasks last their emulated time
def test_the_sim_validation_runs_each_case_on_both_executors():
  case = SimCase(2, (1, 2), (1, 2), 1, ("fast", "whimpy"))
  assert SimValidationConfig().devices == 6 and case.stages_per_vw == [1, 2]
  cluster = case_cluster(case)
  assert [[g.type.name for g in cluster.node_gpus(n)] for n in range(2)] == [["fast"], ["whimpy", "whimpy"]]
  assert cluster.gpus[0].type.fp32_flops == SPEEDS["fast"]
  (check,) = validate_sim(SimValidationConfig(waves=2, cases=(case,)))
  assert type(check) is SimCheck and check.case == case and check.measured > 0 and check.predicted > 0
  assert check.error == pytest.approx(abs(check.predicted - check.measured) / check.measured)


def _in_process_job(flags, out_dir):
  """A stand-in for the multi-process job: the same plan on the sim executor, its trace in ``out_dir``."""
  given = dict(f[2:].split("=", 1) for f in flags)
  assert given["executor"] == "multiprocess" and given["time_scale"] == "1"
  os.makedirs(out_dir, exist_ok=True)
  result = run_hetpipe(get_model("mlp"), synthetic(), RunConfig.of(
      cluster=given["cluster"], policy=parse_policy(given["policy"]), nm=given["nm"], d=int(given["d"]),
      waves=int(given["waves"]), executor="sim", trace_path=os.path.join(out_dir, "trace.jsonl")))
  meta = result.events[0]
  return {"cuts": meta["cuts"], "nm": meta["nm"], "stages": meta["stages"],
          "images_per_second": result.images_per_second}


def test_the_multiprocess_validation_compares_each_job_with_the_sim(tmp_path):
  cases = (MultiprocessCase("two", "ED", 1), MultiprocessCase("four", "HD", 0))
  seen = []
  checks = validate_multiprocess(MultiprocessConfig(str(tmp_path), waves=3, cases=cases), _in_process_job,
                                 seen.append)
  assert checks == seen and [type(c) for c in checks] == [MultiprocessCheck] * 2
  assert [(c.cluster, c.processes, c.policy, c.d) for c in checks] == [("two", 2, "ED", 1), ("four", 4, "HD", 0)]
  assert all(c.error == 0 and c.measured == c.predicted > 0 for c in checks)
  assert (tmp_path / "four_HD_d0" / "trace.jsonl").exists()
  wrong = lambda flags, out: {**_in_process_job(flags, out), "nm": [99]}
  with pytest.raises(RunStopped, match=r"the sim planned \(cuts, Nm\) .* the job ran "):
    validate_multiprocess(MultiprocessConfig(str(tmp_path), waves=3, cases=cases[:1]), wrong)


def test_the_emulated_clusters_are_the_types_at_the_speedup(tmp_path):
  assert {c.cluster for c in CASES} == set(CLUSTERS)
  path = tmp_path / "four.toml"
  path.write_text(cluster_toml("four", CLUSTERS["four"], 3.0))
  cluster = get_cluster(str(path))
  assert cluster.num_nodes == 4 and cluster.gpus[0].type.fp32_flops == pytest.approx(3 * TYPES["fast"])
  with pytest.raises(ConfigError, match=r"--speedup=0.0: give a factor > 0"):
    MultiprocessConfig(str(tmp_path), speedup=0.0)


def test_an_entry_writes_its_optional_fields_only_where_set():
  row = vp.Row("x", "c", "s", "a", "V100 SXM2", 1, 1, "nvlink2", "", "mxnet", "resnet50", 64, 0, 0, "fp32", 400.0,
               "images_per_sec", None, 0, None, "")
  (entry,) = vp.evaluate([row], vp.fit_efficiency([row], []))
  assert entry.reason == "system 'mxnet' not modelled" and entry.simulated is None
  doc = vp.entry_json(entry)
  assert list(doc) == [*vp.Row._fields, "simulated", "error", "reason", "fitted"]
  scaled = entry._replace(simulated=0.8, error=0.1, memory_model_holds=False, published_scaling=0.9,
                          simulated_scaling=0.8, scaling_error=-0.1)
  assert list(vp.entry_json(scaled))[-4:] == list(vp.OPTIONAL)
  stats = vp.summary([scaled, entry])
  assert stats.held_out.cases == 1 and stats.not_run == 1 and stats.held_out.worst_scaling_error == 0.1
  assert vp.summary_json(stats)["per_category"] == {"c": stats.held_out._asdict()}
