#!/usr/bin/env bash
# The benchmark suite on a git ref and on the working tree, side by side: benchmarks/compare.sh [REF] [options]
# (REF defaults to HEAD; --help lists the options; see benchmarks/compare.py).
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
exec "${PYTHON:-$root/.venv/bin/python}" "$root/benchmarks/compare.py" "$@"
