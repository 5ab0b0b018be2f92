"""The trace tools on bad input and on runs the meta line cannot rebuild (issue 36): one line, a non-zero
exit; the efficiency CLI takes the run's cluster file and model factory."""

import json

import pytest

from hetpipe_jax import RunConfig, check_trace, get_cluster, get_model, run_hetpipe, synthetic
from hetpipe_jax.core import check
from hetpipe_jax.core.trace import read_trace, write_trace
from hetpipe_jax.efficiency import main as efficiency_main
from hetpipe_jax.errors import ConfigError

from helpers import assert_trace_ok, one_minibatch_trace

FACTORY = "examples.residual_mlp:model"


def _one_error_line(capsys) -> str:
  err = capsys.readouterr().err
  assert err.count("\n") == 1 and err.startswith("error: ") and "Traceback" not in err, err
  return err


@pytest.mark.parametrize("field, value, message", [
    ("vw", "zero", "vw = 'zero' must be a whole number"),
    ("t0", "soon", "t0 = 'soon' must be a number"),
    ("glob", [0.5], r"glob = \[0.5\] must be a list of whole numbers"),
    ("mb", True, "mb = True must be a whole number"),
])
def test_a_field_of_the_wrong_type_is_one_line_naming_it(tmp_path, capsys, field, value, message):
  events = one_minibatch_trace()
  line = next(n for n, ev in enumerate(events) if field in ev)
  events[line] = {**events[line], field: value}
  path = tmp_path / "t.jsonl"
  write_trace(str(path), events)
  with pytest.raises(ConfigError, match=f"line {line + 1} of .*: {events[line]['ev']} event: {message}"):
    read_trace(str(path))
  assert check.main(["check", str(path)]) == 2
  assert f"line {line + 1}" in _one_error_line(capsys)
  # events handed over in memory: a format violation on that line, not a TypeError
  violations = check_trace(events)
  assert violations[0].line == line + 1 and violations[0].rule == "format", violations


def test_a_bad_meta_field_is_a_format_violation():
  events = one_minibatch_trace()
  events[0] = {**events[0], "d": "one"}
  assert [(v.line, v.rule) for v in check_trace(events)] == [(1, "format")]


def test_efficiency_of_a_trace_of_only_its_meta_line_fails_in_one_line(tmp_path, capsys):
  path = tmp_path / "t.jsonl"
  write_trace(str(path), one_minibatch_trace()[:1])
  assert efficiency_main(["efficiency", str(path)]) == 2
  assert "no event after its meta line" in _one_error_line(capsys)
  assert not (tmp_path / "t.efficiency.png").exists()


def test_efficiency_takes_the_runs_cluster_file_and_model_factory(tmp_path, capsys):
  """A run of a user's model on a cluster from a file: without them, no cost model (tasks count as compute,
  no link time); with --cluster and --model, link time over the 10 GbE link between the nodes, and
  efficiency."""
  toml = tmp_path / "lab.toml"
  toml.write_text('name = "lab"\n[links]\ninter_node = "eth10"\n[[nodes]]\ngpus = ["TITAN V"]\n[[nodes]]\n'
                  'gpus = ["RTX 2060"]\n')
  result = run_hetpipe(get_model(FACTORY), synthetic(num_train=128), RunConfig.of(
      cluster=get_cluster(str(toml)), executor="sim", num_vws=1, stages=2, nm=2, waves=2, batch_size=16))
  assert_trace_ok(result.events)
  path = tmp_path / "t.jsonl"
  write_trace(str(path), result.events)
  assert efficiency_main(["efficiency", str(path)]) == 0
  assert "no cost model" in capsys.readouterr().out
  bare = json.loads((tmp_path / "t.efficiency.json").read_text())
  assert "efficiency" not in bare and all(share["link"] == 0 for share in bare["shares"])
  assert efficiency_main(["efficiency", str(path), f"--cluster={toml}", f"--model={FACTORY}"]) == 0
  report = json.loads((tmp_path / "t.efficiency.json").read_text())
  assert report["note"] is None and 0 < report["efficiency"] < 1
  assert all(share["link"] > 0 for share in report["shares"])  # both stages receive over eth10
  capsys.readouterr()
  assert efficiency_main(["efficiency", str(path), f"--cluster={toml}", "--model=examples.residual_mlp:nope"]) == 2
  assert "nope" in _one_error_line(capsys)
  assert efficiency_main(["efficiency", str(path), "--clustre=x.toml"]) == 2
  assert "--clustre=x.toml is not an option" in _one_error_line(capsys)
