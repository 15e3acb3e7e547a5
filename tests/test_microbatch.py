"""Tests of microbatched_value_and_grad against full-batch gradients."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import optax_tokacc as tokacc

VOCAB, DIM, LENGTH = 11, 8, 6
# Float32 round-off of a batch of 8 sequences: a sum over its n = 8 * LENGTH
# token terms, each through m = DIM + VOCAB + 10 roundings (the dot product,
# the log-softmax over the vocabulary, about 10 elementwise operations).
# Two evaluations in different orders differ by at most 2 (n + m) u of the
# terms' size (u = 2**-24): 9e-6. The loss's terms are positive (no
# cancellation); gradients are compared relative to the largest one.
ROUND_OFF = 2 * (8 * LENGTH + DIM + VOCAB + 10) * 2.0**-24


def init_params(dtype=jnp.float32):
  keys = jax.random.split(jax.random.key(0), 2)
  return {
    'embed': jax.random.normal(keys[0], (VOCAB, DIM), dtype),
    'out': jax.random.normal(keys[1], (DIM, VOCAB), dtype) / 3,
  }


def make_batch(batch_size, seed=0):
  """Sequences of lengths 1..LENGTH, padded; labels -100 on padding."""
  rng = np.random.default_rng(seed)
  tokens = rng.integers(0, VOCAB, size=(batch_size, LENGTH + 1))
  lengths = rng.integers(1, LENGTH + 1, size=batch_size)
  padding = np.arange(LENGTH)[None, :] >= lengths[:, None]
  labels = np.where(padding, -100, tokens[:, 1:])
  return {
    'inputs': jnp.asarray(tokens[:, :-1], jnp.int32),
    'labels': jnp.asarray(labels, jnp.int32),
  }


def loss_fn(params, batch):
  hidden = jnp.tanh(params['embed'][batch['inputs']])
  logits = hidden @ params['out']
  return tokacc.token_cross_entropy(logits, batch['labels'])


def reference_mean_loss(params, batch):
  """Plain token-mean cross-entropy of the whole batch."""
  hidden = jnp.tanh(params['embed'][batch['inputs']])
  log_probs = jax.nn.log_softmax(hidden @ params['out'], axis=-1)
  counted = batch['labels'] != -100
  labels = jnp.where(counted, batch['labels'], 0)
  picked = jnp.take_along_axis(log_probs, labels[..., None], axis=-1)[..., 0]
  return -jnp.sum(jnp.where(counted, picked, 0)) / counted.sum()


@pytest.mark.parametrize(
  'microbatch_size', [pytest.param(1, marks=pytest.mark.slow), 2, 4, 8]
)
def test_equals_full_batch_sum(microbatch_size):
  params, batch = init_params(), make_batch(8)
  grad_fn = jax.jit(
    tokacc.microbatched_value_and_grad(loss_fn, microbatch_size)
  )
  (loss_sum, num_tokens), grads_sum = grad_fn(params, batch)

  (expected_sum, expected_tokens), expected_grads = jax.value_and_grad(
    loss_fn, has_aux=True
  )(params, batch)
  assert num_tokens.dtype == jnp.int32
  assert int(num_tokens) == int(expected_tokens)
  chex.assert_trees_all_close(loss_sum, expected_sum, rtol=ROUND_OFF)
  chex.assert_trees_all_close(
    grads_sum, expected_grads, rtol=0, atol=ROUND_OFF * largest(expected_grads)
  )
  # Divided by the tokens: the gradient of the plain token-mean loss.
  expected_mean = jax.grad(reference_mean_loss)(params, batch)
  chex.assert_trees_all_close(
    jax.tree.map(lambda g: g / num_tokens, grads_sum),
    expected_mean,
    rtol=0,
    atol=ROUND_OFF * largest(expected_mean),
  )


def largest(tree) -> float:
  return max(float(jnp.max(jnp.abs(x))) for x in jax.tree.leaves(tree))


@pytest.mark.slow
def test_gradients_keep_the_parameter_dtype():
  params = init_params(jnp.bfloat16)
  grad_fn = jax.jit(tokacc.microbatched_value_and_grad(loss_fn, 2))
  (loss_sum, _), grads_sum = grad_fn(params, make_batch(8))
  chex.assert_trees_all_equal_dtypes(grads_sum, params)
  assert loss_sum.dtype == jnp.float32


@pytest.mark.slow
@pytest.mark.parametrize('every_k', [1, 2])
def test_composes_with_token_weighted_multistep(every_k):
  """Micro-batches inside and across steps equal full-batch training."""
  window_size, num_windows = 8, 2
  step_size = window_size // every_k
  batches = [make_batch(window_size, seed=s) for s in range(num_windows)]
  inner = optax.chain(optax.clip_by_global_norm(1.0), optax.adam(0.05))

  tx = tokacc.token_weighted_multistep(inner, every_k)
  grad_fn = tokacc.microbatched_value_and_grad(loss_fn, microbatch_size=2)

  @jax.jit
  def train_step(params, opt_state, batch):
    (loss_sum, num_tokens), grads = grad_fn(params, batch)
    updates, opt_state = tx.update(
      grads, opt_state, params, num_tokens=num_tokens, loss=loss_sum
    )
    return tokacc.apply_if_updated(params, updates, opt_state), opt_state

  @jax.jit
  def reference_step(params, opt_state, batch):
    loss, grads = jax.value_and_grad(reference_mean_loss)(params, batch)
    updates, opt_state = inner.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  params = reference_params = init_params()
  opt_state, reference_state = tx.init(params), inner.init(params)
  atol = 0.0  # how far round-off can take params from reference_params
  for batch in batches:
    # The loss is a sum of one-signed terms, within ROUND_OFF of it, taken
    # at parameters up to atol apart: that moves it by at most its
    # gradient's 1-norm times atol (twice both covers the second order).
    gradient = jax.grad(reference_mean_loss)(reference_params, batch)
    gradient_norm = sum(float(jnp.sum(jnp.abs(g))) for g in gradient.values())
    for i in range(every_k):
      step_batch = jax.tree.map(
        lambda x, i=i: x[i * step_size : (i + 1) * step_size], batch
      )
      params, opt_state = train_step(params, opt_state, step_batch)
    previous = reference_params
    reference_params, reference_state, reference_loss = reference_step(
      reference_params, reference_state, batch
    )
    loss_atol = 2 * (ROUND_OFF * float(reference_loss) + gradient_norm * atol)
    # As test_multistep.round_off_atol: the window's gradient within
    # ROUND_OFF of its terms, relative to the update, doubled by the clip
    # and Adam (homogeneous of degree 0 in it); a rounding of each parameter.
    update = largest(jax.tree.map(jnp.subtract, reference_params, previous))
    atol += 2 * ROUND_OFF * update + 2 * 2.0**-24 * largest(reference_params)
    assert bool(tokacc.has_updated(opt_state))
    chex.assert_trees_all_close(params, reference_params, rtol=0, atol=atol)
    chex.assert_trees_all_close(
      tokacc.window_loss(opt_state), reference_loss, rtol=0, atol=loss_atol
    )


@pytest.mark.parametrize(
  ('microbatch_size', 'error', 'message'),
  [
    (0, ValueError, 'microbatch_size must be >= 1'),
    (-2, ValueError, 'microbatch_size must be >= 1'),
    (2.0, TypeError, 'microbatch_size must be a Python int'),
    (True, TypeError, 'microbatch_size must be a Python int'),
    (None, TypeError, 'microbatch_size must be a Python int'),
  ],
)
def test_bad_microbatch_size(microbatch_size, error, message):
  with pytest.raises(error, match=message):
    tokacc.microbatched_value_and_grad(loss_fn, microbatch_size)


def test_batch_not_divisible():
  grad_fn = jax.jit(tokacc.microbatched_value_and_grad(loss_fn, 4))
  with pytest.raises(
    ValueError, match='batch size 6 is not divisible by microbatch_size=4'
  ):
    grad_fn(init_params(), make_batch(6))


def test_batch_leading_axes_differ():
  batch = make_batch(8)
  batch['labels'] = batch['labels'][:4]
  grad_fn = jax.jit(tokacc.microbatched_value_and_grad(loss_fn, 2))
  with pytest.raises(ValueError, match='same leading'):
    grad_fn(init_params(), batch)
