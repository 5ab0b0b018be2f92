"""The studies as library code: each a function of a typed configuration (a frozen dataclass) returning typed
records (NamedTuples), which ``experiments/<name>.py`` turns flags into and writes out.

Each study is its own module (``scale``, ``validate_fast``, ``validate_sim``, ``validate_multiprocess``,
``published``, ...); this package imports none of them, so importing one imports only what it needs.
"""
