"""The thresholds of the window, each tested on both sides of its boundary.

- ``tokens_per_update``: a window whose tokens reach the budget exactly
  closes on that micro-step; one token less and it stays open.
- ``every_k_schedule``: a window closes after exactly k micro-steps, not
  k - 1 or k + 1, also when k comes from a schedule.
- A zero count: under ``'sum'`` its micro-batch adds what it brings; under
  ``'mean'`` nothing. A window of no tokens emits nothing and keeps the
  inner state.
- The int32 counter: a window of exactly 2**31 - 1 tokens is valid and
  exact; 2**31 is not, and the window is dropped.
- A floating counter (issue 53): a window of total weight below 1 is
  divided by its total, not by 1; the totals it honours, on both sides
  (the smallest normal number of ``token_dtype`` and its reciprocal), in
  float32 and in float64; a subnormal weight, a total above the
  reciprocal or one that overflows drops the window and is counted.

The budget and the counter are also tested over devices (``shard_map``,
``pmap`` and explicit sharding, of ``placements.PLACEMENTS``), where the
tokens of the window are summed over all of them; so is an invalid count
with the budget (rule 2 of "Rules of the window", issue 22).

References are written plainly here: which micro-steps close a window
(``helpers.closing_steps``), and the SGD update ``-sum(grads) /
sum(tokens)``. Gradients are given directly
(small integers, whose float32 sums are exact), so an update differs from
its float64 reference only by the one float32 rounding of the division.
"""

import chex
import helpers
import jax
import jax.numpy as jnp
import numpy as np
import optax
import placements
import pytest

import optax_tokacc as tokacc

NUM_DEVICES = 4
PARAMS = {'w': jnp.zeros(2)}


def grads_of(i):
  """The token-summed gradients of micro-batch ``i``: small integers."""
  return {'w': jnp.array([i + 1.0, 2.0 * i - 3.0])}


def reference_update(counts, start, stop):
  """Reference: SGD(1) on the window of micro-batches ``[start, stop)``."""
  total = sum(counts[start:stop])
  grads = sum(
    np.asarray(grads_of(i)['w'], np.float64) for i in range(start, stop)
  )
  return -grads / total


def run(tx, counts, params=PARAMS, grads=grads_of, count_dtype=jnp.int32):
  """Feeds micro-batch ``i`` (``grads(i)``, ``counts[i]`` traced, in
  ``count_dtype``) to ``tx``; returns the updates and states after every
  call."""
  step = jax.jit(lambda g, s, n: tx.update(g, s, params, num_tokens=n))
  state = tx.init(params)
  history = []
  for i, count in enumerate(counts):
    updates, state = step(grads(i), state, jnp.asarray(count, count_dtype))
    history.append((updates, state))
  return history


def closed_at(history):
  return [
    step
    for step, (_, state) in enumerate(history, start=1)
    if bool(tokacc.has_updated(state))
  ]


def assert_updates_match(history, counts):
  """Every emitted update equals SGD(1) on its window's micro-batches."""
  start = 0
  for stop in closed_at(history):
    updates, _ = history[stop - 1]
    expected = reference_update(counts, start, stop)
    np.testing.assert_allclose(
      updates['w'], expected, rtol=helpers.DIVISION_RTOL
    )
    start = stop


# tokens_per_update: the budget reached exactly, and missed by one token.

BUDGET = 12
BUDGET_COUNTS = {
  # cumulative 3, 7, 12: the window holds exactly the budget at step 3;
  # then 2, 12: exactly again at step 5.
  'exactly': [3, 4, 5, 2, 10, 0, 2],
  # cumulative 3, 7, 11: one token short at step 3, over it at step 4;
  # then 10, 10, 12: the next window holds exactly the budget at step 7.
  'one_less': [3, 4, 4, 2, 10, 0, 2],
}


@pytest.mark.parametrize('case', sorted(BUDGET_COUNTS))
def test_budget_boundary(case):
  """Closes on the micro-step whose tokens reach the budget exactly (k is
  never reached), and not one micro-step earlier."""
  counts = BUDGET_COUNTS[case]
  k = 8
  expected = helpers.closing_steps(counts, lambda _: k, BUDGET)
  assert expected == ([3, 5] if case == 'exactly' else [4, 7])
  tx = tokacc.token_weighted_multistep(
    optax.sgd(1.0), k, tokens_per_update=BUDGET
  )
  history = run(tx, counts)
  assert closed_at(history) == expected
  assert int(history[expected[0] - 1][1].last_tokens) == sum(
    counts[: expected[0]]
  )
  assert_updates_match(history, counts)


def test_budget_reached_on_the_kth_micro_step_closes_once():
  """Budget and k on the same micro-step: one window, not two."""
  counts = [4, 4, 4, 4, 4, 4]
  tx = tokacc.token_weighted_multistep(
    optax.sgd(1.0), 3, tokens_per_update=BUDGET
  )
  history = run(tx, counts)
  assert closed_at(history) == helpers.closing_steps(
    counts, lambda _: 3, BUDGET
  )
  assert closed_at(history) == [3, 6]
  assert int(history[-1][1].gradient_step) == 2
  assert_updates_match(history, counts)


# every_k_schedule: exactly k micro-steps.

SCHEDULES = {
  'k=3': (3, lambda window: 3),
  'schedule': (
    lambda step: jnp.where(step < 1, 2, jnp.where(step < 2, 4, 3)),
    lambda window: 2 if window < 1 else 4 if window < 2 else 3,
  ),
}


@pytest.mark.parametrize('name', sorted(SCHEDULES))
def test_k_boundary(name):
  """A window closes after exactly k micro-steps: 3, 6, 9, 12 with k = 3;
  2, 6, 9, 12 with k = 2, then 4, then 3 (k is read at the window's
  optimizer step, as in ``optax.MultiSteps``)."""
  schedule, k_of = SCHEDULES[name]
  counts = [1, 2, 3, 1, 2, 3, 1, 2, 3, 1, 2, 3]
  expected = helpers.closing_steps(counts, k_of)
  assert expected == ([3, 6, 9, 12] if name == 'k=3' else [2, 6, 9, 12])
  history = run(
    tokacc.token_weighted_multistep(optax.sgd(1.0), schedule), counts
  )
  assert closed_at(history) == expected
  assert_updates_match(history, counts)


def test_k_boundary_matches_optax_multisteps():
  """The same closing steps as ``optax.MultiSteps`` with a schedule."""
  schedule = SCHEDULES['schedule'][0]
  counts = [1] * 12
  multi = optax.MultiSteps(optax.sgd(1.0), schedule)
  state = multi.init(PARAMS)
  multi_update = jax.jit(multi.update)
  multi_closes = []
  for i in range(len(counts)):
    _, state = multi_update(grads_of(i), state, PARAMS)
    if int(state.mini_step) == 0:
      multi_closes.append(i + 1)
  history = run(
    tokacc.token_weighted_multistep(optax.sgd(1.0), schedule), counts
  )
  assert closed_at(history) == multi_closes


# A zero count.


def test_zero_count_under_sum_adds_its_gradients():
  """``'sum'``: a micro-batch of no tokens adds what it brings (its
  gradients, a token-summed loss); the window still counts it as a
  micro-step."""
  counts = [2, 0, 3]
  history = run(tokacc.token_weighted_multistep(optax.sgd(1.0), 3), counts)
  assert closed_at(history) == [3]
  assert_updates_match(history, counts)


def test_zero_count_under_mean_adds_nothing():
  """``'mean'``: a micro-batch of no tokens adds nothing, even a NaN mean
  (0/0); the others are weighted by their counts. It still counts as a
  micro-step."""
  counts = [2, 0, 3]
  means = [
    jnp.array([1.0, -2.0]),
    jnp.array([jnp.nan, jnp.nan]),  # the 0/0 of a mean over no tokens
    jnp.array([3.0, 4.0]),
  ]
  tx = tokacc.token_weighted_multistep(optax.sgd(1.0), 3, loss_reduction='mean')
  state = tx.init(PARAMS)
  step = jax.jit(lambda g, s, n: tx.update(g, s, PARAMS, num_tokens=n))
  for mean, count in zip(means, counts):
    updates, state = step({'w': mean}, state, jnp.int32(count))
  assert bool(tokacc.has_updated(state))
  expected = -(2 * np.asarray(means[0]) + 3 * np.asarray(means[2])) / 5
  np.testing.assert_allclose(updates['w'], expected, rtol=helpers.DIVISION_RTOL)


@pytest.mark.parametrize('loss_reduction', ['sum', 'mean'])
def test_window_of_no_tokens(loss_reduction):
  """A window of no tokens emits zero updates (-0.0), keeps the inner state
  (the momentum of the window before), is neither a step nor dropped; the
  next window's update is as if it had not been."""
  inner = optax.sgd(1.0, momentum=0.5)
  tx = tokacc.token_weighted_multistep(inner, 2, loss_reduction=loss_reduction)
  grads = {'w': jnp.array([4.0, -2.0])}
  step = jax.jit(lambda g, s, n: tx.update(g, s, PARAMS, num_tokens=n))
  state = tx.init(PARAMS)
  for count in (1, 1):  # a window of 2 tokens: its mean gradient is g
    _, state = step(grads, state, jnp.int32(count))
  before = state
  for count in (0, 0):
    updates, state = step(grads, state, jnp.int32(count))
  assert not bool(tokacc.has_updated(state))
  chex.assert_trees_all_equal(updates, {'w': -jnp.zeros(2)})
  assert np.all(np.signbit(updates['w']))
  chex.assert_trees_all_equal(state.inner_state, before.inner_state)
  assert int(state.gradient_step) == int(before.gradient_step) == 1
  assert int(state.dropped_windows) == 0
  assert int(state.last_tokens) == 2
  for count in (1, 1):
    updates, state = step(grads, state, jnp.int32(count))
  # Plain momentum: trace = g + 0.5 * g, both windows' mean gradient being
  # g (exact in float32: halves and sums of small integers).
  mean = np.asarray(grads['w'])
  chex.assert_trees_all_equal(updates['w'], -(mean + 0.5 * mean))


# The int32 counter: 2**31 - 1 tokens per window, and not one more.

INT32_MAX = 2**31 - 1


@pytest.mark.parametrize(
  'counts',
  [[INT32_MAX], [2**30, 2**30 - 1], [2**30 - 1, 0, 2**30]],
  ids=['one', 'two', 'three'],
)
def test_int32_max_tokens_are_valid(counts):
  """A window of exactly 2**31 - 1 tokens: valid, and the update is the
  gradient sum over 2**31 - 1 (float32 rounds the divisor to 2**31)."""
  history = run(
    tokacc.token_weighted_multistep(optax.sgd(1.0), len(counts)), counts
  )
  _, state = history[-1]
  assert closed_at(history) == [len(counts)]
  assert int(state.last_tokens) == INT32_MAX
  assert int(state.dropped_windows) == 0
  assert_updates_match(history, counts)


@pytest.mark.parametrize(
  'counts', [[2**30, 2**30], [INT32_MAX, 1], [1, INT32_MAX]]
)
def test_int32_overflow_drops_the_window(counts):
  """2**31 tokens: the window is dropped (zero updates, the inner state and
  step kept, ``dropped_windows`` + 1), and the next window is clean."""
  inner = optax.sgd(1.0, momentum=0.5)
  tx = tokacc.token_weighted_multistep(inner, 2)
  history = run(tx, counts + [3, 1])
  _, first = history[0]
  updates, dropped = history[1]
  assert not bool(tokacc.has_updated(dropped))
  chex.assert_trees_all_equal(updates, {'w': -jnp.zeros(2)})
  chex.assert_trees_all_equal(dropped.inner_state, first.inner_state)
  assert int(dropped.gradient_step) == 0
  assert int(dropped.dropped_windows) == 1
  assert closed_at(history) == [4]
  # The momentum starts afresh: the dropped window left no trace.
  np.testing.assert_allclose(
    history[3][0]['w'],
    reference_update(counts + [3, 1], 2, 4),
    rtol=helpers.DIVISION_RTOL,
  )


def test_float_count_of_2_31_drops_the_window():
  """A float count of 2**31 (exact in float32) is beyond the counter."""
  tx = tokacc.token_weighted_multistep(optax.sgd(1.0), 1)
  step = jax.jit(lambda s, n: tx.update(grads_of(0), s, PARAMS, num_tokens=n))
  _, state = step(tx.init(PARAMS), jnp.float32(2.0**31))
  assert int(state.dropped_windows) == 1
  _, state = step(tx.init(PARAMS), jnp.float32(2.0**30))
  assert int(state.dropped_windows) == 0
  assert int(state.last_tokens) == 2**30


# A floating counter (issue 53): a window is divided by its own total.


def test_float_window_below_one_is_divided_by_its_total():
  """Regression (issue 53): a window of total weight 0.375 was divided by
  1 (``jnp.maximum(total, 1)``, a guard against a zero count), its update
  -0.75 instead of the weighted mean -(0.25 + 0.5) / 0.375 = -2.0 (exact
  in float32)."""
  tx = tokacc.token_weighted_multistep(
    optax.sgd(1.0), 2, token_dtype=jnp.float32
  )
  sums = [0.25, 0.5]  # token-summed gradients: weight times gradient
  history = run(
    tx,
    [0.25, 0.125],
    {'w': jnp.zeros(1)},
    lambda i: {'w': jnp.array([sums[i]])},
    jnp.float32,
  )
  updates, state = history[-1]
  assert bool(tokacc.has_updated(state))
  chex.assert_trees_all_equal(updates, {'w': jnp.array([-2.0])})
  metrics = tokacc.window_metrics(state)
  assert float(metrics.tokens) == 0.375
  assert float(metrics.grad_norm) == 2.0


def total_cases(dtype):
  """Weights of two micro-batches, per case, for a floating ``dtype``:
  (counts, honoured). The totals on both sides of the range a window is
  divided by: [tiny, 1 / tiny], tiny the smallest normal number, the
  largest whose reciprocal is normal. A subnormal weight is below the
  range, or 0 where a comparison reads it so (XLA on a CPU flushes
  subnormal numbers to zero; whether a comparison sees one as 0 is its
  compiler's choice): honoured None, either."""
  tiny = float(jnp.finfo(dtype).tiny)
  largest = 1 / tiny  # a power of two: 2**126 in float32
  return {
    'smallest': ([tiny, 0.0], True),
    'largest': ([largest / 2, largest / 2], True),
    'subnormal_weight': ([tiny / 2, 1.0], None),
    'above_largest': ([largest, largest], False),
    'overflows': ([float(jnp.finfo(dtype).max)] * 2, False),
  }


TOTAL_CASES = sorted(total_cases(jnp.float32))


@pytest.mark.parametrize('dtype', ['float32', 'float64'])
@pytest.mark.parametrize('case', TOTAL_CASES)
def test_float_totals_on_both_sides_of_the_range(case, dtype):
  """A window whose total lies in [tiny, 1 / tiny] is divided by it, its
  norms those of its weighted mean; outside, it is dropped (no update, no
  step) and counted in ``dropped_windows``; the next window is clean. The
  gradients are the weights times small integers, so that every sum and
  quotient is exact, the norms within a float32 rounding (float64 under
  ``jax.enable_x64``)."""
  with jax.enable_x64(dtype == 'float64'):
    counts, honoured = total_cases(dtype)[case]
    counts = counts + [1.0, 3.0]  # the next window
    tx = tokacc.token_weighted_multistep(optax.sgd(1.0), 2, token_dtype=dtype)

    def grads(i):  # weight times a small integer; the NaN of 0 * inf aside
      return {'w': jnp.asarray(counts[i], dtype) * grads_of(i)['w']}

    history = run(tx, counts, {'w': jnp.zeros(2, dtype)}, grads, dtype)
    (updates, state), (next_updates, after) = history[1], history[3]
    if honoured is None:  # a subnormal weight: 0, or the window dropped
      honoured = bool(tokacc.has_updated(state))
      counts[0] = 0.0 if honoured else counts[0]
    assert bool(tokacc.has_updated(state)) == honoured
    assert int(state.dropped_windows) == (not honoured)
    assert int(after.gradient_step) == 1 + honoured
    for stop, found in ((2, updates), (4, next_updates)):
      if stop == 2 and not honoured:
        chex.assert_trees_all_equal(found, {'w': -jnp.zeros(2, dtype)})
        continue
      start = stop - 2
      weights = np.asarray(counts[start:stop], np.float64)
      sums = [
        np.asarray(grads_of(i)['w'], np.float64) for i in (start, stop - 1)
      ]
      expected = -(weights[0] * sums[0] + weights[1] * sums[1]) / weights.sum()
      chex.assert_trees_all_equal(found['w'], expected.astype(dtype))
    if honoured:
      metrics = tokacc.window_metrics(state)
      assert float(metrics.tokens) == sum(counts[:2])
      np.testing.assert_allclose(
        metrics.grad_norm, np.linalg.norm(updates['w']), rtol=2.0**-22
      )


def test_float64_weight_below_float32_drops_the_window():
  """A float64 weight that underflows in a float32 counter (1e-300: 0
  once in float32) is not counted as 0: the window is dropped and
  counted, as is one that overflows there (1e300: inf). Under
  ``jax.enable_x64``, so that the weight reaches the transform in
  float64."""
  with jax.enable_x64(True):
    tx = tokacc.token_weighted_multistep(
      optax.sgd(1.0), 2, token_dtype=jnp.float32
    )

    def grads(i):  # float32, as the parameters
      return jax.tree.map(lambda g: g.astype(jnp.float32), grads_of(i))

    for weight in (1e-300, 1e300):
      counts = [weight, 1.0, 2.0, 1.0]
      history = run(tx, counts, PARAMS, grads, count_dtype=jnp.float64)
      (_, dropped), (_, after) = history[1], history[3]
      assert not bool(tokacc.has_updated(dropped))
      assert int(dropped.dropped_windows) == 1
      assert int(after.gradient_step) == 1
      np.testing.assert_allclose(
        history[3][0]['w'],
        reference_update(counts, 2, 4),
        rtol=helpers.DIVISION_RTOL,
      )


def test_infinite_weight_counts_0_toward_the_budget():
  """An infinite weight makes the window's count invalid when it is added,
  and an invalid count counts 0 toward the budget (rule 2 of "Rules of
  the window", issue 22): the window closes at k (4), not at once, and is
  dropped and counted."""
  tx = tokacc.token_weighted_multistep(
    optax.sgd(1.0), 4, token_dtype=jnp.float32, tokens_per_update=10
  )
  history = run(tx, [1.0, np.inf, 1.0, 1.0], count_dtype=jnp.float32)
  assert [int(s.mini_step) for _, s in history] == [1, 2, 3, 0]
  assert [int(s.dropped_windows) for _, s in history] == [0, 0, 0, 1]
  assert int(history[-1][1].gradient_step) == 0


# Over devices: the budget counts every device's tokens, and so does the
# int32 counter.

DEVICE_BUDGET = 20
DEVICE_COUNTS = {
  # tokens per device at each micro-step; no device alone reaches 20.
  # Over the devices: 10, 20 (exactly the budget at step 2), then 4.
  'exactly': [[2, 3, 1, 4], [3, 3, 2, 2], [1, 1, 1, 1]],
  # 10, 19 (one token short at step 2), 23 (over it at step 3).
  'one_less': [[2, 3, 1, 4], [3, 3, 2, 1], [1, 1, 1, 1]],
}
DEVICE_CLOSES = {'exactly': [2], 'one_less': [3]}


def batch_with_counts(counts, seed):
  """A global micro-batch of ``helpers``' model whose device ``d`` holds
  ``counts[d]`` counted tokens (rows ``[d * SEQS, (d + 1) * SEQS)``)."""
  rng = np.random.default_rng(seed)
  shape = (len(counts) * helpers.SEQS, helpers.SEQ_LEN)
  mask = np.zeros((len(counts), helpers.LOCAL_TOKENS), np.float32)
  for device, count in enumerate(counts):
    mask[device, :count] = 1
  return {
    'x': rng.normal(size=shape + (helpers.FEATURES,)).astype(np.float32),
    'y': rng.normal(size=shape).astype(np.float32),
    'mask': mask.reshape(shape),
  }


def budget_tx(axis_name):
  return tokacc.token_weighted_multistep(
    optax.sgd(helpers.LEARNING_RATE),
    8,
    axis_name=axis_name,
    tokens_per_update=DEVICE_BUDGET,
  )


def steps_over_devices(placement, batches):
  """``(gradient_step, last_tokens)`` after each micro-step of
  ``budget_tx`` on ``placements.PLACEMENTS[placement]``, the same on every
  device."""
  run = placements.PLACEMENTS[placement](NUM_DEVICES, budget_tx)
  seen = []

  def record(params, state):
    del params
    state = tokacc.find_state(state)
    steps = np.ravel(helpers.fetch(state.gradient_step))
    tokens = np.ravel(helpers.fetch(state.last_tokens))
    assert len(set(steps.tolist())) == 1 and len(set(tokens.tolist())) == 1
    seen.append((int(steps[0]), int(tokens[0])))

  placements.train(run, run.params, run.state, batches, on_step=record)
  return seen


# mode: the placement
OVER_DEVICES = {
  'shard_map': 'shard_map',
  'pmap': 'pmap',
  'explicit': 'explicit_ddp',
}


@pytest.mark.parametrize('mode', list(OVER_DEVICES))
@pytest.mark.parametrize('case', sorted(DEVICE_COUNTS))
def test_budget_boundary_over_devices(case, mode):
  """The window closes on the micro-step at which the tokens of all
  devices reach the budget exactly, on every device, and holds them."""
  if not placements.supported(OVER_DEVICES[mode]):
    pytest.skip(placements.NEEDS_TYPED_SHARDING)
  counts = DEVICE_COUNTS[case]
  totals = [sum(c) for c in counts]
  assert (
    helpers.closing_steps(totals, lambda _: 8, DEVICE_BUDGET)
    == (DEVICE_CLOSES[case])
  )
  batches = [batch_with_counts(c, seed) for seed, c in enumerate(counts)]
  seen = steps_over_devices(OVER_DEVICES[mode], batches)
  steps = [0] + [gradient_step for gradient_step, _ in seen]
  closes = [i for i in range(1, len(steps)) if steps[i] > steps[i - 1]]
  assert closes == DEVICE_CLOSES[case]
  close = closes[0]
  assert seen[close - 1][1] == sum(totals[:close])


def pmap_counts(tx, counts_per_step, every_device=False):
  """pmap over 4 devices: device ``d`` gives ``grads_of(d)`` and
  ``counts[d]`` at each micro-step; returns device 0's updates and state
  after each micro-step (every device's, stacked, if ``every_device``)."""
  devices = jax.devices()[:NUM_DEVICES]
  step = jax.pmap(
    lambda g, s, n: tx.update(g, s, PARAMS, num_tokens=n),
    axis_name='data',
    devices=devices,
  )
  grads = jax.tree.map(
    lambda *xs: np.stack(xs), *(grads_of(d) for d in range(NUM_DEVICES))
  )
  state = jax.pmap(tx.init, devices=devices)(
    jax.tree.map(lambda x: np.broadcast_to(x, (NUM_DEVICES,) + x.shape), PARAMS)
  )
  history = []
  for counts in counts_per_step:
    updates, state = step(grads, state, np.asarray(counts, np.int32))
    out = jax.tree.map(np.asarray, (updates, state))
    history.append(out if every_device else jax.tree.map(lambda x: x[0], out))
  return history


def test_int32_max_tokens_over_devices_are_valid():
  """2**31 - 1 tokens summed over 4 devices: valid and exact."""
  counts = [2**29, 2**29, 2**29, 2**29 - 1]
  tx = tokacc.token_weighted_multistep(optax.sgd(1.0), 1, axis_name='data')
  ((updates, state),) = pmap_counts(tx, [counts])
  assert int(state.last_tokens) == INT32_MAX
  assert int(state.dropped_windows) == 0
  np.testing.assert_allclose(
    updates['w'],
    reference_update(counts, 0, NUM_DEVICES),
    rtol=helpers.DIVISION_RTOL,
  )


def test_int32_overflow_over_devices_drops_the_window():
  """2**31 tokens summed over 4 devices (2**29 each, every one valid alone):
  the window is dropped on every device; the next one is clean."""
  tx = tokacc.token_weighted_multistep(optax.sgd(1.0), 1, axis_name='data')
  (updates, dropped), (next_updates, state) = pmap_counts(
    tx, [[2**29] * NUM_DEVICES, [1, 2, 3, 4]]
  )
  chex.assert_trees_all_equal(updates, {'w': -jnp.zeros(2)})
  assert int(dropped.dropped_windows) == 1
  assert int(dropped.gradient_step) == 0
  assert int(state.gradient_step) == 1
  np.testing.assert_allclose(
    next_updates['w'],
    reference_update([1, 2, 3, 4], 0, NUM_DEVICES),
    rtol=helpers.DIVISION_RTOL,
  )


# An invalid count with tokens_per_update over devices.


def reference_budget_close(counts_per_step, budget, k):
  """Reference: the micro-step (from 1) at which a window with invalid
  counts closes. A device's tokens count 0 toward the budget from the
  micro-step of its first invalid count to the window's end."""
  invalid = set()
  total = 0
  for step, counts in enumerate(counts_per_step, start=1):
    invalid |= {d for d, n in enumerate(counts) if n < 0}
    total = sum(
      sum(c[d] for c in counts_per_step[:step])
      for d in range(len(counts))
      if d not in invalid
    )
    if total >= budget or step == k:
      return step
  return None


def test_invalid_count_with_budget_over_devices():
  """pmap over 4 devices: device 2's invalid count makes its tokens count
  0 (9, then 17, then 20 over the others), so the window closes at
  micro-step 3 on every device, not at 2 (where 22 tokens counted with
  device 2's 5 would), and is dropped on every device: rule 2 of "Rules
  of the window" (docs/getting_started.md; issue 22)."""
  counts = [[2, 3, -1, 4], [3, 3, 5, 2], [1, 1, 1, 1]]
  assert reference_budget_close(counts, 20, 8) == 3
  tx = tokacc.token_weighted_multistep(
    optax.sgd(1.0), 8, axis_name='data', tokens_per_update=20
  )
  history = pmap_counts(tx, counts, every_device=True)
  for step, (updates, state) in enumerate(history, start=1):
    np.testing.assert_array_equal(state.dropped_windows, int(step == 3))
    np.testing.assert_array_equal(state.mini_step, step % 3)
    np.testing.assert_array_equal(state.gradient_step, 0)
    assert np.all(np.signbit(updates['w'])) and not np.any(updates['w'])
