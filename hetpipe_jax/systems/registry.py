"""The systems by name: :func:`register` adds one, :func:`get_system` finds one, :func:`systems` lists them.

HetPipe and every peer register themselves when :mod:`hetpipe_jax.systems` is imported; a user's system
registers the same way (``register(MySystem())`` in its module, or in a function), and the studies, the tuner and
``experiments.baseline`` find it by name: their ``--systems_module=package.module`` imports the module
(``package.module:function`` imports it and calls the function).
"""

from __future__ import annotations

import importlib

from hetpipe_jax.errors import ConfigError
from hetpipe_jax.systems.base import KINDS, System

_SYSTEMS: dict[str, System] = {}


def register(system: System, replace: bool = False) -> System:
  """Adds ``system`` under its name (``replace``: over one of that name); returns it.

  Raises:
    ConfigError: for a name already taken (without ``replace``), an empty name, or an unknown kind.
  """
  name = getattr(system, "name", "")
  if not isinstance(name, str) or not name or name == "list":
    raise ConfigError(f"system name {name!r}; give a non-empty name other than 'list'")
  if system.kind not in KINDS:
    raise ConfigError(f"system {name}: kind={system.kind!r}; give one of {', '.join(KINDS)}")
  if name in _SYSTEMS and not replace:
    raise ConfigError(f"system {name!r} is registered already; choose another name (or register(..., replace=True))")
  _SYSTEMS[name] = system
  return system


def unregister(name: str) -> None:
  """Removes ``name`` (a test's system); nothing when it is not registered."""
  _SYSTEMS.pop(name, None)


def get_system(name: str) -> System:
  """The system ``name``.

  Raises:
    ConfigError: for an unknown name (listing the known ones).
  """
  if name not in _SYSTEMS:
    raise ConfigError(f"unknown system {name!r}; choose one of {', '.join(_SYSTEMS)}")
  return _SYSTEMS[name]


def systems() -> dict[str, System]:
  """Every registered system by name, in registration order."""
  return dict(_SYSTEMS)


def import_systems(modules: str | list[str]) -> None:
  """Imports each module of ``modules`` (comma-separated names, or a list), whose import registers systems; a
  ``package.module:function`` imports the module and calls ``function()``, which registers them (the
  ``package.module:factory`` convention of the models).

  Raises:
    ConfigError: for a module that cannot be imported, or a function it lacks.
  """
  names = modules.split(",") if isinstance(modules, str) else modules
  for entry in (m.strip() for m in names):
    if not entry:
      continue
    module, _, function = entry.partition(":")
    try:
      loaded = importlib.import_module(module)
    except ImportError as e:
      raise ConfigError(f"--systems_module={entry}: cannot import {module} ({e}); give an importable module that "
                        "registers systems (hetpipe_jax.systems.register), or package.module:function") from None
    if function:
      if not callable(getattr(loaded, function, None)):
        raise ConfigError(f"--systems_module={entry}: {module} has no function {function!r}; give "
                          "package.module:function, a function that registers systems")
      getattr(loaded, function)()
