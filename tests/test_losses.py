"""Tests of token_cross_entropy against a hand-written reference."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import optax_tokacc as tokacc

BATCH, LENGTH, VOCAB = 3, 5, 7


def reference_cross_entropy(logits, labels, counted):
  """Plain float32 NumPy cross-entropy summed over the counted positions."""
  logits = np.asarray(logits, np.float32)
  shifted = logits - logits.max(axis=-1, keepdims=True)
  log_probs = shifted - np.log(np.exp(shifted).sum(axis=-1, keepdims=True))
  safe_labels = np.where(counted, labels, 0)
  picked = np.take_along_axis(log_probs, safe_labels[..., None], axis=-1)
  token_losses = -picked[..., 0]
  return np.where(counted, token_losses, 0).sum(), int(counted.sum())


def make_inputs(dtype, seed=0):
  rng = np.random.default_rng(seed)
  logits = (3 * rng.normal(size=(BATCH, LENGTH, VOCAB))).astype(np.float32)
  labels = rng.integers(0, VOCAB, size=(BATCH, LENGTH)).astype(np.int32)
  logits = jnp.asarray(logits, dtype)
  return logits, labels, rng


@pytest.mark.parametrize('dtype', [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize('use_where', [False, True])
@pytest.mark.parametrize('ignore_index', [-100, 3, None])
def test_matches_reference(dtype, use_where, ignore_index):
  logits, labels, rng = make_inputs(dtype)
  counted = np.ones(labels.shape, bool)
  if ignore_index == -100:
    padding = rng.random(labels.shape) < 0.3
    labels = np.where(padding, -100, labels)
  if ignore_index == 3:
    labels[0, :2] = 3
  if ignore_index is not None:
    counted &= labels != ignore_index
  where = None
  if use_where:
    where = rng.random(labels.shape) < 0.7
    counted &= where

  fn = jax.jit(
    lambda logits, labels, where: tokacc.token_cross_entropy(
      logits, labels, where=where, ignore_index=ignore_index
    )
  )
  loss_sum, num_tokens = fn(logits, labels, where)

  # The reference upcasts the (already rounded) bf16 logits to float32.
  expected_sum, expected_tokens = reference_cross_entropy(
    np.asarray(logits.astype(jnp.float32)), labels, counted
  )
  assert 0 < expected_tokens < labels.size or ignore_index is None
  assert loss_sum.dtype == jnp.float32
  assert num_tokens.dtype == jnp.int32
  assert int(num_tokens) == expected_tokens
  chex.assert_trees_all_close(loss_sum, expected_sum, rtol=1e-6, atol=1e-5)


def test_bfloat16_logits_use_float32_math():
  # Logits whose log-sum-exp is not representable in bfloat16 arithmetic.
  logits = jnp.asarray([[100.0, 99.0, 98.0, 97.0]], jnp.bfloat16)
  labels = jnp.array([1])
  loss_sum, _ = tokacc.token_cross_entropy(logits, labels)
  expected, _ = reference_cross_entropy(
    np.asarray(logits.astype(jnp.float32)), np.asarray(labels), np.ones(1, bool)
  )
  chex.assert_trees_all_close(loss_sum, expected, rtol=1e-5)


def test_all_positions_ignored_gives_zero_and_finite_grads():
  logits = jnp.ones((2, 3, VOCAB))
  labels = jnp.full((2, 3), -100)

  def loss(logits):
    return tokacc.token_cross_entropy(logits, labels)[0]

  loss_sum, grads = jax.jit(jax.value_and_grad(loss))(logits)
  assert float(loss_sum) == 0.0
  chex.assert_trees_all_equal(grads, jnp.zeros_like(logits))
  assert int(tokacc.token_cross_entropy(logits, labels)[1]) == 0


def test_gradient_matches_reference_mean():
  logits, labels, rng = make_inputs(jnp.float32, seed=1)
  labels = np.where(rng.random(labels.shape) < 0.4, -100, labels)
  counted = labels != -100

  def ours(logits):
    loss_sum, num_tokens = tokacc.token_cross_entropy(logits, labels)
    return loss_sum / num_tokens

  def reference(logits):
    log_probs = jax.nn.log_softmax(logits, axis=-1)
    picked = jnp.take_along_axis(
      log_probs, jnp.where(counted, labels, 0)[..., None], axis=-1
    )[..., 0]
    return -jnp.sum(jnp.where(counted, picked, 0)) / counted.sum()

  chex.assert_trees_all_close(
    jax.jit(jax.grad(ours))(logits),
    jax.grad(reference)(logits),
    rtol=1e-6,
    atol=1e-7,
  )


@pytest.mark.parametrize(
  ('logits_shape', 'labels_shape', 'where_shape', 'error', 'message'),
  [
    ((), (), None, ValueError, 'vocabulary axis'),
    ((2, 3, 7), (2, 4), None, ValueError, r'labels need shape \(2, 3\)'),
    ((2, 3, 7), (2, 3, 7), None, ValueError, 'labels must have the shape'),
    ((2, 3, 7), (2, 3), (2, 4), ValueError, 'where must have the shape'),
  ],
)
def test_bad_shapes(logits_shape, labels_shape, where_shape, error, message):
  logits = jnp.zeros(logits_shape)
  labels = jnp.zeros(labels_shape, jnp.int32)
  where = None if where_shape is None else jnp.ones(where_shape, bool)
  with pytest.raises(error, match=message):
    jax.jit(tokacc.token_cross_entropy)(logits, labels, where=where)


def test_bad_dtypes():
  with pytest.raises(TypeError, match='labels must be integer'):
    tokacc.token_cross_entropy(jnp.zeros((2, 7)), jnp.zeros(2))
  with pytest.raises(TypeError, match='logits must be floating'):
    tokacc.token_cross_entropy(jnp.zeros((2, 7), jnp.int32), jnp.zeros(2, int))
