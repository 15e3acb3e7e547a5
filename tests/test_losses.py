"""Tests of token_cross_entropy against a hand-written reference."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import optax_tokacc as tokacc

BATCH, LENGTH, VOCAB = 3, 5, 7


def reference_cross_entropy(logits, labels, weights):
  """Plain float32 NumPy cross-entropy: (sum of weight x loss, sum of weights).

  ``weights`` is 0 at positions that do not count; bool weights are a mask.
  """
  logits = np.asarray(logits, np.float32)
  shifted = logits - logits.max(axis=-1, keepdims=True)
  log_probs = shifted - np.log(np.exp(shifted).sum(axis=-1, keepdims=True))
  safe_labels = np.where(weights != 0, labels, 0)
  picked = np.take_along_axis(log_probs, safe_labels[..., None], axis=-1)
  token_losses = -picked[..., 0]
  weights = np.asarray(weights, np.float64)
  return (weights * token_losses).sum(), weights.sum()


def make_inputs(dtype, seed=0):
  rng = np.random.default_rng(seed)
  logits = (3 * rng.normal(size=(BATCH, LENGTH, VOCAB))).astype(np.float32)
  labels = rng.integers(0, VOCAB, size=(BATCH, LENGTH)).astype(np.int32)
  logits = jnp.asarray(logits, dtype)
  return logits, labels, rng


def make_where(kind, rng, shape):
  """A mask or weights of the given kind, with some zeros."""
  mask = rng.random(shape) < 0.7
  if kind is None:
    return None
  if kind == 'bool':
    return mask
  if kind == 'int 0/1':
    return mask.astype(np.int32)
  if kind == 'int weights':
    return mask * rng.integers(1, 4, size=shape, dtype=np.int32)
  if kind == 'float 0/1':
    return mask.astype(np.float32)
  assert kind == 'float weights'
  return (mask * rng.uniform(0.05, 2.0, size=shape)).astype(np.float32)


WHERE_KINDS = [None, 'bool', 'int 0/1', 'int weights', 'float 0/1']
WHERE_KINDS += ['float weights']


@pytest.mark.parametrize('dtype', [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize('where_kind', WHERE_KINDS)
@pytest.mark.parametrize('ignore_index', [-100, 3, None])
def test_matches_reference(dtype, where_kind, ignore_index):
  logits, labels, rng = make_inputs(dtype)
  counted = np.ones(labels.shape, bool)
  if ignore_index == -100:
    padding = rng.random(labels.shape) < 0.3
    labels = np.where(padding, -100, labels)
  if ignore_index == 3:
    labels[0, :2] = 3
  if ignore_index is not None:
    counted &= labels != ignore_index
  where = make_where(where_kind, rng, labels.shape)
  weights = counted if where is None else np.where(counted, where, 0)

  fn = jax.jit(
    lambda logits, labels, where: tokacc.token_cross_entropy(
      logits, labels, where=where, ignore_index=ignore_index
    )
  )
  loss_sum, num_tokens = fn(logits, labels, where)

  # The reference upcasts the (already rounded) bf16 logits to float32.
  expected_sum, expected_tokens = reference_cross_entropy(
    np.asarray(logits.astype(jnp.float32)), labels, weights
  )
  assert 0 < np.count_nonzero(weights) < labels.size or ignore_index is None
  assert loss_sum.dtype == jnp.float32
  if where_kind is None or not where_kind.startswith('float'):
    assert num_tokens.dtype == jnp.int32  # an exact count
    assert int(num_tokens) == expected_tokens
  else:
    assert num_tokens.dtype == jnp.float32
    # A float32 sum of n one-signed weights: within gamma(n) of it.
    chex.assert_trees_all_close(
      num_tokens, expected_tokens, rtol=gamma(labels.size)
    )
  rtol, atol = cross_entropy_round_off(logits, weights)
  chex.assert_trees_all_close(loss_sum, expected_sum, rtol=rtol, atol=atol)


UNIT_ROUND_OFF = 2.0**-24  # float32


def gamma(n):
  """Higham's bound on the relative error of a float32 sum of n terms."""
  return n * UNIT_ROUND_OFF / (1 - n * UNIT_ROUND_OFF)


def cross_entropy_round_off(logits, weights):
  """(rtol, atol) between two float32 evaluations of the weighted sum of
  cross-entropies of ``logits``, in any order.

  A token's loss, log sum_j exp(l_j - max l) - (l_y - max l), sums VOCAB
  exponentials (each within a few u) to within gamma(VOCAB + 2) of it,
  relatively, so as much absolutely on its log; the shifts, the logarithm
  and the subtraction round by u of the values involved, at most the
  token's spread max l - min l plus log VOCAB: (VOCAB + 6) u (1 + that),
  weighted. The weighted sum of n such one-signed terms adds gamma(n) of
  it. Either evaluation errs so far: twice. Measured: 0.02 of it.
  """
  logits = np.asarray(jnp.asarray(logits, jnp.float32), np.float64)
  spread = logits.max(axis=-1) - logits.min(axis=-1) + np.log(VOCAB)
  per_token = (VOCAB + 6) * UNIT_ROUND_OFF * (1 + spread)
  atol = 2 * float(np.sum(np.abs(np.asarray(weights, np.float64)) * per_token))
  return 2 * gamma(np.size(weights)), atol


def test_fractional_weights_are_not_a_mask():
  logits = jnp.log(jnp.array([[[1.0, 3.0], [1.0, 1.0], [3.0, 1.0]]]))
  labels = jnp.array([[1, 0, -100]])
  where = jnp.array([[0.25, 0.5, 1.0]])  # the padding counts 0 all the same
  loss_sum, num_tokens = tokacc.token_cross_entropy(logits, labels, where=where)
  # -log p: log(4/3) for the first position, log(2) for the second.
  expected = 0.25 * np.log(4 / 3) + 0.5 * np.log(2)
  rtol, atol = cross_entropy_round_off(logits, where)  # measured: equal
  chex.assert_trees_all_close(loss_sum, expected, rtol=rtol, atol=atol)
  assert num_tokens.dtype == jnp.float32
  assert float(num_tokens) == 0.75


@pytest.mark.parametrize(
  ('where', 'dtype'),
  [
    (np.array([True, False, True]), jnp.int32),
    (np.array([1, 0, 2], np.int8), jnp.int32),
    (np.array([1.0, 0.0, 2.0], np.float32), jnp.float32),
    (jnp.array([1.0, 0.0, 2.0], jnp.bfloat16), jnp.float32),
    (jnp.array([1.0, 0.0, 2.0], jnp.float16), jnp.float32),
  ],
)
def test_count_dtype_follows_where(where, dtype):
  _, num_tokens = tokacc.token_cross_entropy(
    jnp.zeros((3, 4)), jnp.arange(3), where=where
  )
  assert num_tokens.dtype == dtype
  assert num_tokens == np.asarray(where, np.float32).sum()


def test_float_mask_counts_exactly_with_the_default_int32_counter():
  """A 0/1 float mask trains exactly like the same bool mask."""
  logits, labels, rng = make_inputs(jnp.float32, seed=3)
  mask = rng.random(labels.shape) < 0.6
  params = {'logits': logits}
  tx = tokacc.token_weighted_multistep(optax.sgd(1.0), every_k_schedule=2)

  def window(where):
    @jax.jit
    def micro_step(opt_state, where):
      (loss, num_tokens), grads = jax.value_and_grad(
        lambda p: tokacc.token_cross_entropy(p['logits'], labels, where=where),
        has_aux=True,
      )(params)
      return tx.update(
        grads, opt_state, params, num_tokens=num_tokens, loss=loss
      )

    opt_state = tx.init(params)
    first_row = jnp.arange(BATCH)[:, None] == 0
    first = jnp.where(first_row, where, jnp.zeros_like(where))  # fewer tokens
    for micro_batch_where in (first, where):
      updates, opt_state = micro_step(opt_state, micro_batch_where)
    return updates, opt_state

  updates_bool, state_bool = window(jnp.asarray(mask))
  updates_float, state_float = window(jnp.asarray(mask, jnp.float32))
  assert bool(tokacc.has_updated(state_float))
  assert int(state_float.last_tokens) == int(state_bool.last_tokens)
  # Two programs that differ in the mask's type alone: the same terms,
  # perhaps summed in another order (the update is their mean, the terms
  # are below it times 2 BATCH LENGTH). Measured: bit for bit.
  chex.assert_trees_all_close(
    updates_float, updates_bool, rtol=2 * gamma(2 * BATCH * LENGTH)
  )


def test_fractional_weights_accumulate_exactly_with_float_tokens():
  """k micro-batches of weighted tokens give the weighted full-batch step."""
  k, dim = 3, 4
  rng = np.random.default_rng(2)
  features = rng.normal(size=(k, BATCH, LENGTH, dim)).astype(np.float32)
  labels = rng.integers(0, VOCAB, size=(k, BATCH, LENGTH)).astype(np.int32)
  weights = make_where('float weights', rng, labels.shape)
  weights[0] *= 0.1  # micro-batches of very different total weight
  params = {'w': jnp.asarray(rng.normal(size=(dim, VOCAB)), jnp.float32)}

  def loss_fn(params, features, labels, weights):
    logits = features @ params['w']
    return tokacc.token_cross_entropy(logits, labels, where=weights)

  tx = tokacc.token_weighted_multistep(
    optax.sgd(1.0), every_k_schedule=k, token_dtype=jnp.float32
  )

  @jax.jit
  def micro_step(opt_state, features, labels, weights):
    (loss, num_tokens), grads = jax.value_and_grad(loss_fn, has_aux=True)(
      params, features, labels, weights
    )
    return tx.update(grads, opt_state, params, num_tokens=num_tokens, loss=loss)

  opt_state = tx.init(params)
  for i in range(k):
    updates, opt_state = micro_step(
      opt_state, features[i], labels[i], weights[i]
    )

  def weighted_mean(params):  # plain: sum_i w_i l_i / sum_i w_i, all at once
    log_probs = jax.nn.log_softmax(features @ params['w'], axis=-1)
    picked = jnp.take_along_axis(log_probs, labels[..., None], axis=-1)
    return -jnp.sum(weights * picked[..., 0]) / weights.sum()

  expected = jax.tree.map(jnp.negative, jax.grad(weighted_mean)(params))
  # An element of the gradient sums the tokens' weight x feature x (p_v -
  # onehot_v) over total weight, |p - onehot| summing to at most 2 over v:
  # each term of a few roundings (VOCAB + dim + 6), their sum within
  # gamma(n + those) of the terms' size; either evaluation: twice.
  # Measured: 6e-8, 0.003 of it.
  total = float(weights.sum())
  terms = 2 * float(np.sum(weights * np.abs(features).max(axis=-1))) / total
  atol = 2 * gamma(weights.size + VOCAB + dim + 6) * terms
  chex.assert_trees_all_close(updates, expected, rtol=0, atol=atol)
  rtol, atol = cross_entropy_round_off(
    features @ np.asarray(params['w']), weights
  )
  chex.assert_trees_all_close(  # measured: 2.4e-7, 0.007 of it
    tokacc.window_loss(opt_state),
    weighted_mean(params),
    rtol=rtol + gamma(1),  # the division by the total
    atol=atol / total,
  )


def test_bfloat16_logits_use_float32_math():
  # Logits whose log-sum-exp is not representable in bfloat16 arithmetic.
  logits = jnp.asarray([[100.0, 99.0, 98.0, 97.0]], jnp.bfloat16)
  labels = jnp.array([1])
  loss_sum, _ = tokacc.token_cross_entropy(logits, labels)
  expected, _ = reference_cross_entropy(
    np.asarray(logits.astype(jnp.float32)), np.asarray(labels), np.ones(1)
  )
  # Float32 math may form the log-sum-exp (about 100.4) before subtracting
  # the label's logit: a few roundings (4, u = 2**-24) of 100.4 in a loss of
  # about 1.4, and a few of the loss itself in the shifted reference.
  lse = float(np.log(np.sum(np.exp(np.asarray(logits, np.float64)))))
  rtol = 4 * 2.0**-24 * (1 + lse / float(expected))  # 1.7e-5
  chex.assert_trees_all_close(loss_sum, expected, rtol=rtol)


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

  # (softmax - onehot) / count: p_v = exp(l_v - log-sum-exp), whose
  # argument is within cross_entropy_round_off's per-token error, so p_v
  # (< 1) within as much absolutely; either evaluation: twice.
  # Measured: 7.5e-9, 0.003 of it.
  spread = np.ptp(np.asarray(logits), axis=-1).max() + np.log(VOCAB)
  atol = 2 * (VOCAB + 6) * UNIT_ROUND_OFF * (1 + spread)
  chex.assert_trees_all_close(
    jax.jit(jax.grad(ours))(logits),
    jax.grad(reference)(logits),
    rtol=0,
    atol=atol / counted.sum(),
  )


@pytest.mark.parametrize(
  ('logits_shape', 'labels_shape', 'where_shape', 'error', 'message'),
  [
    ((), (), None, ValueError, 'vocabulary axis'),
    ((2, 3, 7), (2, 4), None, ValueError, r'shape \(2, 3\) of logits'),
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


def test_complex_where_is_refused():
  with pytest.raises(TypeError, match='where must be a bool mask or real'):
    tokacc.token_cross_entropy(
      jnp.zeros((2, 7)), jnp.zeros(2, int), where=jnp.ones(2, jnp.complex64)
    )
