"""``--systems_module``: modules a script imports before it reads system names, whose import registers systems
(:func:`hetpipe_jax.systems.register`). Every script that takes systems by name imports this module (through
:mod:`experiments.peer_flags`, or directly: ``experiments.tune``)."""

from __future__ import annotations

from absl import flags

from hetpipe_jax.systems import import_systems

flags.DEFINE_list("systems_module", [], "Modules to import first, whose import registers systems "
                  "(hetpipe_jax.systems.register), e.g. mypackage.my_system; their names are then known.")


def import_from_flags(values: flags.FlagValues) -> None:
  """Imports the modules of ``--systems_module``.

  Raises:
    ConfigError: for a module that cannot be imported.
  """
  import_systems(values.systems_module)
