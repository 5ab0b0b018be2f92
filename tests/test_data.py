"""Datasets load offline; each virtual worker draws its own minibatches, deterministically."""

import numpy as np
import pytest

from hetpipe_jax import MinibatchStreams, load_dataset, synthetic
from hetpipe_jax.data import fashion_mnist_installed


def test_streams_are_disjoint_within_an_epoch_and_cover_it():
  ds = synthetic(num_train=480, num_test=10)
  streams = MinibatchStreams(ds, batch_size=16, num_vws=3, seed=5)
  seen = {}
  for vw in range(3):
    for mb in range(1, 11):  # 3 x 10 = 30 = one epoch of 480 / 16
      epoch, b = streams.index(vw, mb)
      assert epoch == 0
      seen[(vw, mb)] = b
  assert sorted(seen.values()) == list(range(30))
  x0 = np.concatenate([streams(0, mb)[0] for mb in range(1, 11)])
  x1 = np.concatenate([streams(1, mb)[0] for mb in range(1, 11)])
  assert not (x0[:, None] == x1[None]).all(axis=(2, 3, 4)).any()


def test_streams_are_seeded():
  ds = synthetic(num_train=480, num_test=10)
  a, b = MinibatchStreams(ds, 16, 2, seed=1), MinibatchStreams(ds, 16, 2, seed=1)
  c = MinibatchStreams(ds, 16, 2, seed=2)
  np.testing.assert_array_equal(a(1, 7)[1], b(1, 7)[1])
  assert not np.array_equal(a(1, 7)[0], c(1, 7)[0])
  np.testing.assert_array_equal(a(0, 20)[1], b(0, 20)[1])  # a later epoch


def test_digits_is_bundled():
  ds = load_dataset("digits")
  assert ds.x_train.shape == (1536, 8, 8, 1) and len(ds.x_test) == 261
  assert ds.x_train.max() <= 1.0 and set(np.unique(ds.y_train)) == set(range(10))


@pytest.mark.skipif(not fashion_mnist_installed(), reason="apt-get install -y dataset-fashion-mnist")
def test_fashion_mnist_from_the_debian_package():
  ds = load_dataset("fashion_mnist")
  assert ds.x_train.shape == (60000, 28, 28, 1) and ds.x_test.shape == (10000, 28, 28, 1)
  assert load_dataset("auto").name == "fashion_mnist"


def test_a_study_may_evaluate_on_test_examples_spread_over_the_whole_split():
  data = synthetic(num_train=16, num_test=10)
  sub = data.with_test_examples(4)
  keep = [0, 3, 6, 9]
  assert np.array_equal(sub.x_test, data.x_test[keep]) and np.array_equal(sub.y_test, data.y_test[keep])
  assert sub.x_train is data.x_train and sub.num_classes == data.num_classes
  assert all(data.with_test_examples(n) is data for n in (0, 10, 99))  # 0, or the whole split or more: all of it
