"""Regression tests of issue 11, one per defect, against plain references.

Each test compares `token_weighted_multistep` with full-batch training
written out here: the gradient of the token-summed loss over all micro-batches
of a window, divided by the window's total token count, fed to the same inner
optimizer once per window. Defect 9 (a slow fallback of `apply_if_updated`)
is measured in `benchmarks/`, not tested here. The composition matrix and
the dtype pairs of the issue are in `test_composition.py` and
`test_dtypes.py`.
"""

import functools
import pathlib
import pickle
import subprocess
import sys

import chex
import helpers
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import test_multistep
from test_multistep import Reference

import optax_tokacc as tokacc
from optax_tokacc import flax as tokacc_flax

FEATURES = 3
SEQS, SEQ_LEN = 2, 4  # a micro-batch holds up to 8 counted tokens
K = 3
# Counted tokens per micro-batch of each window: unequal, with an empty one.
TOKEN_COUNTS = ((5, 0, 8), (2, 7, 1))
LEARNING_RATE = 0.1
PLAIN_LEARNING_RATE = 0.01
TESTS_DIR = pathlib.Path(__file__).resolve().parent
# The deadlock's subprocess: 78 s on 2 loaded cores (load 17), ~10 s of
# CPU; 600 s is 7x the loaded run (issue 33).
TIMEOUT_S = 600
BF16 = jnp.bfloat16


def init_params(dtype=jnp.float32):
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


def loss_mean(params, batch):
  """The token-mean loss of a micro-batch: 0/0 = NaN when it is empty."""
  return loss_sum(params, batch) / jnp.sum(batch['mask'])


def int_count(batch):
  return jnp.sum(batch['mask']).astype(jnp.int32)


def make_batch(seed, num_tokens, dtype=np.float32):
  rng = np.random.default_rng(seed)
  mask = (np.arange(SEQS * SEQ_LEN) < num_tokens).reshape(SEQS, SEQ_LEN)
  return {
    'x': rng.normal(size=(SEQS, SEQ_LEN, FEATURES)).astype(dtype),
    'y': rng.normal(size=(SEQS, SEQ_LEN)).astype(dtype),
    'mask': mask.astype(dtype),
  }


def make_windows(token_counts=TOKEN_COUNTS, dtype=np.float32, seed=0):
  return [
    [make_batch(seed + 10 * w + i, n, dtype) for i, n in enumerate(counts)]
    for w, counts in enumerate(token_counts)
  ]


def nan_batch(seed=99):
  """A micro-batch with tokens whose loss and gradients are NaN."""
  batch = make_batch(seed, SEQS * SEQ_LEN)
  batch['y'][0, 0] = np.nan
  return batch


@jax.jit
def full_batch_grads(params, window):
  """Gradient of the window's token-summed loss over its total tokens."""
  total = sum(jnp.sum(batch['mask']) for batch in window)

  def window_loss(params):
    return sum(loss_sum(params, batch) for batch in window) / total

  return jax.grad(window_loss)(params)


micro_grads = jax.jit(jax.grad(loss_sum))


def full_batch_loss(params, window):
  total = sum(float(np.sum(batch['mask'])) for batch in window)
  return sum(float(loss_sum(params, batch)) for batch in window) / total


def loss_atol(expected: Reference, window) -> float:
  """How far a window's loss, taken at parameters within ``expected.atol``
  of ``expected.params``, can be from ``full_batch_loss`` at them.

  As ``helpers.full_batch``: a sum of n one-signed
  terms of m roundings each, within 2 (n + m) u of it relatively; and the
  parameters' difference moves it by at most the 1-norm of its gradient
  times ``expected.atol``, plus a second-order term (twice both covers it).
  """
  n = test_multistep.window_tokens([window])
  relative = 2 * (n + test_multistep.TERM_ROUNDINGS) * 2.0**-24
  loss = full_batch_loss(expected.params, window)
  gradient = full_batch_grads(expected.params, window)
  gradient_norm = sum(
    float(jnp.sum(jnp.abs(g))) for g in jax.tree.leaves(gradient)
  )
  return 2 * (relative * abs(loss) + gradient_norm * expected.atol)


def train_full_batch(inner, params, windows) -> Reference:
  """Reference: one step of ``inner`` per window, on the full batch, with
  ``test_multistep.round_off_atol`` (the same model and FEATURES): how far
  float32 round-off can take accumulation from it."""
  state = inner.init(params)
  largest_updates, largest_params = [], [largest(params)]
  for window in windows:
    grads = full_batch_grads(params, window)
    updates, state = inner.update(grads, state, params)
    params = optax.apply_updates(params, updates)
    largest_updates.append(largest(updates))
    largest_params.append(largest(params))
  if not windows:
    return Reference(params, 0.0)
  atol = test_multistep.round_off_atol(
    largest_updates, max(largest_params), windows
  )
  return Reference(params, atol)


largest = test_multistep.largest


@functools.lru_cache(maxsize=None, typed=True)  # True and np.bool_(True)
def jitted_step(
  tx, loss_fn=loss_sum, count_fn=int_count, with_loss=True, **update_kwargs
):
  """A jitted micro-step; cached, so that each setting compiles once."""

  @jax.jit
  def step(params, state, batch):
    loss, grads = jax.value_and_grad(loss_fn)(params, batch)
    updates, state = tx.update(
      grads,
      state,
      params,
      num_tokens=count_fn(batch),
      loss=loss if with_loss else None,
      **update_kwargs,
    )
    return optax.apply_updates(params, updates), state, updates

  return step


def train(tx, params, micro_batches, **step_kwargs):
  step = jitted_step(tx, **step_kwargs)
  state = tx.init(params)
  for batch in micro_batches:
    params, state, _ = step(params, state, batch)
  return params, state


def flatten(windows):
  return [batch for window in windows for batch in window]


def assert_within_round_off(actual, expected: Reference):
  """Within round-off of full-batch training: ``expected.atol``."""
  chex.assert_trees_all_close(
    actual, expected.params, rtol=0, atol=expected.atol
  )


# Defect 1: axis_name + should_skip_update_fn deadlocked. Run in a subprocess
# so that a hang fails the test instead of stalling CI.

DATA_PARALLEL_SCRIPT = """
import sys

import jax

jax.config.update('jax_platforms', 'cpu')
jax.config.update('jax_num_cpu_devices', 8)

from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
import multihost_worker as harness
import numpy as np
import optax

import optax_tokacc as tokacc

MODE = sys.argv[1]
NUM_DEVICES = 4
K = 3
# (window, micro-step, device) whose micro-batch has a NaN gradient: one in
# the middle of the first window, one on the emitting step of the second.
REJECTED = ((0, 1, 1), (1, 2, 3))
ROWS = helpers.SEQS


def rows(device):
  return slice(device * ROWS, (device + 1) * ROWS)


def poisoned_and_reference(windows):
  # The poisoned micro-batches count all their tokens; the reference has
  # the rejected device's rows without tokens (and finite).
  poisoned, reference = [], []
  for w, window in enumerate(windows):
    poisoned.append([]), reference.append([])
    for m, batch in enumerate(window):
      bad = {k: v.copy() for k, v in batch.items()}
      good = {k: v.copy() for k, v in batch.items()}
      for rw, rm, device in REJECTED:
        if (rw, rm) == (w, m):
          bad['mask'][rows(device)] = 1.0
          bad['y'][rows(device)] = np.nan
          good['mask'][rows(device)] = 0.0
      poisoned[-1].append(bad)
      reference[-1].append(good)
  return poisoned, reference


def make_tx():
  return tokacc.token_weighted_multistep(
    harness.adamw(),
    K,
    axis_name='data',
    should_skip_update_fn=tokacc.skip_not_finite,
  )


def train_pmap(windows, devices):
  tx = make_tx()

  def step(params, state, batch):
    loss, grads = jax.value_and_grad(helpers.loss_sum)(params, batch)
    updates, state = tx.update(
      grads, state, params, num_tokens=helpers.token_count(batch), loss=loss
    )
    return optax.apply_updates(params, updates), state

  p_step = jax.pmap(step, axis_name='data', devices=devices)
  # Sharded over the axis of the step's outputs, so that it compiles once.
  replicate = jax.pmap(lambda x: x, axis_name='data', devices=devices)
  params = replicate(
    jax.tree.map(
      lambda x: np.broadcast_to(x, (NUM_DEVICES,) + x.shape),
      helpers.init_params(),
    )
  )
  state = jax.pmap(tx.init, axis_name='data', devices=devices)(params)
  for window in windows:
    for batch in window:
      batch = jax.tree.map(
        lambda x: x.reshape((NUM_DEVICES, ROWS) + x.shape[1:]), batch
      )
      params, state = p_step(params, state, batch)
  return jax.tree.map(np.asarray, params), jax.tree.map(np.asarray, state)


def train_shard_map(windows, devices):
  tx = make_tx()
  mesh = jax.make_mesh(
    (NUM_DEVICES,),
    ('data',),
    axis_types=(jax.sharding.AxisType.Auto,),
    devices=devices,
  )
  state = harness.shard_map_state(tx, helpers.init_params(), mesh, 'data')
  step = harness.shard_map_step(tx, mesh, 'data', state, with_emit_now=False)
  params = jax.tree.map(
    lambda x: helpers.put(x, NamedSharding(mesh, P())), helpers.init_params()
  )
  data = NamedSharding(mesh, P('data'))
  for window in windows:
    for batch in window:
      batch = jax.tree.map(lambda x: helpers.put(x, data), batch)
      params, state = step(params, state, batch)
  params = jax.tree.map(
    lambda x: np.broadcast_to(np.asarray(x), (NUM_DEVICES,) + x.shape), params
  )
  return params, helpers.fetch(state)


def main():
  devices = jax.devices()[:NUM_DEVICES]
  windows = helpers.make_windows((K, K), NUM_DEVICES)
  poisoned, reference = poisoned_and_reference(windows)
  train = train_pmap if MODE == 'pmap' else train_shard_map
  params, state = train(poisoned, devices)
  # Within the round-off bounds that helpers.full_batch
  # derives (relative to each window's largest update).
  expected = helpers.full_batch(
    harness.adamw(), helpers.init_params(), reference
  )
  for device in range(NUM_DEVICES):
    for name in ('w', 'v'):
      np.testing.assert_allclose(
        params[name][device], expected.params[name], atol=expected.atol
      )
  np.testing.assert_array_equal(np.ravel(state.gradient_step), 2)
  np.testing.assert_array_equal(np.ravel(state.mini_step), 0)
  np.testing.assert_allclose(
    np.ravel(tokacc.window_loss(state)),
    expected.loss,
    atol=expected.loss_atol,
  )
  print('data-parallel skip run equals full-batch training')


main()
"""


@pytest.mark.waits_on_processes(TIMEOUT_S)
@pytest.mark.slow  # starts a Python process
@pytest.mark.parametrize('mode', ['pmap', 'shard_map'])
def test_1_data_parallel_skip_closes_window_everywhere(mode):
  env = helpers.subprocess_env()  # the same optax_tokacc as this process
  env.pop('XLA_FLAGS', None)
  try:
    result = subprocess.run(
      [sys.executable, '-c', DATA_PARALLEL_SCRIPT, mode],
      env=env,
      cwd=TESTS_DIR.parent,
      capture_output=True,
      text=True,
      timeout=TIMEOUT_S,
    )
  except subprocess.TimeoutExpired:
    pytest.fail(
      f'{mode}: one NaN micro-batch on one device hung the data-parallel '
      f'job (no result after {TIMEOUT_S} s): a deadlock.'
    )
  output = result.stdout + result.stderr
  stuck = [line for line in output.splitlines() if 'stuck' in line.lower()]
  assert result.returncode == 0, (
    f'{mode} worker failed (exit code {result.returncode}):\n'
    + '\n'.join(stuck[:3])
    + '\n...\n'
    + output[-3000:]
  )


@pytest.mark.slow
def test_1_without_axis_name_a_rejected_micro_batch_does_not_advance():
  """As optax.MultiSteps: the window takes K accepted micro-batches."""
  windows = make_windows()
  stream = flatten(windows)
  stream.insert(1, nan_batch())  # rejected: the first window stays 3 long
  inner = optax.adam(LEARNING_RATE)
  tx = tokacc.token_weighted_multistep(
    inner, K, should_skip_update_fn=tokacc.skip_not_finite
  )
  step = jitted_step(tx)
  params, state = init_params(), tx.init(init_params())
  mini_steps = []
  for batch in stream:
    params, state, _ = step(params, state, batch)
    mini_steps.append(int(state.mini_step))
  assert mini_steps == [1, 1, 2, 0, 1, 2, 0]
  assert int(state.gradient_step) == 2
  assert_within_round_off(
    params, train_full_batch(inner, init_params(), windows)
  )


# Defect 2: mixed precision (every dtype pair is in test_dtypes.py).


def train_dtype_stable_reference(inner, params, windows, grad_fn, grad_dtype):
  """Full-batch training that keeps the inner state's dtypes, as MultiSteps.

  ``windows[w]`` lists the micro-batches of window ``w`` (of all devices);
  their gradients are summed in float32, divided by the window's tokens and
  cast to the gradient dtype.
  """
  state = inner.init(params)
  for window in windows:
    total = sum(float(np.sum(batch['mask'])) for batch in window)
    window_sum = jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params)
    for batch in window:
      grads = grad_fn(params, batch)
      window_sum = jax.tree.map(
        lambda s, g: s + g.astype(jnp.float32), window_sum, grads
      )
    grads = jax.tree.map(
      lambda s, t=total: (s / t).astype(grad_dtype), window_sum
    )
    updates, new_state = inner.update(grads, state, params)
    new_state = optax.tree.cast_like(new_state, state)
    state = new_state
    params = optax.apply_updates(params, updates)
  return params, state


def grads_in(grad_dtype):
  """The micro-batch gradients, computed in ``grad_dtype``."""

  @jax.jit
  def grad_fn(params, batch):
    params = jax.tree.map(lambda p: p.astype(grad_dtype), params)
    batch = jax.tree.map(lambda x: x.astype(grad_dtype), batch)
    return jax.grad(loss_sum)(params, batch)

  return grad_fn


def expected_update_dtypes(inner, params, grad_dtype):
  grads = jax.tree.map(lambda p: jnp.zeros(p.shape, grad_dtype), params)
  updates, _ = jax.eval_shape(inner.update, grads, inner.init(params), params)
  return jax.tree.map(lambda u: u.dtype, updates)


def dtypes_of(tree):
  return jax.tree.map(lambda x: jnp.result_type(x), tree)


# bf16 parameters with Adam: f32 gradients (Adam's mu is promoted by the
# update), and mu_dtype=float32 with bf16 gradients (f32 updates).
MIXED_PRECISION = {
  'adam_f32_grads': (lambda: optax.adam(LEARNING_RATE, eps=1e-3), jnp.float32),
  'adam_mu_f32_bf16_grads': (
    lambda: optax.adam(LEARNING_RATE, eps=1e-3, mu_dtype=jnp.float32),
    jnp.bfloat16,
  ),
}


@pytest.mark.slow
def test_2_adam_bf16_params_under_pmap():
  """Both settings of MIXED_PRECISION in one pmapped step over 2 devices."""
  devices = jax.devices()[:2]
  inners = {name: make() for name, (make, _) in MIXED_PRECISION.items()}
  txs = {
    name: tokacc.token_weighted_multistep(inner, K, axis_name='data')
    for name, inner in inners.items()
  }
  # Device d holds micro-batches of its own: both together make the window.
  per_device = [make_windows(), make_windows(((1, 8, 0), (6, 3, 4)), seed=50)]
  reference_windows = [
    per_device[0][w] + per_device[1][w] for w in range(len(TOKEN_COUNTS))
  ]

  def step(params, states, batch):
    results = {}
    for name, tx in txs.items():
      grad_dtype = MIXED_PRECISION[name][1]
      grads = jax.grad(loss_sum)(
        jax.tree.map(lambda p, g=grad_dtype: p.astype(g), params[name]),
        jax.tree.map(lambda x, g=grad_dtype: x.astype(g), batch),
      )
      updates, state = tx.update(
        grads, states[name], params[name], num_tokens=int_count(batch)
      )
      new_params = optax.apply_updates(params[name], updates)
      results[name] = (new_params, state, updates)
    return results

  def stack(*xs):
    return np.stack(xs)

  # Sharded over the axis of the step's outputs, so that it compiles once.
  replicate = jax.pmap(lambda x: x, axis_name='data', devices=devices)
  params = {
    name: replicate(jax.tree.map(lambda x: stack(x, x), init_params(BF16)))
    for name in txs
  }
  states = {
    name: jax.pmap(tx.init, axis_name='data', devices=devices)(params[name])
    for name, tx in txs.items()
  }
  p_step = jax.pmap(step, axis_name='data', devices=devices)
  updates = {name: [] for name in txs}
  for w in range(len(TOKEN_COUNTS)):
    for m in range(K):
      batch = jax.tree.map(stack, per_device[0][w][m], per_device[1][w][m])
      results = p_step(params, states, batch)
      for name, (new_params, state, new_updates) in results.items():
        params[name], states[name] = new_params, state
        updates[name].append(new_updates)
  for name, inner in inners.items():
    grad_dtype = MIXED_PRECISION[name][1]
    expected, _ = train_dtype_stable_reference(
      inner,
      init_params(BF16),
      reference_windows,
      grads_in(grad_dtype),
      grad_dtype,
    )
    update_dtypes = expected_update_dtypes(inner, init_params(BF16), grad_dtype)
    for step_updates in updates[name]:
      assert dtypes_of(step_updates) == update_dtypes, (
        f'{name}: updates of dtypes {dtypes_of(step_updates)}, but '
        f'jax.eval_shape(inner.update, ...) gives {update_dtypes}'
      )
    rtol, atol = bfloat16_tolerances(grad_dtype, reference_windows)
    for d in range(len(devices)):
      chex.assert_trees_all_close(
        jax.tree.map(lambda x, d=d: x[d], params[name]),
        expected,
        rtol=rtol,
        atol=atol,
        custom_message=f'{name} on device {d}',
      )


def bfloat16_tolerances(grad_dtype, windows):
  """(rtol, atol) between bfloat16 parameters trained with Adam by
  accumulation and by ``train_dtype_stable_reference``.

  bfloat16 keeps 8 significant bits (u = 2**-8): each run rounds every
  parameter to bfloat16 once per window (by at most u |p|), so the two may
  end a window a unit in the last place (2 u |p|) further apart: rtol 2 u
  per window. A window's float32 gradient differs by round-off
  (``test_multistep.round_off_atol``'s 2 (n + m) u, u = 2**-24), and by
  about 2 u (u = 2**-8) where it is taken at parameters a unit apart or
  cast to bfloat16 (each): Adam's update moves by at most twice a relative
  change of its gradient, times the learning rate: atol, per window.
  Measured: one unit apart at |p| = 0.68 (3.9e-3), 0.37 of the bound.
  """
  bf16_round_off = 2.0**-8
  n = test_multistep.window_tokens(windows)
  gradient = 2 * (n + test_multistep.TERM_ROUNDINGS) * 2.0**-24
  gradient += 2 * bf16_round_off * (2 if grad_dtype == BF16 else 1)
  rtol = len(windows) * 2 * bf16_round_off
  atol = len(windows) * 2 * gradient * LEARNING_RATE
  return rtol, atol


# Defect 3: updates of other transforms dropped by apply_if_updated.

LABELS = {'w': 'acc', 'v': 'plain'}
ACC_MASK = {'w': True, 'v': False}
PLAIN_MASK = {'w': False, 'v': True}


def train_split_reference(inner, params, micro_batches, plain_learning_rate):
  """'w': ``inner`` once per window on its full-batch gradient; 'v': plain
  SGD on each micro-batch's token-summed gradient, every micro-step.

  Returns the parameters after every micro-step, each with the bound of
  ``test_multistep.round_off_atol`` over the updates so far ('v' every
  micro-step, 'w' at the end of each window): each is linear (SGD) or
  homogeneous of degree 0 (Adam) in a sum of at most a window's terms.
  """
  state = inner.init(params['w'])
  window_grad, window_tokens, trajectory = 0.0, 0.0, []
  largest_updates, largest_params = [], [largest(params)]
  windows = [micro_batches[i : i + K] for i in range(0, len(micro_batches), K)]
  for i, batch in enumerate(micro_batches):
    grads = micro_grads(params, batch)
    window_grad = window_grad + grads['w']
    window_tokens += float(np.sum(batch['mask']))
    w = params['w']
    plain_update = plain_learning_rate * grads['v']
    largest_updates.append(largest(plain_update))
    if (i + 1) % K == 0:
      updates, state = inner.update(window_grad / window_tokens, state, w)
      w = w + updates
      largest_updates.append(largest(updates))
      window_grad, window_tokens = 0.0, 0.0
    params = {'w': w, 'v': params['v'] - plain_update}
    largest_params.append(largest(params))
    atol = test_multistep.round_off_atol(
      largest_updates, max(largest_params), windows
    )
    trajectory.append(Reference(params, atol))
  return trajectory


def split_transform(kind, inner):
  acc = tokacc.token_weighted_multistep(inner, K)
  if kind == 'multi_transform':
    return optax.multi_transform(
      {'acc': acc, 'plain': optax.sgd(PLAIN_LEARNING_RATE)}, LABELS
    )
  return optax.chain(
    optax.masked(acc, ACC_MASK),
    optax.masked(optax.sgd(PLAIN_LEARNING_RATE), PLAIN_MASK),
  )


@pytest.mark.parametrize('kind', ['multi_transform', 'masked'])
def test_3_apply_if_updated_keeps_other_updates(kind):
  inner = optax.adam(LEARNING_RATE)
  tx = split_transform(kind, inner)
  micro_batches = flatten(make_windows())
  expected = train_split_reference(
    inner, init_params(), micro_batches, PLAIN_LEARNING_RATE
  )

  @jax.jit
  def step(params, state, batch):
    grads = jax.grad(loss_sum)(params, batch)
    updates, state = tx.update(
      grads, state, params, num_tokens=int_count(batch)
    )
    return tokacc.apply_if_updated(params, updates, state), state

  params = init_params()
  state = tx.init(params)
  for i, batch in enumerate(micro_batches):
    params, state = step(params, state, batch)
    assert_within_round_off(params, expected[i])


def test_3_flax_train_state_keeps_other_updates():
  inner = optax.adam(LEARNING_RATE)
  tx = split_transform('multi_transform', inner)
  micro_batches = flatten(make_windows())
  expected = train_split_reference(
    inner, init_params(), micro_batches, PLAIN_LEARNING_RATE
  )

  @jax.jit
  def step(state, batch):
    loss, grads = jax.value_and_grad(loss_sum)(state.params, batch)
    return state.apply_gradients(
      grads=grads, num_tokens=int_count(batch), loss=loss
    )

  state = tokacc_flax.TrainState.create(
    apply_fn=loss_sum, params=init_params(), tx=tx
  )
  for i, batch in enumerate(micro_batches):
    state = step(state, batch)
    assert_within_round_off(state.params, expected[i])
    assert int(state.step) == (i + 1) // K


# Defect 4: TrainState.step went stale under optax.apply_if_finite.


def test_4_train_state_step_under_apply_if_finite():
  inner = optax.adam(LEARNING_RATE)
  tx = optax.apply_if_finite(
    tokacc.token_weighted_multistep(inner, K), max_consecutive_errors=10
  )
  windows = make_windows()
  # A NaN micro-batch right after each emitting step: rejected entirely by
  # apply_if_finite (the previous state is kept).
  stream = []
  for window in windows:
    stream.extend(window)
    stream.append(nan_batch())
  windows_closed = []
  closed = 0
  for batch in stream:
    if np.isfinite(batch['y']).all():
      closed += 1
    windows_closed.append(closed // K)

  @jax.jit
  def step(state, batch):
    loss, grads = jax.value_and_grad(loss_sum)(state.params, batch)
    return state.apply_gradients(
      grads=grads, num_tokens=int_count(batch), loss=loss
    )

  state = tokacc_flax.TrainState.create(
    apply_fn=loss_sum, params=init_params(), tx=tx
  )
  steps = []
  for batch in stream:
    state = step(state, batch)
    steps.append(int(state.step))
  assert steps == windows_closed
  assert int(tokacc.find_state(state.opt_state).gradient_step) == len(windows)
  assert_within_round_off(
    state.params, train_full_batch(inner, init_params(), windows)
  )


# Defect 5: loss_reduction='mean' with an empty micro-batch.


def test_5_mean_reduction_with_empty_micro_batch():
  inner = optax.adam(LEARNING_RATE)
  tx = tokacc.token_weighted_multistep(inner, K, loss_reduction='mean')
  windows = make_windows()  # the first window has an empty micro-batch
  step = jitted_step(tx, loss_fn=loss_mean)
  params, state = init_params(), tx.init(init_params())
  for w, window in enumerate(windows):
    expected = train_full_batch(inner, init_params(), windows[:w])
    for batch in window:
      params, state, _ = step(params, state, batch)
    assert all(bool(jnp.isfinite(x).all()) for x in jax.tree.leaves(params))
    np.testing.assert_allclose(
      tokacc.window_loss(state),
      full_batch_loss(expected.params, window),
      rtol=0,
      atol=loss_atol(expected, window),
    )
  assert_within_round_off(
    params, train_full_batch(inner, init_params(), windows)
  )


# Defect 6: counts and emit_now of the wrong kind or out of range.


def one_update(tx, num_tokens=None, missing=False, **kwargs):
  params = init_params()
  grads = jax.tree.map(jnp.ones_like, params)
  extra = {} if missing else {'num_tokens': num_tokens}
  return tx.update(grads, tx.init(params), params, **extra, **kwargs)


@functools.cache
def adam_tx(**kwargs):
  return tokacc.token_weighted_multistep(optax.adam(LEARNING_RATE), K, **kwargs)


@pytest.mark.parametrize('use_jit', [False, True], ids=['eager', 'jit'])
@pytest.mark.parametrize(
  'num_tokens',
  [
    np.int64(2**32 + 5),
    2**32 + 5,
    np.uint32(2**31),
    2.5,
  ],
  ids=['np_int64', 'python_int', 'np_uint32', 'python_float'],
)
def test_6_concrete_count_not_representable_is_refused(num_tokens, use_jit):
  """Out of int32's range, or not whole: never wrapped nor rounded."""
  tx = adam_tx()
  fn = jax.jit(lambda: one_update(tx, num_tokens)) if use_jit else None
  with pytest.raises(ValueError, match='num_tokens'):
    fn() if use_jit else one_update(tx, num_tokens)


@pytest.mark.parametrize(
  'num_tokens',
  [True, np.bool_(True), jnp.asarray(True), 'False', '5', jnp.ones(2), None],
  ids=['bool', 'np_bool', 'jnp_bool', 'str_false', 'str_5', 'vector', 'none'],
)
def test_6_num_tokens_of_wrong_kind_is_refused(num_tokens):
  with pytest.raises((TypeError, ValueError), match='num_tokens'):
    one_update(adam_tx(), num_tokens)


def test_6_missing_num_tokens_is_refused():
  with pytest.raises((TypeError, ValueError), match='num_tokens'):
    one_update(adam_tx(), missing=True)


@pytest.mark.parametrize(
  'emit_now',
  ['False', 'True', jnp.int32(1), np.float32(1.0), jnp.asarray(0)],
  ids=['str_false', 'str_true', 'int32', 'float32', 'int_array'],
)
def test_6_emit_now_of_wrong_kind_is_refused(emit_now):
  with pytest.raises(TypeError, match='emit_now'):
    one_update(adam_tx(), 3, emit_now=emit_now)


@pytest.mark.parametrize(
  'kind',
  [
    pytest.param('python_bool', marks=pytest.mark.slow),
    'np_bool',
    'traced_bool',
  ],
)
def test_6_emit_now_closes_the_window(kind):
  inner = optax.adam(LEARNING_RATE)
  tx = adam_tx()
  windows = make_windows()
  short = [windows[0][:2], windows[1]]  # the first closed after two

  @jax.jit
  def traced_step(params, state, batch, close):
    grads = jax.grad(loss_sum)(params, batch)
    updates, state = tx.update(
      grads, state, params, num_tokens=int_count(batch), emit_now=close
    )
    return optax.apply_updates(params, updates), state, updates

  step = jitted_step(tx)
  flag = True if kind == 'python_bool' else np.bool_(True)
  close_step = jitted_step(tx, emit_now=flag)
  params, state = init_params(), tx.init(init_params())
  for i, batch in enumerate(flatten(short)):
    if kind == 'traced_bool':
      params, state, _ = traced_step(params, state, batch, jnp.asarray(i == 1))
    else:
      params, state, _ = (close_step if i == 1 else step)(params, state, batch)
  assert int(state.gradient_step) == 2
  assert_within_round_off(params, train_full_batch(inner, init_params(), short))


# Defect 7: a restored state of another configuration.


def train_to_mid_window(tx):
  params = init_params()
  step = jitted_step(tx)
  state = tx.init(params)
  for batch in make_windows()[0][:2]:
    params, state, _ = step(params, state, batch)
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
def test_7_restore_into_another_configuration_is_refused(
  saved_kwargs, restored_kwargs, words
):
  params, state = train_to_mid_window(adam_tx(**saved_kwargs))
  step = jitted_step(adam_tx(**restored_kwargs))
  with pytest.raises((TypeError, ValueError)) as info:
    step(params, state, make_windows()[0][2])
  message = str(info.value)
  for word in words:
    assert word in message, f'{word!r} not in the error: {message}'


@pytest.mark.parametrize(
  'kwargs',
  [{}, {'accumulator_dtype': jnp.bfloat16, 'compensated': True}],
  ids=['default', 'bf16_compensated'],
)
def test_7_restore_into_the_same_configuration_resumes(kwargs):
  windows = make_windows()
  tx = adam_tx(**kwargs)
  params, state = train_to_mid_window(tx)
  step = jitted_step(tx)
  for batch in flatten(windows)[2:]:
    params, state, _ = step(params, state, batch)
  straight, _ = train(tx, init_params(), flatten(windows))
  chex.assert_trees_all_equal(params, straight)
  if not kwargs:
    expected = train_full_batch(
      optax.adam(LEARNING_RATE), init_params(), windows
    )
    assert_within_round_off(params, expected)


# Defect 8: float token counts.


def float_count(batch):
  return jnp.sum(jnp.asarray(batch['mask'], jnp.float32))


def non_whole_count(batch):  # 0.5 more than the tokens: not a whole number
  return float_count(batch) + 0.5


def test_8_float_mask_sum_is_counted_exactly():
  inner = optax.adam(LEARNING_RATE)
  windows = make_windows()
  tx = adam_tx()
  params, state = train(
    tx, init_params(), flatten(windows), count_fn=float_count
  )
  assert_within_round_off(
    params, train_full_batch(inner, init_params(), windows)
  )
  with_ints, _ = train(tx, init_params(), flatten(windows))
  chex.assert_trees_all_equal(params, with_ints)
  assert int(state.last_tokens) == sum(TOKEN_COUNTS[-1])

  step = jitted_step(tx, count_fn=float_count)
  state = tx.init(init_params())
  for batch in windows[0][:2]:
    _, state, _ = step(init_params(), state, batch)
  assert int(state.acc_tokens) == sum(TOKEN_COUNTS[0][:2])


def test_8_non_whole_traced_float_count_drops_the_window():
  inner = optax.adam(LEARNING_RATE)
  windows = make_windows()
  tx = adam_tx()

  step = jitted_step(tx)
  bad_step = jitted_step(tx, count_fn=non_whole_count)
  params, state = init_params(), tx.init(init_params())
  for m, batch in enumerate(windows[0]):
    params, state, updates = (bad_step if m == 1 else step)(
      params, state, batch
    )
    chex.assert_trees_all_equal(updates, optax.tree.zeros_like(updates))
  chex.assert_trees_all_equal(params, init_params())
  assert int(state.gradient_step) == 0
  assert int(state.dropped_windows) == 1
  assert not bool(tokacc.has_updated(state))
  for batch in windows[1]:
    params, state, _ = step(params, state, batch)
  assert int(state.gradient_step) == 1
  expected = train_full_batch(inner, init_params(), windows[1:])
  assert_within_round_off(params, expected)


def test_8_float_token_dtype_accumulates_fractional_weights():
  inner = optax.adam(LEARNING_RATE)
  rng = np.random.default_rng(7)
  windows = make_windows()
  for batch in flatten(windows):
    batch['mask'] = batch['mask'] * rng.uniform(0.1, 1.5, batch['mask'].shape)
    batch['mask'] = batch['mask'].astype(np.float32)
  tx = tokacc.token_weighted_multistep(inner, K, token_dtype=jnp.float32)
  params, _ = train(tx, init_params(), flatten(windows), count_fn=float_count)
  assert_within_round_off(
    params, train_full_batch(inner, init_params(), windows)
  )


# Defect 10: what grad_sums holds.


def test_10_acc_grads_is_the_sum_of_gradients_during_a_window():
  tx = adam_tx()
  step = jitted_step(tx)
  params, state = init_params(), tx.init(init_params())
  for window in make_windows():
    window_sum = jax.tree.map(jnp.zeros_like, params)
    window_params = params
    largest_grads = []
    for batch in window[:-1]:
      grads = micro_grads(window_params, batch)
      window_sum = jax.tree.map(jnp.add, window_sum, grads)
      params, state, _ = step(params, state, batch)
      # Each micro-batch's gradient within round_off_atol's bound, with the
      # gradients as the "updates" (the sum is linear in them).
      largest_grads.append(largest(grads))
      atol = test_multistep.round_off_atol(
        largest_grads, largest(window_sum), [window]
      )
      assert_within_round_off(state.grad_sums, Reference(window_sum, atol))
    params, state, _ = step(params, state, window[-1])


# Contract: window_loss is unmistakable before a window and without loss.


def test_window_loss_is_nan_before_the_first_window_and_without_loss():
  tx = adam_tx()
  state = tx.init(init_params())
  assert np.isnan(tokacc.window_loss(state))
  step = jitted_step(tx, with_loss=False)
  params = init_params()
  for batch in make_windows()[0]:
    params, state, _ = step(params, state, batch)
  assert bool(tokacc.has_updated(state))
  assert np.isnan(tokacc.window_loss(state))


def test_zero_token_window_emits_zeros_and_keeps_inner_state():
  inner = optax.adam(LEARNING_RATE)
  tx = adam_tx()
  windows = make_windows(((0, 0, 0), (4, 0, 6)))
  step = jitted_step(tx)
  params, state = init_params(), tx.init(init_params())
  for batch in windows[0]:
    params, state, updates = step(params, state, batch)
    chex.assert_trees_all_equal(updates, optax.tree.zeros_like(updates))
  chex.assert_trees_all_equal(params, init_params())
  chex.assert_trees_all_equal(state.inner_state, inner.init(init_params()))
  assert int(state.gradient_step) == 0
  assert not bool(tokacc.has_updated(state))
  for batch in windows[1]:
    params, state, _ = step(params, state, batch)
  assert_within_round_off(
    params, train_full_batch(inner, init_params(), windows[1:])
  )


# Issue 19: a window with NaN gradients must not poison the next ones ("the
# next window starts clean"). Without should_skip_update_fn, such a window
# either emits NaN updates or, without counted tokens, is dropped; either
# way the accumulator's buffer is left holding NaN. A window restarted by
# multiplying with zero keeps 0 * NaN = NaN and turns every later update
# into NaN; a select starts it afresh.


def empty_nan_batch(seed):
  """A micro-batch without counted tokens whose padding holds a NaN: its
  token-summed loss and gradients are NaN (NaN * 0 = NaN)."""
  batch = make_batch(seed, 0)
  batch['y'][0, 0] = np.nan
  return batch


# case: (inner, the NaN window). 'dropped': no tokens, so no optimizer step;
# 'emitted': tokens and one NaN micro-batch, so NaN updates, which the
# training loop below discards (sgd keeps no state for them to poison).
NAN_WINDOWS = {
  'dropped': (
    lambda: optax.adam(LEARNING_RATE),
    lambda: [empty_nan_batch(98), make_batch(97, 0), empty_nan_batch(96)],
  ),
  'emitted': (
    lambda: optax.sgd(LEARNING_RATE),
    lambda: [make_batch(98, 4), nan_batch(), make_batch(97, 6)],
  ),
}


def is_finite_tree(tree):
  return all(bool(np.isfinite(leaf).all()) for leaf in jax.tree.leaves(tree))


@pytest.mark.parametrize('compensated', [False, True])
@pytest.mark.parametrize('case', sorted(NAN_WINDOWS))
def test_window_after_a_nan_window_starts_clean(case, compensated):
  make_inner, make_nan_window = NAN_WINDOWS[case]
  tx = tokacc.token_weighted_multistep(make_inner(), K, compensated=compensated)
  step = jitted_step(tx)
  params, state = init_params(), tx.init(init_params())
  for batch in make_nan_window():
    new_params, state, updates = step(params, state, batch)
    if is_finite_tree(updates):
      params = new_params  # else the loop keeps its parameters
  chex.assert_trees_all_equal(params, init_params())
  if case == 'dropped':
    chex.assert_trees_all_equal(updates, optax.tree.zeros_like(updates))
    assert int(state.gradient_step) == 0
  else:
    assert all(np.isnan(u).all() for u in jax.tree.leaves(updates))
    assert int(state.gradient_step) == 1

  windows = make_windows()
  for w, window in enumerate(windows):
    # At the very parameters the window's losses are taken at: round-off
    # of the sum alone (loss_atol with atol 0).
    expected_loss = full_batch_loss(params, window)
    atol = loss_atol(Reference(params, 0.0), window)
    for batch in window:
      params, state, updates = step(params, state, batch)
    assert is_finite_tree(updates), f'window {w} after the NaN window'
    expected = train_full_batch(make_inner(), init_params(), windows[: w + 1])
    assert_within_round_off(params, expected)
    np.testing.assert_allclose(
      tokacc.window_loss(state), expected_loss, rtol=0, atol=atol
    )
