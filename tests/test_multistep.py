"""Tests of `token_weighted_multistep` against full-batch training."""

from typing import NamedTuple

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import optax_tokacc as tokacc

FEATURES = 3
SEQ_LEN = 5

# Tokens counted per micro-batch of two sequences: deliberately unequal, with
# an all-padding micro-batch in the second window.
TOKEN_COUNTS = ((10, 1, 7, 3), (0, 9, 2, 6), (5, 5, 1, 8))


def init_params(dtype=jnp.float32):
  key_w, key_v = jax.random.split(jax.random.key(0))
  return {
    'w': jax.random.normal(key_w, (FEATURES, FEATURES), dtype),
    'v': jax.random.normal(key_v, (FEATURES,), dtype),
  }


def token_losses(params, batch):
  """Per-token squared error of a small nonlinear model, shape [B, T]."""
  hidden = jnp.tanh(batch['x'] @ params['w'])
  prediction = hidden @ params['v']
  return (prediction - batch['y']) ** 2


def loss_sum(params, batch):
  """The micro-batch loss summed over counted tokens (what users pass)."""
  return jnp.sum(token_losses(params, batch) * batch['mask'])


def loss_mean(params, batch):
  """The micro-batch token-mean loss (what MultiSteps users pass).

  An all-padding micro-batch has no mean; users take 0 for it.
  """
  return loss_sum(params, batch) / jnp.maximum(jnp.sum(batch['mask']), 1)


def make_micro_batch(seed, num_tokens, dtype=jnp.float32):
  """Two sequences of SEQ_LEN with exactly `num_tokens` counted positions."""
  rng = np.random.default_rng(seed)
  mask = np.zeros(2 * SEQ_LEN)
  mask[:num_tokens] = 1.0
  return {
    'x': jnp.asarray(rng.normal(size=(2, SEQ_LEN, FEATURES)), dtype),
    'y': jnp.asarray(rng.normal(size=(2, SEQ_LEN)), dtype),
    'mask': jnp.asarray(mask.reshape(2, SEQ_LEN), dtype),
  }


def make_windows(token_counts=TOKEN_COUNTS, dtype=jnp.float32):
  return [
    [make_micro_batch(10 * w + i, n, dtype) for i, n in enumerate(counts)]
    for w, counts in enumerate(token_counts)
  ]


def concat(micro_batches):
  return jax.tree.map(lambda *xs: jnp.concatenate(xs), *micro_batches)


def num_tokens_of(batch):
  return jnp.sum(batch['mask']).astype(jnp.int32)


def train_full_batch(optimizer, params, windows):
  """Reference: one plain optimizer step per window on the whole window."""
  return full_batch(optimizer, params, windows).params


class Reference(NamedTuple):
  """Full-batch training's parameters, and how far float32 round-off can
  take a run of the same windows from them (:func:`round_off_atol`)."""

  params: optax.Params
  atol: float


def full_batch(optimizer, params, windows) -> Reference:
  """:func:`train_full_batch`, with the round-off bound of its steps."""

  def full_batch_loss(params, batch):
    return loss_sum(params, batch) / jnp.sum(batch['mask'])

  state = optimizer.init(params)
  largest_updates, largest_params = [], [largest(params)]
  for window in windows:
    grads = jax.grad(full_batch_loss)(params, concat(window))
    updates, state = optimizer.update(grads, state, params)
    params = optax.apply_updates(params, updates)
    largest_updates.append(largest(updates))
    largest_params.append(largest(params))
  atol = round_off_atol(largest_updates, max(largest_params), windows)
  return Reference(params, atol)


def largest(tree) -> float:
  return max(float(jnp.max(jnp.abs(x))) for x in jax.tree.leaves(tree))


UNIT_ROUND_OFF = 2.0**-24  # float32


# The roundings on one token's path to its gradient term: the dot products'
# terms (2 FEATURES, forward and backward) and about 16 elementwise
# operations (tanh's own error counted as a few).
TERM_ROUNDINGS = 2 * FEATURES + 16


def window_tokens(windows) -> int:
  """The counted tokens of the largest window."""
  return max(sum(int(jnp.sum(b['mask'])) for b in w) for w in windows)


def round_off_atol(
  largest_updates, largest_param, windows, term_roundings=TERM_ROUNDINGS
) -> float:
  """How far float32 round-off can take accumulation from full-batch
  training, over steps whose largest updates are ``largest_updates``.

  A window's gradient sums the terms of its n counted tokens, each computed
  through m = ``term_roundings`` roundings (this model's
  ``TERM_ROUNDINGS`` unless another model's count is given). Two float32 evaluations in
  different orders (per micro-batch and then over the window, against the
  whole window at once) differ by at most 2 (n + m) u times the terms' size
  (u = 2**-24; Higham, Accuracy and Stability of Numerical Algorithms,
  2002, sections 3.1 and 4.2), taken relative to the step's largest update.
  SGD and momentum are linear in the gradients; Adam's update is
  homogeneous of degree 0 in them, so it moves by at most twice the
  relative error: a factor 2 for all. Adding an update rounds a parameter
  by at most u |p| in each run. This worst case (errors of one sign) exceeds
  the typical one (random signs) by sqrt(n + m) > 5, which covers terms
  that cancel and the growth of a difference over a few steps: measured,
  differences stay below 1/8 of it on two CPUs (``--xla_cpu_max_isa=AVX``
  emulating an older one), where a fixed 1e-6 came within 1/6. It is still
  below 1e-3 of the gap the average of averages leaves.
  """
  n = window_tokens(windows)
  relative = 2 * 2 * (n + term_roundings) * UNIT_ROUND_OFF
  rounding = 2 * UNIT_ROUND_OFF * largest_param
  return sum(relative * update + rounding for update in largest_updates)


def assert_within_round_off(actual, expected: Reference):
  chex.assert_trees_all_close(
    actual, expected.params, rtol=0, atol=expected.atol
  )


def train_accumulated(tx, params, windows, *, use_jit=True, loss_fn=loss_sum):
  def step(params, state, batch):
    grads = jax.grad(loss_fn)(params, batch)
    updates, state = tx.update(
      grads, state, params, num_tokens=num_tokens_of(batch)
    )
    return optax.apply_updates(params, updates), state

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


def assert_relative_close(actual, expected, rtol):
  for a, e in zip(jax.tree.leaves(actual), jax.tree.leaves(expected)):
    a, e = np.asarray(a), np.asarray(e)
    scale = np.maximum(np.abs(e).max(), 1e-30)
    np.testing.assert_array_less(np.abs(a - e).max() / scale, rtol)


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
  params = init_params()
  expected = full_batch(optimizer(), params, windows)
  tx = tokacc.token_weighted_multistep(optimizer(), every_k_schedule=4)
  actual, state = train_accumulated(tx, params, windows, use_jit=use_jit)
  assert_within_round_off(actual, expected)
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
    windows = make_windows(dtype=jnp.float64)
    params = init_params(jnp.float64)
    expected = train_full_batch(optimizer(), params, windows)
    tx = tokacc.token_weighted_multistep(optimizer(), every_k_schedule=4)
    actual, state = train_accumulated(tx, params, windows)
    assert state.grad_sums['w'].dtype == jnp.float64
    assert_relative_close(actual, expected, rtol=1e-12)


def test_multisteps_is_wrong_with_unequal_tokens():
  """The average-of-averages bug: the test setup does catch it."""
  windows = make_windows()
  params = init_params()
  expected = train_full_batch(optax.sgd(0.1), params, windows)
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
    grads = jax.grad(loss_mean)(params, batch)
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
  windows = make_windows(((6, 6, 6), (4, 4, 4), (10, 10, 10)))
  params = init_params()
  multi = optax.MultiSteps(optimizer(), every_k_schedule=3)
  _, expected = train_multisteps(multi, params, windows)

  tx = tokacc.token_weighted_multistep(
    optimizer(), every_k_schedule=3, loss_reduction='mean'
  )

  @jax.jit
  def step(params, state, batch):
    grads = jax.grad(loss_mean)(params, batch)
    updates, state = tx.update(
      grads, state, params, num_tokens=num_tokens_of(batch)
    )
    return optax.apply_updates(params, updates), state, updates

  state = tx.init(params)
  batches = [batch for window in windows for batch in window]
  largest_updates = []
  # round_off_atol: MultiSteps' running mean rounds 3 times a micro-step,
  # fewer than the n + m terms the bound allows for.
  for batch, (expected_params, expected_updates) in zip(batches, expected):
    params, state, updates = step(params, state, batch)
    largest_updates.append(largest(expected_updates))
    chex.assert_trees_all_close(
      updates,
      expected_updates,
      rtol=0,
      atol=round_off_atol(largest_updates[-1:], 0.0, windows),
    )
    chex.assert_trees_all_close(
      params,
      expected_params,
      rtol=0,
      atol=round_off_atol(largest_updates, largest(expected_params), windows),
    )


def test_mean_reduction_equals_full_batch_with_unequal_tokens():
  windows = make_windows()
  params = init_params()
  expected = full_batch(optax.adam(0.05), params, windows)
  tx = tokacc.token_weighted_multistep(
    optax.adam(0.05), every_k_schedule=4, loss_reduction='mean'
  )
  actual, _ = train_accumulated(tx, params, windows, loss_fn=loss_mean)
  assert_within_round_off(actual, expected)


def test_inner_optimizer_runs_once_per_window():
  """Adam's count, and so its bias correction, advances once per window."""
  windows = make_windows()
  tx = tokacc.token_weighted_multistep(optax.adam(0.05), every_k_schedule=4)
  _, state = train_accumulated(tx, init_params(), windows)
  adam_state = state.inner_state[0]
  assert int(adam_state.count) == len(windows)


@pytest.mark.slow
def test_micro_steps_return_zero_updates_and_keep_inner_state():
  """Micro-steps return zeros and leave SGD's momentum alone; the closing
  step hands it the window's full-batch gradient (unequal token counts)."""
  learning_rate = 0.1
  params = init_params()
  tx = tokacc.token_weighted_multistep(
    optax.sgd(learning_rate, momentum=0.9), every_k_schedule=3
  )
  state = tx.init(params)
  window = [make_micro_batch(i, n) for i, n in enumerate((7, 2, 9))]

  @jax.jit
  def step(state, batch):
    grads = jax.grad(loss_sum)(params, batch)
    return tx.update(grads, state, params, num_tokens=num_tokens_of(batch))

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
  full = concat(window)
  full_grads = jax.grad(lambda p: loss_sum(p, full) / jnp.sum(full['mask']))(
    params
  )
  # One window: round_off_atol relative to the largest gradient, and to
  # the largest update (the learning rate times it; -lr * g rounds once).
  gradient_atol = round_off_atol([largest(full_grads)], 0.0, [window])
  chex.assert_trees_all_close(
    new_state.inner_state[0].trace, full_grads, rtol=0, atol=gradient_atol
  )
  chex.assert_trees_all_close(
    updates,
    jax.tree.map(lambda g: -learning_rate * g, full_grads),
    rtol=UNIT_ROUND_OFF,
    atol=learning_rate * gradient_atol,
  )
  assert_within_round_off(
    optax.apply_updates(params, updates),
    full_batch(optax.sgd(learning_rate, momentum=0.9), params, [window]),
  )


def test_as_element_of_optax_chain():
  windows = make_windows()
  params = init_params()
  expected = full_batch(
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
  assert_within_round_off(actual, expected)


@pytest.mark.slow
def test_inner_inject_hyperparams_with_schedule():
  """A learning-rate schedule inside `inner` advances once per window."""

  def optimizer():
    schedule = optax.linear_schedule(0.1, 0.01, transition_steps=3)
    return optax.inject_hyperparams(optax.adam)(learning_rate=schedule)

  windows = make_windows()
  params = init_params()
  expected = full_batch(optimizer(), params, windows)
  tx = tokacc.token_weighted_multistep(optimizer(), every_k_schedule=4)
  actual, state = train_accumulated(tx, params, windows)
  assert_within_round_off(actual, expected)
  assert int(state.inner_state.count) == len(windows)


def test_inner_hyperparams_can_be_changed_in_state():
  params = init_params()
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
  params = init_params()
  tx = optax.inject_hyperparams(
    tokacc.token_weighted_multistep, static_args=('every_k_schedule',)
  )(inner=optax.sgd(0.1), every_k_schedule=2)
  windows = make_windows(((3, 5), (2, 7)))
  expected = full_batch(optax.sgd(0.1), params, windows)
  actual, _ = train_accumulated(tx, params, windows)
  assert_within_round_off(actual, expected)


def test_every_k_schedule_function():
  """Batch-size warm-up: windows of 2, then 3 micro-batches."""
  token_counts = ((4, 9), (3, 0), (8, 1, 5), (2, 6, 10))
  windows = make_windows(token_counts)
  params = init_params()
  expected = full_batch(optax.adam(0.05), params, windows)
  tx = tokacc.token_weighted_multistep(
    optax.adam(0.05), every_k_schedule=lambda step: jnp.where(step < 2, 2, 3)
  )
  actual, state = train_accumulated(tx, params, windows)
  assert_within_round_off(actual, expected)
  assert int(state.gradient_step) == 4


def test_zero_token_window_emits_nothing():
  windows = make_windows(((3, 4), (0, 0), (5, 2)))
  params = init_params()
  # Full batch skips the empty window: it has no loss to take a step on.
  expected = full_batch(optax.adam(0.05), params, [windows[0], windows[2]])
  tx = tokacc.token_weighted_multistep(optax.adam(0.05), every_k_schedule=2)

  step_fn = jax.jit(
    lambda p, s, b: tx.update(
      jax.grad(loss_sum)(p, b), s, p, num_tokens=num_tokens_of(b)
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
  assert_within_round_off(params, expected)


@pytest.mark.slow
def test_skip_not_finite_drops_micro_batch_without_poisoning():
  windows = make_windows()
  params = init_params()
  expected = full_batch(optax.adam(0.05), params, windows)
  tx = tokacc.token_weighted_multistep(
    optax.adam(0.05),
    every_k_schedule=4,
    should_skip_update_fn=tokacc.skip_not_finite,
  )

  @jax.jit
  def step(params, state, batch, poison):
    grads = jax.grad(loss_sum)(params, batch)
    grads = jax.tree.map(lambda g: jnp.where(poison, jnp.nan, g), grads)
    updates, state = tx.update(
      grads, state, params, num_tokens=num_tokens_of(batch)
    )
    return optax.apply_updates(params, updates), state

  state = tx.init(params)
  for window in windows:
    for i, batch in enumerate(window):
      if i == 1:  # A NaN micro-batch: rejected, the window does not advance.
        params, state = step(params, state, batch, True)
        assert bool(state.skip_state['should_skip'])
      params, state = step(params, state, batch, False)
  assert_within_round_off(params, expected)


@pytest.mark.parametrize('change', ['later_stage', 'by_hand', 'none'])
def test_apply_if_updated_applies_the_updates_it_is_given(change):
  # `apply_if_updated` may read the emitted updates from the state's buffer
  # when it is given exactly the updates returned with that state; updates
  # changed after the transform must be the ones applied.
  windows = make_windows()
  params = init_params()
  inner = optax.sgd(0.1)
  scale = 1.0 if change == 'none' else 0.5
  stages = [tokacc.token_weighted_multistep(inner, every_k_schedule=4)]
  if change == 'later_stage':
    stages.append(optax.scale(scale))
  tx = optax.chain(*stages)

  @jax.jit
  def step(params, state, batch):
    grads = jax.grad(loss_sum)(params, batch)
    updates, state = tx.update(
      grads, state, params, num_tokens=num_tokens_of(batch)
    )
    if change == 'by_hand':
      updates = jax.tree.map(lambda u: u * scale, updates)
    return tokacc.apply_if_updated(params, updates, state), state

  state = tx.init(params)
  for window in windows:
    for batch in window:
      params, state = step(params, state, batch)
  expected = full_batch(optax.sgd(0.1 * scale), init_params(), windows)
  assert_within_round_off(params, expected)


def test_window_loss_and_apply_if_updated():
  windows = make_windows()
  params = init_params()
  tx = tokacc.token_weighted_multistep(optax.adam(0.05), every_k_schedule=4)
  expected_params = full_batch(optax.adam(0.05), params, windows)

  @jax.jit
  def step(params, state, batch):
    loss, grads = jax.value_and_grad(loss_sum)(params, batch)
    updates, state = tx.update(
      grads, state, params, num_tokens=num_tokens_of(batch), loss=loss
    )
    return tokacc.apply_if_updated(params, updates, state), state

  state = tx.init(params)
  for window in windows:
    full = concat(window)
    expected_loss = loss_sum(params, full) / jnp.sum(full['mask'])
    for batch in window:
      params, state = step(params, state, batch)
    # A sum of squared errors: terms of one sign, so the relative error of
    # either evaluation is at most (n + m) u, with no cancellation.
    loss_rtol = 2 * (window_tokens([window]) + TERM_ROUNDINGS) * UNIT_ROUND_OFF
    np.testing.assert_allclose(
      tokacc.window_loss(state), expected_loss, rtol=loss_rtol
    )
  assert_within_round_off(params, expected_params)


def test_compiles_once():
  traces = []
  params = init_params()
  tx = tokacc.token_weighted_multistep(optax.adamw(0.01), every_k_schedule=3)

  @jax.jit
  def step(params, state, batch):
    traces.append(None)
    loss, grads = jax.value_and_grad(loss_sum)(params, batch)
    updates, state = tx.update(
      grads, state, params, num_tokens=num_tokens_of(batch), loss=loss
    )
    return optax.apply_updates(params, updates), state

  state = tx.init(params)
  for seed in range(20):
    params, state = step(params, state, make_micro_batch(seed, seed % 10))
  assert len(traces) == 1
  assert int(state.gradient_step) == 6


@pytest.mark.parametrize(
  'use_scan', [pytest.param(False, marks=pytest.mark.slow), True]
)
def test_bfloat16_grads_accumulate_in_float32(use_scan):
  params = init_params(jnp.bfloat16)
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
  params = init_params()
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
  params = init_params()
  expected = full_batch(optax.adam(0.05), params, windows)
  tx = tokacc.token_weighted_multistep(
    optax.adam(0.05), 4, token_dtype=jnp.float32
  )

  @jax.jit
  def step(params, state, batch):
    grads = jax.grad(loss_sum)(params, batch)
    updates, state = tx.update(
      grads, state, params, num_tokens=jnp.sum(batch['mask'])
    )
    return optax.apply_updates(params, updates), state

  state = tx.init(params)
  for window in windows:
    for batch in window:
      params, state = step(params, state, batch)
  assert_within_round_off(params, expected)


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
      TypeError, match=r'token_dtype must be int32 or a floating'
    ):
      tokacc.token_weighted_multistep(optax.sgd(0.1), 2, token_dtype=jnp.bool_)

  def test_missing_num_tokens(self):
    params = init_params()
    tx = tokacc.token_weighted_multistep(optax.sgd(0.1), 2)
    state = tx.init(params)
    with pytest.raises(
      TypeError, match=r'num_tokens.*tx\.update\(grads, state'
    ):
      jax.jit(tx.update)(params, state, params)

  def test_non_scalar_num_tokens(self):
    params = init_params()
    tx = tokacc.token_weighted_multistep(optax.sgd(0.1), 2)
    state = tx.init(params)
    with pytest.raises(ValueError, match=r'num_tokens must be a real scalar'):
      jax.jit(tx.update)(params, state, params, num_tokens=jnp.ones(3))

  def test_traced_float_num_tokens_with_integer_counter(self):
    """A float count holding a whole number is exact; a fractional one is
    never rounded: its window is dropped (defect 8 of 0.1)."""
    params = init_params()
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
    params = init_params()
    tx = tokacc.token_weighted_multistep(optax.sgd(0.1), 2)
    state = tx.init(params)
    with pytest.raises(ValueError, match=r'does not match the parameters'):
      tx.update({'w': params['w']}, state, params, num_tokens=3)
    with pytest.raises(ValueError, match=r'does not match the accumulator'):
      tx.update({'w': params['w']}, state, None, num_tokens=3)


def test_helpers_find_state_inside_a_chain():
  params = init_params()
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
