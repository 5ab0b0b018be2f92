"""Console scripts import from the working directory, as ``python -m`` does.

``python -m experiments.plan --model=mymodel:model`` finds ``mymodel.py`` in the working directory because
``python -m`` puts that directory first on ``sys.path``; an installed console script (``hetpipe-plan``)
starts with its own ``bin`` directory there instead. Every console entry point calls
:func:`import_from_working_directory` first, so both find the same modules.
"""

from __future__ import annotations

import os
import sys


def import_from_working_directory() -> None:
  """Puts the working directory first on ``sys.path`` (where ``python -m`` puts it), unless it is there."""
  cwd = os.getcwd()
  if sys.path[:1] not in ([cwd], [""]):  # ("": the working directory, as python -c and the REPL put it)
    sys.path.insert(0, cwd)
