"""The one error type for bad configurations."""


class ConfigError(ValueError):
  """A configuration that cannot run; the message names the value, the limit and what to change."""
