"""The two error types: a configuration that cannot run, and a breach of the pipeline or WSP protocol."""


class ConfigError(ValueError):
  """A configuration that cannot run; the message names the value, the limit and what to change."""


class ProtocolError(RuntimeError):
  """A breach of the pipeline or WSP protocol at run time (a wave pushed twice or out of order, a
  minibatch completed out of order, an executor that stalled): a bug in the runtime, never bad input."""

