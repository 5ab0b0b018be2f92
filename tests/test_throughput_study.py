"""The throughput study end to end (``experiments.throughput``, in its own process): one table per model with
every peer and HetPipe row, and the goodput marks and headline from convergence.json files."""

import csv
import json
import os
import subprocess
import sys

import pytest

from experiments.common import batch_profiles
from hetpipe_jax import ConfigError, get_cluster
from hetpipe_jax.studies.throughput import run_throughput
from hetpipe_jax.studies.throughput_goodput import goodput
from hetpipe_jax.studies.throughput_records import TableEntry, ThroughputConfig
from hetpipe_jax.systems import rule_lr

ENV = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
ROWS = ["horovod", "hetero_dp", "sync_pipeline", "local_sgd", "HetPipe NP D=0", "HetPipe ED D=0", "HetPipe HD D=0",
        "HetPipe tuned", "HetPipe tuned for images/s", "HetPipe tuned + outer"]
ENTRY = {"model", "row", "system", "config", "objective", "gpus", "images_per_sec", "throughput", "unit",
         "ideal_images_per_sec", "efficiency", "mfu", "ratio_to_best_peer", "goodput", "time_to_target_s", "reason",
         "signature"}


def run_study(*args: str, timeout: int = 300) -> subprocess.CompletedProcess:
  proc = subprocess.run([sys.executable, "-m", "experiments.throughput", *args], capture_output=True, text=True,
                        timeout=timeout, env=ENV)
  assert proc.returncode == 0, proc.stderr[-3000:]
  return proc


def convergence_file(path, cluster: str, missed: dict[str, int], staleness: bool = True) -> str:
  """A hand-written convergence.json for the cnn's time model on ``cluster``: one summary entry per row of
  ``missed`` (row -> seeds that missed of 3)."""
  summary = {f"{row} (entry)": {"row": row, "seeds": [0, 1, 2], "missed": n, "gpus": 4,
                                "mean_time_to_target_s": None if n else 10.0 + i}
             for i, (row, n) in enumerate(missed.items())}
  doc = {"target_accuracy": 0.87, "time_axis": f"cost model of cnn (batch 32) on {cluster}", "cluster": cluster,
         "summary": summary, "runs": [{"name": name, "system": "x", "row": s["row"], "seed": 0,
                                       "time_to_target_s": s["mean_time_to_target_s"]} for name, s in summary.items()]}
  if staleness:
    doc["staleness_model"] = {"images0": 50_000.0, "beta": 0.05, "target_accuracy": 0.87}
  path.write_text(json.dumps(doc))
  return str(path)


@pytest.mark.slow
def test_table_goodput_marks_and_headline(tmp_path):
  """cnn on paper_mini with a matching convergence file (and one of another cluster, ignored): every row, the
  columns, the marks, the headline the fastest row that reaches; mlp without data: the one-line note."""
  marks = {"horovod": 0, "hetero_dp": 0, "local_sgd": 0, "HetPipe HD D=0": 0, "HetPipe ED D=0": 0,
           "HetPipe tuned": 1, "HetPipe tuned for images/s": 2, "HetPipe tuned + outer": 3, "sync_pipeline": 1}
  other = convergence_file(tmp_path / "other.json", "paper_testbed", dict.fromkeys(ROWS, 3))
  mine = convergence_file(tmp_path / "mine.json", "paper_mini", marks)
  out = tmp_path / "out"
  proc = run_study("--cluster=paper_mini", "--models=cnn,mlp", "--waves=6", "--ds=0", "--sub_studies=",
                   f"--convergence={other},{mine}", f"--out_dir={out}")
  doc = json.loads((out / "throughput.json").read_text())
  assert doc["cluster"] == "paper_mini" and doc["convergence"] == [other, mine] and doc["rows"] == []
  cnn, mlp = doc["models"]["cnn"], doc["models"]["mlp"]
  for model in (cnn, mlp):
    table = model["table"]
    assert [e["row"] for e in table] == ROWS
    assert all(set(e) == ENTRY for e in table)
    assert all(e["images_per_sec"] > 0 and e["reason"] is None for e in table)  # every system runs on paper_mini
    best_peer = max(e["images_per_sec"] for e in table if e["system"] != "hetpipe")
    fastest = {}
    for e in table:
      if e["system"] not in fastest or e["images_per_sec"] > fastest[e["system"]]["images_per_sec"]:
        fastest[e["system"]] = e
    assert {k: b["row"] for k, b in model["breakdowns"].items()} == {k: e["row"] for k, e in fastest.items()}
    for b in model["breakdowns"].values():  # every GPU's time is in one category: the means add up to 1
      assert sum(b["shares"].values()) == pytest.approx(1.0) and b["shares"]["compute"] > 0
    per_example = table[0]["mfu"] / table[0]["images_per_sec"]  # the model's flops over the cluster's peak
    for e in table:
      assert e["mfu"] == pytest.approx(e["images_per_sec"] * per_example) and 0 < e["mfu"] < 1
      assert e["efficiency"] == pytest.approx(e["images_per_sec"] / e["ideal_images_per_sec"])
      assert e["ratio_to_best_peer"] == pytest.approx(e["images_per_sec"] / best_peer)
      assert e["throughput"] == e["images_per_sec"] and e["unit"] == "images"
    tuned = {e["row"]: e for e in table}
    assert tuned["HetPipe tuned + outer"]["images_per_sec"] == tuned["HetPipe tuned"]["images_per_sec"]
    assert tuned["HetPipe tuned for images/s"]["images_per_sec"] >= max(
        e["images_per_sec"] for e in table if e["row"].startswith("HetPipe") and "D=" in e["row"])
  assert cnn["convergence"] == [mine] and mlp["convergence"] == []
  goodput = {e["row"]: e["goodput"] for e in cnn["table"]}
  assert goodput == {row: ("not trained" if row not in marks else "misses" if marks[row] else "reaches")
                     for row in ROWS}
  assert {e["row"]: e["objective"] for e in cnn["table"] if e["objective"]} == {
      "HetPipe tuned": "time_to_accuracy", "HetPipe tuned for images/s": "throughput",
      "HetPipe tuned + outer": "time_to_accuracy"}  # the matching file's staleness model ranks the tuned row
  reaching = max((e for e in cnn["table"] if e["goodput"] == "reaches"), key=lambda e: e["images_per_sec"])
  fastest = max(cnn["table"], key=lambda e: e["images_per_sec"])
  assert fastest["goodput"] == "misses"  # so the headline is not merely the fastest row
  assert cnn["headline"]["row"] == reaching["row"] and cnn["headline"]["goodput_known"]
  assert cnn["headline"]["fastest"] == fastest["row"]
  assert all(e["goodput"] == "not trained" for e in mlp["table"])
  assert mlp["headline"]["row"] == max(mlp["table"], key=lambda e: e["images_per_sec"])["row"]
  assert not mlp["headline"]["goodput_known"]
  lines = proc.stdout.splitlines()
  heads = [i for i, line in enumerate(lines) if line.startswith("headline, ")]
  assert len(heads) == 2 and lines[heads[-1] + 1].startswith("json ")  # the headlines last, before the paths
  assert lines[heads[0]].startswith(f"headline, cnn: the fastest row that reaches the target 0.87: {reaching['row']},")
  assert lines[heads[1]].startswith("headline, mlp: no convergence data for mlp on paper_mini")
  assert "goodput unknown" in lines[heads[1]]
  assert any(line.startswith(f"fastest overall, cnn: {fastest['row']},") for line in lines)
  with open(out / "throughput.csv", newline="") as f:
    assert [r["row"] for r in csv.DictReader(f)] == ROWS * 2
  assert (out / "throughput_table.png").stat().st_size > 10_000


def test_without_convergence_data_and_rows_that_cannot_run(tmp_path):
  """No convergence file: the one-line note; GPT-2 XL on 4 small GPUs: every row shows why it cannot run,
  in tokens/s; --ds and --sub_studies shape what runs."""
  out = tmp_path / "out"
  proc = run_study("--cluster=paper_mini", "--models=mlp,gpt2-xl", "--waves=4", "--ds=0,2", "--sub_studies=nm",
                   "--nm_max=2", "--notuned", "--convergence=", f"--out_dir={out}")
  doc = json.loads((out / "throughput.json").read_text())
  assert doc["convergence"] == []
  mlp, gpt = doc["models"]["mlp"], doc["models"]["gpt2-xl"]
  rows = ROWS[:4] + [f"HetPipe {p} D={d}" for p in ("NP", "ED", "HD") for d in (0, 2)]
  assert [e["row"] for e in mlp["table"]] == rows and [e["row"] for e in gpt["table"]] == rows
  assert all(e["images_per_sec"] > 0 for e in mlp["table"])
  assert gpt["unit"] == "tokens" and gpt["batch_size"] == 8 and gpt["per_example"] == 1024  # --gpt_batch_size
  assert all(e["images_per_sec"] is None and e["throughput"] is None and e["reason"] for e in gpt["table"])
  assert gpt["headline"]["row"] is None and gpt["best_peer"] is None
  assert {(r["model"], r["study"]) for r in doc["rows"]} == {("mlp", "nm")}
  assert mlp["headline"]["goodput_known"] is False
  assert "headline, mlp: no convergence data for mlp on paper_mini (read: none); goodput unknown" in proc.stdout
  assert "horovod                      cannot run: horovod: no worker" in proc.stdout
  assert (out / "throughput_nm.png").exists() and not (out / "throughput_whimpy.png").exists()


@pytest.mark.slow  # 13 s here: the paper testbed with its tuner and sub-studies
def test_paper_testbed_study(tmp_path):
  proc = run_study("--models=vgg19", "--waves=20", "--nm_max=3", "--convergence=", f"--out_dir={tmp_path}",
                   timeout=600)
  doc = json.loads((tmp_path / "throughput.json").read_text())
  table = doc["models"]["vgg19"]["table"]
  assert [e["row"] for e in table] == ROWS[:4] + [f"HetPipe {p} D={d}" for p in ("NP", "ED", "HD")
                                                   for d in (0, 4, 32)] + ROWS[7:]
  assert all(e["images_per_sec"] > 0 and 0 < e["efficiency"] < 1 for e in table)
  assert len({e["ideal_images_per_sec"] for e in table}) == 1  # every row: the whole cluster's ideal
  tuned = next(e for e in table if e["row"] == "HetPipe tuned for images/s")
  assert tuned["images_per_sec"] >= max(e["images_per_sec"] for e in table if "D=" in e["row"])
  rows = doc["rows"]
  assert {r["study"] for r in rows} == {"nm", "closed_form", "whimpy"}  # the sub-studies, outside the table
  assert all(set(r) == {"model", "study", "config", "gpus", "nm", "d", "transfers", "images_per_sec",
                        "ideal_images_per_sec", "efficiency"} and r["images_per_sec"] > 0 for r in rows)
  for name in ("throughput.csv", "throughput_rows.csv", "throughput_table.png", "throughput_nm.png",
               "throughput_whimpy.png"):
    assert (tmp_path / name).stat().st_size > 0 and str(tmp_path / name) in proc.stdout


def test_goodput_marks_only_the_configuration_that_was_trained():
  runs = [{"row": "HetPipe ED D=0", "system": "hetpipe", "nm": [4, 4], "d": 0, "seed": s, "time_to_target_s": t}
          for s, t in ((0, 10.0), (1, 14.0))]
  runs += [{"row": "hetero_dp", "system": "hetero_dp", "batch_sizes": [40, 24], "local_steps": [1, 1], "seed": 0,
            "time_to_target_s": None, "nm": [1]}]
  docs = [{"runs": runs, "summary": {}}]
  assert goodput(docs, "HetPipe ED D=0", [[4, 4], 0]) == ("reaches", 12.0)
  assert goodput(docs, "HetPipe ED D=0", [[5, 4], 0])[0].startswith("not trained (the convergence study trained")
  assert goodput(docs, "hetero_dp", [[40, 24], [1, 1]]) == ("misses", None)
  assert goodput(docs, "sync_pipeline", [[64], [1]]) == ("not trained", None)


def test_learning_rate_rule_scales_linearly_or_with_the_square_root():
  assert rule_lr(128) == pytest.approx(0.08)  # 0.02 per 32 examples, x 4
  assert rule_lr(128, 0.002, "sqrt") == pytest.approx(0.004)  # x sqrt(4)
  assert rule_lr(8, 0.002, "sqrt") == pytest.approx(0.001)


def test_the_study_as_library_code_returns_typed_records():
  """run_throughput on a typed configuration (no flags): its table entries, sub-study rows and headline are
  records, and a bad configuration is refused in one line before anything runs."""
  cluster = get_cluster("paper_mini")
  for bad, words in (({"ds": ()}, "--ds=; give one or more"), ({"sub_studies": ("nm", "x")}, "--sub_studies=nm,x"),
                     ({"batch_size": 0}, "--batch_size=0")):
    with pytest.raises(ConfigError, match=words):
      ThroughputConfig(cluster, **bad)
  config = ThroughputConfig(cluster, models=("mlp",), waves=4, ds=(0,), sub_studies=("closed_form",), tuned=False,
                            systems=("hetero_dp",))
  result = run_throughput(config, batch_profiles)
  mlp, = result.models
  assert [e.row for e in mlp.table] == ["hetero_dp", "HetPipe NP D=0", "HetPipe ED D=0", "HetPipe HD D=0"]
  assert all(isinstance(e, TableEntry) and e.images_per_sec for e in mlp.table)
  assert mlp.best_peer is mlp.table[0] and mlp.table[0].ratio_to_best_peer == 1.0
  assert mlp.headline.fastest == max(mlp.table, key=lambda e: e.images_per_sec or 0).row
  assert [r.study for r in result.rows] == ["closed_form"] and result.to_json()["models"]["mlp"]["table"][0] == \
      mlp.table[0]._asdict()
