"""`token_weighted_multistep` on one device against full-batch training
(``helpers.full_batch``) and ``optax.MultiSteps``.

The accumulation of unequal token counts, in float32 and float64, with
``loss_reduction='mean'``, schedules of k, ``optax.chain`` and
``inject_hyperparams``; zero updates and the inner state on micro-steps;
windows without tokens; ``skip_not_finite`` and rejected micro-batches
(issue 11, defect 1); ``emit_now`` (defect 6); float and fractional counts
(defect 8); what ``grad_sums`` holds (defect 10); ``window_loss`` and
``apply_if_updated``; a window after a NaN window (issue 19); dtypes of the
accumulator; one compilation; the constructor's and ``update``'s errors.
"""

import functools

import chex
import helpers
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import optax_tokacc as tokacc

# Tokens counted per micro-batch (of helpers.LOCAL_TOKENS = 8 positions):
# deliberately unequal, with an all-padding micro-batch in the second window.
TOKEN_COUNTS = ((8, 1, 7, 3), (0, 6, 2, 5), (5, 5, 1, 8))
U = helpers.UNIT_ROUND_OFF


def make_windows(token_counts=TOKEN_COUNTS, dtype=np.float32):
  return helpers.windows_of(token_counts, dtype)


def train_accumulated(
  tx, params, windows, *, use_jit=True, loss_fn=helpers.loss_sum
):
  step = helpers.train_step(tx, loss_fn, with_loss=False)
  if use_jit:
    step = jax.jit(step)
  state = tx.init(params)
  for window in windows:
    for batch in window:
      params, state = step(params, state, batch)
  return params, state


OPTIMIZERS = {
  'sgd': lambda: optax.sgd(0.1, momentum=0.9),
  'adam': lambda: optax.adam(0.05),
  'adamw_clip': lambda: optax.chain(
    optax.clip_by_global_norm(0.5), optax.adamw(0.05, weight_decay=0.1)
  ),
}


@pytest.mark.parametrize(
  ('use_jit', 'optimizer_name'),
  [
    pytest.param(
      use_jit,
      name,
      marks=pytest.mark.slow
      if not use_jit or (use_jit, name) == (True, 'adam')
      else (),
    )
    for name in sorted(OPTIMIZERS)
    for use_jit in (True, False)
  ],
)
def test_equals_full_batch_float32(optimizer_name, use_jit):
  optimizer = OPTIMIZERS[optimizer_name]
  windows = make_windows()
  params = helpers.init_params()
  expected = helpers.full_batch(optimizer(), params, windows)
  tx = tokacc.token_weighted_multistep(optimizer(), every_k_schedule=4)
  actual, state = train_accumulated(tx, params, windows, use_jit=use_jit)
  helpers.assert_within_round_off(actual, expected)
  assert int(state.gradient_step) == len(windows)
  assert int(state.last_tokens) == sum(TOKEN_COUNTS[-1])


@pytest.mark.parametrize(
  'optimizer_name',
  [
    pytest.param(name, marks=pytest.mark.slow if name == 'adam' else ())
    for name in sorted(OPTIMIZERS)
  ],
)
def test_equals_full_batch_float64(optimizer_name):
  optimizer = OPTIMIZERS[optimizer_name]
  with jax.enable_x64(True):
    windows = make_windows(dtype=np.float64)
    params = helpers.init_params(np.float64)
    # round_off_atol in float64's unit round-off (2**-53)
    expected = helpers.full_batch(optimizer(), params, windows)
    tx = tokacc.token_weighted_multistep(optimizer(), every_k_schedule=4)
    actual, state = train_accumulated(tx, params, windows)
    assert state.grad_sums['w'].dtype == jnp.float64
    helpers.assert_within_round_off(actual, expected)


def test_multisteps_is_wrong_with_unequal_tokens():
  """The average-of-averages bug: the test setup does catch it."""
  windows = make_windows()
  params = helpers.init_params()
  expected = helpers.full_batch(optax.sgd(0.1), params, windows).params
  multi = optax.MultiSteps(optax.sgd(0.1), every_k_schedule=4)
  actual, _ = train_multisteps(multi, params, windows)
  difference = max(
    float(jnp.max(jnp.abs(a - e)) / jnp.max(jnp.abs(e)))
    for a, e in zip(jax.tree.leaves(actual), jax.tree.leaves(expected))
  )
  assert difference > 1e-2


def train_multisteps(multi, params, windows):
  """optax.MultiSteps on per-micro-batch mean losses, as users write it."""

  @jax.jit
  def step(params, state, batch):
    grads = jax.grad(helpers.loss_mean)(params, batch)
    updates, state = multi.update(grads, state, params)
    return optax.apply_updates(params, updates), state, updates

  state = multi.init(params)
  trajectory = []
  for window in windows:
    for batch in window:
      params, state, updates = step(params, state, batch)
      trajectory.append((params, updates))
  return params, trajectory


@pytest.mark.parametrize('optimizer_name', sorted(OPTIMIZERS))
def test_matches_multisteps_with_equal_tokens(optimizer_name):
  optimizer = OPTIMIZERS[optimizer_name]
  windows = make_windows(((6, 6, 6), (4, 4, 4), (8, 8, 8)))
  params = helpers.init_params()
  multi = optax.MultiSteps(optimizer(), every_k_schedule=3)
  _, expected = train_multisteps(multi, params, windows)

  tx = tokacc.token_weighted_multistep(
    optimizer(), every_k_schedule=3, loss_reduction='mean'
  )
  step = helpers.train_step(
    tx, helpers.loss_mean, with_loss=False, with_updates=True
  )
  step = jax.jit(step)
  state = tx.init(params)
  batches = [batch for window in windows for batch in window]
  largest_updates = []
  n, m = helpers.window_tokens(windows), helpers.TERM_ROUNDINGS
  # round_off_atol: MultiSteps' running mean rounds 3 times a micro-step,
  # fewer than the n + m terms the bound allows for.
  for batch, (expected_params, expected_updates) in zip(batches, expected):
    params, state, updates = step(params, state, batch)
    largest_updates.append(helpers.largest(expected_updates))
    chex.assert_trees_all_close(
      updates,
      expected_updates,
      rtol=0,
      atol=helpers.round_off_atol(largest_updates[-1:], [0.0], n, m, U),
    )
    chex.assert_trees_all_close(
      params,
      expected_params,
      rtol=0,
      atol=helpers.round_off_atol(
        largest_updates,
        [helpers.largest(expected_params)] * len(largest_updates),
        n,
        m,
        U,
      ),
    )


def test_mean_reduction_equals_full_batch_with_unequal_tokens():
  windows = make_windows()
  params = helpers.init_params()
  expected = helpers.full_batch(optax.adam(0.05), params, windows)
  tx = tokacc.token_weighted_multistep(
    optax.adam(0.05), every_k_schedule=4, loss_reduction='mean'
  )
  actual, _ = train_accumulated(tx, params, windows, loss_fn=helpers.loss_mean)
  helpers.assert_within_round_off(actual, expected)


def test_inner_optimizer_runs_once_per_window():
  """Adam's count, and so its bias correction, advances once per window."""
  windows = make_windows()
  tx = tokacc.token_weighted_multistep(optax.adam(0.05), every_k_schedule=4)
  _, state = train_accumulated(tx, helpers.init_params(), windows)
  adam_state = state.inner_state[0]
  assert int(adam_state.count) == len(windows)


@pytest.mark.slow
def test_micro_steps_return_zero_updates_and_keep_inner_state():
  """Micro-steps return zeros and leave SGD's momentum alone; the closing
  step hands it the window's full-batch gradient (unequal token counts)."""
  learning_rate = 0.1
  params = helpers.init_params()
  tx = tokacc.token_weighted_multistep(
    optax.sgd(learning_rate, momentum=0.9), every_k_schedule=3
  )
  state = tx.init(params)
  window = [helpers.micro_batch(i, n) for i, n in enumerate((7, 2, 8))]

  @jax.jit
  def step(state, batch):
    grads = jax.grad(helpers.loss_sum)(params, batch)
    return tx.update(
      grads, state, params, num_tokens=helpers.token_count(batch)
    )

  for batch in window[:-1]:
    updates, new_state = step(state, batch)
    chex.assert_trees_all_equal(updates, optax.tree.zeros_like(params))
    chex.assert_trees_all_equal(new_state.inner_state, state.inner_state)
    assert not bool(tokacc.has_updated(new_state))
    state = new_state
  updates, new_state = step(state, window[-1])
  assert bool(tokacc.has_updated(new_state))
  # SGD's first step, written out: the momentum is the full-batch gradient,
  # the update minus the learning rate times it.
  full = helpers.concat(window)
  full_grads = jax.grad(
    lambda p: helpers.loss_sum(p, full) / jnp.sum(full['mask'])
  )(params)
  # One window: round_off_atol relative to the largest gradient, and to
  # the largest update (the learning rate times it; -lr * g rounds once).
  gradient_atol = helpers.round_off_atol(
    [helpers.largest(full_grads)],
    [0.0],
    helpers.window_tokens([window]),
    helpers.TERM_ROUNDINGS,
    U,
  )
  chex.assert_trees_all_close(
    new_state.inner_state[0].trace, full_grads, rtol=0, atol=gradient_atol
  )
  chex.assert_trees_all_close(
    updates,
    jax.tree.map(lambda g: -learning_rate * g, full_grads),
    rtol=U,
    atol=learning_rate * gradient_atol,
  )
  helpers.assert_within_round_off(
    optax.apply_updates(params, updates),
    helpers.full_batch(
      optax.sgd(learning_rate, momentum=0.9), params, [window]
    ),
  )


def test_as_element_of_optax_chain():
  windows = make_windows()
  params = helpers.init_params()
  expected = helpers.full_batch(
    optax.chain(optax.clip_by_global_norm(0.5), optax.adam(0.05)),
    params,
    windows,
  )
  tx = optax.chain(
    optax.clip_by_global_norm(1e6),  # A no-op before accumulation.
    tokacc.token_weighted_multistep(
      optax.chain(optax.clip_by_global_norm(0.5), optax.adam(0.05)),
      every_k_schedule=4,
    ),
  )
  assert isinstance(tx, optax.GradientTransformationExtraArgs)
  actual, _ = train_accumulated(tx, params, windows)
  helpers.assert_within_round_off(actual, expected)


@pytest.mark.slow
def test_inner_inject_hyperparams_with_schedule():
  """A learning-rate schedule inside `inner` advances once per window."""

  def optimizer():
    schedule = optax.linear_schedule(0.1, 0.01, transition_steps=3)
    return optax.inject_hyperparams(optax.adam)(learning_rate=schedule)

  windows = make_windows()
  params = helpers.init_params()
  expected = helpers.full_batch(optimizer(), params, windows)
  tx = tokacc.token_weighted_multistep(optimizer(), every_k_schedule=4)
  actual, state = train_accumulated(tx, params, windows)
  helpers.assert_within_round_off(actual, expected)
  assert int(state.inner_state.count) == len(windows)


def test_inner_hyperparams_can_be_changed_in_state():
  params = helpers.init_params()
  inner = optax.inject_hyperparams(optax.sgd)(learning_rate=1.0)
  tx = tokacc.token_weighted_multistep(inner, every_k_schedule=1)
  state = tx.init(params)
  state.inner_state.hyperparams['learning_rate'] = jnp.asarray(0.5)
  grads = jax.tree.map(jnp.ones_like, params)
  updates, _ = tx.update(grads, state, params, num_tokens=2)
  chex.assert_trees_all_close(updates, jax.tree.map(lambda g: -0.25 * g, grads))


@pytest.mark.slow
def test_outer_inject_hyperparams():
  """`every_k_schedule` as an injected (static) hyperparameter."""
  params = helpers.init_params()
  tx = optax.inject_hyperparams(
    tokacc.token_weighted_multistep, static_args=('every_k_schedule',)
  )(inner=optax.sgd(0.1), every_k_schedule=2)
  windows = make_windows(((3, 5), (2, 7)))
  expected = helpers.full_batch(optax.sgd(0.1), params, windows)
  actual, _ = train_accumulated(tx, params, windows)
  helpers.assert_within_round_off(actual, expected)


def test_every_k_schedule_function():
  """Batch-size warm-up: windows of 2, then 3 micro-batches."""
  token_counts = ((4, 7), (3, 0), (8, 1, 5), (2, 6, 8))
  windows = make_windows(token_counts)
  params = helpers.init_params()
  expected = helpers.full_batch(optax.adam(0.05), params, windows)
  tx = tokacc.token_weighted_multistep(
    optax.adam(0.05), every_k_schedule=lambda step: jnp.where(step < 2, 2, 3)
  )
  actual, state = train_accumulated(tx, params, windows)
  helpers.assert_within_round_off(actual, expected)
  assert int(state.gradient_step) == 4


def test_zero_token_window_emits_nothing():
  windows = make_windows(((3, 4), (0, 0), (5, 2)))
  params = helpers.init_params()
  # Full batch skips the empty window: it has no loss to take a step on.
  expected = helpers.full_batch(optax.adam(0.05), params, windows)
  tx = tokacc.token_weighted_multistep(optax.adam(0.05), every_k_schedule=2)

  step_fn = jax.jit(
    lambda p, s, b: tx.update(
      jax.grad(helpers.loss_sum)(p, b), s, p, num_tokens=helpers.token_count(b)
    )
  )
  state = tx.init(params)
  for w, window in enumerate(windows):
    inner_before = state.inner_state
    for batch in window:
      updates, state = step_fn(params, state, batch)
      params = optax.apply_updates(params, updates)
    if w == 1:
      chex.assert_trees_all_equal(updates, optax.tree.zeros_like(params))
      chex.assert_trees_all_equal(state.inner_state, inner_before)
      assert not bool(tokacc.has_updated(state))
      assert int(state.gradient_step) == 1
      assert int(state.mini_step) == 0
  chex.assert_tree_all_finite(params)
  helpers.assert_within_round_off(params, expected)


@pytest.mark.slow
def test_skip_not_finite_drops_micro_batch_without_poisoning():
  windows = make_windows()
  params = helpers.init_params()
  expected = helpers.full_batch(optax.adam(0.05), params, windows)
  tx = tokacc.token_weighted_multistep(
    optax.adam(0.05),
    every_k_schedule=4,
    should_skip_update_fn=tokacc.skip_not_finite,
  )

  @jax.jit
  def step(params, state, batch, poison):
    grads = jax.grad(helpers.loss_sum)(params, batch)
    grads = jax.tree.map(lambda g: jnp.where(poison, jnp.nan, g), grads)
    updates, state = tx.update(
      grads, state, params, num_tokens=helpers.token_count(batch)
    )
    return optax.apply_updates(params, updates), state

  state = tx.init(params)
  for window in windows:
    for i, batch in enumerate(window):
      if i == 1:  # A NaN micro-batch: rejected, the window does not advance.
        params, state = step(params, state, batch, True)
        assert bool(state.skip_state['should_skip'])
      params, state = step(params, state, batch, False)
  helpers.assert_within_round_off(params, expected)


@pytest.mark.parametrize('change', ['later_stage', 'by_hand', 'none'])
def test_apply_if_updated_applies_the_updates_it_is_given(change):
  # `apply_if_updated` may read the emitted updates from the state's buffer
  # when it is given exactly the updates returned with that state; updates
  # changed after the transform must be the ones applied.
  windows = make_windows()
  params = helpers.init_params()
  inner = optax.sgd(0.1)
  scale = 1.0 if change == 'none' else 0.5
  stages = [tokacc.token_weighted_multistep(inner, every_k_schedule=4)]
  if change == 'later_stage':
    stages.append(optax.scale(scale))
  tx = optax.chain(*stages)

  @jax.jit
  def step(params, state, batch):
    grads = jax.grad(helpers.loss_sum)(params, batch)
    updates, state = tx.update(
      grads, state, params, num_tokens=helpers.token_count(batch)
    )
    if change == 'by_hand':
      updates = jax.tree.map(lambda u: u * scale, updates)
    return tokacc.apply_if_updated(params, updates, state), state

  state = tx.init(params)
  for window in windows:
    for batch in window:
      params, state = step(params, state, batch)
  expected = helpers.full_batch(
    optax.sgd(0.1 * scale), helpers.init_params(), windows
  )
  helpers.assert_within_round_off(params, expected)


def test_window_loss_and_apply_if_updated():
  windows = make_windows()
  params = helpers.init_params()
  tx = tokacc.token_weighted_multistep(optax.adam(0.05), every_k_schedule=4)
  expected_params = helpers.full_batch(optax.adam(0.05), params, windows)
  step = jax.jit(helpers.train_step(tx, apply_fn=tokacc.apply_if_updated))
  state = tx.init(params)
  for window in windows:
    full = helpers.concat(window)
    expected_loss = helpers.loss_sum(params, full) / jnp.sum(full['mask'])
    for batch in window:
      params, state = step(params, state, batch)
    # A sum of squared errors: terms of one sign, so the relative error of
    # either evaluation is at most (n + m) u, with no cancellation.
    loss_rtol = (
      2 * (helpers.window_tokens([window]) + helpers.TERM_ROUNDINGS) * U
    )
    np.testing.assert_allclose(
      tokacc.window_loss(state), expected_loss, rtol=loss_rtol
    )
  helpers.assert_within_round_off(params, expected_params)


def test_compiles_once():
  traces = []
  params = helpers.init_params()
  tx = tokacc.token_weighted_multistep(optax.adamw(0.01), every_k_schedule=3)
  train_step = helpers.train_step(tx)

  @jax.jit
  def step(params, state, batch):
    traces.append(None)
    return train_step(params, state, batch)

  state = tx.init(params)
  for seed in range(20):
    params, state = step(params, state, helpers.micro_batch(seed, seed % 9))
  assert len(traces) == 1
  assert int(state.gradient_step) == 6


@pytest.mark.parametrize(
  'use_scan', [pytest.param(False, marks=pytest.mark.slow), True]
)
def test_bfloat16_grads_accumulate_in_float32(use_scan):
  params = helpers.init_params(jnp.bfloat16)
  tx = tokacc.token_weighted_multistep(optax.sgd(1.0), every_k_schedule=64)
  state = tx.init(params)
  assert state.grad_sums['w'].dtype == jnp.float32
  # 64 micro-batches of tiny gradients: bf16 accumulation would lose them.
  grads = jax.tree.map(lambda p: jnp.full_like(p, 1e-3), params)
  large = jax.tree.map(lambda p: jnp.full_like(p, 1.0), params)
  counts = 1 + np.arange(64) % 4  # unequal: 160 tokens in all

  def body(state, i):
    g = jax.tree.map(lambda a, b: jnp.where(i == 0, b, a), grads, large)
    num_tokens = 1 + i % 4
    updates, state = tx.update(g, state, params, num_tokens=num_tokens)
    return state, updates

  if use_scan:
    state, all_updates = jax.lax.scan(body, state, jnp.arange(64))
    updates = jax.tree.map(lambda u: u[-1], all_updates)
  else:
    for i in range(64):
      state, updates = jax.jit(body)(state, i)
  assert updates['w'].dtype == jnp.bfloat16
  expected = -(1.0 + 63 * 1e-3) / counts.sum()
  # Summing in bf16 would give -(1.0) / 160: 1e-3 is lost against 1.0.
  # The float32 window (error about 64 * 2**-24) is rounded once to bf16:
  # half a bf16 ulp, 2**-8 relative, within 1e-2.
  np.testing.assert_allclose(
    np.asarray(updates['w'], np.float32), expected, rtol=1e-2
  )
  assert abs(float(updates['w'][0, 0]) - (-1.0 / counts.sum())) > 2e-4


def test_explicit_accumulator_dtype():
  params = helpers.init_params()
  tx = tokacc.token_weighted_multistep(
    optax.sgd(1.0), 2, accumulator_dtype=jnp.bfloat16
  )
  state = tx.init(params)
  assert state.grad_sums['w'].dtype == jnp.bfloat16
  updates, state = tx.update(params, state, params, num_tokens=1)
  assert updates['w'].dtype == jnp.float32
  assert state.grad_sums['w'].dtype == jnp.bfloat16


def test_float_token_weights_with_float_token_dtype():
  windows = make_windows()
  params = helpers.init_params()
  expected = helpers.full_batch(optax.adam(0.05), params, windows)
  tx = tokacc.token_weighted_multistep(
    optax.adam(0.05), 4, token_dtype=jnp.float32
  )
  step = helpers.train_step(tx, count_fn=float_count, with_loss=False)
  step = jax.jit(step)
  state = tx.init(params)
  for window in windows:
    for batch in window:
      params, state = step(params, state, batch)
  helpers.assert_within_round_off(params, expected)


class TestErrors:
  @pytest.mark.parametrize('k', [0, -3])
  def test_every_k_below_one(self, k):
    with pytest.raises(ValueError, match=r'every_k_schedule must be >= 1'):
      tokacc.token_weighted_multistep(optax.sgd(0.1), k)

  @pytest.mark.parametrize('k', [2.0, '4', True, None])
  def test_every_k_wrong_type(self, k):
    with pytest.raises(TypeError, match=r'every_k_schedule must be an int'):
      tokacc.token_weighted_multistep(optax.sgd(0.1), k)

  def test_unknown_loss_reduction(self):
    with pytest.raises(ValueError, match=r'loss_reduction must be one of'):
      tokacc.token_weighted_multistep(optax.sgd(0.1), 2, loss_reduction='avg')

  @pytest.mark.parametrize('dtype', [jnp.int32, jnp.bool_, 'not-a-dtype'])
  def test_non_floating_accumulator_dtype(self, dtype):
    with pytest.raises(
      TypeError, match=r'accumulator_dtype must be a floating'
    ):
      tokacc.token_weighted_multistep(
        optax.sgd(0.1), 2, accumulator_dtype=dtype
      )

  def test_non_numeric_token_dtype(self):
    with pytest.raises(
      TypeError, match=r'token_dtype must be int32, float32 or float64'
    ):
      tokacc.token_weighted_multistep(optax.sgd(0.1), 2, token_dtype=jnp.bool_)

  def test_missing_num_tokens(self):
    params = helpers.init_params()
    tx = tokacc.token_weighted_multistep(optax.sgd(0.1), 2)
    state = tx.init(params)
    with pytest.raises(
      TypeError, match=r'num_tokens.*tx\.update\(grads, state'
    ):
      jax.jit(tx.update)(params, state, params)

  def test_non_scalar_num_tokens(self):
    params = helpers.init_params()
    tx = tokacc.token_weighted_multistep(optax.sgd(0.1), 2)
    state = tx.init(params)
    with pytest.raises(ValueError, match=r'num_tokens must be a real scalar'):
      jax.jit(tx.update)(params, state, params, num_tokens=jnp.ones(3))

  def test_traced_float_num_tokens_with_integer_counter(self):
    """A float count holding a whole number is exact; a fractional one is
    never rounded: its window is dropped (defect 8 of 0.1)."""
    params = helpers.init_params()
    tx = tokacc.token_weighted_multistep(optax.sgd(1.0), 2)
    update = jax.jit(tx.update)
    grads = jax.tree.map(jnp.ones_like, params)
    state = tx.init(params)
    _, state = update(grads, state, params, num_tokens=jnp.float32(3))
    updates, state = update(grads, state, params, num_tokens=jnp.float32(1))
    assert int(state.last_tokens) == 4 and int(state.gradient_step) == 1
    chex.assert_trees_all_close(updates, jax.tree.map(lambda g: -g / 2, grads))
    _, state = update(grads, state, params, num_tokens=jnp.float32(2.5))
    updates, state = update(grads, state, params, num_tokens=jnp.float32(1))
    assert int(state.dropped_windows) == 1 and int(state.gradient_step) == 1
    chex.assert_trees_all_equal(updates, jax.tree.map(jnp.zeros_like, grads))

  def test_grads_structure_differs_from_params(self):
    params = helpers.init_params()
    tx = tokacc.token_weighted_multistep(optax.sgd(0.1), 2)
    state = tx.init(params)
    with pytest.raises(ValueError, match=r'does not match the parameters'):
      tx.update({'w': params['w']}, state, params, num_tokens=3)
    with pytest.raises(ValueError, match=r'does not match the accumulator'):
      tx.update({'w': params['w']}, state, None, num_tokens=3)


def test_helpers_find_state_inside_a_chain():
  params = helpers.init_params()
  tx = optax.chain(
    optax.scale(1.0),
    tokacc.token_weighted_multistep(optax.sgd(1.0), every_k_schedule=1),
  )
  state = tx.init(params)
  grads = jax.tree.map(jnp.ones_like, params)
  updates, state = tx.update(grads, state, params, num_tokens=4, loss=2.0)
  assert tokacc.find_state(state) is state[1]
  assert bool(tokacc.has_updated(state))
  np.testing.assert_allclose(tokacc.window_loss(state), 0.5)
  chex.assert_trees_all_close(
    tokacc.apply_if_updated(params, updates, state),
    jax.tree.map(lambda p: p - 0.25, params),
  )
  with pytest.raises(ValueError, match=r'exactly one TokenWeightedMultiStep'):
    tokacc.has_updated(optax.adam(0.1).init(params))


# Rejected micro-batches, emit_now, float counts, what grad_sums holds, and
# windows after a NaN window: K = 3 micro-steps of Adam, on windows of
# unequal token counts with an empty micro-batch.

K = 3
LEARNING_RATE = 0.1
SMALL_COUNTS = ((5, 0, 8), (2, 7, 1))


def small_windows():
  return helpers.windows_of(SMALL_COUNTS)


def nan_batch(seed=99):
  """A micro-batch with tokens whose loss and gradients are NaN."""
  batch = helpers.micro_batch(seed, helpers.LOCAL_TOKENS)
  batch['y'][0, 0] = np.nan
  return batch


def flatten(windows):
  return [batch for window in windows for batch in window]


@functools.cache
def adam_tx(**kwargs):
  return tokacc.token_weighted_multistep(optax.adam(LEARNING_RATE), K, **kwargs)


@functools.lru_cache(maxsize=None, typed=True)  # True and np.bool_(True)
def jitted_step(
  tx,
  loss_fn=helpers.loss_sum,
  count_fn=helpers.token_count,
  with_loss=True,
  **update_kwargs,
):
  """A jitted micro-step returning ``(params, state, updates)``, its
  ``update_kwargs`` bound; cached, so that each setting compiles once."""
  step = helpers.train_step(
    tx, loss_fn, count_fn=count_fn, with_loss=with_loss, with_updates=True
  )
  return jax.jit(functools.partial(step, **update_kwargs))


def train(tx, params, micro_batches, **step_kwargs):
  step = jitted_step(tx, **step_kwargs)
  state = tx.init(params)
  for batch in micro_batches:
    params, state, _ = step(params, state, batch)
  return params, state


def full_batch(windows, inner=None):
  """``helpers.full_batch`` of Adam (or ``inner``) on ``windows``."""
  inner = inner or optax.adam(LEARNING_RATE)
  return helpers.full_batch(inner, helpers.init_params(), windows)


@pytest.mark.slow
def test_a_rejected_micro_batch_does_not_advance_the_window():
  """Regression (issue 11, defect 1, without ``axis_name``): as
  ``optax.MultiSteps``, the window takes K accepted micro-batches."""
  windows = small_windows()
  stream = flatten(windows)
  stream.insert(1, nan_batch())  # rejected: the first window stays 3 long
  tx = adam_tx(should_skip_update_fn=tokacc.skip_not_finite)
  step = jitted_step(tx)
  params = helpers.init_params()
  state = tx.init(params)
  mini_steps = []
  for batch in stream:
    params, state, _ = step(params, state, batch)
    mini_steps.append(int(state.mini_step))
  assert mini_steps == [1, 1, 2, 0, 1, 2, 0]
  assert int(state.gradient_step) == 2
  helpers.assert_within_round_off(params, full_batch(windows))


@pytest.mark.parametrize(
  'kind',
  [
    pytest.param('python_bool', marks=pytest.mark.slow),
    'np_bool',
    'traced_bool',
  ],
)
def test_emit_now_closes_the_window(kind):
  """Regression (issue 11, defect 6): ``emit_now`` as a Python bool, a
  NumPy bool or a traced bool closes the window early."""
  tx = adam_tx()
  windows = small_windows()
  short = [windows[0][:2], windows[1]]  # the first closed after two
  traced_step = jax.jit(helpers.train_step(tx, with_loss=False))
  step = jitted_step(tx)
  flag = True if kind == 'python_bool' else np.bool_(True)
  close_step = jitted_step(tx, emit_now=flag)
  params = helpers.init_params()
  state = tx.init(params)
  for i, batch in enumerate(flatten(short)):
    if kind == 'traced_bool':
      emit_now = jnp.asarray(i == 1)
      params, state = traced_step(params, state, batch, emit_now=emit_now)
    else:
      params, state, _ = (close_step if i == 1 else step)(params, state, batch)
  assert int(state.gradient_step) == 2
  helpers.assert_within_round_off(params, full_batch(short))


def test_mean_reduction_with_an_empty_micro_batch():
  """Regression (issue 11, defect 5): ``loss_reduction='mean'`` with a
  micro-batch of no tokens (its mean 0/0 = NaN) stays finite, its window
  loss and parameters those of full-batch training."""

  def nan_mean(params, batch):  # 0/0 = NaN when the micro-batch is empty
    return helpers.loss_sum(params, batch) / jnp.sum(batch['mask'])

  tx = adam_tx(loss_reduction='mean')
  windows = small_windows()  # the first window has an empty micro-batch
  step = jitted_step(tx, loss_fn=nan_mean)
  params = helpers.init_params()
  state = tx.init(params)
  expected = full_batch(windows)
  for window, reference in zip(windows, expected.windows):
    for batch in window:
      params, state, _ = step(params, state, batch)
    assert all(bool(jnp.isfinite(x).all()) for x in jax.tree.leaves(params))
    np.testing.assert_allclose(
      tokacc.window_loss(state),
      reference.loss,
      rtol=0,
      atol=reference.loss_atol,
    )
  helpers.assert_within_round_off(params, expected)


def float_count(batch):
  return jnp.sum(jnp.asarray(batch['mask'], jnp.float32))


def non_whole_count(batch):  # 0.5 more than the tokens: not a whole number
  return float_count(batch) + 0.5


def test_float_mask_sum_is_counted_exactly():
  """Regression (issue 11, defect 8): a float count that holds a whole
  number (``mask.sum()`` of a float mask) counts exactly under the int32
  counter, as the same count as an int."""
  windows = small_windows()
  tx = adam_tx()
  params, state = train(
    tx, helpers.init_params(), flatten(windows), count_fn=float_count
  )
  helpers.assert_within_round_off(params, full_batch(windows))
  with_ints, _ = train(tx, helpers.init_params(), flatten(windows))
  chex.assert_trees_all_equal(params, with_ints)
  assert int(state.last_tokens) == sum(SMALL_COUNTS[-1])

  step = jitted_step(tx, count_fn=float_count)
  state = tx.init(helpers.init_params())
  for batch in windows[0][:2]:
    _, state, _ = step(helpers.init_params(), state, batch)
  assert int(state.acc_tokens) == sum(SMALL_COUNTS[0][:2])


def test_a_fractional_traced_count_drops_the_window():
  """Regression (issue 11, defect 8): a traced float count that is not a
  whole number is never rounded: its window is dropped (zero updates, no
  step), and the next window trains as full-batch training."""
  windows = small_windows()
  tx = adam_tx()
  step = jitted_step(tx)
  bad_step = jitted_step(tx, count_fn=non_whole_count)
  params = helpers.init_params()
  state = tx.init(params)
  for m, batch in enumerate(windows[0]):
    params, state, updates = (bad_step if m == 1 else step)(
      params, state, batch
    )
    chex.assert_trees_all_equal(updates, optax.tree.zeros_like(updates))
  chex.assert_trees_all_equal(params, helpers.init_params())
  assert int(state.gradient_step) == 0
  assert int(state.dropped_windows) == 1
  assert not bool(tokacc.has_updated(state))
  for batch in windows[1]:
    params, state, _ = step(params, state, batch)
  assert int(state.gradient_step) == 1
  helpers.assert_within_round_off(params, full_batch(windows[1:]))


def test_float_token_dtype_accumulates_fractional_weights():
  """Regression (issue 11, defect 8): ``token_dtype=jnp.float32`` counts
  fractional weights: training equals full-batch training on the weighted
  tokens."""
  rng = np.random.default_rng(7)
  windows = small_windows()
  for batch in flatten(windows):
    batch['mask'] = batch['mask'] * rng.uniform(0.1, 1.5, batch['mask'].shape)
    batch['mask'] = batch['mask'].astype(np.float32)
  tx = adam_tx(token_dtype=jnp.float32)
  params, _ = train(
    tx, helpers.init_params(), flatten(windows), count_fn=float_count
  )
  helpers.assert_within_round_off(params, full_batch(windows))


def test_float64_counts_are_carried_in_float64():
  """Regression (issue 53): under ``jax_enable_x64`` a float64 count was
  carried in float32, so that a weight of 3.1 was 3.0999999046 in
  ``last_tokens`` and in the division. Now the window's count, its parts
  and its division stay float64."""
  with jax.enable_x64(True):
    tx = tokacc.token_weighted_multistep(
      optax.sgd(1.0), 2, token_dtype=jnp.float64
    )
    params = {'w': jnp.zeros(2, jnp.float64)}
    step = jax.jit(lambda g, s, n: tx.update(g, s, params, num_tokens=n))
    state = tx.init(params)
    weights, grads = [3.1, 0.7], [[3.1, -6.2], [0.7, 0.0]]
    for weight, grad in zip(weights, grads):
      updates, state = step({'w': jnp.asarray(grad)}, state, weight)
    assert state.last_tokens.dtype == jnp.float64
    assert float(state.last_tokens) == 3.1 + 0.7
    expected = -(np.sum(grads, axis=0)) / (3.1 + 0.7)
    # One float64 rounding of the reciprocal and one of the product.
    np.testing.assert_allclose(updates['w'], expected, rtol=2 * 2.0**-53)


micro_grads = jax.jit(jax.grad(helpers.loss_sum))


def test_grad_sums_is_the_sum_of_gradients_during_a_window():
  """Regression (issue 11, defect 10): during a window ``grad_sums`` holds
  the sum of its micro-batches' token-summed gradients."""
  tx = adam_tx()
  step = jitted_step(tx)
  params = helpers.init_params()
  state = tx.init(params)
  for window in small_windows():
    window_sum = jax.tree.map(jnp.zeros_like, params)
    window_params = params
    largest_grads = []
    for batch in window[:-1]:
      grads = micro_grads(window_params, batch)
      window_sum = jax.tree.map(jnp.add, window_sum, grads)
      params, state, _ = step(params, state, batch)
      # Each micro-batch's gradient within round_off_atol's bound, with the
      # gradients as the "updates" (the sum is linear in them).
      largest_grads.append(helpers.largest(grads))
      atol = helpers.round_off_atol(
        largest_grads,
        [helpers.largest(window_sum)] * len(largest_grads),
        helpers.window_tokens([window]),
        helpers.TERM_ROUNDINGS,
        U,
      )
      helpers.assert_within_round_off(
        state.grad_sums, helpers.Reference(window_sum, atol)
      )
    params, state, _ = step(params, state, window[-1])


def test_window_loss_is_nan_before_the_first_window_and_without_loss():
  """``window_loss`` is unmistakable before a window and without ``loss``."""
  tx = adam_tx()
  state = tx.init(helpers.init_params())
  assert np.isnan(tokacc.window_loss(state))
  step = jitted_step(tx, with_loss=False)
  params = helpers.init_params()
  for batch in small_windows()[0]:
    params, state, _ = step(params, state, batch)
  assert bool(tokacc.has_updated(state))
  assert np.isnan(tokacc.window_loss(state))


def test_a_first_window_without_tokens_keeps_the_initial_state():
  """A first window of no tokens emits zero updates and keeps the initial
  inner state; the next window trains as full-batch training."""
  inner = optax.adam(LEARNING_RATE)
  tx = adam_tx()
  windows = helpers.windows_of(((0, 0, 0), (4, 0, 6)))
  step = jitted_step(tx)
  params = helpers.init_params()
  state = tx.init(params)
  for batch in windows[0]:
    params, state, updates = step(params, state, batch)
    chex.assert_trees_all_equal(updates, optax.tree.zeros_like(updates))
  chex.assert_trees_all_equal(params, helpers.init_params())
  chex.assert_trees_all_equal(
    state.inner_state, inner.init(helpers.init_params())
  )
  assert int(state.gradient_step) == 0
  assert not bool(tokacc.has_updated(state))
  for batch in windows[1]:
    params, state, _ = step(params, state, batch)
  helpers.assert_within_round_off(params, full_batch(windows[1:]))


# A window with NaN gradients must not poison the next ones ("the next
# window starts clean"). Without should_skip_update_fn, such a window either
# emits NaN updates or, without counted tokens, is dropped; either way the
# accumulator's buffer is left holding NaN. A window restarted by
# multiplying with zero keeps 0 * NaN = NaN and turns every later update
# into NaN; a select starts it afresh.


def empty_nan_batch(seed):
  """A micro-batch without counted tokens whose padding holds a NaN: its
  token-summed loss and gradients are NaN (NaN * 0 = NaN)."""
  batch = helpers.micro_batch(seed, 0)
  batch['y'][0, 0] = np.nan
  return batch


# case: (inner, the NaN window). 'dropped': no tokens, so no optimizer step;
# 'emitted': tokens and one NaN micro-batch, so NaN updates, which the
# training loop below discards (sgd keeps no state for them to poison).
NAN_WINDOWS = {
  'dropped': (
    lambda: optax.adam(LEARNING_RATE),
    lambda: [
      empty_nan_batch(98),
      helpers.micro_batch(97, 0),
      empty_nan_batch(96),
    ],
  ),
  'emitted': (
    lambda: optax.sgd(LEARNING_RATE),
    lambda: [
      helpers.micro_batch(98, 4),
      nan_batch(),
      helpers.micro_batch(97, 6),
    ],
  ),
}


def is_finite_tree(tree):
  return all(bool(np.isfinite(leaf).all()) for leaf in jax.tree.leaves(tree))


@pytest.mark.parametrize('compensated', [False, True])
@pytest.mark.parametrize('case', sorted(NAN_WINDOWS))
def test_window_after_a_nan_window_starts_clean(case, compensated):
  """Regression (issue 19): the windows after a NaN window (dropped, or
  emitted and discarded by the loop) are full-batch training's."""
  make_inner, make_nan_window = NAN_WINDOWS[case]
  tx = tokacc.token_weighted_multistep(make_inner(), K, compensated=compensated)
  step = jitted_step(tx)
  params = helpers.init_params()
  state = tx.init(params)
  for batch in make_nan_window():
    new_params, state, updates = step(params, state, batch)
    if is_finite_tree(updates):
      params = new_params  # else the loop keeps its parameters
  chex.assert_trees_all_equal(params, helpers.init_params())
  if case == 'dropped':
    chex.assert_trees_all_equal(updates, optax.tree.zeros_like(updates))
    assert int(state.gradient_step) == 0
  else:
    assert all(np.isnan(u).all() for u in jax.tree.leaves(updates))
    assert int(state.gradient_step) == 1

  windows = small_windows()
  for w, window in enumerate(windows):
    # At the very parameters the window's losses are taken at: round-off
    # of the sum alone (the loss_atol of a first window).
    at_params = helpers.full_batch(make_inner(), params, [window])
    for batch in window:
      params, state, updates = step(params, state, batch)
    assert is_finite_tree(updates), f'window {w} after the NaN window'
    expected = full_batch(windows[: w + 1], make_inner())
    helpers.assert_within_round_off(params, expected)
    np.testing.assert_allclose(
      tokacc.window_loss(state),
      at_params.loss,
      rtol=0,
      atol=at_params.loss_atol,
    )
