"""A byte-level language-modelling corpus: documents, a split by document, next-byte sequences.

The corpus of ``--dataset=text`` is Debian's ``fortunes`` package (fortune-mod's cookie files,
``apt-get install -y fortunes``; BSD licence, /usr/share/doc/fortunes/copyright): about 2.4 MB of English
quotations, jokes and definitions in 40 files under /usr/share/games/fortunes, one document per fortune, the
documents separated by a line holding ``%``.

The pipeline, each step a pure function on bytes:

1. :func:`read_documents`: every fortune of every file (sorted by file name, then in file order), exact
   duplicates kept once (the same quotation in two files would otherwise sit on both sides of the split).
2. :func:`split_documents`: every ``valid_every``-th document (the last of each run of that many) is a
   validation document, the others training ones. The split is by document position, so no validation
   byte is ever part of a training sequence (no overlapping windows of the same text).
3. :func:`byte_stream`: a split's documents as one stream of bytes, each followed by ``%\\n``, the
   corpus's own separator (so the model learns where a fortune ends).
4. :func:`next_byte_windows`: the stream cut into consecutive windows of ``seq_len`` bytes (no overlap);
   each window's labels are the ``seq_len`` bytes after each of its bytes (the window shifted by one).

Byte-level: the vocabulary is the 256 byte values; no tokenizer, nothing to download.
"""

from __future__ import annotations

import os
import re

import numpy as np

FORTUNES_DIR = "/usr/share/games/fortunes"
SEPARATOR = b"%\n"  # after every document in a stream: the fortune files' own separator line
VOCAB = 256  # byte values


def corpus_files(root: str = FORTUNES_DIR) -> list[str]:
  """The cookie files under ``root``, sorted: the plain files without an extension (not the ``.dat``
  indexes, not the ``.u8`` links to the same files)."""
  if not os.path.isdir(root):
    return []
  names = sorted(n for n in os.listdir(root) if "." not in n)
  return [os.path.join(root, n) for n in names if os.path.isfile(os.path.join(root, n))
          and not os.path.islink(os.path.join(root, n))]


def split_fortunes(data: bytes) -> list[bytes]:
  """The documents of one cookie file: the text between lines that hold only ``%``, empty ones dropped.

  Example:
    >>> split_fortunes(b"one\\n%\\ntwo\\nlines\\n%\\n")
    [b'one\\n', b'two\\nlines\\n']
  """
  return [d for d in re.split(rb"^%\n", data, flags=re.MULTILINE) if d.strip()]


def read_documents(files: list[str]) -> list[bytes]:
  """Every document of ``files`` in order, an exact duplicate (after stripping white space) kept once."""
  seen: set[bytes] = set()
  docs = []
  for path in files:
    with open(path, "rb") as f:
      for doc in split_fortunes(f.read()):
        key = doc.strip()
        if key not in seen:
          seen.add(key)
          docs.append(doc)
  return docs


def split_documents(docs: list[bytes], valid_every: int) -> tuple[list[bytes], list[bytes]]:
  """(training, validation) documents: document i (from 0) is a validation one when ``i % valid_every ==
  valid_every - 1``.

  Example:
    >>> split_documents([b"a", b"b", b"c", b"d", b"e"], 2)
    ([b'a', b'c', b'e'], [b'b', b'd'])
  """
  valid = [i % valid_every == valid_every - 1 for i in range(len(docs))]
  return [d for d, v in zip(docs, valid) if not v], [d for d, v in zip(docs, valid) if v]


def byte_stream(docs: list[bytes]) -> np.ndarray:
  """The documents as one uint8 stream, each followed by :data:`SEPARATOR`."""
  return np.frombuffer(b"".join(d + SEPARATOR for d in docs), np.uint8)


def next_byte_windows(stream: np.ndarray, seq_len: int) -> tuple[np.ndarray, np.ndarray]:
  """(inputs, labels), int32 ``(n, seq_len)`` each: window k holds bytes ``k * seq_len .. (k + 1) *
  seq_len - 1`` of ``stream``; its labels are the bytes one further on. A tail too short for a window and
  its labels is dropped (at most ``seq_len`` bytes).

  Example:
    >>> x, y = next_byte_windows(np.arange(7, dtype=np.uint8), 3)
    >>> x.tolist(), y.tolist()
    ([[0, 1, 2], [3, 4, 5]], [[1, 2, 3], [4, 5, 6]])
  """
  n = (len(stream) - 1) // seq_len
  x = stream[:n * seq_len].reshape(n, seq_len).astype(np.int32)
  y = stream[1:n * seq_len + 1].reshape(n, seq_len).astype(np.int32)
  return x, y
