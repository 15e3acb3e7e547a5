"""The window is the unit: what ``inner`` sees, and when a window closes.

- ``value``: with ``loss=`` passed, ``inner`` receives ``value=`` the
  window's token-mean loss over all devices, so ``reduce_on_plateau`` inside
  ``inner`` takes the decisions full-batch training takes. A user ``value``
  and functions that re-evaluate the objective are refused.
- ``tokens_per_update``: a window closes at the first micro-step at which
  its counted tokens over all devices reach the budget (or after
  ``every_k_schedule`` micro-steps).

Those are compared with full-batch training (``helpers.full_batch``) on
unequal token counts per device and micro-step.

And the rules of the window that issue 22 found open, as decided and
written in "Rules of the window" (docs/getting_started.md), with gradients
and losses given directly, small numbers whose float32 sums are exact:

1. A micro-batch that adds to the window must bring its loss, else
   ``window_loss`` is NaN. Under ``'mean'`` a micro-batch of no tokens adds
   nothing (its NaN or missing loss is ignored); a rejected micro-batch adds
   nothing; under ``'sum'`` one of no tokens adds its gradients and loss as
   given.
2. An invalid count with ``tokens_per_update``: the device's tokens in that
   window count 0 toward the budget, the window closes by the same rule on
   every device (over devices: ``test_boundaries``), and is dropped.
3. The count of a rejected micro-batch is ignored even if invalid;
   ``with_input_checks`` still reports it.
5. bf16 parameters with ``optax.inject_hyperparams``: optax casts the
   hyperparameters to bf16 (``b2 = 0.999`` becomes 1.0) unless
   ``hyperparam_dtype=jnp.float32``.
"""

import chex
import helpers
import jax
from jax.experimental import checkify
import jax.numpy as jnp
import numpy as np
import optax
import placements
import pytest

import optax_tokacc as tokacc
from optax_tokacc.testing import collectives
from optax_tokacc.testing import hlo

K = 3
NUM_DEVICES = 4
# Not derived, for the two inners that the argument of helpers.round_off_atol
# does not cover: reduce_on_plateau's SGD, compared window by window with
# its states, and L-BFGS, whose curvature pairs difference the gradients.
# Measured on one CPU: 1.2e-7 and 3e-8 (factors 80 and 300 below it).
TOLERANCE = 1e-5


def single_device(tx, windows, on_window=None):
  """Trains on one device, every micro-batch whole; returns final params
  and state. ``on_window(params, state, micro_steps)`` after each emitted
  update, with the number of micro-steps taken so far."""
  step = jax.jit(helpers.train_step(tx))
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
  expected = helpers.full_batch(
    helpers.plateau_inner(), helpers.init_params(), windows, with_value=True
  ).windows
  expected_scales = [helpers.plateau_scale(w.opt_state) for w in expected]
  assert min(expected_scales) < 1.0, expected_scales

  tx = tokacc.token_weighted_multistep(helpers.plateau_inner(), K)
  seen = []

  def record(params, state, _):
    seen.append((params, helpers.plateau_scale(state.inner_state)))

  single_device(tx, windows, record)
  assert [scale for _, scale in seen] == expected_scales
  for (params, _), window in zip(seen, expected):
    chex.assert_trees_all_close(params, window.params, atol=TOLERANCE)


def test_window_loss_is_what_inner_sees():
  """``value`` is exactly ``window_loss``: inner records it in its state."""
  windows = helpers.make_windows((K, K), NUM_DEVICES, seed=4)
  tx = tokacc.token_weighted_multistep(helpers.plateau_inner(), K)
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
  tx = tokacc.token_weighted_multistep(helpers.plateau_inner(), K)
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


def over_devices(mode, windows, inner, **options):
  """Trains ``inner`` accumulated over 4 devices of ``mode`` (``explicit``:
  explicit DDP), the last window closed early by ``emit_now``: the host
  parameters, and the state."""
  placement = OVER_DEVICES[mode]
  if not placements.supported(placement):
    pytest.skip(placements.NEEDS_TYPED_SHARDING)

  def make_tx(axis_name):
    return tokacc.token_weighted_multistep(
      inner, K, axis_name=axis_name, **options
    )

  run = placements.PLACEMENTS[placement](NUM_DEVICES, make_tx)
  batches = [batch for window in windows for batch in window]
  params, state = placements.train(
    run, run.params, run.state, batches, emit_last=True
  )
  return run.host(params), state


def gradient_step(state):
  """The state's gradient step, the same on every device."""
  steps = np.ravel(helpers.fetch(tokacc.find_state(state).gradient_step))
  assert len(set(steps.tolist())) == 1, steps
  return int(steps[0])


# mode: the placement
OVER_DEVICES = {
  'shard_map': 'shard_map',
  'explicit': 'explicit_ddp',
  'pmap': 'pmap',
}


@pytest.mark.parametrize(
  'mode', [pytest.param('shard_map', marks=pytest.mark.slow), 'explicit']
)
def test_reduce_on_plateau_under_data_parallelism(mode):
  """With the batch split over 4 devices, ``value`` is the token-mean loss
  over all of them (the last window closed early by emit_now)."""
  windows = helpers.make_windows(PLATEAU_WINDOWS, NUM_DEVICES, seed=4)
  expected = helpers.full_batch(
    helpers.plateau_inner(), helpers.init_params(), windows, with_value=True
  ).windows
  expected_params = expected[-1].params
  assert min(helpers.plateau_scale(w.opt_state) for w in expected) < 1.0
  params, state = over_devices(mode, windows, helpers.plateau_inner())
  if mode == 'shard_map':
    scale = float(tokacc.find_state(state).inner_state[1].scale)
    assert scale == helpers.plateau_scale(expected[-1].opt_state)
  assert gradient_step(state) == len(windows)
  chex.assert_trees_all_close(params, expected_params, atol=TOLERANCE)


# Token-budget windows.

BUDGET = 36  # a micro-step holds 0 to 32 tokens over the 4 devices
BUDGET_K = 3


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
  sizes = helpers.budget_window_sizes(counts, BUDGET, k)
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
    helpers.adamw(), helpers.init_params(), windows[:-1]
  )
  tx = tokacc.token_weighted_multistep(
    helpers.adamw(), k, tokens_per_update=BUDGET
  )
  closed_after = []
  params, _ = single_device(
    tx,
    windows[:-1],
    lambda params, state, micro_steps: closed_after.append(micro_steps),
  )
  assert closed_after == list(np.cumsum(sizes[:-1]))
  helpers.assert_within_round_off(params, expected)


@pytest.mark.parametrize(
  'mode',
  [pytest.param('shard_map', marks=pytest.mark.slow), 'explicit', 'pmap'],
)
def test_budget_over_all_devices(mode):
  """The budget counts the tokens of every device; every device closes at
  the same micro-step (the last window closes early by emit_now)."""
  k = BUDGET_K
  windows, sizes = budget_windows(k)
  expected = helpers.full_batch(helpers.adamw(), helpers.init_params(), windows)
  # the transform finds the windows (k = BUDGET_K = K)
  params, state = over_devices(
    mode, windows, helpers.adamw(), tokens_per_update=BUDGET
  )
  assert gradient_step(state) == len(sizes)
  helpers.assert_within_round_off(params, expected)


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
      helpers.adamw(), K, axis_name='data', tokens_per_update=budget
    )
    state = placements.shard_map_state(tx, params, mesh, 'data')
    step = placements.shard_map_step(tx, mesh, 'data', False)
    text = hlo.compiled_text(step, params, state, batch)
    sites = collectives.compiled_collectives(text)
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
    helpers.adamw(), k, tokens_per_update=BUDGET
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
  helpers.assert_within_round_off(params, expected)


def sgd_with_extra_args(refuses):
  """SGD whose update takes extra keyword args and raises a ``TypeError`` in
  its own words (not Python's) when ``refuses(extra)``."""
  sgd = optax.sgd(0.05)

  def update(updates, state, params=None, **extra):
    if refuses(extra):
      raise TypeError('this optimizer was given the wrong objective')
    return sgd.update(updates, state, params)

  return optax.GradientTransformationExtraArgs(sgd.init, update)


def test_inner_that_refuses_value_in_its_own_words_runs_without_it():
  """Regression (issue 56): ``inner`` that rejects ``value=`` with its own
  ``TypeError`` runs without it when ``loss=`` is passed, as an ``inner``
  whose update takes no ``value`` does (the error's text is not read)."""
  inner = sgd_with_extra_args(lambda extra: 'value' in extra)
  windows = helpers.make_windows((K,) * 2, NUM_DEVICES, seed=3)
  expected = helpers.full_batch(optax.sgd(0.05), helpers.init_params(), windows)
  params, _ = single_device(tokacc.token_weighted_multistep(inner, K), windows)
  helpers.assert_within_round_off(params, expected)


def test_inner_needing_value_in_its_own_words_names_loss():
  """Regression (issue 56): ``inner`` that fails without ``value=`` with its
  own ``TypeError`` gets the error that names ``loss=`` (the error's text is
  not read: ``inner`` runs with a value)."""
  inner = sgd_with_extra_args(lambda extra: 'value' not in extra)
  tx = tokacc.token_weighted_multistep(inner, K)
  with pytest.raises(TypeError, match=r'inner needs value=.*loss=') as error:
    _update_once(tx)
  assert 'wrong objective' in str(error.value)  # inner's own words


# The rules of the window (issue 22).

PARAMS = {'w': jnp.zeros(2)}
NAN = float('nan')
MISSING = None  # no loss= passed on that micro-step


def window(
  counts,
  grads,
  losses,
  *,
  k=None,
  loss_reduction='sum',
  skip=False,
  tokens_per_update=None,
  checked=False,
):
  """Feeds the micro-batches to a fresh transform over SGD(1); returns the
  updates and state after every call (and the checkify errors if
  ``checked``)."""
  tx = tokacc.token_weighted_multistep(
    optax.sgd(1.0),
    k or len(counts),
    loss_reduction=loss_reduction,
    should_skip_update_fn=tokacc.skip_not_finite if skip else None,
    tokens_per_update=tokens_per_update,
  )
  if checked:
    tx = tokacc.with_input_checks(tx)

  def update(g, s, n, **loss):
    return tx.update({'w': g}, s, PARAMS, num_tokens=n, **loss)

  with_loss = jax.jit(checkify.checkify(update) if checked else update)
  state = tx.init(PARAMS)
  history = []
  for count, grad, loss in zip(counts, grads, losses):
    kwargs = {} if loss is MISSING else {'loss': jnp.float32(loss)}
    out = with_loss(
      jnp.asarray(grad, jnp.float32), state, jnp.int32(count), **kwargs
    )
    if checked:
      error, out = out
      history.append((out, error.get()))
    else:
      history.append(out)
    state = out[1]
  return history


GRADS = [[1.0, -2.0], [5.0, 6.0], [3.0, 4.0]]


# Rule 1: the window's loss.


@pytest.mark.parametrize(
  'loss_reduction', [pytest.param('sum', marks=pytest.mark.slow), 'mean']
)
def test_every_counted_micro_batch_brings_its_loss(loss_reduction):
  """With every loss passed, the window's loss is the token-mean loss;
  missing on one micro-batch with tokens, it is NaN (never a number that
  leaves that micro-batch out)."""
  counts, losses = [2, 1, 3], [4.0, 2.5, 6.0]
  if loss_reduction == 'sum':  # losses summed over the micro-batch
    expected = sum(losses) / sum(counts)
  else:  # per micro-batch means, weighted by their tokens
    expected = sum(n * x for n, x in zip(counts, losses)) / sum(counts)
  (*_, (_, state)) = window(
    counts, GRADS, losses, loss_reduction=loss_reduction
  )
  np.testing.assert_allclose(
    tokacc.window_loss(state), expected, rtol=helpers.DIVISION_RTOL
  )
  (*_, (_, state)) = window(
    counts, GRADS, [4.0, MISSING, 6.0], loss_reduction=loss_reduction
  )
  assert bool(tokacc.has_updated(state))
  assert np.isnan(tokacc.window_loss(state))


@pytest.mark.parametrize('loss', [NAN, MISSING], ids=['nan', 'missing'])
def test_mean_micro_batch_of_no_tokens_adds_nothing(loss):
  """``'mean'``: a micro-batch of no tokens adds no gradients, tokens or
  loss; a NaN (0/0) or missing loss there is ignored."""
  counts = [2, 0, 3]
  grads = [GRADS[0], [NAN, NAN], GRADS[2]]
  history = window(counts, grads, [4.0, loss, 6.0], loss_reduction='mean')
  updates, state = history[-1]
  expected = -(2 * np.array(GRADS[0]) + 3 * np.array(GRADS[2])) / 5
  np.testing.assert_allclose(updates['w'], expected, rtol=helpers.DIVISION_RTOL)
  np.testing.assert_allclose(
    tokacc.window_loss(state),
    (2 * 4.0 + 3 * 6.0) / 5,
    rtol=helpers.DIVISION_RTOL,
  )
  assert int(state.last_tokens) == 5


def test_sum_micro_batch_of_no_tokens_adds_what_it_brings():
  """``'sum'``: a micro-batch of no tokens adds its gradients and loss as
  given; without its loss the window's loss is NaN."""
  counts = [2, 0, 3]
  updates, state = window(counts, GRADS, [4.0, 2.5, 6.0])[-1]
  expected = -np.sum(GRADS, axis=0) / 5
  np.testing.assert_allclose(updates['w'], expected, rtol=helpers.DIVISION_RTOL)
  np.testing.assert_allclose(
    tokacc.window_loss(state), (4.0 + 2.5 + 6.0) / 5, rtol=helpers.DIVISION_RTOL
  )
  _, state = window(counts, GRADS, [4.0, MISSING, 6.0])[-1]
  assert np.isnan(tokacc.window_loss(state))


@pytest.mark.parametrize('loss', [NAN, MISSING], ids=['nan', 'missing'])
def test_rejected_micro_batch_adds_nothing(loss):
  """A micro-batch that ``skip_not_finite`` rejects adds no gradients,
  tokens or loss, and does not advance the window (no ``axis_name``)."""
  counts = [2, 4, 3]
  grads = [GRADS[0], [NAN, 1.0], GRADS[2]]
  history = window(counts, grads, [4.0, loss, 6.0], k=2, skip=True)
  assert [bool(tokacc.has_updated(s)) for _, s in history] == [
    False,
    False,
    True,
  ]
  updates, state = history[-1]
  expected = -(np.array(GRADS[0]) + np.array(GRADS[2])) / 5
  np.testing.assert_allclose(updates['w'], expected, rtol=helpers.DIVISION_RTOL)
  np.testing.assert_allclose(
    tokacc.window_loss(state), (4.0 + 6.0) / 5, rtol=helpers.DIVISION_RTOL
  )


# Rule 2: an invalid count with tokens_per_update.


def test_invalid_count_with_budget_on_one_device():
  """One device: from the invalid count on, the window's tokens count 0
  toward the budget (4 + 6 would reach 10 at micro-step 3), so it closes
  after k micro-steps, and is dropped; the next window is clean."""
  counts = [4, -1, 6, 1, 1, 10]
  grads = GRADS * 2
  history = window(counts, grads, [MISSING] * 6, k=5, tokens_per_update=10)
  dropped = [int(s.dropped_windows) for _, s in history]
  assert dropped == [0, 0, 0, 0, 1, 1]
  updates, state = history[4]
  chex.assert_trees_all_equal(updates, {'w': -jnp.zeros(2)})
  assert int(state.gradient_step) == 0
  assert not any(bool(tokacc.has_updated(s)) for _, s in history[:5])
  updates, state = history[5]  # 10 tokens: the budget closes it at once
  assert bool(tokacc.has_updated(state))
  np.testing.assert_allclose(
    updates['w'], -np.array(grads[5]) / 10, rtol=helpers.DIVISION_RTOL
  )


# Rule 3: the count of a rejected micro-batch.


def test_rejected_micro_batch_with_invalid_count_is_ignored():
  """``skip_not_finite`` rejects the NaN micro-batch; its count -1 is
  ignored (the window is not dropped), and ``with_input_checks`` reports
  it while giving the same updates."""
  counts = [2, -1, 3]
  grads = [GRADS[0], [NAN, 1.0], GRADS[2]]
  losses = [4.0, NAN, 6.0]
  plain = window(counts, grads, losses, k=2, skip=True)
  updates, state = plain[-1]
  assert int(state.dropped_windows) == 0
  assert bool(tokacc.has_updated(state))
  expected = -(np.array(GRADS[0]) + np.array(GRADS[2])) / 5
  np.testing.assert_allclose(updates['w'], expected, rtol=helpers.DIVISION_RTOL)
  checked = window(counts, grads, losses, k=2, skip=True, checked=True)
  errors = [error for _, error in checked]
  assert errors[0] is None and errors[2] is None
  assert 'num_tokens=-1 is negative' in errors[1]
  for (out, _), plain_out in zip(checked, plain):
    chex.assert_trees_all_equal(out, plain_out)


# Rule 5: bf16 parameters with optax.inject_hyperparams.


def test_inject_hyperparams_casts_to_bf16_params_dtype():
  """optax casts injected hyperparameters to the parameters' dtype: with
  bf16 parameters AdamW's ``b2 = 0.999`` becomes 1.0 (bf16 numbers just
  below 1 are 2**-8 apart, and 0.999 is within 2**-9 of 1), so the second
  moment never grows and the bias correction ``1 - b2**t`` is 0: NaN
  updates. ``hyperparam_dtype=jnp.float32`` keeps it."""
  # Plain arithmetic: the nearest bf16 to 0.999 is 1.0; float32 keeps it
  # below 1.
  assert abs(1.0 - 0.999) < 2.0**-9
  assert float(np.float32(0.999)) < 1.0
  params = {'w': jnp.ones(3, jnp.bfloat16)}
  grads = {'w': jnp.array([1.0, -2.0, 3.0], jnp.bfloat16)}
  for hyperparam_dtype, b2 in ((None, 1.0), (jnp.float32, np.float32(0.999))):
    kwargs = (
      {} if hyperparam_dtype is None else {'hyperparam_dtype': hyperparam_dtype}
    )
    inner = optax.inject_hyperparams(optax.adamw, **kwargs)(
      learning_rate=1e-2, b2=0.999
    )
    tx = tokacc.token_weighted_multistep(inner, 1)
    state = tx.init(params)
    injected = state.inner_state.hyperparams['b2']
    assert float(injected) == b2
    updates, _ = tx.update(grads, state, params, num_tokens=1)
    finite = bool(jnp.all(jnp.isfinite(updates['w'])))
    assert finite == (hyperparam_dtype is not None)
