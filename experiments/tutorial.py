r"""Render the tutorial: execute docs/tutorial.py (a jupytext percent-format notebook) from start to end in a
fresh Jupyter kernel and write docs/tutorial.ipynb, the same cells with their outputs (plots embedded)::

  python -m experiments.tutorial            # renders docs/tutorial.ipynb; the notebook's files go to outputs/tutorial
  python -m experiments.tutorial --check    # executes it only: exit 1 on an error in a cell or over --budget_s

The kernel imports this checkout's package (the repository root first on its ``PYTHONPATH``) and runs in
``--run_dir`` (default: the repository root). ``tests/test_tutorial.py`` checks that the rendered notebook
matches its source and, in the slow run, executes it within its budget.
"""

from __future__ import annotations

import os
import time
from typing import Any

from absl import flags

from experiments import common

FLAGS = flags.FLAGS
flags.DEFINE_bool("check", False, "Execute the tutorial without writing docs/tutorial.ipynb.")
flags.DEFINE_string("run_dir", None, "The kernel's working directory (default: the repository root).")
flags.DEFINE_float("budget_s", 180.0, "Most seconds the whole notebook may take, kernel start included.")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SOURCE = os.path.join(ROOT, "docs", "tutorial.py")
RENDERED = os.path.join(ROOT, "docs", "tutorial.ipynb")


def execute_tutorial(run_dir: str, timeout_s: float) -> tuple[Any, float]:
  """Executes docs/tutorial.py in a new kernel working in ``run_dir``.

  Args:
    run_dir: the kernel's working directory (the notebook writes ``outputs/tutorial`` under it).
    timeout_s: most seconds any one cell may take.

  Returns:
    (the executed notebook with every cell's outputs, the seconds it took).

  Raises:
    nbclient.exceptions.CellExecutionError: naming the cell and its error, when a cell fails.
  """
  # Imported here, not at the top: jupytext, nbclient and nbformat are test extras (pyproject.toml), not the
  # package's dependencies; a plain install runs ``--help`` and imports this module without them.
  import jupytext  # pylint: disable=g-import-not-at-top
  from nbclient import NotebookClient  # pylint: disable=g-import-not-at-top

  notebook = jupytext.read(SOURCE)
  path = os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")]))
  client = NotebookClient(notebook, timeout=timeout_s, kernel_name="python3",
                          resources={"metadata": {"path": run_dir}})
  start = time.monotonic()
  client.execute(env={**os.environ, "PYTHONPATH": path})
  return notebook, time.monotonic() - start


def main(argv):
  del argv
  import nbformat  # pylint: disable=g-import-not-at-top  (a test extra, as in execute_tutorial)

  notebook, seconds = execute_tutorial(FLAGS.run_dir or ROOT, FLAGS.budget_s)
  print(f"tutorial: executed in {seconds:.1f} s (budget {FLAGS.budget_s:.0f} s)")
  if seconds > FLAGS.budget_s:
    raise SystemExit(f"error: the tutorial took {seconds:.1f} s, over its budget of {FLAGS.budget_s:.0f} s; "
                     "make its runs smaller (fewer waves, smaller models)")
  if not FLAGS.check:
    nbformat.write(notebook, RENDERED)
    common.print_outputs([("notebook", RENDERED)])


cli = common.console(main)

if __name__ == "__main__":
  cli()
