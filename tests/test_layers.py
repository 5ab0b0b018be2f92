"""The dependency rule: every package imports only the layers below it (BUILD_NOTES.md, map of the code).

  core            imports nothing of hetpipe_jax but errors
  precision       (the precisions' registry) likewise
  recompute       (the activation recomputation modes and their jax.checkpoint policies) likewise
  corpus          (the text corpus's byte pipeline) likewise
  data            + corpus
  cluster         + precision
  tensor          (tensor parallelism: the mesh of a stage and the PartitionSpecs of its weights) likewise
  models          + recompute, tensor
  cost            + core, models, optim, precision, recompute, tensor
  plan            + cluster, cost
  runtime, sim    + plan (sim: never runtime; runtime: never sim)
  api, baselines, viz, the CLI shims: anything

and, inside each package, no import cycle between its modules: not at module level, not in a function
(where one once hid), not under ``TYPE_CHECKING``.
"""

import ast
import pathlib
import subprocess
import sys

import pytest

import hetpipe_jax

ROOT = pathlib.Path(hetpipe_jax.__file__).parent
BASE = {"errors"}
ALLOWED = {
    "core": BASE | {"core"},
    "models": BASE | {"models", "recompute", "tensor"},
    "tensor": BASE | {"tensor"},
    "optim": BASE | {"optim"},
    "corpus": BASE | {"corpus"},
    "data": BASE | {"data", "corpus"},
    "precision": BASE | {"precision"},
    "recompute": BASE | {"recompute"},
    "cluster": BASE | {"cluster", "precision"},
    "cost": BASE | {"cost", "cluster", "models", "optim", "core", "precision", "recompute", "tensor"},
    "plan": BASE | {"plan", "cost", "cluster", "models", "optim", "core", "precision", "recompute", "tensor"},
    "sim": BASE | {"sim", "plan", "cost", "cluster", "models", "optim", "core", "precision", "recompute", "tensor"},
    "runtime": BASE | {"runtime", "plan", "cost", "cluster", "models", "optim", "core", "data", "evaluate",
                       "precision", "recompute", "tensor"},
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
  bad.write_text("from hetpipe_jax.runtime.numerics.ps import ParameterServer\nimport hetpipe_jax.sim.network\n")
  assert imported_packages(bad) == {"runtime", "sim"}


def module_graph(root: pathlib.Path, top: str = "hetpipe_jax") -> dict[str, set[str]]:
  """Module -> the modules of ``top`` (the package at ``root``) it imports: at module level, inside
  functions, under ``TYPE_CHECKING``, alike (a ``from P import m`` of a submodule ``m`` imports ``P.m``)."""
  paths = {".".join([top, *p.relative_to(root).with_suffix("").parts]).removesuffix(".__init__"): p
           for p in root.rglob("*.py")}
  modules = set(paths)
  def resolve(name: str) -> str | None:  # the longest prefix of ``name`` that is a module
    parts = name.split(".")
    return next((".".join(parts[:k]) for k in range(len(parts), 0, -1) if ".".join(parts[:k]) in modules), None)
  graph: dict[str, set[str]] = {}
  for module, path in paths.items():
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
      names = []
      if isinstance(node, ast.ImportFrom):
        base = node.module or ""
        if node.level:
          base = ".".join([*package.split(".")[:len(package.split(".")) - node.level + 1], *filter(None, [base])])
        names = [f"{base}.{a.name}" for a in node.names]
      elif isinstance(node, ast.Import):
        names = [a.name for a in node.names]
      out |= {m for m in map(resolve, names) if m is not None}
    graph[module] = out - {module}
  return graph


def package_of(module: str) -> str:
  """``hetpipe_jax.cost.profile`` -> ``cost`` (a top-level module is its own package)."""
  return module.split(".")[1] if "." in module else module


def cycles_inside_packages(graph: dict[str, set[str]]) -> list[list[str]]:
  """The import cycles among modules of one package: each strongly connected component of the graph of
  same-package imports with more than one module (Tarjan), sorted."""
  edges = {m: sorted(t for t in ts if package_of(t) == package_of(m)) for m, ts in graph.items()}
  index: dict[str, int] = {}
  low: dict[str, int] = {}
  stack: list[str] = []
  found: list[list[str]] = []
  def visit(m: str) -> None:
    index[m] = low[m] = len(index)
    stack.append(m)
    for t in edges.get(m, ()):
      if t not in index:
        visit(t)
        low[m] = min(low[m], low[t])
      elif t in stack:
        low[m] = min(low[m], index[t])
    if low[m] == index[m]:
      component = []
      while not component or component[-1] != m:
        component.append(stack.pop())
      if len(component) > 1:
        found.append(sorted(component))
  for m in sorted(edges):
    if m not in index:
      visit(m)
  return sorted(found)


def test_no_import_cycle_inside_a_package():
  cycles = cycles_inside_packages(module_graph(ROOT))
  assert not cycles, "import cycles (module-level or in a function): " + "; ".join(" <-> ".join(c) for c in cycles)


def test_the_cycle_rule_sees_a_cycle_hidden_in_a_function(tmp_path):
  pkg = tmp_path / "pkg"
  (pkg / "sub").mkdir(parents=True)
  (pkg / "__init__.py").write_text("")
  (pkg / "sub" / "__init__.py").write_text("from pkg.sub.a import A\n")
  (pkg / "sub" / "a.py").write_text("from pkg.sub import b\nA = 1\n")  # a submodule by `from package import`
  (pkg / "sub" / "b.py").write_text("def f():\n  from pkg.sub.c import C\n  return C\n")  # hidden in a function
  (pkg / "sub" / "c.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n  from pkg.sub.a import A\n"
                                    "C = 2\n")
  (pkg / "d.py").write_text("from pkg.sub.a import A\n")  # another package: imports, no cycle
  (pkg / "e.py").write_text("from . import d\n")  # relative
  graph = module_graph(pkg, "pkg")
  assert graph["pkg.sub.a"] == {"pkg.sub.b"} and graph["pkg.sub.b"] == {"pkg.sub.c"}
  assert graph["pkg.e"] == {"pkg.d"}
  assert cycles_inside_packages(graph) == [["pkg.sub.a", "pkg.sub.b", "pkg.sub.c"]]
  (pkg / "sub" / "b.py").write_text("def f():\n  return 1\n")
  assert cycles_inside_packages(module_graph(pkg, "pkg")) == []


def test_importing_any_module_starts_no_thread():
  """Nothing runs at import: every module of the package, and the training CLI, imported in a fresh process,
  leave it with its main thread alone (the pull pool of the multi-process transport starts with its first pull)."""
  code = ("import importlib, pkgutil, threading, hetpipe_jax, experiments.train\n"
          "names = [m.name for m in pkgutil.walk_packages(hetpipe_jax.__path__, 'hetpipe_jax.')]\n"
          "for name in names: importlib.import_module(name)\n"
          "print(len(names), sorted(t.name for t in threading.enumerate()))\n")
  out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                       cwd=ROOT.parent, check=True).stdout.split(maxsplit=1)
  assert int(out[0]) > 100 and out[1].strip() == "['MainThread']", out
