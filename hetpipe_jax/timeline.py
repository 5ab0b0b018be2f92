"""``python -m hetpipe_jax.timeline TRACE [WAVES]``: timeline exports (see :mod:`hetpipe_jax.viz.timeline`)."""

import sys

from hetpipe_jax.viz.timeline import main
from hetpipe_jax.workdir import import_from_working_directory


def cli() -> None:
  """The ``hetpipe-timeline`` console entry point."""
  import_from_working_directory()
  sys.exit(main(sys.argv))


if __name__ == "__main__":
  cli()
