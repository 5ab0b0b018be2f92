r"""What every experiment script shares: its entry point, flag parsing, output files and the trace check.

A script defines its absl flags and a ``main(argv)``, then ends with::

  cli = common.console(main)   # the zero-argument entry, also named in pyproject.toml [project.scripts]

  if __name__ == "__main__":
    cli()

``console`` turns a :class:`hetpipe_jax.ConfigError` into one line ``error: ...`` and exit status 1, so a
bad flag never ends in a traceback. Importing JAX starts no backend, so a script can still choose the CPU
device count (:func:`ensure_devices`) before JAX computes.
"""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import matplotlib
from absl import app, flags

from hetpipe_jax.cluster import enable_compilation_cache, ensure_cpu_devices
from hetpipe_jax.cost.batch import BatchProfiles
from hetpipe_jax.cost.profile import full_size_profiles, profile_units
from hetpipe_jax.data import tokens as token_data
from hetpipe_jax.errors import ConfigError, RunStopped
from hetpipe_jax.models import FULL_SIZE, full_size_input, get_model
from hetpipe_jax.run.config import check_seed  # noqa: F401  (the scripts' seed check: the package's)
from hetpipe_jax.runtime.transport.launch import child_environment

# Every script's trace check and progress lines (absl INFO on stderr; stdout keeps the results):
from hetpipe_jax.studies.checked import TraceCheckError, progress, require_wsp  # noqa: F401
from hetpipe_jax.workdir import import_from_working_directory

Main = Callable[[list[str]], int | None]

# CPU devices a script asks JAX for at least, more when its layout places more emulated GPUs (a GPU's
# index in the cluster is its device's). 8 is the test suite's count (tests/conftest.py), so a command-line
# run sees the same devices as a test of the same configuration. Numerics do not depend on it (the small
# golden runs are identical with exactly as many devices as GPUs).
MIN_CPU_DEVICES = 8
ACTIVATIONS_HELP = ("What a unit without recomputation is charged for its activations: jax (every residual of "
                    "jax.vjp: what this package's runtime keeps) or eager (what PyTorch or TensorFlow without XLA "
                    "keep, as the published systems ran: the convolutions' and matmuls' outputs, ReLU's and "
                    "softmax's).")  # --activations of experiments.baseline and plan

# Seeds go to numpy's default_rng (which takes no negative seed) and to jax.random.key (a C long).


def entry(main: Main) -> Main:
  """Wraps an absl ``main`` so that a ConfigError or a RunStopped ends the program with one line (exit
  status 1).

  Args:
    main: the script's ``main(argv)``.

  Returns:
    ``main`` that first checks the script's output flags (:func:`check_output_flags`) and raises
    ``SystemExit("error: <message>")`` instead of a ConfigError or RunStopped.
  """

  def wrapped(argv: list[str]) -> int | None:
    try:
      check_output_flags()
      return main(argv)
    except (ConfigError, RunStopped) as e:
      raise SystemExit(f"error: {e}") from None

  return wrapped


def console(main: Main) -> Callable[[], None]:
  """The zero-argument entry point of a script: absl parses ``sys.argv`` and runs ``entry(main)``.

  Args:
    main: the script's ``main(argv)``.

  Returns:
    A function for ``if __name__ == "__main__"`` and for ``[project.scripts]`` in pyproject.toml. Run as
    an installed script (``hetpipe-train``), it makes ``--helpshort`` list the script's flags, which absl
    otherwise looks up under the launcher's name.
  """

  def run() -> None:
    import_from_working_directory()  # as python -m does: --model=mymodel:factory finds ./mymodel.py
    if main.__module__ != "__main__":  # an installed script: show the script's flags and docstring
      for flag in flags.FLAGS.get_key_flags_for_module(main.__module__):
        flags.FLAGS.register_key_flag_for_module(sys.argv[0], flag)
      launcher = sys.modules["__main__"]
      if launcher.__doc__ is None:
        launcher.__doc__ = sys.modules[main.__module__].__doc__
    app.run(entry(main))

  return run


def config_error(message: str) -> Exception:
  """A :class:`hetpipe_jax.ConfigError` with ``message``."""
  return ConfigError(message)


def parse_ints(flag: str, values: Sequence[str]) -> list[int]:
  """The integers of a list flag, e.g. ``--stages=2,4`` -> [2, 4].

  Raises:
    ConfigError: naming the flag and its value when one of them is not an integer.
  """
  try:
    return [int(v) for v in values]
  except ValueError:
    raise config_error(f"--{flag}={','.join(values)} must be integers, e.g. --{flag}=2 or "
                       f"--{flag}=2,4") from None


def parse_floats(flag: str, values: Sequence[str], give: str) -> tuple[float, ...]:
  """The numbers of a list flag, e.g. ``--lrs=0.01,0.02`` -> (0.01, 0.02).

  Raises:
    ConfigError: ``--FLAG=VALUES; give GIVE`` when one of them is not a number.
  """
  try:
    return tuple(float(v) for v in values)
  except ValueError:
    raise config_error(f"--{flag}={','.join(values)}; give {give}") from None


TRANSFERS = {"serial": False, "overlap": True}  # stage-to-stage inputs received in series, or overlapped
PS_TRANSFERS = {"whole": False, "staged": True}  # a virtual worker's push and pull as one, or per stage


def parse_choices(flag: str, values: Sequence[str], choices: Mapping[str, Any]) -> list[Any]:
  """A list flag of two named choices (e.g. ``--transfers=serial,overlap``) as their values, each once.

  Raises:
    ConfigError: naming the flag and its value when it is empty or names something else.
  """
  if not values or any(v not in choices for v in values):
    raise config_error(f"--{flag}={','.join(values)}; give {', '.join(choices)} or both")
  return [choices[v] for v in dict.fromkeys(values)]


def parse_ps_transfers(values: Sequence[str]) -> list[bool]:
  """``--ps_transfers`` (whole, staged or both) as the tuner's ``staged`` values."""
  return parse_choices("ps_transfers", values, PS_TRANSFERS)


def parse_nm(text: str) -> int | str:
  """An Nm flag: a number, or a planner rule (max_fit, best) passed on as it is."""
  return int(text) if text.isdigit() else text


def parse_cuts(text: str, num_vws: int) -> list[list[int]]:
  """``--cuts``: one list of unit boundaries for every virtual worker, or one per VW separated by ';'.

  Raises:
    ConfigError: for a boundary that is not an integer, or a count of lists that is neither 1 nor N.
  """
  try:
    cuts = [[int(b) for b in part.split(",")] for part in text.split(";")]
  except ValueError:
    raise config_error(f"--cuts={text} must be integer unit boundaries, e.g. --cuts=0,2,5 (every virtual "
                       "worker) or --cuts=0,2,5;0,3,5 (one list per virtual worker)") from None
  if len(cuts) == 1:
    return [list(cuts[0]) for _ in range(num_vws)]
  if len(cuts) != num_vws:
    raise config_error(f"--cuts={text} gives {len(cuts)} lists of boundaries for --num_vws={num_vws}; "
                       "give one list for every virtual worker (e.g. --cuts=0,2,5) or one per virtual worker "
                       "separated by ';'")
  return cuts


def ensure_devices(count: int) -> None:
  """Makes JAX expose at least ``max(MIN_CPU_DEVICES, count)`` CPU devices and keep what it compiles in the
  persistent compilation cache (:func:`hetpipe_jax.cluster.enable_compilation_cache`); call before JAX
  computes."""
  ensure_cpu_devices(max(MIN_CPU_DEVICES, count))
  enable_compilation_cache()


def output_path(out_dir: str, name: str, given: str | None = None) -> str:
  """``given``, else ``out_dir/name``; creates the file's directory.

  Args:
    out_dir: the script's output directory.
    name: the file's name in it.
    given: a path the user chose for this file (a flag such as --trace_out), or None.

  Returns:
    The path, relative as given.
  """
  return ensure_parent(given or os.path.join(out_dir, name))


def ensure_parent(path: str) -> str:
  """Creates the directory ``path`` will be written in; returns ``path``.

  Raises:
    ConfigError: when that directory cannot be created or written (one line naming it).
  """
  folder = os.path.dirname(os.path.abspath(path))
  try:
    os.makedirs(folder, exist_ok=True)
    if not os.access(folder, os.W_OK):
      raise PermissionError(13, "Permission denied")
  except OSError as e:
    raise config_error(f"cannot write {path}: {folder} is not a writable directory ({e.strerror}); choose "
                       "another --out_dir (or output path)") from None
  return path


def print_outputs(outputs: Iterable[tuple[str, str]], width: int = 8) -> None:
  """Prints one ``name   /absolute/path`` line per output, names left-aligned in ``width`` columns."""
  for name, path in outputs:
    print(f"{name:{width}s} {os.path.abspath(path)}")


def write_json(path: str, doc: Any, indent: int | None = 1) -> str:
  """Writes ``doc`` as JSON (UTF-8); returns ``path``."""
  with open(path, "w", encoding="utf-8") as f:
    json.dump(doc, f, indent=indent)
  return path


def write_jsonl(path: str, rows: Iterable[Mapping[str, Any]]) -> str:
  """Writes one JSON object per line (JSON Lines); returns ``path``."""
  with open(path, "w", encoding="utf-8") as f:
    for row in rows:
      f.write(json.dumps(row) + "\n")
  return path


def write_csv(path: str, header: Sequence[str], rows: Iterable[Sequence[Any]]) -> str:
  """Writes a header line and one line per row; returns ``path``."""
  with open(path, "w", newline="", encoding="utf-8") as f:
    writer = csv.writer(f)
    writer.writerow(header)
    writer.writerows(rows)
  return path


def write_dict_csv(path: str, rows: Sequence[Mapping[str, Any]]) -> str:
  """Writes dicts with the same keys as CSV, the first row's keys as the header; returns ``path``."""
  header = list(rows[0])
  return write_csv(path, header, ([row[k] for k in header] for row in rows))


def pyplot():
  """matplotlib.pyplot on the Agg backend (files only, no display).

  pyplot is imported here, on use, not at the top: its import costs every script's ``--help`` about 0.4 s,
  and it picks its backend when imported, which must be Agg by then.
  """
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
  return plt


def save_figure(fig, path: str) -> str:
  """Lays ``fig`` out, writes it to ``path`` (PNG, 110 dpi), closes it; returns ``path``."""
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  pyplot().close(fig)
  return path


def run_train_job(flags: Sequence[str], out_dir: str, timeout_s: float) -> dict[str, Any]:
  """Runs ``python -m experiments.train FLAGS --out_dir=OUT_DIR`` as a subprocess (the environment of a
  launched process: it sets its own device count) and returns its ``summary.json``.

  Raises:
    SystemExit: with one ``error:`` line when the job fails or runs past ``timeout_s``.
  """
  cmd = [sys.executable, "-m", "experiments.train", *flags, f"--out_dir={out_dir}"]
  what = " ".join(cmd[2:])
  try:
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, env=child_environment())
  except subprocess.TimeoutExpired:
    raise SystemExit(f"error: {what} took longer than {timeout_s:g} s (--timeout)") from None
  if proc.returncode != 0:
    raise SystemExit(f"error: {what} failed: {(proc.stderr.strip().splitlines() or ['(no output)'])[-1]}")
  with open(os.path.join(out_dir, "summary.json"), encoding="utf-8") as f:
    return json.load(f)


def model_profiles(name: str, batch_size: int, seq_len: int | None = None) -> tuple[list, int, str]:
  """Profiles of any model the experiments name: a full-size one (``vgg19``, ``resnet152``, the GPTs) on its
  input, the small GPT (``gpt``) on the tokens dataset's sequences, a small image model on 28x28 grey
  images, or a user's ``package.module:factory`` model on its own input spec.

  Returns:
    (the profiles, what one example counts as in throughput: its tokens for a GPT, else 1, and that unit's
    name: "tokens" or "images").

  Raises:
    ConfigError: for an unknown model or a bad ``seq_len``.
  """
  if name in FULL_SIZE:
    shape = full_size_input(name, batch_size, seq_len)
    tokens = shape.shape[1] if len(shape.shape) == 2 else 0
    return full_size_profiles(name, batch_size, seq_len=seq_len), tokens or 1, "tokens" if tokens else "images"
  if ":" in name:  # a user's model, on the input it declares
    model = get_model(name)
    x = model.sample_input(batch_size)
    tokens = x.shape[1] if len(x.shape) == 2 and jnp.issubdtype(x.dtype, jnp.integer) else 0
    return profile_units(model, x), tokens or 1, "tokens" if tokens else "images"
  if name.startswith("gpt"):  # the small GPTs, on the tokens dataset's sequences
    data = token_data(num_train=1, num_test=1)
    seq = data.x_train.shape[1]
    return (profile_units(get_model(name, data.num_classes),
                          jax.ShapeDtypeStruct((batch_size, *data.x_train.shape[1:]), jnp.int32)), seq, "tokens")
  return (profile_units(get_model(name), jax.ShapeDtypeStruct((batch_size, 28, 28, 1), jnp.float32)), 1,
          "images")


def batch_profiles(name: str, batch_size: int, seq_len: int | None = None):
  """Any model :func:`model_profiles` names, as :class:`~hetpipe_jax.cost.batch.BatchProfiles` (at
  ``batch_size`` and twice it), with what one example counts as in throughput and that unit's name."""
  low, per_example, unit = model_profiles(name, batch_size, seq_len)
  high = model_profiles(name, 2 * batch_size, seq_len)[0]
  return BatchProfiles(tuple(low), tuple(high), batch_size, 2 * batch_size), per_example, unit


OUTPUT_FLAGS = ("out_dir", "out", "trace_out", "metrics_out")  # the scripts' output flags: a folder, then files


def check_output_flags() -> None:
  """Refuses, before any work, a script's output flag (:data:`OUTPUT_FLAGS`, those it defines and sets) whose
  folder cannot be created or written: a plan or a study does not run for minutes to fail at its first write.

  Raises:
    ConfigError: in one line naming the flag, its value, why and what to change.
  """
  for name in OUTPUT_FLAGS:
    value = flags.FLAGS[name].value if name in flags.FLAGS else None
    if not value:
      continue
    folder = os.path.abspath(value if name == "out_dir" else os.path.dirname(os.path.abspath(value)))
    reason = unwritable(folder)
    if reason:
      raise config_error(f"--{name}={value}: {folder} is not a writable directory ({reason}); choose another "
                         f"--{name}")


def unwritable(folder: str) -> str | None:
  """Why ``folder`` cannot be created or written (None: it can), creating nothing."""
  existing = folder
  while not os.path.exists(existing):
    existing = os.path.dirname(existing)
  if not os.path.isdir(existing):
    return "Not a directory"
  return None if os.access(existing, os.W_OK) else "Permission denied"
