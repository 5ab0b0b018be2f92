"""Console entry points for the package's own command lines, which take ``argv`` and return an exit code.

pyproject.toml's ``[project.scripts]`` names zero-argument functions; the absl scripts provide theirs
(``experiments.train:cli``, ...), and these two wrap ``python -m hetpipe_jax.check`` and
``python -m hetpipe_jax.timeline``::

  hetpipe-check outputs/train/trace.jsonl        # "OK" and the observed staleness, or every violation
  hetpipe-timeline outputs/train/trace.jsonl 3   # Chrome trace and Gantt chart of the first 3 waves
"""

from __future__ import annotations

import sys


def check() -> None:
  """``hetpipe-check TRACE``: exit 0 when every WSP guarantee holds, 1 on violations, 2 on usage."""
  from hetpipe_jax.check import main
  sys.exit(main(sys.argv))


def timeline() -> None:
  """``hetpipe-timeline TRACE [WAVES]``: writes TRACE's Chrome trace and Gantt chart beside it."""
  from hetpipe_jax.timeline import main
  sys.exit(main(sys.argv))
