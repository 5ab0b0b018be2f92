"""Console scripts find a module in the working directory, as ``python -m`` does (issue 36).

An installed script (``.venv/bin/hetpipe-plan``) is ``sys.path[0] = <bin dir>; from experiments.plan import
cli; cli()``. The scripts in the venv point at the main checkout through its editable install, so to test
this tree's code the test runs the same thing through ``python -c``: ``sys.path[0]`` set to the bin directory
(where a script has it, instead of the working directory), this tree first on ``PYTHONPATH``, the working
directory a temporary folder holding a tiny model module.
"""

import json
import os
import shutil
import subprocess
import sys

from hetpipe_jax.runtime.transport.launch import child_environment

from helpers import ROOT

SCRIPT = ("import sys; sys.path[0] = {bin!r}; from {module} import {attr}; sys.argv = {argv!r}; {attr}()")


def run_script(cwd, target: str, argv: list[str]) -> subprocess.CompletedProcess:
  module, attr = target.split(":")
  code = SCRIPT.format(bin=os.path.dirname(sys.executable), module=module, attr=attr, argv=argv)
  env = {**child_environment(), "PYTHONPATH": ROOT}
  return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=cwd, env=env)


def test_hetpipe_plan_finds_a_model_module_in_the_working_directory(tmp_path):
  shutil.copy(os.path.join(ROOT, "examples", "residual_mlp.py"), tmp_path / "mymodel.py")
  with open(os.path.join(ROOT, "pyproject.toml"), encoding="utf-8") as f:
    assert 'hetpipe-plan = "experiments.plan:cli"' in f.read()  # what the installed script runs
  proc = run_script(tmp_path, "experiments.plan:cli", ["hetpipe-plan", "--model=mymodel:model", "--cluster=hetero4",
                                                       "--policy=ED", "--nosimulate", "--out=plan.json"])
  assert proc.returncode == 0, proc.stderr[-2000:]
  assert json.loads((tmp_path / "plan.json").read_text())["model"] == "mymodel:model"
