"""Mixed precision: parameter and gradient dtypes with Adam and AdamW.

For every pair of parameter dtype and gradient dtype (float32, bfloat16,
float16), `token_weighted_multistep` under `jax.jit` is compared over several
windows with full-batch training that keeps the inner state's dtypes, as
`optax.MultiSteps` does: the micro-batch gradients (computed in the gradient
dtype) are summed in float32, divided by the window's tokens, cast to the
gradient dtype and fed to the inner optimizer, whose new state is cast back
to the dtypes it had. The returned updates must have the dtypes that
`jax.eval_shape` of the inner update gives, and the inner state must keep
its dtypes from window to window.
"""

import functools
import itertools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import optax_tokacc as tokacc

FEATURES = 3
SEQS, SEQ_LEN = 2, 4  # a micro-batch holds up to 8 counted tokens
K = 2
TOKEN_COUNTS = ((6, 1), (0, 8), (3, 5))  # unequal, with an empty micro-batch
LEARNING_RATE = 0.05
EPS = 1e-3  # Adam's default 1e-8 is zero in float16

DTYPES = {'f32': jnp.float32, 'bf16': jnp.bfloat16, 'f16': jnp.float16}
# Relative and absolute tolerance on the parameters: a few units in the last
# place of the less precise of the parameter and gradient dtypes.
TOLERANCE = {'f32': 1e-5, 'f16': 4e-3, 'bf16': 2e-2}

OPTIMIZERS = {
  'adam': lambda: optax.adam(LEARNING_RATE, eps=EPS),
  'adamw': lambda: optax.adamw(LEARNING_RATE, eps=EPS, weight_decay=0.1),
  'adam_mu_f32': lambda: optax.adam(
    LEARNING_RATE, eps=EPS, mu_dtype=jnp.float32
  ),
}

CASES = [
  (params, grads, optimizer)
  for params, grads in itertools.product(DTYPES, DTYPES)
  for optimizer in ('adam', 'adamw')
] + [('bf16', 'bf16', 'adam_mu_f32'), ('bf16', 'f32', 'adam_mu_f32')]


def init_params(dtype):
  rng = np.random.default_rng(0)
  return {
    'w': jnp.asarray(rng.normal(size=(FEATURES, FEATURES)), dtype),
    'v': jnp.asarray(rng.normal(size=(FEATURES,)), dtype),
  }


def loss_sum(params, batch):
  """Squared error summed over the counted tokens of the batch."""
  hidden = jnp.tanh(batch['x'] @ params['w'])
  prediction = hidden @ params['v']
  return jnp.sum((prediction - batch['y']) ** 2 * batch['mask'])


def make_windows():
  windows = []
  for w, counts in enumerate(TOKEN_COUNTS):
    window = []
    for i, count in enumerate(counts):
      rng = np.random.default_rng(10 * w + i)
      mask = (np.arange(SEQS * SEQ_LEN) < count).reshape(SEQS, SEQ_LEN)
      window.append(
        {
          'x': rng.normal(size=(SEQS, SEQ_LEN, FEATURES)).astype(np.float32),
          'y': rng.normal(size=(SEQS, SEQ_LEN)).astype(np.float32),
          'mask': mask.astype(np.float32),
        }
      )
    windows.append(window)
  return windows


@functools.cache
def micro_grads(grad_dtype):
  """The gradient of a micro-batch's token-summed loss, in ``grad_dtype``."""

  @jax.jit
  def grads(params, batch):
    params = jax.tree.map(lambda p: p.astype(grad_dtype), params)
    batch = jax.tree.map(lambda x: x.astype(grad_dtype), batch)
    return jax.grad(loss_sum)(params, batch)

  return grads


def dtypes_of(tree):
  return jax.tree.map(lambda x: jnp.result_type(x), tree)


def train_reference(inner, params, windows, grad_dtype):
  """Full-batch training whose inner state keeps its dtypes.

  Returns the parameters and the inner state after every window.
  """
  grad_fn = micro_grads(grad_dtype)
  inner_update = jax.jit(inner.update)
  state = inner.init(params)
  results = []
  for window in windows:
    total = sum(float(np.sum(batch['mask'])) for batch in window)
    window_sum = jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params)
    for batch in window:
      window_sum = jax.tree.map(
        lambda s, g: s + g.astype(jnp.float32),
        window_sum,
        grad_fn(params, batch),
      )
    grads = jax.tree.map(
      lambda s, t=total: (s / t).astype(grad_dtype), window_sum
    )
    updates, new_state = inner_update(grads, state, params)
    new_state = optax.tree.cast_like(new_state, state)
    state = new_state
    params = optax.apply_updates(params, updates)
    results.append((params, state))
  return results


@pytest.mark.parametrize('param_name, grad_name, optimizer_name', CASES)
def test_dtype_pair_equals_full_batch(param_name, grad_name, optimizer_name):
  param_dtype, grad_dtype = DTYPES[param_name], DTYPES[grad_name]
  inner = OPTIMIZERS[optimizer_name]()
  tx = tokacc.token_weighted_multistep(inner, K)
  params = init_params(param_dtype)
  windows = make_windows()
  expected = train_reference(inner, params, windows, grad_dtype)
  inner_dtypes = dtypes_of(inner.init(params))
  zero_grads = jax.tree.map(lambda p: jnp.zeros(p.shape, grad_dtype), params)
  update_dtypes = dtypes_of(
    jax.eval_shape(inner.update, zero_grads, inner.init(params), params)[0]
  )
  tolerance = max(TOLERANCE[param_name], TOLERANCE[grad_name])
  grad_fn = micro_grads(grad_dtype)

  @jax.jit
  def step(params, state, grads, num_tokens):
    updates, state = tx.update(grads, state, params, num_tokens=num_tokens)
    return optax.apply_updates(params, updates), state, updates

  state = tx.init(params)
  for w, window in enumerate(windows):
    for batch in window:
      num_tokens = jnp.sum(batch['mask']).astype(jnp.int32)
      params, state, updates = step(
        params, state, grad_fn(params, batch), num_tokens
      )
      assert dtypes_of(updates) == update_dtypes
      assert dtypes_of(params) == dtypes_of(init_params(param_dtype))
      assert dtypes_of(state.inner_state) == inner_dtypes
      assert dtypes_of(state.acc_grads) == jax.tree.map(
        lambda _: jnp.dtype(jnp.float32), params
      )
    expected_params, expected_state = expected[w]
    chex.assert_trees_all_close(
      params, expected_params, rtol=tolerance, atol=tolerance
    )
    chex.assert_trees_all_close(
      state.inner_state, expected_state, rtol=tolerance, atol=tolerance
    )
    assert int(state.gradient_step) == w + 1
