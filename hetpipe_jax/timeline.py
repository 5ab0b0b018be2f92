"""``python -m hetpipe_jax.timeline TRACE [WAVES]``: timeline exports (see :mod:`hetpipe_jax.viz.timeline`)."""

import sys

from hetpipe_jax.viz.timeline import main

if __name__ == "__main__":
  sys.exit(main(sys.argv))
