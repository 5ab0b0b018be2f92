"""Offline datasets and per-virtual-worker minibatch streams.

* ``fashion_mnist``: 60k/10k 28x28 images from Debian's ``dataset-fashion-mnist`` package
  (``apt-get install -y dataset-fashion-mnist``; IDX files under /usr/share/datasets/fashion-mnist/).
* ``digits``: scikit-learn's bundled 8x8 digits (1,797 images), split 1,536 train / 261 test.
* ``synthetic``: Gaussian class clusters shaped as 8x8 images; fast and always there.
* ``tokens``: sequences of a synthetic language for the GPT models: a fixed random Markov chain over 32
  tokens in which each token is followed by its own successor with probability 0.9 (else any token), so
  the next token is learnable and the loss falls from ln 32 = 3.47 towards the chain's entropy (about
  0.65 nats). Inputs are ``(16,)`` int32 tokens, labels the next 16 (:func:`tokens`).
* ``text``: English text for the GPT models, byte by byte (vocabulary 256): Debian's ``fortunes`` package
  (``apt-get install -y fortunes``; BSD licence), every tenth fortune a validation document, the rest
  training ones, cut into windows of 64 bytes whose labels are the next 64 (:func:`text`,
  :mod:`hetpipe_jax.corpus`).
* ``auto``: Fashion-MNIST when installed, else digits (the log says which).

Each virtual worker draws its own stream: epoch e is a seeded permutation of the training set cut into
minibatches, dealt round-robin to the virtual workers, so no two train on the same minibatch in an epoch.
The peers' numerics (:mod:`hetpipe_jax.baselines.numerics`) read :class:`WorkerStreams`: a minibatch size (and a
number of local steps per round) of each worker's own, the same examples as those streams for equal sizes.
"""

from __future__ import annotations

import copy
import dataclasses
import gzip
import os
import struct
from collections.abc import Sequence

import numpy as np
from absl import logging

from hetpipe_jax import corpus
from hetpipe_jax.errors import ConfigError

FASHION_DIR = "/usr/share/datasets/fashion-mnist"
DATASETS = ("auto", "fashion_mnist", "digits", "synthetic", "tokens", "text")
BYTE_DATASETS = ("text",)  # the datasets whose tokens are bytes


@dataclasses.dataclass(frozen=True)
class Dataset:
  name: str
  x_train: np.ndarray  # float32, NHWC, scaled to [0, 1] (synthetic: standardised); tokens, text: int32 (n, seq)
  y_train: np.ndarray  # int32 (n,); tokens, text: the next tokens, (n, seq)
  x_test: np.ndarray
  y_test: np.ndarray
  num_classes: int  # tokens, text: the vocabulary

  def with_test_examples(self, n: int) -> Dataset:
    """The same data with ``n`` test examples evenly spread over its test split (0, or at least the split's
    size: the whole split): a cheaper evaluation of a study's many runs, the same examples for every run."""
    if n <= 0 or n >= len(self.x_test):
      return self
    keep = np.linspace(0, len(self.x_test) - 1, n).round().astype(int)
    return dataclasses.replace(self, x_test=self.x_test[keep], y_test=self.y_test[keep])


def _read_idx(path: str) -> np.ndarray:
  with gzip.open(path, "rb") as f:
    data = f.read()
  ndim = data[3]
  dims = struct.unpack(">" + "I" * ndim, data[4:4 + 4 * ndim])
  return np.frombuffer(data, np.uint8, offset=4 + 4 * ndim).reshape(dims)


def fashion_mnist_installed(root: str = FASHION_DIR) -> bool:
  return os.path.exists(os.path.join(root, "train-images-idx3-ubyte.gz"))


def _fashion_mnist(root: str = FASHION_DIR) -> Dataset:
  if not fashion_mnist_installed(root):
    raise ConfigError(f"Fashion-MNIST is not installed under {root}; run `apt-get install -y "
                      "dataset-fashion-mnist` (the README's setup does), or use --dataset=digits")
  img = lambda name: (_read_idx(os.path.join(root, name))[..., None] / 255.0).astype(np.float32)
  lab = lambda name: _read_idx(os.path.join(root, name)).astype(np.int32)
  return Dataset("fashion_mnist", img("train-images-idx3-ubyte.gz"), lab("train-labels-idx1-ubyte.gz"),
                 img("t10k-images-idx3-ubyte.gz"), lab("t10k-labels-idx1-ubyte.gz"), 10)


def _digits() -> Dataset:
  from sklearn.datasets import load_digits  # imported here: only this fallback needs scikit-learn
  images, target = load_digits(return_X_y=True)  # (n, 64) pixels 0..16, labels
  x = (images.reshape(-1, 8, 8, 1) / 16.0).astype(np.float32)
  y = target.astype(np.int32)
  perm = np.random.default_rng(0).permutation(len(x))
  train, test = perm[:1536], perm[1536:]
  return Dataset("digits", x[train], y[train], x[test], y[test], 10)


def synthetic(num_train: int = 2048, num_test: int = 512, num_classes: int = 10, seed: int = 0,
              noise: float = 1.0) -> Dataset:
  """Gaussian clusters around random class means, shaped (8, 8, 1)."""
  rng = np.random.default_rng(seed)
  means = rng.normal(size=(num_classes, 64)).astype(np.float32)

  def draw(n):
    y = rng.integers(0, num_classes, n).astype(np.int32)
    x = means[y] + noise * rng.normal(size=(n, 64)).astype(np.float32)
    return x.reshape(n, 8, 8, 1), y

  x_train, y_train = draw(num_train)
  x_test, y_test = draw(num_test)
  return Dataset("synthetic", x_train, y_train, x_test, y_test, num_classes)


def tokens(num_train: int = 2048, num_test: int = 256, vocab_size: int = 32, seq_len: int = 16, seed: int = 0,
           follow: float = 0.9) -> Dataset:
  """Sequences of a fixed random Markov chain: token t is followed by ``successor[t]`` with probability
  ``follow``, else by a uniformly drawn token. Each example is ``seq_len`` tokens; its labels are the
  ``seq_len`` tokens after each (the sequence shifted by one).

  Args:
    num_train / num_test: sequences in each split.
    vocab_size: tokens in the vocabulary (the dataset's ``num_classes``).
    seq_len: tokens per example.
    seed: the chain and the draws.
    follow: probability that a token is followed by its successor.

  Returns:
    The dataset, named ``tokens``.
  """
  rng = np.random.default_rng(seed)
  successor = rng.permutation(vocab_size)

  def draw(n):
    seqs = np.empty((n, seq_len + 1), np.int32)
    seqs[:, 0] = rng.integers(0, vocab_size, n)
    for t in range(seq_len):
      follows = rng.random(n) < follow
      seqs[:, t + 1] = np.where(follows, successor[seqs[:, t]], rng.integers(0, vocab_size, n))
    return seqs[:, :-1], seqs[:, 1:]

  x_train, y_train = draw(num_train)
  x_test, y_test = draw(num_test)
  return Dataset("tokens", x_train, y_train, x_test, y_test, vocab_size)


def text_installed(root: str = corpus.FORTUNES_DIR) -> bool:
  """Whether Debian's ``fortunes`` corpus is under ``root``."""
  return bool(corpus.corpus_files(root))


def text(root: str = corpus.FORTUNES_DIR, seq_len: int = 64, valid_every: int = 10,
         train_multiple: int = 256) -> Dataset:
  """English text, byte-level: the documents of the cookie files under ``root`` (:mod:`hetpipe_jax.corpus`),
  every ``valid_every``-th one for validation (the test split), cut into windows of ``seq_len`` bytes whose
  labels are the next ``seq_len``.

  Args:
    root: the cookie files (Debian's ``fortunes``: /usr/share/games/fortunes).
    seq_len: bytes per example.
    valid_every: one document in this many is a validation document.
    train_multiple: the training windows are cut to a multiple of this (the stream's tail: at most this
      many windows less one), so that every power-of-two batch size up to it divides the training set.

  Returns:
    The dataset, named ``text``; ``num_classes`` is 256.

  Raises:
    ConfigError: when the corpus is not installed, a size is below 1 (``valid_every`` below 2), or the corpus
      gives fewer than ``train_multiple`` training windows or no validation window.
  """
  for name, value, low in (("seq_len", seq_len, 1), ("valid_every", valid_every, 2),
                           ("train_multiple", train_multiple, 1)):
    if value < low:
      raise ConfigError(f"text: {name}={value} must be >= {low}")
  if not text_installed(root):
    raise ConfigError(f"the text corpus is not installed under {root}; run `apt-get install -y fortunes` (the "
                      "README's setup does), or use --dataset=tokens")
  train_docs, valid_docs = corpus.split_documents(corpus.read_documents(corpus.corpus_files(root)), valid_every)
  x_train, y_train = corpus.next_byte_windows(corpus.byte_stream(train_docs), seq_len)
  x_test, y_test = corpus.next_byte_windows(corpus.byte_stream(valid_docs), seq_len)
  keep = len(x_train) // train_multiple * train_multiple
  if not keep or not len(x_test):
    raise ConfigError(f"the text corpus under {root} gives {len(x_train)} training and {len(x_test)} validation "
                      f"windows of {seq_len} bytes; it needs {train_multiple} and 1 (a shorter seq_len, or a larger "
                      "corpus)")
  return Dataset("text", x_train[:keep], y_train[:keep], x_test, y_test, corpus.VOCAB)


def load_dataset(name: str) -> Dataset:
  """Loads a dataset by name (see the module docstring).

  Raises:
    ConfigError: for an unknown name, or fashion_mnist or text when it is not installed.
  """
  if name == "auto":
    if fashion_mnist_installed():
      return _fashion_mnist()
    logging.warning("Fashion-MNIST is not installed (apt-get install -y dataset-fashion-mnist); "
                    "using scikit-learn's bundled 8x8 digits instead")
    return _digits()
  loaders = {"fashion_mnist": _fashion_mnist, "digits": _digits, "synthetic": synthetic, "tokens": tokens,
             "text": text}
  if name not in loaders:
    raise ConfigError(f"unknown dataset {name!r}; known datasets: {', '.join(DATASETS)}")
  return loaders[name]()


def check_batch_size(dataset: Dataset, batch_size: int, drop_remainder: bool = False) -> None:
  """Raises ConfigError for a batch size below 1, above the training set, or that does not divide it
  (unless ``drop_remainder``)."""
  n = len(dataset.x_train)
  if not 1 <= batch_size <= n:
    raise ConfigError(f"batch_size={batch_size} must be between 1 and the {n} training examples of "
                      f"{dataset.name}")
  if n % batch_size and not drop_remainder:
    divisors = [b for b in range(8, min(n, 512) + 1) if n % b == 0][:8]
    raise ConfigError(
        f"batch_size={batch_size} does not divide the {n} training examples of {dataset.name} "
        f"({n % batch_size} would be left over each epoch); use a divisor such as "
        f"{', '.join(map(str, divisors))}, or pass --drop_remainder to drop them")


class MinibatchStreams:
  """Minibatch p of virtual worker i, for every i and p, from seeded per-epoch permutations.

  Args:
    dataset: the dataset.
    batch_size: examples per minibatch; must divide the training set unless ``drop_remainder``.
    num_vws: virtual workers sharing each epoch.
    seed: shuffling seed.
    drop_remainder: drop the examples of an epoch that do not fill a minibatch.

  Raises:
    ConfigError: for a batch size below 1, above the training set, or that does not divide it.
  """

  def __init__(self, dataset: Dataset, batch_size: int, num_vws: int, seed: int = 0,
               drop_remainder: bool = False):
    check_batch_size(dataset, batch_size, drop_remainder)
    n = len(dataset.x_train)
    self.dataset, self.batch_size, self.num_vws, self.seed = dataset, batch_size, num_vws, seed
    self.batches_per_epoch = n // batch_size
    self._perms: dict[int, np.ndarray] = {}
    self.taken: tuple[int, ...] = (0,) * num_vws  # minibatches each virtual worker drew before (see :meth:`after`)

  def after(self, taken: Sequence[int]) -> MinibatchStreams:
    """These streams once virtual worker i has drawn ``taken[i]`` minibatches: minibatch p of the result is
    minibatch ``taken[i] + p`` of these (a run that goes on in another layout)."""
    out = copy.copy(self)
    out.taken, out._perms = tuple(taken), {}
    return out

  def _perm(self, epoch: int) -> np.ndarray:
    if epoch not in self._perms:
      if len(self._perms) >= 4:  # virtual workers are at most a few waves apart: keep recent epochs
        del self._perms[min(self._perms)]
      rng = np.random.default_rng([self.seed, epoch])
      self._perms[epoch] = rng.permutation(len(self.dataset.x_train))
    return self._perms[epoch]

  def index(self, vw: int, mb: int) -> tuple[int, int]:
    """(epoch, batch within the epoch) of minibatch ``mb`` (from 1) of virtual worker ``vw``."""
    g = (mb + self.taken[vw] - 1) * self.num_vws + vw
    return divmod(g, self.batches_per_epoch)

  def __call__(self, vw: int, mb: int) -> tuple[np.ndarray, np.ndarray]:
    epoch, b = self.index(vw, mb)
    idx = self._perm(epoch)[b * self.batch_size:(b + 1) * self.batch_size]
    return self.dataset.x_train[idx], self.dataset.y_train[idx]


def _check_sizes(name: str, values, low: int, what: str) -> list[int]:
  """``values`` as a list of ints >= ``low``; ConfigError naming the first that is not."""
  values = list(values)
  if not values:
    raise ConfigError(f"{name} is empty; give one entry per worker, e.g. {name}=[32, 32]")
  for i, v in enumerate(values):
    if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < low:
      raise ConfigError(f"{name}[{i}]={v!r}; each entry must be an integer >= {low} ({what})")
  return [int(v) for v in values]


class WorkerStreams:
  """Minibatches of per-worker sizes: worker i's are ``batch_sizes[i]`` examples, ``local_steps[i]`` of them
  per round (synchronous SGD: one per round, its step).

  The training set, epoch after epoch (epoch e: the seeded permutation :class:`MinibatchStreams` uses), is
  read as one sequence of examples. Round r (from 1) takes the next R = sum_i H_i x b_i of them (H: local
  steps, b: batch sizes), dealt to the workers in order: worker i's k-th minibatch (from 1) of round r is the
  b_i examples from position (r - 1) R + sum_{j < i} H_j b_j + (k - 1) b_i. Every example is thus seen once
  per epoch across the workers; a minibatch at the end of an epoch goes on into the next one (so it may
  hold an example twice), and no example is dropped. A worker of batch size 0 takes nothing (it sits out).
  With equal sizes b that divide the training set and one step per round, worker i's minibatch of round r is
  ``MinibatchStreams(dataset, b, num_workers, seed)(i, r)``, the same examples in the same order.

  Args:
    dataset: the dataset.
    batch_sizes: examples per minibatch of each worker (0: the worker takes none); not all 0, none above
      the training set.
    seed: shuffling seed.
    local_steps: minibatches of each worker per round (default 1 each).

  Raises:
    ConfigError: for an empty or negative size, all sizes 0, a size above the training set, a local step
      count below 1, or lists of different lengths.
  """

  def __init__(self, dataset: Dataset, batch_sizes, seed: int = 0, local_steps=None):
    n = len(dataset.x_train)
    sizes = _check_sizes("batch_sizes", batch_sizes, 0, "0: the worker sits out")
    steps = [1] * len(sizes) if local_steps is None else _check_sizes("local_steps", local_steps, 1,
                                                                      "local steps per round")
    if len(steps) != len(sizes):
      raise ConfigError(f"local_steps has {len(steps)} entries but batch_sizes {len(sizes)}; give one local step "
                        "count per worker")
    if not any(sizes):
      raise ConfigError(f"batch_sizes={sizes} are all 0; at least one worker needs a minibatch of 1 or more")
    if max(sizes) > n:
      i = sizes.index(max(sizes))
      raise ConfigError(f"batch_sizes[{i}]={sizes[i]} is above the {n} training examples of {dataset.name}; use "
                        f"at most {n}")
    self.dataset, self.batch_sizes, self.local_steps, self.seed = dataset, sizes, steps, seed
    self.offsets = np.concatenate([[0], np.cumsum([h * b for h, b in zip(steps, sizes)])]).astype(np.int64)
    self.examples_per_round = int(self.offsets[-1])
    self._perms: dict[int, np.ndarray] = {}

  def _perm(self, epoch: int) -> np.ndarray:
    if epoch not in self._perms:
      if len(self._perms) >= 4:  # reads go forward, at most one epoch per minibatch: keep recent epochs
        del self._perms[min(self._perms)]
      rng = np.random.default_rng([self.seed, epoch])
      self._perms[epoch] = rng.permutation(len(self.dataset.x_train))
    return self._perms[epoch]

  def position(self, worker: int, rnd: int, k: int = 1) -> int:
    """Where worker ``worker``'s ``k``-th minibatch of round ``rnd`` (both from 1) starts in the sequence."""
    if not 1 <= k <= self.local_steps[worker]:
      raise ConfigError(f"local step k={k} of worker {worker}; it takes 1..{self.local_steps[worker]} per round")
    return (rnd - 1) * self.examples_per_round + int(self.offsets[worker]) + (k - 1) * self.batch_sizes[worker]

  def indices(self, start: int, count: int) -> np.ndarray:
    """The training-set indices of examples ``start .. start + count - 1`` of the sequence."""
    n = len(self.dataset.x_train)
    parts, pos, end = [], start, start + count
    while pos < end:
      epoch, offset = divmod(pos, n)
      take = min(end - pos, n - offset)
      parts.append(self._perm(epoch)[offset:offset + take])
      pos += take
    return parts[0] if len(parts) == 1 else np.concatenate(parts) if parts else np.zeros(0, np.int64)

  def __call__(self, worker: int, rnd: int, k: int = 1) -> tuple[np.ndarray, np.ndarray]:
    """Worker ``worker``'s ``k``-th minibatch of round ``rnd`` (both from 1): ``(x, y)``."""
    idx = self.indices(self.position(worker, rnd, k), self.batch_sizes[worker])
    return self.dataset.x_train[idx], self.dataset.y_train[idx]
