"""``python -m hetpipe_jax.check TRACE``: the trace checker's command line (see :mod:`hetpipe_jax.core.check`)."""

import sys

from hetpipe_jax.core.check import main

if __name__ == "__main__":
  sys.exit(main(sys.argv))
