"""The text dataset: a byte pipeline split by document (no validation byte in a training window), labels the
inputs shifted by one, a clear error without the corpus, and a small GPT trained on it under WSP."""

import math

import numpy as np
import pytest

from hetpipe_jax import ConfigError, RunConfig, run_hetpipe
from hetpipe_jax.corpus import SEPARATOR, read_documents, split_fortunes
from hetpipe_jax.data import text, text_installed
from hetpipe_jax.evaluate import unigram_loss
from hetpipe_jax.models import gpt

from helpers import assert_trace_ok

FILES = {  # two cookie files; "Same old." is in both
    "a": b"First fortune.\n%\nSame old.\n%\nThird one,\n  on two lines.\n%\nFourth.\n%\n",
    "b": b"Same old.\n%\nFifth: the end.\n%\nSixth and last\n%\n",
}
DOCS = [b"First fortune.\n", b"Same old.\n", b"Third one,\n  on two lines.\n", b"Fourth.\n", b"Fifth: the end.\n",
        b"Sixth and last\n"]


@pytest.fixture(name="root")
def fixture_root(tmp_path):
  for name, data in FILES.items():
    (tmp_path / name).write_bytes(data)
    (tmp_path / f"{name}.dat").write_bytes(b"\0\1index")  # strfile's index: not text
    (tmp_path / f"{name}.u8").symlink_to(tmp_path / name)  # the same file again: read once
  return tmp_path


def stream_of(x: np.ndarray, y: np.ndarray) -> bytes:
  """The bytes the windows cover: every window's inputs, then the last label."""
  return bytes(np.concatenate([x.ravel(), y[-1, -1:]]).astype(np.uint8))


def test_documents_are_the_fortunes_of_every_file_once(root):
  assert split_fortunes(FILES["a"]) == DOCS[:4]
  assert read_documents([str(root / "a"), str(root / "b")]) == DOCS  # the duplicate kept once


def test_windows_have_their_next_bytes_as_labels_and_the_split_does_not_leak(root):
  data = text(str(root), seq_len=8, valid_every=3, train_multiple=1)
  train_docs = [DOCS[i] for i in (0, 1, 3, 4)]  # documents 2 and 5 (every third) are validation ones
  valid_docs = [DOCS[2], DOCS[5]]
  train_stream = b"".join(d + SEPARATOR for d in train_docs)
  valid_stream = b"".join(d + SEPARATOR for d in valid_docs)
  assert data.name == "text" and data.num_classes == 256
  assert data.x_train.dtype == data.y_train.dtype == np.int32
  assert data.x_train.shape == data.y_train.shape == ((len(train_stream) - 1) // 8, 8)
  assert data.x_test.shape == data.y_test.shape == ((len(valid_stream) - 1) // 8, 8)
  for x, y in ((data.x_train, data.y_train), (data.x_test, data.y_test)):
    np.testing.assert_array_equal(y[:, :-1], x[:, 1:])  # labels = inputs shifted by one
    np.testing.assert_array_equal(y[:-1, -1], x[1:, 0])  # and on into the next window
  covered_train, covered_valid = stream_of(data.x_train, data.y_train), stream_of(data.x_test, data.y_test)
  assert train_stream.startswith(covered_train) and len(train_stream) - len(covered_train) < 8
  assert valid_stream.startswith(covered_valid) and len(valid_stream) - len(covered_valid) < 8
  for doc in valid_docs:  # no validation document, nor any 6-byte piece of one, in a training window
    pieces = {doc[i:i + 6] for i in range(len(doc) - 5)}
    assert doc not in covered_train and not any(p in covered_train for p in pieces)


def test_the_training_windows_are_cut_to_a_multiple_of_batch_sizes(root):
  full = text(str(root), seq_len=4, valid_every=3, train_multiple=1)
  cut = text(str(root), seq_len=4, valid_every=3, train_multiple=8)
  assert len(full.x_train) == 14  # 57 bytes of training documents and separators: 14 windows of 4 (+ 1 label)
  np.testing.assert_array_equal(cut.x_train, full.x_train[:8])
  cut = text(str(root), seq_len=4, valid_every=3, train_multiple=5)
  np.testing.assert_array_equal(cut.x_train, full.x_train[:10])
  np.testing.assert_array_equal(cut.x_test, full.x_test)


def test_without_the_corpus_or_with_bad_sizes_the_error_says_what_to_do(tmp_path, root):
  with pytest.raises(ConfigError, match=r"the text corpus is not installed under .*; run `apt-get install -y "
                                        r"fortunes` \(the README's setup does\), or use --dataset=tokens"):
    text(str(tmp_path / "nothing"))
  with pytest.raises(ConfigError, match="text: seq_len=0 must be >= 1"):
    text(str(root), seq_len=0)
  with pytest.raises(ConfigError, match="text: valid_every=1 must be >= 2"):
    text(str(root), valid_every=1)
  with pytest.raises(ConfigError, match=r"gives 1 training and 0 validation windows of 64 bytes; it needs 256 and 1"):
    text(str(root))


def test_the_unigram_baseline_is_the_training_frequencies_cross_entropy(root):
  data = text(str(root), seq_len=8, valid_every=3, train_multiple=1)
  counts = np.bincount(data.y_train.ravel(), minlength=256) + 1
  expected = -np.mean([math.log(counts[b] / counts.sum()) for b in data.y_test.ravel()])
  assert unigram_loss(data) == pytest.approx(expected)
  assert math.log(2) < unigram_loss(data) < math.log(256)  # better than uniform over the bytes


@pytest.mark.slow  # 140 s on this busy 2-core machine, nearly all compiling the stage programs
@pytest.mark.skipif(not text_installed(), reason="the text corpus is not installed: apt-get install -y fortunes "
                    "(./setup.sh does)")
def test_a_small_gpt_learns_english_bytes_under_wsp():
  """2 virtual workers x 2 stages on hetero4, D = 1; one block of width 32 (the registered small GPT has two:
  compiling the stage programs dominates the test's time). 160 minibatches take the test loss below the
  byte-unigram baseline's."""
  data = text()
  assert data.num_classes == 256 and data.x_train.shape[1:] == (64,) and len(data.x_train) % 256 == 0
  result = run_hetpipe(gpt(data.num_classes, 1, 32, 2, 64), data, RunConfig.of(
      cluster="hetero4", num_vws=2, stages=2, nm=2, d=1, waves=40, batch_size=32, optimizer="adam",
      learning_rate=0.01, eval_every=100))
  assert_trace_ok(result.events)
  first = np.mean([r["train_loss"] for r in result.metrics if r["wave"] == 0])
  last = np.mean([r["train_loss"] for r in result.metrics if r["wave"] >= 38])
  assert first > 5.0  # about ln 256 = 5.55 at the start
  final = result.metrics[-1]
  assert last < first - 1.5 and final["test_loss"] < unigram_loss(data)  # below the byte-unigram baseline
