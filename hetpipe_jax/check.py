"""``python -m hetpipe_jax.check TRACE``: the trace checker's command line (see :mod:`hetpipe_jax.core.check`)."""

import sys

from hetpipe_jax.core.check import main
from hetpipe_jax.workdir import import_from_working_directory


def cli() -> None:
  """The ``hetpipe-check`` console entry point."""
  import_from_working_directory()
  sys.exit(main(sys.argv))


if __name__ == "__main__":
  cli()
