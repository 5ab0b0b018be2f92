"""The studies as library code: each a function of a typed configuration (a frozen dataclass) returning typed
records (NamedTuples), which a thin script in ``experiments/`` makes from its flags and writes out.

Each study is its own module of this package; this file imports none of them.
"""
