"""The tutorial: docs/tutorial.py (jupytext, percent format) and docs/tutorial.ipynb, the same cells rendered
with their outputs. The rendered notebook must match its source and hold a complete, error-free run; the
slow test executes the source from start to end within its time budget.

Render it again after changing the source: ``.venv/bin/python -m experiments.tutorial``.
"""

import pathlib

import jupytext
import matplotlib
import nbformat
import pytest

from experiments.tutorial import execute_tutorial
from hetpipe_jax.core.breakdown import shares, time_breakdown
from hetpipe_jax.efficiency import plot_breakdown
from hetpipe_jax.viz.timeline import plot_gantt

from helpers import schedule_only

ROOT = pathlib.Path(__file__).resolve().parent.parent
SOURCE, RENDERED = ROOT / "docs" / "tutorial.py", ROOT / "docs" / "tutorial.ipynb"
BUDGET_S = 180  # the whole notebook, kernel start included, on a 2-core CPU machine
RENDER = ".venv/bin/python -m experiments.tutorial"


def cells(notebook) -> list[tuple[str, str]]:
  return [(c.cell_type, c.source) for c in notebook.cells]


def test_the_rendered_notebook_is_its_source_run_to_the_end():
  source, rendered = jupytext.read(SOURCE), nbformat.read(RENDERED, as_version=4)
  assert cells(rendered) == cells(source), f"docs/tutorial.ipynb is not docs/tutorial.py: render it ({RENDER})"
  code = [c for c in rendered.cells if c.cell_type == "code"]
  assert [c.execution_count for c in code] == list(range(1, len(code) + 1)), f"not run in order: {RENDER}"
  errors = [o for c in code for o in c.outputs if o.output_type == "error"]
  assert not errors, f"the rendered notebook holds an error: {errors[0].get('ename')}: {errors[0].get('evalue')}"
  images = [o for c in code for o in c.outputs if "image/png" in o.get("data", {})]
  assert len(images) >= 5  # the breakdown, the D sweep, training, staleness, the timeline: embedded PNGs


def test_the_library_plots_leave_the_matplotlib_backend_alone(tmp_path):
  """plot_gantt and plot_breakdown draw on their own figure: a notebook's inline backend stays on."""
  events = schedule_only([2, 1], [2, 2], 1, 3, [1.0, 2.0])
  before = matplotlib.get_backend()
  matplotlib.use("pdf")
  try:
    plot_gantt(events, str(tmp_path / "gantt.png"))
    breakdown = time_breakdown(events)
    plot_breakdown({"devices": breakdown["devices"], "shares": shares(breakdown)}, str(tmp_path / "bars.png"))
    assert matplotlib.get_backend() == "pdf"
  finally:
    matplotlib.use(before)
  for name in ("gantt.png", "bars.png"):
    assert (tmp_path / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.slow
def test_the_tutorial_runs_from_start_to_end_within_its_budget(tmp_path):
  """Executes docs/tutorial.py in a fresh kernel (this checkout's package, its files under ``tmp_path``);
  an error in any cell fails it, naming the cell."""
  _, seconds = execute_tutorial(str(tmp_path), BUDGET_S)
  assert seconds < BUDGET_S, f"the tutorial took {seconds:.0f} s, over its {BUDGET_S} s: make its runs smaller"
  for name in ("lab.toml", "sim.efficiency.png", "timeline.png", "timeline.chrome.json"):
    assert (tmp_path / "outputs" / "tutorial" / name).stat().st_size > 0
