"""Checkpoint and restore with orbax in the middle of an accumulation window.

Training resumed from a checkpoint taken after some micro-steps of a window
(before it emits) must give bit-identical parameters and state to training
that never stopped, in the same process and in a new one; a checkpoint of
0.4 resumes by the CHANGELOG's recipe; a state restored into another
configuration is refused, naming what differs (issue 11, defect 7).
"""

import functools
import pickle

import chex
import children
import helpers
import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest

import optax_tokacc as tokacc

EVERY_K = 4
NUM_MICRO_STEPS = 14  # three windows and a half


@functools.cache
def make_tx(variant):
  """The transforms checkpointed: plain state, and one with every field."""
  if variant == 'adamw_clip':
    inner = optax.chain(
      optax.clip_by_global_norm(1.0), optax.adamw(0.05, weight_decay=0.1)
    )
    return tokacc.token_weighted_multistep(inner, EVERY_K)
  return tokacc.token_weighted_multistep(
    optax.adam(0.05),
    EVERY_K,
    accumulator_dtype=jnp.bfloat16,
    compensated=True,
    should_skip_update_fn=tokacc.skip_not_finite,
  )


def micro_batch(step):
  """Deterministic data; some micro-batches without tokens or with a NaN."""
  rng = np.random.default_rng(step)
  num_tokens = int(rng.integers(0, 6)) if step % 5 else 0
  mask = (np.arange(6) < num_tokens).astype(np.float32)
  x = rng.normal(size=(6, helpers.FEATURES)).astype(np.float32)
  if step == 9:
    x[0, 0] = np.nan  # a non-finite micro-batch, rejected by the skip fn
  return {'x': x, 'y': rng.normal(size=6).astype(np.float32), 'mask': mask}


@functools.cache
def make_step(tx):
  return jax.jit(helpers.train_step(tx, apply_fn=tokacc.apply_if_updated))


def train(step, train_state, start, stop):
  for i in range(start, stop):
    train_state = step(*train_state, micro_batch(i))
  return train_state


def save(path, train_state):
  checkpointer = ocp.StandardCheckpointer()
  checkpointer.save(path, train_state)
  checkpointer.wait_until_finished()


def restore(path, tx):
  """Restores into the structure of a freshly initialized state."""
  params = helpers.init_params()
  target = jax.tree.map(
    ocp.utils.to_shape_dtype_struct, (params, tx.init(params))
  )
  return ocp.StandardCheckpointer().restore(path, target)


def uninterrupted(variant):
  tx = make_tx(variant)
  params = helpers.init_params()
  return train(make_step(tx), (params, tx.init(params)), 0, NUM_MICRO_STEPS)


@pytest.mark.slow
@pytest.mark.parametrize(
  'variant, stop_at', [('adamw_clip', 6), ('compensated_skip', 9)]
)
def test_resume_mid_window_is_bit_identical(tmp_path, variant, stop_at):
  tx = make_tx(variant)
  step = make_step(tx)
  params = helpers.init_params()
  train_state = train(step, (params, tx.init(params)), 0, stop_at)
  opt_state = train_state[1]
  assert 0 < int(opt_state.mini_step) < EVERY_K  # really mid-window
  assert int(opt_state.acc_tokens) > 0
  save(tmp_path / 'ckpt', train_state)

  restored = restore(tmp_path / 'ckpt', tx)
  chex.assert_trees_all_equal(restored, train_state)
  assert isinstance(restored[1], tokacc.TokenWeightedMultiStepState)
  resumed = train(step, restored, stop_at, NUM_MICRO_STEPS)
  expected = uninterrupted(variant)
  chex.assert_trees_all_equal(resumed, expected)
  assert int(expected[1].gradient_step) >= 2  # windows were applied


@pytest.mark.parametrize('form', ['saved', 'plain'])
@pytest.mark.parametrize('variant', ['adamw_clip', 'compensated_skip'])
def test_a_boundary_checkpoint_of_0_5_holding_scratch_resumes_exactly(
  variant, form
):
  """Regression (issue 46): 0.5.0 left scratch in the sums at a window
  boundary (the emitted updates), restarted by the next micro-step; a
  micro-step now only adds, and a closing step leaves zeros. Through
  ``from_checkpoint`` (``to_checkpoint``'s form, or the plain state 0.5
  saved) the scratch is not added into the next window: training resumes
  bit for bit."""
  tx = make_tx(variant)
  step = make_step(tx)
  params = helpers.init_params()
  boundary, stop = EVERY_K, 2 * EVERY_K  # windows before the NaN of step 9
  expected = train(step, (params, tx.init(params)), 0, stop)
  params, opt_state = train(step, (params, tx.init(params)), 0, boundary)
  assert int(opt_state.mini_step) == 0 and bool(opt_state.emitted)

  def scratch(x):
    return jnp.full_like(x, 7.0)

  opt_state = opt_state._replace(
    grad_sums=jax.tree.map(scratch, opt_state.grad_sums),
    acc_compensation=jax.tree.map(scratch, opt_state.acc_compensation),
  )
  saved = tokacc.to_checkpoint(opt_state) if form == 'saved' else opt_state
  like = tx.init(helpers.init_params())
  restored = tokacc.from_checkpoint(saved, like)
  resumed = train(step, (params, restored), boundary, stop)
  chex.assert_trees_all_equal(resumed, expected)
  assert int(expected[1].gradient_step) == 2
  assert all(np.isfinite(x).all() for x in jax.tree.leaves(expected[0]))


def as_saved_by_0_4(opt_state):
  """The state as 0.4 saved it: a dict of its fields, the accumulator named
  ``acc_grads``, no window norms (0.5 added them)."""
  fields = opt_state._asdict()
  fields['acc_grads'] = fields.pop('grad_sums')
  del fields['last_grad_norm'], fields['last_update_norm']
  return fields


@pytest.mark.slow
def test_a_checkpoint_saved_before_the_rename_resumes_bit_identical(tmp_path):
  """The CHANGELOG's recipe for a checkpoint saved by 0.4 (before
  ``acc_grads`` became ``grad_sums``): restore into a target shaped like the
  old state, rebuild the state; training resumes bit for bit (the window
  norms are NaN until the next window closes)."""
  tx = make_tx('adamw_clip')
  step = make_step(tx)
  params, opt_state = train(
    step, (helpers.init_params(), tx.init(helpers.init_params())), 0, 6
  )
  assert 0 < int(opt_state.mini_step) < EVERY_K
  save(tmp_path / 'ckpt', (params, as_saved_by_0_4(opt_state)))

  like = (
    helpers.init_params(),
    as_saved_by_0_4(tx.init(helpers.init_params())),
  )
  target = jax.tree.map(ocp.utils.to_shape_dtype_struct, like)
  params, saved = ocp.StandardCheckpointer().restore(tmp_path / 'ckpt', target)
  rest = {name: value for name, value in saved.items() if name != 'acc_grads'}
  opt_state = tokacc.TokenWeightedMultiStepState(
    **rest, grad_sums=saved['acc_grads']
  )
  assert np.isnan(tokacc.window_metrics(opt_state).grad_norm)
  resumed = train(step, (params, opt_state), 6, NUM_MICRO_STEPS)
  expected = uninterrupted('adamw_clip')
  assert int(expected[1].gradient_step) > int(saved['gradient_step'])
  chex.assert_trees_all_equal(resumed, expected)


# 120 s loaded (load 17), 18 s CPU: 5x (issue 33).
CHILD_LIMIT_S = 600


def save_or_resume(role, path, variant, stop_at):
  """In a new process (``python -m children checkpoint``): `save` trains
  to `stop_at` and checkpoints, `resume` restores, finishes training and
  checkpoints the result."""
  tx = make_tx(variant)
  step = make_step(tx)
  stop_at = int(stop_at)
  if role == 'save':
    params = helpers.init_params()
    save(path, train(step, (params, tx.init(params)), 0, stop_at))
  else:
    train_state = train(step, restore(path, tx), stop_at, NUM_MICRO_STEPS)
    save(path + '_final', train_state)


def run_child(*args):
  result = children.run('checkpoint', *args, limit_s=CHILD_LIMIT_S)
  assert result.returncode == 0, result.stderr[-3000:]


# A process that imports only JAX, the package and the tests' support
# modules: a few seconds; 120 s is the limit on 2 cores at load 17 (issue 33).
@pytest.mark.waits_on_processes(120)
def test_a_child_sets_its_devices_after_importing_the_support_modules():
  """Regression: every child process imports ``children`` and ``helpers``
  before it sets its number of devices, so importing them must start no
  JAX backend. Arrays made at ``helpers``' import (the bad-input tests'
  values, for a few commits) made every child fail with "should be updated
  before backends are initialized"."""
  done = children.run('devices', 3, limit_s=120)
  assert done.returncode == 0, done.stderr
  assert done.stdout.split() == ['3']


@pytest.mark.waits_on_processes(2 * CHILD_LIMIT_S)  # one after the other
@pytest.mark.slow
def test_resume_mid_window_in_new_process(tmp_path):
  variant, stop_at = 'compensated_skip', 6
  path = str(tmp_path / 'ckpt')
  run_child('save', path, variant, stop_at)  # process 1: train, save
  run_child('resume', path, variant, stop_at)  # process 2: restore, go on
  tx = make_tx(variant)
  saved = restore(path, tx)
  assert 0 < int(saved[1].mini_step) < EVERY_K
  final = restore(path + '_final', tx)
  chex.assert_trees_all_equal(final, uninterrupted(variant))


# A state restored into another configuration: Adam, k = 3, on windows of
# unequal token counts with an empty micro-batch.

RESTORED_K = 3


def restored_windows():
  return helpers.windows_of(((5, 0, 8), (2, 7, 1)))


@functools.cache
def adam_tx(**kwargs):
  return tokacc.token_weighted_multistep(optax.adam(0.1), RESTORED_K, **kwargs)


def run_batches(tx, train_state, batches):
  step = make_step(tx)
  for batch in batches:
    train_state = step(*train_state, batch)
  return train_state


def mid_window(tx):
  """Parameters and a state (through pickle, as a checkpoint) two
  micro-steps into the first window of ``tx``."""
  first = restored_windows()[0][:2]
  params, state = run_batches(
    tx, (helpers.init_params(), tx.init(helpers.init_params())), first
  )
  return params, pickle.loads(pickle.dumps(state))


@pytest.mark.parametrize(
  'saved_kwargs, restored_kwargs, words',
  [
    (
      {'accumulator_dtype': jnp.bfloat16},
      {},
      ('grad_sums', 'bfloat16', 'float32'),
    ),
    ({}, {'compensated': True}, ('compensated',)),
    ({'compensated': True}, {}, ('compensated',)),
  ],
  ids=['bf16_into_f32', 'plain_into_compensated', 'compensated_into_plain'],
)
def test_a_state_of_another_configuration_is_refused(
  saved_kwargs, restored_kwargs, words
):
  """Regression (issue 11, defect 7): the error names what differs."""
  params, state = mid_window(adam_tx(**saved_kwargs))
  step = make_step(adam_tx(**restored_kwargs))
  with pytest.raises((TypeError, ValueError)) as info:
    step(params, state, restored_windows()[0][2])
  message = str(info.value)
  for word in words:
    assert word in message, f'{word!r} not in the error: {message}'


@pytest.mark.parametrize(
  'kwargs',
  [{}, {'accumulator_dtype': jnp.bfloat16, 'compensated': True}],
  ids=['default', 'bf16_compensated'],
)
def test_a_state_of_the_same_configuration_resumes(kwargs):
  """Regression (issue 11, defect 7): a state restored into the same
  configuration resumes bit for bit (and, float32, as full-batch
  training)."""
  tx = adam_tx(**kwargs)
  windows = restored_windows()
  batches = [batch for window in windows for batch in window]
  params, _ = run_batches(tx, mid_window(tx), batches[2:])
  straight, _ = run_batches(
    tx, (helpers.init_params(), tx.init(helpers.init_params())), batches
  )
  chex.assert_trees_all_equal(params, straight)
  if not kwargs:
    expected = helpers.full_batch(
      optax.adam(0.1), helpers.init_params(), windows
    )
    helpers.assert_within_round_off(params, expected)
