"""The one error type for bad configurations."""


class ConfigError(ValueError):
  """A configuration that cannot run; the message names the value, the limit and what to change."""


def exit_on_config_error(main):
  """Wraps an absl ``main`` so that a ConfigError ends the program with its one-line message (exit 1)."""

  def wrapped(argv):
    try:
      return main(argv)
    except ConfigError as e:
      raise SystemExit(f"error: {e}") from None

  return wrapped
