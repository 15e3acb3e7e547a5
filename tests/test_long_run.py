"""Long runs and counters at their limits: nothing overflows silently."""

import functools

import chex
import helpers
import jax
from jax import lax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import optax_tokacc as tokacc

INT32_MAX = 2**31 - 1
UNIT_ROUND_OFF = helpers.UNIT_ROUND_OFF  # float32
NUM_MICRO_STEPS = 3000
EVERY_K = 4
MAX_TOKENS = 8


def long_run_optimizer():
  return optax.chain(optax.clip_by_global_norm(1.0), optax.adam(1e-2))


def emitting_windows(tokens, non_finite):
  """Independent bookkeeping: rejected micro-batches do not count; every
  EVERY_K accepted ones close a window; windows with tokens emit.

  Returns the micro-batch indices of each emitting window, and those of
  the window still open at the end.
  """
  windows, window = [], []
  for i in range(len(tokens)):
    if non_finite[i]:
      continue
    window.append(i)
    if len(window) == EVERY_K:
      if tokens[window].sum() > 0:
        windows.append(window)
      window = []
  return np.array(windows), window


@pytest.mark.slow
def test_long_run_with_empty_and_non_finite_micro_batches():
  """3,000 micro-steps with empty and NaN/inf micro-batches (rejected): the
  counters, and the parameters against full-batch training on the windows
  that emit."""
  rng = np.random.default_rng(0)
  tokens = rng.integers(0, MAX_TOKENS + 1, NUM_MICRO_STEPS)
  tokens[rng.random(NUM_MICRO_STEPS) < 0.2] = 0  # padding-only batches
  non_finite = rng.random(NUM_MICRO_STEPS) < 0.05
  x = rng.normal(size=(NUM_MICRO_STEPS, MAX_TOKENS, helpers.FEATURES))
  x = x.astype(np.float32)
  x[non_finite, 0, 0] = np.where(
    rng.random(non_finite.sum()) < 0.5, np.nan, np.inf
  )
  y = rng.normal(size=(NUM_MICRO_STEPS, MAX_TOKENS)).astype(np.float32)
  mask = (np.arange(MAX_TOKENS) < tokens[:, None]).astype(np.float32)

  tx = tokacc.token_weighted_multistep(
    long_run_optimizer(),
    EVERY_K,
    should_skip_update_fn=tokacc.skip_not_finite,
  )
  initial = jax.tree.map(jnp.asarray, helpers.init_params())
  params = initial
  step = helpers.train_step(tx, apply_fn=tokacc.apply_if_updated)

  @jax.jit
  def run(params, data):
    def micro_step(carry, batch):
      params, state = step(*carry, batch)
      return (params, state), (state.emitted, state.last_tokens)

    return lax.scan(micro_step, (params, tx.init(params)), data)

  data = {'x': x, 'y': y, 'mask': mask}
  (params, state), (emitted, last_tokens) = run(params, data)
  emitted, last_tokens = np.asarray(emitted), np.asarray(last_tokens)

  windows, open_window = emitting_windows(tokens, non_finite)
  window_sums = tokens[windows].sum(axis=1)
  expected_emitted = np.zeros(NUM_MICRO_STEPS, bool)
  expected_emitted[windows[:, -1]] = True

  for leaf in jax.tree.leaves(params):
    assert np.all(np.isfinite(leaf))
  assert np.isfinite(float(tokacc.window_loss(state)))
  np.testing.assert_array_equal(emitted, expected_emitted)
  np.testing.assert_array_equal(last_tokens[emitted], window_sums)
  assert int(state.gradient_step) == len(window_sums)
  assert int(state.mini_step) == len(open_window)
  assert int(state.acc_tokens) == tokens[open_window].sum()
  assert int(state.dropped_windows) == 0
  assert bool(state.skip_state['should_skip']) == non_finite[-1]
  # adam's own counter advanced once per emitted window.
  assert int(state.inner_state[1][0].count) == len(window_sums)
  # The parameters are those of full-batch training on the emitting windows,
  # within helpers.full_batch's bound (derived there: a global-norm clip and
  # Adam, homogeneous of degree 0 in the gradient).
  expected = helpers.full_batch(
    long_run_optimizer(),
    helpers.init_params(),
    [[{k: v[i] for k, v in data.items()} for i in w] for w in windows],
  )
  helpers.assert_within_round_off(params, expected)


def sgd_reference(params, grads_per_window, learning_rate=0.1):
  """Plain SGD with momentum on the windows' mean gradients."""
  optimizer = optax.sgd(learning_rate, momentum=0.9)
  opt_state = optimizer.init(params)
  for grads in grads_per_window:
    updates, opt_state = optimizer.update(grads, opt_state, params)
    params = optax.apply_updates(params, updates)
  return params


def test_step_counters_saturate_near_int32_max():
  params = {'w': jnp.zeros(2)}
  tx = tokacc.token_weighted_multistep(optax.sgd(0.1, momentum=0.9), 2)
  state = tx.init(params)._replace(gradient_step=jnp.int32(INT32_MAX - 1))
  step = jax.jit(tx.update)
  grads = [{'w': jnp.array([1.0, -2.0])}, {'w': jnp.array([3.0, 0.5])}]
  counts = [3, 1]  # tokens the token-summed gradients above are over
  for _ in range(3):  # three windows: the counter reaches max and stays
    for g, n in zip(grads, counts):
      updates, state = step(g, state, params, num_tokens=n)
    params = optax.apply_updates(params, updates)
    assert int(state.gradient_step) >= INT32_MAX - 1
  assert int(state.gradient_step) == INT32_MAX
  mean = {'w': (grads[0]['w'] + grads[1]['w']) / sum(counts)}
  # The mean, (1 + 3) / 4 and (-2 + 0.5) / 4, is exact in both runs; each
  # window then rounds each parameter's one-signed momentum, update and sum
  # four times: within gamma(12) of exact after three windows in either
  # run (jitted, where a multiply-add may fuse, and eager). Measured: equal.
  chex.assert_trees_all_close(
    params,
    sgd_reference({'w': jnp.zeros(2)}, [mean] * 3),
    rtol=2 * 12 * UNIT_ROUND_OFF,
  )


def test_mini_step_saturates_with_a_huge_k():
  params = {'w': jnp.zeros(2)}
  tx = tokacc.token_weighted_multistep(optax.sgd(1.0), INT32_MAX)
  state = tx.init(params)._replace(mini_step=jnp.int32(INT32_MAX - 2))
  step = jax.jit(tx.update)
  grads = {'w': jnp.array([1.0, 2.0])}
  updates, state = step(grads, state, params, num_tokens=2)
  assert int(state.mini_step) == INT32_MAX - 1
  updates, state = step(grads, state, params, num_tokens=2)
  # The k-th (INT32_MAX-th) micro-step closes the window: no wrap to < 0.
  assert bool(tokacc.has_updated(state))
  assert int(state.mini_step) == 0
  # Exact: sums, halves and negations of small integers.
  chex.assert_trees_all_equal(updates, {'w': -grads['w'] / 2})


def run_window(tx, counts, params, grads):
  step = jax.jit(tx.update)
  state = tx.init(params)
  for n in counts:
    updates, state = step(grads, state, params, num_tokens=jnp.int32(n))
  return updates, state


@pytest.mark.parametrize(
  'counts', [(2**30, 2**30 - 1), (INT32_MAX,), (INT32_MAX - 5, 0, 5)]
)
def test_token_counts_exact_up_to_int32_max(counts):
  params = {'w': jnp.zeros(2)}
  grads = {'w': jnp.array([2.0**30, -(2.0**29)])}
  tx = tokacc.token_weighted_multistep(optax.sgd(1.0), len(counts))
  updates, state = run_window(tx, counts, params, grads)
  assert int(state.last_tokens) == INT32_MAX
  assert bool(tokacc.has_updated(state))
  expected = -len(counts) * np.array([2.0**30, -(2.0**29)]) / INT32_MAX
  # The gradients' sum is exact; the count rounds to float32 (2**31) and
  # the quotient rounds: u each. Measured: 2**-31 relatively, 0.004 of it.
  np.testing.assert_allclose(updates['w'], expected, rtol=2 * UNIT_ROUND_OFF)


@pytest.mark.parametrize(
  'counts', [(2**30, 2**30), (INT32_MAX, 1), (INT32_MAX, INT32_MAX)]
)
def test_overflowing_window_is_dropped(counts):
  params = {'w': jnp.zeros(2)}
  grads = {'w': jnp.ones(2)}
  tx = tokacc.token_weighted_multistep(optax.adam(1.0), len(counts))
  updates, state = run_window(tx, counts, params, grads)
  chex.assert_trees_all_equal(updates, {'w': jnp.zeros(2)})
  assert not bool(tokacc.has_updated(state))
  assert int(state.gradient_step) == 0
  assert int(state.dropped_windows) == 1
  chex.assert_trees_all_equal(state.inner_state, tx.init(params).inner_state)
  # The accumulators were reset: the next window is exact.
  step = jax.jit(tx.update)
  for _ in counts:
    updates, state = step(grads, state, params, num_tokens=3)
  assert int(state.last_tokens) == 3 * len(counts)
  assert int(state.gradient_step) == 1


@functools.cache
def pmapped_window(num_devices):
  tx = tokacc.token_weighted_multistep(optax.sgd(1.0), 1, axis_name='data')

  def update(num_tokens):
    params = {'w': jnp.zeros(2)}
    grads = {'w': jnp.ones(2)}
    state = tx.init(params)
    updates, state = tx.update(grads, state, params, num_tokens=num_tokens)
    return updates, state

  return jax.pmap(update, axis_name='data', devices=jax.devices()[:num_devices])


# Per-device counts whose sum fits exactly, or does not (psum in int32 would
# wrap: 8 * (2**29 + 1) = 2**32 + 8 reads as 8).
@pytest.mark.parametrize(
  'counts, fits',
  [
    ([2**29] * 3 + [2**29 - 1], True),
    ([INT32_MAX, 0, 0, 0], True),
    ([2**29] * 4, False),
    ([INT32_MAX, 1, 0, 0], False),
    ([INT32_MAX] * 4, False),
    ([2**29 + 1] * 8, False),
  ],
)
def test_overflow_across_devices_is_detected(counts, fits):
  updates, state = pmapped_window(len(counts))(jnp.array(counts, jnp.int32))
  emitted = np.asarray(state.emitted)
  assert np.all(emitted == fits)  # the same decision on every device
  np.testing.assert_array_equal(state.dropped_windows, int(not fits))
  if fits:
    np.testing.assert_array_equal(state.last_tokens, INT32_MAX)
    expected = -len(counts) / INT32_MAX
    # As in test_token_counts_exact_up_to_int32_max: the count's rounding
    # to float32 and the quotient's, u each (measured: 0.004 of it).
    np.testing.assert_allclose(updates['w'], expected, rtol=2 * UNIT_ROUND_OFF)
  else:
    np.testing.assert_array_equal(updates['w'], 0.0)
    np.testing.assert_array_equal(state.gradient_step, 0)
