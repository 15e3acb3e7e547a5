"""The window is the unit: what ``inner`` sees, and when a window closes.

- ``value``: with ``loss=`` passed, ``inner`` receives ``value=`` the
  window's token-mean loss over all devices, so ``reduce_on_plateau`` inside
  ``inner`` takes the decisions full-batch training takes. A user ``value``
  and functions that re-evaluate the objective are refused.
- ``tokens_per_update``: a window closes at the first micro-step at which
  its counted tokens over all devices reach the budget (or after
  ``every_k_schedule`` micro-steps).

Everything is compared with full-batch training written plainly here, on
unequal token counts per device and micro-step.
"""

import chex
import helpers
import hlo
import jax
import jax.numpy as jnp
import multihost_worker as harness
import numpy as np
import optax
import pytest

import optax_tokacc as tokacc
from optax_tokacc import _typed_sharding

K = 3
NUM_DEVICES = 4
# Not derived, for the two inners that full_batch_with_bounds's argument
# does not cover: reduce_on_plateau's SGD, compared window by window with
# its states, and L-BFGS, whose curvature pairs difference the gradients.
# Measured on one CPU: 1.2e-7 and 3e-8 (factors 80 and 300 below it).
TOLERANCE = 1e-5


def assert_within_round_off(params, expected):
  """``params`` are ``expected.params`` (``helpers.full_batch``)
  within its bound, relative to each window's largest update; it holds for
  an ``inner`` linear in the gradients (SGD, SAM's SGD steps) or homogeneous
  of degree 0 in them (AdamW)."""
  chex.assert_trees_all_close(
    params, expected.params, rtol=0, atol=expected.atol
  )


def plateau_inner():
  """SGD whose learning rate ``reduce_on_plateau`` halves whenever the
  loss does not improve on its best (no patience, no cooldown)."""
  return optax.chain(
    optax.sgd(0.3),
    optax.contrib.reduce_on_plateau(
      factor=0.5, patience=0, cooldown=0, rtol=1e-4, atol=0.0
    ),
  )


def plateau_scale(opt_state):
  """The learning-rate scale of ``plateau_inner``'s state."""
  return float(opt_state[1].scale)


def full_batch_with_value(optimizer, windows):
  """Reference: one step per window, ``value=`` its token-mean loss.

  Returns the parameters after every window and ``optimizer``'s states.
  """

  @jax.jit
  def step(params, opt_state, batch):
    num_tokens = jnp.sum(batch['mask'])
    loss, grads = jax.value_and_grad(helpers.loss_sum)(params, batch)
    grads = jax.tree.map(lambda g: g / num_tokens, grads)
    updates, opt_state = optimizer.update(
      grads, opt_state, params, value=loss / num_tokens
    )
    return optax.apply_updates(params, updates), opt_state

  params = jax.tree.map(jnp.asarray, helpers.init_params())
  opt_state = optimizer.init(params)
  history = []
  for window in windows:
    batch = jax.tree.map(lambda *xs: np.concatenate(xs), *window)
    params, opt_state = step(params, opt_state, batch)
    history.append((params, opt_state))
  return history


def single_device(tx, windows, on_window=None):
  """Trains on one device, every micro-batch whole; returns final params
  and state. ``on_window(params, state, micro_steps)`` after each emitted
  update, with the number of micro-steps taken so far."""

  @jax.jit
  def step(params, state, batch):
    loss, grads = jax.value_and_grad(helpers.loss_sum)(params, batch)
    updates, state = tx.update(
      grads, state, params, num_tokens=helpers.token_count(batch), loss=loss
    )
    return optax.apply_updates(params, updates), state

  params = jax.tree.map(jnp.asarray, helpers.init_params())
  state = tx.init(params)
  micro_batches = [batch for window in windows for batch in window]
  for micro_steps, batch in enumerate(micro_batches, start=1):
    params, state = step(params, state, batch)
    if on_window is not None and bool(tokacc.has_updated(state)):
      on_window(params, state, micro_steps)
  return params, state


PLATEAU_WINDOWS = (K,) * 8


def test_reduce_on_plateau_sees_the_window_loss():
  """Over 8 windows the plateau scale of ``inner`` follows full-batch
  training step for step, and halves at least once (so the decisions are
  really compared)."""
  windows = helpers.make_windows(PLATEAU_WINDOWS, NUM_DEVICES, seed=4)
  expected = full_batch_with_value(plateau_inner(), windows)
  expected_scales = [plateau_scale(s) for _, s in expected]
  assert min(expected_scales) < 1.0, expected_scales

  tx = tokacc.token_weighted_multistep(plateau_inner(), K)
  seen = []

  def record(params, state, _):
    seen.append((params, plateau_scale(state.inner_state)))

  single_device(tx, windows, record)
  assert [scale for _, scale in seen] == expected_scales
  for (params, _), (expected_params, _) in zip(seen, expected):
    chex.assert_trees_all_close(params, expected_params, atol=TOLERANCE)


def test_window_loss_is_what_inner_sees():
  """``value`` is exactly ``window_loss``: inner records it in its state."""
  windows = helpers.make_windows((K, K), NUM_DEVICES, seed=4)
  tx = tokacc.token_weighted_multistep(plateau_inner(), K)
  losses = []

  def record(params, state, _):
    del params
    losses.append((float(tokacc.window_loss(state)), state.inner_state))

  single_device(tx, windows, record)
  # reduce_on_plateau keeps the best value seen: the first window's.
  first_loss, first_inner = losses[0]
  assert float(first_inner[1].best_value) == first_loss


@pytest.mark.slow
def test_lbfgs_without_line_search():
  windows = helpers.make_windows((K,) * 4, NUM_DEVICES, seed=2)
  optimizer = optax.lbfgs(learning_rate=0.05, linesearch=None)
  expected = helpers.full_batch(
    optimizer, helpers.init_params(), windows
  ).params
  tx = tokacc.token_weighted_multistep(
    optax.lbfgs(learning_rate=0.05, linesearch=None), K
  )
  params, _ = single_device(tx, windows)
  chex.assert_trees_all_close(params, expected, atol=TOLERANCE)


def _update_once(tx, **kwargs):
  params = {'w': jnp.ones(3)}
  state = tx.init(params)
  return tx.update({'w': jnp.ones(3)}, state, params, num_tokens=2, **kwargs)


@pytest.mark.parametrize(
  'kwargs, match',
  [
    ({'loss': 1.0, 'value': 1.0}, r'got value=.*pass .* as loss='),
    (
      {'loss': 1.0, 'value_fn': lambda p: 0.0},
      r'value_fn=.*re-evaluates the objective.*linesearch=None',
    ),
    ({'loss': 1.0, 'grad_fn': lambda p: p}, r'grad_fn=.*opaque_mode=False'),
    ({'loss': 1.0, 'obj_fn': lambda p: 0.0}, r'obj_fn='),
    ({'loss': 1.0, 'schedule': lambda s: 0.1}, r'schedule=.*a function'),
  ],
  ids=['value', 'value_fn', 'grad_fn', 'obj_fn', 'any_callable'],
)
def test_extra_args_that_describe_the_last_micro_batch_are_refused(
  kwargs, match
):
  tx = tokacc.token_weighted_multistep(optax.sgd(0.1), K)
  with pytest.raises(TypeError, match=match):
    jax.jit(lambda: _update_once(tx, **kwargs)).trace()


def test_inner_needing_value_without_loss_names_loss():
  tx = tokacc.token_weighted_multistep(plateau_inner(), K)
  with pytest.raises(TypeError, match=r'inner needs value=.*loss='):
    _update_once(tx)


def test_lbfgs_with_its_line_search_names_the_fix():
  """The zoom line search needs ``value_fn``: refused when passed, and when
  missing the error names ``loss`` and the line search's own message."""
  tx = tokacc.token_weighted_multistep(optax.lbfgs(), K)
  with pytest.raises(TypeError, match='linesearch=None'):
    _update_once(tx, loss=1.0, value_fn=lambda p: 0.0)
  with pytest.raises(TypeError, match='value_fn'):
    _update_once(tx, loss=1.0)


def test_other_extra_args_are_forwarded_from_the_closing_call():
  """A non-callable extra arg reaches ``inner`` from the closing call."""
  seen = []

  def update(updates, state, params=None, *, tag, **extra):
    del params, extra
    seen.append(tag)
    return updates, state

  inner = optax.GradientTransformationExtraArgs(lambda p: (), update)
  tx = tokacc.token_weighted_multistep(inner, 2)
  params = {'w': jnp.ones(3)}
  state = tx.init(params)
  for tag in (1, 2):
    _, state = tx.update(
      {'w': jnp.ones(3)}, state, params, num_tokens=1, tag=tag
    )
  assert seen[-1] == 2


# The same under data parallelism and explicit sharding.


def shard_map_training(tx, windows):
  mesh = jax.make_mesh(
    (NUM_DEVICES,),
    ('data',),
    axis_types=(jax.sharding.AxisType.Auto,),
    devices=jax.devices()[:NUM_DEVICES],
  )
  params, state = harness.train_shard_map(
    tx, helpers.init_params(), windows, mesh, 'data'
  )
  return helpers.fetch(params), state


def explicit_training(tx, windows):
  mesh = jax.make_mesh(
    (NUM_DEVICES,), ('data',), devices=jax.devices()[:NUM_DEVICES]
  )
  params, _ = harness.train_explicit(tx, helpers.init_params(), windows, mesh)
  return params


@pytest.mark.parametrize(
  'mode', [pytest.param('shard_map', marks=pytest.mark.slow), 'explicit']
)
def test_reduce_on_plateau_under_data_parallelism(mode):
  """With the batch split over 4 devices, ``value`` is the token-mean loss
  over all of them (the harness closes the last window with emit_now)."""
  if mode == 'explicit' and not _typed_sharding.SUPPORTED:
    pytest.skip('reduced/unreduced types need jax >= 0.10')
  windows = helpers.make_windows(PLATEAU_WINDOWS, NUM_DEVICES, seed=4)
  expected = full_batch_with_value(plateau_inner(), windows)
  expected_params = expected[-1][0]
  assert min(plateau_scale(s) for _, s in expected) < 1.0
  if mode == 'shard_map':
    tx = tokacc.token_weighted_multistep(plateau_inner(), K, axis_name='data')
    params, state = shard_map_training(tx, windows)
    scale = float(tokacc.find_state(state).inner_state[1].scale)
    assert scale == plateau_scale(expected[-1][1])
  else:
    tx = tokacc.token_weighted_multistep(plateau_inner(), K)
    params = explicit_training(tx, windows)
  chex.assert_trees_all_close(params, expected_params, atol=TOLERANCE)


# Token-budget windows.

BUDGET = 36  # a micro-step holds 0 to 32 tokens over the 4 devices
BUDGET_K = 3


def window_sizes(counts, budget, k):
  """Reference: micro-batches per window, closing at the first micro-step
  whose window total reaches ``budget``, or after ``k``."""
  sizes, size, total = [], 0, 0
  for count in counts:
    size, total = size + 1, total + count
    if total >= budget or size == k:
      sizes.append(size)
      size, total = 0, 0
  if size:
    sizes.append(size)  # the last window, closed by emit_now
  return sizes


def budget_windows(k, seed=5):
  """Micro-batches regrouped into the windows the budget makes, and the
  sizes of those windows: ``[3, 3, 2, 3, 1]`` (two windows of 34 tokens
  capped by k = 3, one closed by the budget after 2 micro-steps)."""
  micro = [
    b
    for w in helpers.make_windows((4, 4, 4), NUM_DEVICES, seed=seed)
    for b in w
  ]
  counts = [int(np.sum(b['mask'])) for b in micro]
  sizes = window_sizes(counts, BUDGET, k)
  windows, start = [], 0
  for size in sizes:
    windows.append(micro[start : start + size])
    start += size
  return windows, sizes


def test_budget_closes_windows_where_the_tokens_reach_it():
  """Single device: every window closes where the reference says (some by
  the budget, some by k), and training equals full-batch training."""
  k = BUDGET_K
  windows, sizes = budget_windows(k)
  assert len(set(sizes)) > 1 and max(sizes) == k and min(sizes) < k
  expected = helpers.full_batch(
    harness.adamw(), helpers.init_params(), windows[:-1]
  )
  tx = tokacc.token_weighted_multistep(
    harness.adamw(), k, tokens_per_update=BUDGET
  )
  closed_after = []
  params, _ = single_device(
    tx,
    windows[:-1],
    lambda params, state, micro_steps: closed_after.append(micro_steps),
  )
  assert closed_after == list(np.cumsum(sizes[:-1]))
  assert_within_round_off(params, expected)


@pytest.mark.parametrize(
  'mode',
  [pytest.param('shard_map', marks=pytest.mark.slow), 'explicit', 'pmap'],
)
def test_budget_over_all_devices(mode):
  """The budget counts the tokens of every device; every device closes at
  the same micro-step (the last window closes early by emit_now)."""
  if mode == 'explicit' and not _typed_sharding.SUPPORTED:
    pytest.skip('reduced/unreduced types need jax >= 0.10')
  k = BUDGET_K
  windows, sizes = budget_windows(k)
  expected = helpers.full_batch(harness.adamw(), helpers.init_params(), windows)
  flat = [[b for w in windows for b in w]]  # the transform finds the windows
  if mode == 'shard_map':
    tx = tokacc.token_weighted_multistep(
      harness.adamw(), k, axis_name='data', tokens_per_update=BUDGET
    )
    params, state = shard_map_training(tx, flat)
    assert int(tokacc.find_state(state).gradient_step) == len(sizes)
  elif mode == 'explicit':
    tx = tokacc.token_weighted_multistep(
      harness.adamw(), k, tokens_per_update=BUDGET
    )
    params = explicit_training(tx, flat)
  else:
    params = pmap_training(k, flat)
  assert_within_round_off(params, expected)


def pmap_training(k, windows):
  import test_data_parallel as dp  # noqa: PLC0415

  devices = jax.devices()[:NUM_DEVICES]
  tx = tokacc.token_weighted_multistep(
    harness.adamw(), k, axis_name='data', tokens_per_update=BUDGET
  )

  step = dp.pmap_step(tx, devices=devices)
  params = jax.tree.map(
    lambda x: np.broadcast_to(x, (NUM_DEVICES,) + x.shape),
    helpers.init_params(),
  )
  state = jax.pmap(tx.init, devices=devices)(params)
  micro = [b for w in windows for b in w]
  for i, batch in enumerate(micro):
    emit_now = np.full(NUM_DEVICES, i == len(micro) - 1)
    local = jax.tree.map(
      lambda x: x.reshape((NUM_DEVICES, -1) + x.shape[1:]), batch
    )
    params, state = step(params, state, local, emit_now)
  return jax.tree.map(lambda x: np.asarray(x[0]), params)


@pytest.mark.slow
def test_budget_costs_one_scalar_all_reduce_per_micro_step():
  """Under shard_map the budget needs the window's count over all devices
  on every micro-step: one all-reduce of four float32 scalars (the count's
  exact parts), and no other collective outside the closing branch."""

  mesh = jax.make_mesh(
    (NUM_DEVICES,),
    ('data',),
    axis_types=(jax.sharding.AxisType.Auto,),
    devices=jax.devices()[:NUM_DEVICES],
  )
  params = helpers.init_params()
  batch = helpers.make_windows((1,), NUM_DEVICES)[0][0]
  for budget, expected in ((None, []), (BUDGET, [(('f32', (4,)),)])):
    tx = tokacc.token_weighted_multistep(
      harness.adamw(), K, axis_name='data', tokens_per_update=budget
    )
    state = harness.shard_map_state(tx, params, mesh, 'data')
    step = harness.shard_map_step(tx, mesh, 'data', state, False)
    text = step.lower(params, state, batch).compile().as_text()
    sites = hlo.collective_sites(hlo.parse_hlo(text))
    every_step = [site.shapes for site, path in sites if not path]
    assert every_step == expected


@pytest.mark.slow
def test_budget_survives_a_mid_window_checkpoint(tmp_path):
  """The window's tokens so far are the state's ``acc_tokens``: a restored
  state closes its window where the uninterrupted run does."""
  import orbax.checkpoint as ocp  # noqa: PLC0415

  k = BUDGET_K
  windows, _ = budget_windows(k)
  micro = [b for w in windows[:-1] for b in w]
  tx = tokacc.token_weighted_multistep(
    harness.adamw(), k, tokens_per_update=BUDGET
  )
  step = jax.jit(
    lambda p, s, b: (lambda out: (optax.apply_updates(p, out[0]), out[1]))(
      tx.update(
        jax.grad(helpers.loss_sum)(p, b),
        s,
        p,
        num_tokens=helpers.token_count(b),
      )
    )
  )
  params = jax.tree.map(jnp.asarray, helpers.init_params())
  train_state = (params, tx.init(params))
  stop = 1
  for batch in micro[:stop]:
    train_state = step(*train_state, batch)
  assert int(train_state[1].mini_step) == 1
  checkpointer = ocp.StandardCheckpointer()
  checkpointer.save(tmp_path / 'ckpt', train_state)
  checkpointer.wait_until_finished()
  target = jax.tree.map(ocp.utils.to_shape_dtype_struct, train_state)
  resumed = checkpointer.restore(tmp_path / 'ckpt', target)
  for batch in micro[stop:]:
    resumed = step(*resumed, batch)
    train_state = step(*train_state, batch)
  chex.assert_trees_all_equal(resumed, train_state)


def test_inner_that_takes_no_value_gets_none():
  """``optax.contrib.sam``'s update takes no ``value``: with ``loss=``
  passed it still runs (and equals full-batch training)."""

  def sam():
    return optax.contrib.sam(
      optax.sgd(0.05), optax.sgd(0.05), sync_period=2, opaque_mode=False
    )

  windows = helpers.make_windows((K,) * 4, NUM_DEVICES, seed=2)
  expected = helpers.full_batch(sam(), helpers.init_params(), windows)
  tx = tokacc.token_weighted_multistep(sam(), K)
  params, _ = single_device(tx, windows)  # passes loss= on every micro-step
  assert_within_round_off(params, expected)
