"""Every bad configuration raises one ConfigError naming the value, the limit and the fix."""

import subprocess
import sys

import pytest

from hetpipe_jax import ConfigError, RunConfig, get_model, load_dataset, run_hetpipe, synthetic
from hetpipe_jax.cluster import CLASS_D, GpuType, make_cluster
from hetpipe_jax.models.zoo import MODELS

from helpers import assert_trace_ok

DATA = synthetic(num_train=512, num_test=64)
MLP = get_model("mlp")  # 4 units


@pytest.mark.parametrize("config,pattern", [
    (dict(nm=0), r"Nm=0 for virtual worker 0; Nm .* must be >= 1"),
    (dict(nm=(2, -1)), r"Nm=-1 for virtual worker 1"),
    (dict(d=-1), r"D=-1; the clock distance bound must be >= 0"),
    (dict(num_vws=0), r"num_vws=0; at least 1"),
    (dict(num_vws=3, stages=3), r"3 virtual workers with \[3, 3, 3\] stages need 9 GPUs, but cluster "
                                r"'hetero4' has 8; use fewer"),
    (dict(stages=5), r"virtual worker 0 has 5 stages but model mlp has only 4 units to cut; use at most 4"),
    (dict(stages=0), r"virtual worker 0 has 0 stages; every virtual worker needs at least 1"),
    (dict(stages=(1, 2, 3)), r"stages has 3 values \[1, 2, 3\] for 2 virtual workers"),
    (dict(cluster="dgx"), r"unknown cluster 'dgx'; known clusters: datacenter256, hetero4, hetero4x4, paper_half"),
    (dict(batch_size=30), r"batch_size=30 does not divide the 512 training examples of synthetic \(2 would "
                          r"be left over each epoch\); use a divisor such as 8, 16, 32.*--drop_remainder"),
    (dict(batch_size=0), r"batch_size=0 must be between 1 and the 512 training examples"),
    (dict(weight_mode="fresh"), r"unknown weight_mode 'fresh'; choose one of stash, latest"),
    (dict(executor="gpu"), r"unknown executor 'gpu'; choose one of virtual, wall, sim"),
    (dict(waves=0), r"waves=0; run at least 1 wave"),
    (dict(eval_every=0), r"eval_every=0; evaluate every 1 or more global clock ticks"),
    (dict(time_scale=-1.0), r"time_scale=-1.0; use 0 \(no padding\) or a positive factor"),
    (dict(cuts=[[0, 3, 3, 4], [0, 2, 4]], stages=(3, 2)), r"cuts \[0, 3, 3, 4\] of virtual worker 0 must be 4 "
                                                          r"increasing boundaries"),
    (dict(cuts=[[0, 2, 4]] * 3), r"cuts has 3 entries for 2 virtual workers; give one list for all"),
    (dict(seed=-5), r"seed=-5; use a seed in \[0, 2\*\*63 - 1\]"),
    (dict(schedule="pipedream"), r"unknown schedule 'pipedream'; choose one of 1f1b, fifo, gpipe"),
    (dict(window=3), r"window=3 with Nm=2; the window \(most minibatches in flight\) must be between 1 and "
                     r"Nm=2"),
    (dict(window=0), r"window=0 with Nm=2; the window .* must be between 1 and Nm=2"),
    (dict(window=(1, 1, 1)), r"window has 3 values \[1, 1, 1\] for 2 virtual workers; give one value, or one "
                             r"per virtual worker"),
])
def test_bad_config(config, pattern):
  base = dict(cluster="hetero4", num_vws=2, stages=2, nm=2, d=1, waves=2, batch_size=16)
  with pytest.raises(ConfigError, match=pattern):
    run_hetpipe(MLP, DATA, RunConfig.of(**{**base, **config}))


@pytest.mark.slow
def test_one_cut_list_serves_every_virtual_worker():
  result = run_hetpipe(MLP, DATA, RunConfig.of(cluster="hetero4", num_vws=2, stages=2, nm=2, d=1, waves=2,
                                            batch_size=16, cuts=[[0, 1, 4]]))
  assert_trace_ok(result.events)
  assert result.events[0]["cuts"] == [[0, 1, 4], [0, 1, 4]]


def test_batch_size_that_does_not_divide_runs_with_drop_remainder():
  result = run_hetpipe(MLP, DATA, RunConfig.of(cluster="hetero4", num_vws=1, stages=1, nm=1, d=0, waves=2,
                                            batch_size=30, drop_remainder=True))
  assert_trace_ok(result.events)
  assert len(result.metrics) == 2


def test_stage_that_fits_no_gpu():
  tiny = GpuType("tiny", memory_bytes=100_000, fp32_flops=1e12, fp16_flops=1e12, mem_bytes_per_s=1e11)
  cluster = make_cluster("tiny", [[tiny, CLASS_D]])
  with pytest.raises(ConfigError, match=r"stage 0 of virtual worker 0 \(units 0..1\) needs .* KiB with Nm=2 in "
                                        r"flight \(stash, recompute=none\), but GPU n0.tiny.0 has 97.7 KiB; "
                                        r"use more stages"):
    run_hetpipe(MLP, DATA, RunConfig.of(cluster=cluster, num_vws=1, stages=2, nm=2, d=0, waves=1,
                                     batch_size=16, cuts=[[0, 2, 4]]))
  with pytest.raises(ConfigError, match=r"no partition of the model over 2 GPUs \(n0.tiny.0, n0.D.1\) fits in "
                                        r"memory with Nm=2: the least-loaded cut still needs \d+.\d KiB on "
                                        r"n0.tiny.0 \(tiny, 97.7 KiB\)"):
    run_hetpipe(MLP, DATA, RunConfig.of(cluster=cluster, num_vws=1, stages=2, nm=2, d=0, waves=1,
                                     batch_size=16))


def test_unknown_model_and_dataset():
  with pytest.raises(ConfigError) as raised:
    get_model("bert")
  message = str(raised.value)
  assert message.startswith("unknown model 'bert'; known models: cnn, gpt, ") and "\n" not in message
  assert message.split(": ", 1)[1] == ", ".join(sorted(MODELS))  # every model, in order
  with pytest.raises(ConfigError, match="unknown dataset 'imagenet'; known datasets: auto, fashion_mnist"):
    load_dataset("imagenet")


@pytest.mark.slow  # (10-28 s: the README's test command keeps under 10 minutes; .ci/run runs it)
def test_cli_reports_bad_input_in_one_line():
  proc = subprocess.run([sys.executable, "-m", "experiments.train", "--nm=0", "--waves=1"],
                        capture_output=True, text=True, timeout=300)
  assert proc.returncode != 0
  assert "Nm=0 for virtual worker 0; Nm (minibatches in flight) must be >= 1" in proc.stderr
  assert "Traceback" not in proc.stderr


def test_a_cluster_file_whose_numbers_overflow_once_scaled(tmp_path):
  path = tmp_path / "big.toml"
  path.write_text('[gpu_types.X]\nmemory_gib = 12\nfp32_tflops = 1e300\nbandwidth_gbytes_per_s = 600\n'
                  '[[nodes]]\ngpus = ["X", "X"]\n')
  with pytest.raises(ConfigError, match=r"gpu_types.'X'.fp32_tflops = 1e\+300 is over the limit of 1e\+06 "
                                        r"\(Tflop/s\); give the value in that unit"):
    run_hetpipe(MLP, DATA, RunConfig.of(cluster=str(path), num_vws=1, stages=2, nm=1, waves=1, batch_size=16))


def test_a_padding_that_cannot_finish_is_refused_and_options_of_other_executors_too():
  with pytest.raises(ConfigError, match=r"time_scale=1e\+12 pads this run to at least .* s of wall time \(its "
                                        r"emulated time x 1e\+12\), over the 86400 s a padded run may take: use "
                                        r"time_scale <= "):
    run_hetpipe(MLP, DATA, RunConfig.of(cluster="hetero4", num_vws=1, stages=2, nm=1, waves=1, batch_size=16,
                                        executor="wall", time_scale=1e12))
  with pytest.raises(ConfigError, match=r"time_scale=2.0 pads the tasks of the wall and multiprocess executors; "
                                        r"the virtual executor runs on a virtual clock: drop time_scale"):
    run_hetpipe(MLP, DATA, RunConfig.of(num_vws=1, stages=2, waves=1, batch_size=16, time_scale=2.0))
  with pytest.raises(ConfigError, match=r"RunConfig has no field 'dd'"):
    RunConfig.of(dd=1)


@pytest.mark.parametrize("args, message", [
    (["--executor=multiprocess", "--num_processes=0"], "--num_processes=0; a job has at least 1 process"),
    (["--num_processes=2"], "--num_processes join a multi-process job, but --executor=virtual"),
    (["--executor=multiprocess", "--process_id=1"], "--process_id and --num_processes join a job through its "
                                                     "coordinator: give --coordinator_address"),
])
@pytest.mark.slow
def test_cli_refuses_process_flags_it_would_not_use(args, message):
  proc = subprocess.run([sys.executable, "-m", "experiments.train", *args, "--waves=1"], capture_output=True,
                        text=True, timeout=300)
  assert proc.returncode != 0
  assert message in proc.stderr and "Traceback" not in proc.stderr
