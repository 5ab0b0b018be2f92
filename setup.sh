#!/usr/bin/env bash
# Sets up hetpipe_jax on a fresh machine; safe to run again (it only does what is missing).
#  - Fashion-MNIST from Debian's dataset-fashion-mnist package (needs root or sudo; without it the
#    training CLI falls back to scikit-learn's bundled digits and says so);
#  - a Python >= 3.11 virtual environment in .venv with the package and its test extras.
set -euo pipefail
cd "$(dirname "$0")"

if [ ! -f /usr/share/datasets/fashion-mnist/train-images-idx3-ubyte.gz ]; then
  if [ "$(id -u)" = 0 ]; then SUDO=""; elif command -v sudo >/dev/null; then SUDO="sudo"; else SUDO="none"; fi
  if [ "$SUDO" != none ] && command -v apt-get >/dev/null; then
    echo "setup: installing Fashion-MNIST (apt-get install dataset-fashion-mnist)"
    $SUDO apt-get update -qq && $SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq dataset-fashion-mnist >/dev/null \
      || echo "setup: WARNING: could not install dataset-fashion-mnist; training will use the bundled digits"
  else
    echo "setup: WARNING: no apt-get/root to install dataset-fashion-mnist; training will use the bundled digits"
  fi
fi

PYTHON="${PYTHON:-python3}"
if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -c 'import sys; sys.exit(sys.version_info < (3, 11))' \
    || { echo "setup: hetpipe_jax needs Python >= 3.11 (found $("$PYTHON" --version)); set PYTHON=..." >&2; exit 1; }
  "$PYTHON" -m venv .venv
fi
stamp=".venv/.hetpipe-installed-$(sha1sum pyproject.toml | cut -c1-12)"
if [ ! -f "$stamp" ]; then
  echo "setup: installing hetpipe_jax and its dependencies into .venv"
  .venv/bin/python -m pip install -q --upgrade pip
  .venv/bin/python -m pip install -q -e '.[test]'
  rm -f .venv/.hetpipe-installed-* && touch "$stamp"
fi
