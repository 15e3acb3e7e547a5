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

import chex
import equinox as eqx
import helpers
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import optax_tokacc as tokacc

# Each test takes 5 s or more of a core (--durations=0).
pytestmark = pytest.mark.slow

FEATURES, WIDTH = helpers.FEATURES, 4
K = 3
TOKEN_COUNTS = ((5, 1, 8), (0, 6, 3), (7, 2, 4))  # three windows of K
CLIP_NORM = 1e3  # far above the gradient norms: the chain is not scale-free
# The roundings on one token's path to its gradient term, for
# helpers.round_off_atol: the dot products' terms (FEATURES, WIDTH and WIDTH
# forward, as many backward) and about 20 elementwise operations (the bias
# adds, two tanh and their derivatives, the square, the mask).
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
    self.offset = jnp.linspace(-0.25, 1.0, FEATURES)
    self.feature_order = jnp.arange(FEATURES)[::-1].astype(jnp.int32)
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


def model_loss_sum(model, batch):
  """Squared error summed over the counted tokens of the batch."""
  prediction = jax.vmap(jax.vmap(model))(batch['x'])
  return jnp.sum((prediction - batch['y']) ** 2 * batch['mask'])


@eqx.filter_jit
def train_step(model, opt_state, batch, spec, tx):
  trained, frozen = eqx.partition(model, spec)

  def loss_fn(trained):
    return model_loss_sum(eqx.combine(trained, frozen), batch)

  loss, grads = eqx.filter_value_and_grad(loss_fn)(trained)
  updates, opt_state = tx.update(
    grads, opt_state, trained, num_tokens=helpers.token_count(batch), loss=loss
  )
  return eqx.apply_updates(model, updates), opt_state, grads


def trained_part(model, spec):
  return eqx.filter(model, spec)


def make_windows():
  return helpers.windows_of(TOKEN_COUNTS)


@functools.cache
def reference_run(model_name, optimizer_name):
  """Full-batch training of the trained part of the model
  (``helpers.full_batch``, with this model's ``TERM_ROUNDINGS``): the
  updates of ``CLIPPED_ADAMW`` are linear in the gradient or between that
  and homogeneous of degree 0 (Adam with a large eps; the clip does not
  bind), as the bound needs."""
  make_model, make_spec = MODELS[model_name]
  model = make_model()
  spec = make_spec(model)
  trained, frozen = eqx.partition(model, spec)

  def loss_fn(trained, batch):
    return model_loss_sum(eqx.combine(trained, frozen), batch)

  return helpers.full_batch(
    OPTIMIZERS[optimizer_name](),
    trained,
    make_windows(),
    loss_fn,
    term_roundings=TERM_ROUNDINGS,
  )


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
    make_windows(), reference_run(model_name, optimizer_name).windows
  ):
    for i, batch in enumerate(window):
      previous = model
      model, opt_state, grads = train_step(model, opt_state, batch, spec, tx)
      if i < K - 1:  # micro-steps leave the model as it was
        chex.assert_trees_all_equal(
          eqx.filter(model, eqx.is_array), eqx.filter(previous, eqx.is_array)
        )
    assert bool(tokacc.has_updated(opt_state))
    helpers.assert_within_round_off(trained_part(model, spec), expected)
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
