"""The two error types: a configuration that cannot run, and a breach of the pipeline or WSP protocol."""


class ConfigError(ValueError):
  """A configuration that cannot run; the message names the value, the limit and what to change."""


class ProtocolError(RuntimeError):
  """A breach of the pipeline or WSP protocol at run time (a wave pushed twice or out of order, a
  minibatch completed out of order, an executor that stalled): a bug in the runtime, never bad input."""


def exit_on_config_error(main):
  """Wraps an absl ``main`` so that a ConfigError ends the program with its one-line message (exit 1)."""

  def wrapped(argv):
    try:
      return main(argv)
    except ConfigError as e:
      raise SystemExit(f"error: {e}") from None

  return wrapped
