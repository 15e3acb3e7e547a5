# Copyright 2026 The optax_tokacc Authors.
#
# Licensed under the Apache License, Version 2.0 (the "License");
# you may not use this file except in compliance with the License.
# You may obtain a copy of the License at
#
#     http://www.apache.org/licenses/LICENSE-2.0
#
# Unless required by applicable law or agreed to in writing, software
# distributed under the License is distributed on an "AS IS" BASIS,
# WITHOUT WARRANTIES OR CONDITIONS OF ANY KIND, either express or implied.
# See the License for the specific language governing permissions and
# limitations under the License.
# ==============================================================================
"""Parts the tests share: the model, the data, the one full-batch reference
with its round-off bound, global arrays, and the repository's files.

The model is a one-hidden-layer per-token regression (``loss_sum``); the
data are global micro-batches of ``SEQS`` sequences per device with unequal
counted tokens (``make_windows``); the reference is plain optax on one
device, one step per window on all of its tokens (``full_batch``), with
the bound within which float32 round-off keeps any accumulation of the same
windows from it (``round_off_atol``, derived in its docstring);
``assert_within_round_off`` compares with it.

The tests run against whatever ``optax_tokacc`` Python imports: the
checkout (``pip install -e``), or an installed wheel with a copy of
``tests/`` beside it (the ``release`` session of ``noxfile.py`` runs them
from the unpacked sdist). Tests of the repository's other files (README,
docs, examples, benchmarks) skip there, naming what is missing
(:func:`needs_repository`), and processes that tests start import the same
``optax_tokacc`` as the test itself (:func:`subprocess_env`).
"""

import os
import pathlib
from typing import NamedTuple

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import optax_tokacc

TESTS_DIR = pathlib.Path(__file__).resolve().parent
REPO = TESTS_DIR.parent  # the checkout, or the unpacked sdist


def needs_repository(*names: str) -> pytest.MarkDecorator:
  """A ``skipif`` marker for a test of the repository's files ``names``
  (relative to its root), which an installed package with a copy of
  ``tests/`` does not have."""
  missing = [name for name in names if not (REPO / name).exists()]
  return pytest.mark.skipif(
    bool(missing),
    reason=f"needs the repository's {', '.join(missing)}, absent beside "
    'this copy of tests/ (an installed optax_tokacc, or the sdist)',
  )


def subprocess_env(**variables: str) -> dict[str, str]:
  """The environment of a Python process started by a test: it imports the
  ``optax_tokacc`` this process imported (the checkout or the installed
  wheel, never a source tree beside the tests), and the tests' modules;
  ``variables`` are set too."""
  package_root = pathlib.Path(optax_tokacc.__file__).resolve().parents[1]
  env = dict(os.environ, **variables)
  paths = [str(package_root), str(TESTS_DIR), env.get('PYTHONPATH')]
  env['PYTHONPATH'] = os.pathsep.join(filter(None, paths))
  return env


# The model and the data.

FEATURES = 8
SEQS = 2  # sequences per device per micro-step
SEQ_LEN = 4
LOCAL_TOKENS = SEQS * SEQ_LEN
LEARNING_RATE = 0.05


def init_params(dtype=jnp.float32):
  """Numpy parameters of a one-hidden-layer per-token regression model."""
  rng = np.random.default_rng(0)
  return {
    'w': rng.normal(size=(FEATURES, FEATURES)).astype(dtype),
    'v': rng.normal(size=(FEATURES,)).astype(dtype),
  }


def token_losses(params, batch):
  """Each token's squared error, shape ``[sequences, SEQ_LEN]``."""
  hidden = jnp.tanh(batch['x'] @ params['w'])
  return (hidden @ params['v'] - batch['y']) ** 2


def loss_sum(params, batch):
  """The squared error summed over the batch's counted tokens."""
  return jnp.sum(token_losses(params, batch) * batch['mask'])


def loss_mean(params, batch):
  """The micro-batch's token-mean loss (what ``optax.MultiSteps`` users
  pass); an all-padding micro-batch has no mean: 0 for it."""
  return loss_sum(params, batch) / jnp.maximum(jnp.sum(batch['mask']), 1)


def token_count(batch):
  return jnp.sum(batch['mask']).astype(jnp.int32)


def token_counts(window_sizes, num_devices, seed=0):
  """Counted tokens per window, micro-step and device: unequal, with zeros.

  Device 1 has no tokens on the first micro-step of every window, and device
  2 has none in the whole first window.
  """
  rng = np.random.default_rng(seed)
  counts = []
  for w, size in enumerate(window_sizes):
    window = rng.integers(0, LOCAL_TOKENS + 1, size=(size, num_devices))
    window[0, 1 % num_devices] = 0
    if w == 0:
      window[:, 2 % num_devices] = 0
    window[-1, 0] = LOCAL_TOKENS  # every window has tokens
    counts.append(window)
  return counts


def make_windows(window_sizes, num_devices, dtype=np.float32, seed=0):
  """Global micro-batches: device d holds rows [d * SEQS, (d + 1) * SEQS)."""
  rng = np.random.default_rng(seed + 1)
  windows = []
  for counts in token_counts(window_sizes, num_devices, seed):
    window = []
    for step_counts in counts:
      mask = np.zeros((num_devices, LOCAL_TOKENS))
      for device, count in enumerate(step_counts):
        mask[device, rng.permutation(LOCAL_TOKENS)[:count]] = 1
      shape = (num_devices * SEQS, SEQ_LEN)
      window.append(
        {
          'x': rng.normal(size=shape + (FEATURES,)).astype(dtype),
          'y': rng.normal(size=shape).astype(dtype),
          'mask': mask.reshape(shape).astype(dtype),
        }
      )
    windows.append(window)
  return windows


def concat(micro_batches):
  """The micro-batches of a window as one batch."""
  return jax.tree.map(lambda *xs: np.concatenate(xs), *micro_batches)


# The reference: full-batch training, and the round-off bound.

# The roundings on one token's path to its gradient term: the dot products'
# terms (2 FEATURES, forward and backward) and about 16 elementwise
# operations (tanh's own error counted as a few).
TERM_ROUNDINGS = 2 * FEATURES + 16


class Reference(NamedTuple):
  """Full-batch training, and how far float32 round-off can take a run of
  the same windows from it (:func:`round_off_atol`)."""

  params: dict  # the final parameters
  loss: float  # the last window's token-mean loss
  atol: float  # of every parameter
  loss_atol: float  # of ``loss``
  losses: tuple  # each window's token-mean loss


def window_tokens(windows) -> int:
  """The counted tokens of the largest window."""
  return max(sum(int(np.sum(b['mask'])) for b in w) for w in windows)


def round_off_atol(
  largest_updates, largest_params, windows, term_roundings, unit_round_off
) -> float:
  """How far round-off can take accumulation from full-batch training, over
  steps whose largest updates and parameters are ``largest_updates`` and
  ``largest_params``.

  A window's gradient sums the terms of its n counted tokens, each computed
  through m = ``term_roundings`` roundings. Two evaluations in different
  orders (per micro-batch and device, then over the window, against the
  whole window at once) differ by at most 2 (n + m) u times the terms' size
  (u the unit round-off of the parameters' dtype, 2**-24 in float32;
  Higham, Accuracy and Stability of Numerical Algorithms, 2002, sections
  3.1 and 4.2), taken relative to the step's largest update. SGD and
  momentum are linear in the gradients; Adam's update and a global-norm
  clip that binds are homogeneous of degree 0 in them, so the update moves
  by at most twice the relative error: a factor 2 for all. Adding an update
  rounds a parameter by at most u |p| in each run. This worst case (errors
  of one sign) exceeds the typical one (random signs) by sqrt(n + m) > 5,
  which covers terms that cancel and the growth of a difference over a few
  steps: measured, differences stay below 1/8 of it on two CPUs
  (``--xla_cpu_max_isa=AVX`` emulating an older one), where a fixed 1e-6
  came within 1/6. It is still below 1e-3 of the gap the average of
  averages leaves.
  """
  n = window_tokens(windows)
  relative = 2 * 2 * (n + term_roundings) * unit_round_off
  return sum(
    relative * update + 2 * unit_round_off * param
    for update, param in zip(largest_updates, largest_params)
  )


def largest(tree) -> float:
  return max(float(jnp.max(jnp.abs(x))) for x in jax.tree.leaves(tree))


def full_batch(
  optimizer, params, windows, loss_fn=loss_sum, term_roundings=TERM_ROUNDINGS
) -> Reference:
  """Plain ``optimizer`` on one device, one step per window on all of its
  tokens (the gradient of ``loss_fn`` summed over them, divided by their
  count), eagerly, with its round-off bounds: ``atol`` of every parameter
  (:func:`round_off_atol`), and ``loss_atol`` of the last window's
  token-mean loss: a sum of n one-signed terms (within 2 (n + m) u of it,
  relative), taken at parameters that may differ by the windows' ``atol``
  before it, which moves it by at most the 1-norm of its gradient times that
  ``atol``, and a second-order term below it (twice the first covers
  both)."""
  params = jax.tree.map(jnp.asarray, params)
  leaf = jax.tree.leaves(params)[0]
  unit_round_off = float(jnp.finfo(leaf.dtype).eps) / 2
  opt_state = optimizer.init(params)
  n = window_tokens(windows)
  largest_updates, largest_params, losses, atol = [], [], [], 0.0
  for window in windows:
    batch = concat(window)
    tokens = np.sum(batch['mask'])
    mean_loss = lambda p, batch=batch, tokens=tokens: loss_fn(p, batch) / tokens  # noqa: E731
    loss, grads = jax.value_and_grad(mean_loss)(params)
    losses.append(float(loss))
    gradient_norm = sum(
      float(jnp.sum(jnp.abs(g))) for g in jax.tree.leaves(grads)
    )
    loss_atol = 2 * (
      2 * (n + term_roundings) * unit_round_off * float(loss)
      + gradient_norm * atol
    )
    updates, opt_state = optimizer.update(grads, opt_state, params)
    before = largest(params)
    params = optax.apply_updates(params, updates)
    largest_updates.append(largest(updates))
    largest_params.append(max(before, largest(params)))
    atol = round_off_atol(
      largest_updates, largest_params, windows, term_roundings, unit_round_off
    )
  return Reference(params, float(loss), atol, loss_atol, tuple(losses))


def assert_within_round_off(actual, reference: Reference) -> None:
  """``actual`` parameters equal ``reference``'s within its ``atol``."""
  chex.assert_trees_all_close(
    jax.tree.map(np.asarray, actual),
    jax.tree.map(np.asarray, reference.params),
    rtol=0,
    atol=reference.atol,
  )


# Global arrays (several processes included).


def put(value, sharding):
  """A global array from a host value that every process holds in full."""
  value = np.asarray(value)
  return jax.make_array_from_callback(
    value.shape, sharding, lambda index: value[index]
  )


def fetch(tree):
  """Host copies of global arrays, gathered from all processes."""
  if jax.process_count() == 1:
    return jax.tree.map(np.asarray, tree)
  from jax.experimental import multihost_utils  # noqa: PLC0415

  return jax.tree.map(
    lambda x: np.asarray(multihost_utils.process_allgather(x, tiled=True)),
    tree,
  )
