"""Tests of microbatched_value_and_grad against full-batch gradients."""

import chex
import helpers
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


def lm_params(dtype=jnp.float32):
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


def reference_loss_sum(params, batch):
  """Plain cross-entropy summed over the batch's counted tokens."""
  hidden = jnp.tanh(params['embed'][batch['inputs']])
  log_probs = jax.nn.log_softmax(hidden @ params['out'], axis=-1)
  counted = batch['labels'] != -100
  labels = jnp.where(counted, batch['labels'], 0)
  picked = jnp.take_along_axis(log_probs, labels[..., None], axis=-1)[..., 0]
  return -jnp.sum(jnp.where(counted, picked, 0))


def counted(batch):
  return float(np.sum(batch['labels'] != -100))


def reference_mean_loss(params, batch):
  """Plain token-mean cross-entropy of the whole batch."""
  return reference_loss_sum(params, batch) / counted(batch)


@pytest.mark.parametrize(
  'microbatch_size', [pytest.param(1, marks=pytest.mark.slow), 2, 4, 8]
)
def test_equals_full_batch_sum(microbatch_size):
  params, batch = lm_params(), make_batch(8)
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
    grads_sum,
    expected_grads,
    rtol=0,
    atol=ROUND_OFF * helpers.largest(expected_grads),
  )
  # Divided by the tokens: the gradient of the plain token-mean loss.
  expected_mean = jax.grad(reference_mean_loss)(params, batch)
  chex.assert_trees_all_close(
    jax.tree.map(lambda g: g / num_tokens, grads_sum),
    expected_mean,
    rtol=0,
    atol=ROUND_OFF * helpers.largest(expected_mean),
  )


@pytest.mark.slow
def test_gradients_keep_the_parameter_dtype():
  params = lm_params(jnp.bfloat16)
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

  # helpers.full_batch with this model's roundings of a token's term (the
  # dot product, the log-softmax over the vocabulary, about 10 elementwise
  # operations): the window's gradient within 2 (n + m) u of its terms,
  # relative to the update, doubled by the clip and Adam (homogeneous of
  # degree 0 in it); a rounding of each parameter.
  expected = helpers.full_batch(
    inner,
    lm_params(),
    [[batch] for batch in batches],
    reference_loss_sum,
    term_roundings=DIM + VOCAB + 10,
    count_fn=counted,
  )
  params, opt_state = lm_params(), tx.init(lm_params())
  for batch, window in zip(batches, expected.windows):
    for i in range(every_k):
      step_batch = jax.tree.map(
        lambda x, i=i: x[i * step_size : (i + 1) * step_size], batch
      )
      params, opt_state = train_step(params, opt_state, step_batch)
    assert bool(tokacc.has_updated(opt_state))
    helpers.assert_within_round_off(params, window)
    chex.assert_trees_all_close(
      tokacc.window_loss(opt_state), window.loss, rtol=0, atol=window.loss_atol
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
    grad_fn(lm_params(), make_batch(6))


def test_batch_leading_axes_differ():
  batch = make_batch(8)
  batch['labels'] = batch['labels'][:4]
  grad_fn = jax.jit(tokacc.microbatched_value_and_grad(loss_fn, 2))
  with pytest.raises(ValueError, match='same leading'):
    grad_fn(lm_params(), batch)
