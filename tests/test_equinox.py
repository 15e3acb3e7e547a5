"""Equinox models trained the Equinox way equal full-batch training.

The accumulator is used as any optax optimizer is with Equinox:
``tx.init(eqx.filter(model, ...))``, gradients from
``eqx.filter_value_and_grad``, ``eqx.apply_updates``, one
``eqx.filter_jit``-compiled step. The reference trains the same model with
the same inner optimizer, fed the gradient of each window's token-summed
loss over its total tokens, computed here on the whole window at once.
Token counts differ between micro-batches (one has none), so a wrong scale
or the average of per-micro-batch means would show.
"""

from collections.abc import Callable
import functools
from typing import NamedTuple

import chex
import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import test_multistep

import optax_tokacc as tokacc

# Each test takes 5 s or more of a core (--durations=0).
pytestmark = pytest.mark.slow

FEATURES, WIDTH = 3, 4
SEQS, SEQ_LEN = 2, 4  # a micro-batch holds up to 8 counted tokens
K = 3
TOKEN_COUNTS = ((5, 1, 8), (0, 6, 3), (7, 2, 4))  # three windows of K
CLIP_NORM = 1e3  # far above the gradient norms: the chain is not scale-free
# The roundings on one token's path to its gradient term, for
# test_multistep.round_off_atol: the dot products' terms (FEATURES, WIDTH
# and WIDTH forward, as many backward) and about 20 elementwise operations
# (the bias adds, two tanh and their derivatives, the square, the mask).
TERM_ROUNDINGS = 2 * (FEATURES + 2 * WIDTH) + 20


class Regressor(eqx.Module):
  """A per-token regressor with fields that are not trained.

  ``hidden`` and ``head`` are trained; ``offset`` is a float array left out
  of training by a filter (its gradients are ``None``); ``feature_order``
  is an integer array, ``width`` a Python int and ``activation`` a static
  callable: none of them is an inexact array.
  """

  hidden: eqx.nn.Linear
  head: eqx.nn.Linear
  offset: jax.Array
  feature_order: jax.Array
  width: int
  activation: Callable = eqx.field(static=True)

  def __init__(self, key):
    hidden_key, head_key = jax.random.split(key)
    self.hidden = eqx.nn.Linear(FEATURES, WIDTH + 1, key=hidden_key)
    self.head = eqx.nn.Linear(WIDTH, 'scalar', key=head_key)
    self.offset = jnp.array([0.5, -0.25, 1.0])
    self.feature_order = jnp.array([2, 0, 1], jnp.int32)
    self.width = WIDTH
    self.activation = jnp.tanh

  def __call__(self, x):
    x = x[self.feature_order] + self.offset
    return self.head(self.activation(self.hidden(x))[: self.width])


def make_mlp():
  return eqx.nn.MLP(
    FEATURES, 'scalar', WIDTH, 2, activation=jnp.tanh, key=jax.random.key(0)
  )


def make_regressor():
  return Regressor(jax.random.key(1))


def trains_all(model):
  del model
  return eqx.is_inexact_array


def trains_all_but_offset(model):
  """True on every inexact array but ``offset``: a frozen field."""
  spec = jax.tree.map(eqx.is_inexact_array, model)
  return eqx.tree_at(lambda m: m.offset, spec, replace=False)


# name: (the model, its filter spec: what is trained)
MODELS = {
  'mlp': (make_mlp, trains_all),
  'frozen_fields': (make_regressor, trains_all_but_offset),
}

OPTIMIZERS = {
  'sgd_momentum': lambda: optax.sgd(0.1, momentum=0.9),
  'clipped_adamw': lambda: optax.chain(
    optax.clip_by_global_norm(CLIP_NORM),
    optax.adamw(0.05, eps=0.1, weight_decay=0.1),  # large eps: scale shows
  ),
}


def make_batch(seed, count):
  rng = np.random.default_rng(seed)
  mask = (np.arange(SEQS * SEQ_LEN) < count).reshape(SEQS, SEQ_LEN)
  return {
    'x': jnp.asarray(rng.normal(size=(SEQS, SEQ_LEN, FEATURES)), jnp.float32),
    'y': jnp.asarray(rng.normal(size=(SEQS, SEQ_LEN)), jnp.float32),
    'mask': jnp.asarray(mask, jnp.float32),
  }


def make_windows():
  return [
    [make_batch(10 * w + i, n) for i, n in enumerate(counts)]
    for w, counts in enumerate(TOKEN_COUNTS)
  ]


def loss_sum(model, batch):
  """Squared error summed over the counted tokens of the batch."""
  prediction = jax.vmap(jax.vmap(model))(batch['x'])
  return jnp.sum((prediction - batch['y']) ** 2 * batch['mask'])


def num_tokens(batch):
  return jnp.sum(batch['mask']).astype(jnp.int32)


@eqx.filter_jit
def train_step(model, opt_state, batch, spec, tx):
  trained, frozen = eqx.partition(model, spec)

  def loss_fn(trained):
    return loss_sum(eqx.combine(trained, frozen), batch)

  loss, grads = eqx.filter_value_and_grad(loss_fn)(trained)
  updates, opt_state = tx.update(
    grads, opt_state, trained, num_tokens=num_tokens(batch), loss=loss
  )
  return eqx.apply_updates(model, updates), opt_state, grads


@eqx.filter_jit
def full_batch_step(model, opt_state, window, spec, inner):
  """One step of ``inner`` on the window's token-mean gradient."""
  trained, frozen = eqx.partition(model, spec)
  total = sum(jnp.sum(batch['mask']) for batch in window)

  def window_loss(trained):
    model = eqx.combine(trained, frozen)
    return sum(loss_sum(model, batch) for batch in window) / total

  loss, grads = eqx.filter_value_and_grad(window_loss)(trained)
  updates, opt_state = inner.update(grads, opt_state, trained)
  model = eqx.apply_updates(model, updates)
  return model, opt_state, loss, optax.tree.norm(grads, ord=1), updates


class Expected(NamedTuple):
  """A window of full-batch training: the model after it and the loss
  before it, each with how far float32 round-off can take accumulation
  from it."""

  model: eqx.Module
  atol: float
  loss: float
  loss_atol: float


@functools.cache
def reference_run(model_name, optimizer_name):
  """Full-batch training, an :class:`Expected` per window.

  ``atol`` is ``test_multistep.round_off_atol`` (its docstring derives it)
  with this model's ``TERM_ROUNDINGS``: per window 2 (n + m) u of the
  gradient, doubled by the update (linear in it: momentum SGD; homogeneous
  of degree 0 or between: Adam with a large eps; the clip does not bind),
  relative to the window's largest update, plus a rounding of each
  parameter in each run. As ``helpers.full_batch``,
  the window's loss, a sum of n one-signed terms, is within 2 (n + m) u of
  it relatively, taken at parameters up to the previous windows' ``atol``
  apart: the 1-norm of its gradient times that, doubled for the
  second-order term.
  """
  make_model, make_spec = MODELS[model_name]
  model = make_model()
  spec = make_spec(model)
  inner = OPTIMIZERS[optimizer_name]()
  opt_state = inner.init(eqx.filter(model, spec))
  windows = make_windows()
  n = test_multistep.window_tokens(windows)
  loss_rtol = 2 * (n + TERM_ROUNDINGS) * test_multistep.UNIT_ROUND_OFF
  largest_param = test_multistep.largest(trained_part(model, spec))
  run, largest_updates, atol = [], [], 0.0
  for window in windows:
    model, opt_state, loss, gradient_norm, updates = full_batch_step(
      model, opt_state, window, spec, inner
    )
    loss_atol = 2 * (loss_rtol * float(loss) + float(gradient_norm) * atol)
    largest_updates.append(test_multistep.largest(updates))
    largest_param = max(
      largest_param, test_multistep.largest(trained_part(model, spec))
    )
    atol = test_multistep.round_off_atol(
      largest_updates, largest_param, windows, TERM_ROUNDINGS
    )
    run.append(Expected(model, atol, float(loss), loss_atol))
  return run


def trained_part(model, spec):
  return eqx.filter(model, spec)


@pytest.mark.parametrize('optimizer_name', sorted(OPTIMIZERS))
@pytest.mark.parametrize('model_name', sorted(MODELS))
def test_equals_full_batch_training(model_name, optimizer_name):
  make_model, make_spec = MODELS[model_name]
  model = make_model()
  initial = model
  spec = make_spec(model)
  tx = tokacc.token_weighted_multistep(OPTIMIZERS[optimizer_name](), K)
  opt_state = tx.init(eqx.filter(model, spec))
  for window, expected in zip(
    make_windows(), reference_run(model_name, optimizer_name)
  ):
    for i, batch in enumerate(window):
      previous = model
      model, opt_state, grads = train_step(model, opt_state, batch, spec, tx)
      if i < K - 1:  # micro-steps leave the model as it was
        chex.assert_trees_all_equal(
          eqx.filter(model, eqx.is_array), eqx.filter(previous, eqx.is_array)
        )
    assert bool(tokacc.has_updated(opt_state))
    # Within the round-off bounds of reference_run (derived there).
    chex.assert_trees_all_close(
      trained_part(model, spec),
      trained_part(expected.model, spec),
      rtol=0,
      atol=expected.atol,
    )
    np.testing.assert_allclose(
      tokacc.window_loss(opt_state),
      expected.loss,
      rtol=0,
      atol=expected.loss_atol,
    )
  assert int(tokacc.find_state(opt_state).gradient_step) == len(TOKEN_COUNTS)
  # What is not trained is untouched, and kept its type.
  frozen = eqx.filter(model, spec, inverse=True)
  chex.assert_trees_all_equal(frozen, eqx.filter(initial, spec, inverse=True))
  assert jax.tree.structure(model) == jax.tree.structure(initial)


def test_frozen_field_gradients_are_none_and_accumulator_skips_them():
  """The filtered-out field has ``None`` gradients, and no accumulator."""
  model = make_regressor()
  spec = trains_all_but_offset(model)
  tx = tokacc.token_weighted_multistep(OPTIMIZERS['sgd_momentum'](), K)
  opt_state = tx.init(eqx.filter(model, spec))
  batch = make_windows()[0][0]
  _, opt_state, grads = train_step(model, opt_state, batch, spec, tx)
  assert grads.offset is None and grads.feature_order is None
  assert grads.width is None
  grad_sums = tokacc.find_state(opt_state).grad_sums
  assert grad_sums.offset is None and grad_sums.feature_order is None
  chex.assert_trees_all_equal_structs(grad_sums, grads)
  # It holds the micro-batch's token-summed gradients, bit for bit: the
  # window's first micro-step adds them to zeros (0 + g is g exactly, with
  # compensation too: its error term is 0 + 0).
  chex.assert_trees_all_equal(grad_sums, grads)
