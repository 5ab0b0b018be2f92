"""The dependency rule: every package imports only the layers below it (BUILD_NOTES.md, map of the code).

  core            imports nothing of hetpipe_jax but errors
  precision       (the precisions' registry) likewise
  cluster         + precision
  cost            + core, models, optim, precision
  plan            + cluster, cost
  runtime, sim    + plan (sim: never runtime; runtime: never sim)
  api, baselines, viz, the CLI shims: anything
"""

import ast
import pathlib

import pytest

import hetpipe_jax

ROOT = pathlib.Path(hetpipe_jax.__file__).parent
BASE = {"errors"}
ALLOWED = {
    "core": BASE | {"core"},
    "models": BASE | {"models"},
    "optim": BASE | {"optim"},
    "data": BASE | {"data"},
    "precision": BASE | {"precision"},
    "cluster": BASE | {"cluster", "precision"},
    "cost": BASE | {"cost", "cluster", "models", "optim", "core", "precision"},
    "plan": BASE | {"plan", "cost", "cluster", "models", "optim", "core", "precision"},
    "sim": BASE | {"sim", "plan", "cost", "cluster", "models", "optim", "core", "precision"},
    "runtime": BASE | {"runtime", "plan", "cost", "cluster", "models", "optim", "core", "data", "evaluate",
                       "precision"},
}


def imported_packages(path: pathlib.Path) -> set[str]:
  """The first component after ``hetpipe_jax.`` of every import in ``path``."""
  out = set()
  for node in ast.walk(ast.parse(path.read_text())):
    names = []
    if isinstance(node, ast.ImportFrom) and node.module:
      names = [node.module] + [f"{node.module}.{a.name}" for a in node.names] if node.module == "hetpipe_jax" \
          else [node.module]
    elif isinstance(node, ast.Import):
      names = [a.name for a in node.names]
    for name in names:
      parts = name.split(".")
      if parts[0] == "hetpipe_jax" and len(parts) > 1:
        out.add(parts[1])
  return out


@pytest.mark.parametrize("layer", sorted(ALLOWED))
def test_layer_imports_only_what_is_below(layer):
  files = list((ROOT / layer).rglob("*.py")) if (ROOT / layer).is_dir() else [ROOT / f"{layer}.py"]
  assert files
  for path in files:
    bad = imported_packages(path) - ALLOWED[layer]
    assert not bad, f"{path.relative_to(ROOT)} imports {sorted(bad)}; {layer} may import {sorted(ALLOWED[layer])}"


def test_the_rule_sees_a_breach(tmp_path):
  bad = tmp_path / "x.py"
  bad.write_text("from hetpipe_jax.runtime.ps import ParameterServer\nimport hetpipe_jax.sim.network\n")
  assert imported_packages(bad) == {"runtime", "sim"}
