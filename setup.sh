#!/usr/bin/env bash
# Sets up hetpipe_jax on a fresh machine; safe to run again (it only does what is missing).
#  - Fashion-MNIST from Debian's dataset-fashion-mnist package (needs root or sudo; without it the
#    training CLI falls back to scikit-learn's bundled digits and says so);
#  - the English text of --dataset=text from Debian's fortunes package (BSD licence; without it
#    --dataset=text says what to install);
#  - a Python >= 3.11 virtual environment in .venv with the package and its test extras.
set -euo pipefail
cd "$(dirname "$0")"

# apt_install PACKAGE FILE WHAT: installs PACKAGE with apt-get unless FILE exists; warns (WHAT) if it cannot.
apt_install() {
  [ -e "$2" ] && return 0
  if [ "$(id -u)" = 0 ]; then SUDO=""; elif command -v sudo >/dev/null; then SUDO="sudo"; else SUDO="none"; fi
  if [ "$SUDO" != none ] && command -v apt-get >/dev/null; then
    echo "setup: installing $1 (apt-get install $1)"
    if [ -z "${APT_UPDATED:-}" ]; then $SUDO apt-get update -qq || true; APT_UPDATED=1; fi
    $SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "$1" >/dev/null \
      || echo "setup: WARNING: could not install $1; $3"
  else
    echo "setup: WARNING: no apt-get/root to install $1; $3"
  fi
}
apt_install dataset-fashion-mnist /usr/share/datasets/fashion-mnist/train-images-idx3-ubyte.gz \
  "training will use the bundled digits"
apt_install fortunes /usr/share/games/fortunes/cookie "--dataset=text will not be available"

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
