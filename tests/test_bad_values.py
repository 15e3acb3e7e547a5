"""Bad values that exist only at run time, which cannot be refused at trace
time: the documented behaviour for a negative or NaN ``num_tokens``, a
non-finite ``loss`` and non-finite gradients, and the opt-in ``checkify``
checks (``with_input_checks``) that report them.
"""

from bad_input import GRADS
from bad_input import PARAMS
from bad_input import build
import chex
import jax
from jax.experimental import checkify
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import optax_tokacc as tokacc

# Documented behaviour of bad values that only exist at run time.


def run_window(tx, num_tokens, losses=(1.0, 2.0), grads=GRADS):
  """Two jitted micro-steps; returns the last updates and state."""
  step = jax.jit(tx.update)
  state = tx.init(PARAMS)
  for n, loss in zip(num_tokens, losses):
    updates, state = step(grads, state, PARAMS, num_tokens=n, loss=loss)
  return updates, state


@pytest.mark.parametrize('token_dtype', [None, jnp.float32])
@pytest.mark.parametrize('bad_tokens', [-1, -5])
def test_negative_num_tokens_drops_the_window(token_dtype, bad_tokens):
  tx = build(token_dtype=token_dtype)
  # -1 + 4 would be a "valid" 3 if negative counts were just added.
  updates, state = run_window(tx, [bad_tokens, 4])
  chex.assert_trees_all_equal(updates, optax.tree.zeros_like(GRADS))
  assert not bool(tokacc.has_updated(state))
  assert int(state.gradient_step) == 0
  assert int(state.dropped_windows) == 1
  # The next window is unaffected.
  step = jax.jit(tx.update)
  for _ in range(2):
    updates, state = step(GRADS, state, PARAMS, num_tokens=2)
  # Full batch: 2 * GRADS over 4 tokens.
  chex.assert_trees_all_close(
    updates, jax.tree.map(lambda g: -0.1 * g / 2, GRADS)
  )
  assert int(state.dropped_windows) == 1
  assert int(state.last_tokens) == 4


def test_nan_float_num_tokens_drops_the_window():
  tx = build(token_dtype=jnp.float32)
  updates, state = run_window(tx, [jnp.float32(np.nan), 4.0])
  chex.assert_trees_all_equal(updates, optax.tree.zeros_like(GRADS))
  assert int(state.dropped_windows) == 1


def test_non_finite_loss_is_reported_not_applied():
  """The loss is for reporting: a NaN shows in window_loss for its window."""
  tx = build()
  updates, state = run_window(tx, [1, 3], losses=(np.nan, 2.0))
  expected = jax.tree.map(lambda g: -0.1 * 2 * g / 4, GRADS)
  chex.assert_trees_all_close(updates, expected)
  assert np.isnan(tokacc.window_loss(state))
  step = jax.jit(tx.update)
  for loss in (1.0, 3.0):
    updates, state = step(GRADS, state, PARAMS, num_tokens=2, loss=loss)
  np.testing.assert_allclose(tokacc.window_loss(state), 1.0)


@pytest.mark.parametrize('bad', ['nan', 'inf'])
def test_non_finite_grads_are_skipped_with_skip_not_finite(bad):
  tx = build(should_skip_update_fn=tokacc.skip_not_finite)
  bad_grads = {'w': GRADS['w'].at[0, 0].set(float(bad)), 'b': GRADS['b']}
  step = jax.jit(tx.update)
  state = tx.init(PARAMS)
  updates, state = step(GRADS, state, PARAMS, num_tokens=1)
  updates, state = step(bad_grads, state, PARAMS, num_tokens=5)
  assert int(state.mini_step) == 1  # rejected: the window did not advance
  updates, state = step(GRADS, state, PARAMS, num_tokens=3)
  # Full batch over the two good micro-batches: 2 * GRADS / 4 tokens.
  chex.assert_trees_all_close(
    updates, jax.tree.map(lambda g: -0.1 * g / 2, GRADS)
  )
  assert int(state.last_tokens) == 4


# Opt-in checkify checks.


def checked_step(tx):
  @jax.jit
  @checkify.checkify
  def step(state, num_tokens, loss):
    return tx.update(GRADS, state, PARAMS, num_tokens=num_tokens, loss=loss)

  return step


def test_checks_pass_on_good_input():
  tx = tokacc.with_input_checks(build())
  unchecked = build()
  step = checked_step(tx)
  state = expected_state = tx.init(PARAMS)
  for n in (3, 4, 0, 2):
    err, (updates, state) = step(state, n, 1.0)
    err.throw()
    expected, expected_state = unchecked.update(
      GRADS, expected_state, PARAMS, num_tokens=n, loss=1.0
    )
    chex.assert_trees_all_equal((updates, state), (expected, expected_state))


# (id, micro-steps before the bad one, bad num_tokens, bad loss, message)
CHECK_CASES = [
  ('negative', 0, -3, 1.0, r'num_tokens=-3 is negative.*mini_step=0'),
  ('loss_nan', 1, 2, np.nan, r'loss=nan is not finite at mini_step=1'),
  ('loss_inf', 2, 2, np.inf, r'loss=inf is not finite.*gradient_step=1'),
  (
    'overflow',
    1,
    2**31 - 1,
    1.0,
    r'window closed at mini_step=1, gradient_step=0 was dropped',
  ),
]


@pytest.mark.parametrize(
  'good_steps, num_tokens, loss, match',
  [case[1:] for case in CHECK_CASES],
  ids=[case[0] for case in CHECK_CASES],
)
def test_checks_report_the_bad_micro_step(good_steps, num_tokens, loss, match):
  tx = tokacc.with_input_checks(build())
  step = checked_step(tx)
  state = tx.init(PARAMS)
  for _ in range(good_steps):
    err, (_, state) = step(state, 1, 1.0)
    err.throw()
  err, _ = step(state, num_tokens, loss)
  with pytest.raises(checkify.JaxRuntimeError, match=match):
    err.throw()


def test_checks_inside_a_chain_without_loss():
  tx = tokacc.with_input_checks(optax.chain(optax.scale(1.0), build()))

  @jax.jit
  @checkify.checkify
  def step(state, num_tokens):
    return tx.update(GRADS, state, PARAMS, num_tokens=num_tokens)

  err, (_, state) = step(tx.init(PARAMS), 2)
  err.throw()
  err, _ = step(state, -1)
  with pytest.raises(checkify.JaxRuntimeError, match=r'mini_step=1'):
    err.throw()
