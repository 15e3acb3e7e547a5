"""Mixed precision: parameter and gradient dtypes with Adam and AdamW.

For every pair of parameter dtype and gradient dtype (float32, bfloat16,
float16), `token_weighted_multistep` under `jax.jit` is compared over several
windows with full-batch training that keeps the inner state's dtypes, as
`optax.MultiSteps` does: the micro-batch gradients (computed in the gradient
dtype) are summed in float32, divided by the window's tokens, cast to the
gradient dtype and fed to the inner optimizer, whose new state is cast back
to the dtypes it had. The returned updates must have the dtypes that
`jax.eval_shape` of the inner update gives, and the inner state must keep
its dtypes from window to window (``helpers.full_batch`` with
``gradient_fn`` and ``keep_state_dtypes``). Also bfloat16 parameters with
Adam under ``pmap`` (issue 11, defect 2), and micro-steps that keep every
bit of the parameters.
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

K = 2
TOKEN_COUNTS = ((6, 1), (0, 8), (3, 5))  # unequal, with an empty micro-batch
LEARNING_RATE = 0.05
EPS = 1e-3  # Adam's default 1e-8 is zero in float16

DTYPES = {'f32': jnp.float32, 'bf16': jnp.bfloat16, 'f16': jnp.float16}


def unit_round_off(name):
  return float(jnp.finfo(DTYPES[name]).eps) / 2


def tolerances(param_name, grad_name):
  """((rtol, atol) on the parameters, tolerance on the inner state) after
  len(TOKEN_COUNTS) windows, from each dtype's unit round-off u.

  Each run rounds every parameter to its dtype once per window (by at most
  u |p|), so the two may end a window a unit in the last place (2 u |p|)
  further apart: rtol 2 u per window. The window's gradient: its float32
  sum of K terms and division round K + 1 times in each run (u = 2**-24);
  cast to the gradient dtype it may round to the reference's neighbour (2
  u relative), and so may a gradient taken at parameters a unit apart (2 u
  of the parameters' dtype). Adam's update moves by at most twice a
  relative change of its gradient, times the learning rate: atol per
  window. The moments are averages of the gradients (of their squares)
  with weights that sum to at most 1: they change by at most the
  gradients' relative change (twice for the second) times the gradients'
  size, below 1 here (rtol and atol both), and by a rounding to their
  dtype in each run per window.
  Measured: parameters 0.14 of the bound at most (float32 with float32
  gradients, 6e-8; with float16 gradients 3.7e-5, one gradient rounded to
  its neighbour), the state 0.01 of it; bfloat16 and float16 parameters
  bit for bit.
  """
  steps = len(TOKEN_COUNTS)
  u_param, u_grad = unit_round_off(param_name), unit_round_off(grad_name)
  gradient = 2 * (K + 1) * 2.0**-24 + 2 * u_grad + 2 * u_param
  on_params = (steps * 2 * u_param, steps * 2 * gradient * LEARNING_RATE)
  on_state = 2 * gradient + steps * 2 * max(u_param, u_grad)
  return on_params, on_state


OPTIMIZERS = {
  'adam': lambda: optax.adam(LEARNING_RATE, eps=EPS),
  'adamw': lambda: optax.adamw(LEARNING_RATE, eps=EPS, weight_decay=0.1),
  'adam_mu_f32': lambda: optax.adam(
    LEARNING_RATE, eps=EPS, mu_dtype=jnp.float32
  ),
}


def make_windows():
  return helpers.windows_of(TOKEN_COUNTS)


@functools.cache
def micro_grads(grad_dtype):
  """The gradient of a micro-batch's token-summed loss, in ``grad_dtype``."""

  @jax.jit
  def grads(params, batch):
    params = jax.tree.map(lambda p: p.astype(grad_dtype), params)
    batch = jax.tree.map(lambda x: x.astype(grad_dtype), batch)
    return jax.grad(helpers.loss_sum)(params, batch)

  return grads


def mixed_precision_gradient(grad_dtype):
  """The window's gradient as ``optax.MultiSteps`` forms it: each
  micro-batch's in ``grad_dtype``, summed in float32, divided by the
  window's tokens and cast to ``grad_dtype`` (``helpers.full_batch``'s
  ``gradient_fn``)."""

  def gradient(params, window):
    total = sum(helpers.mask_count(batch) for batch in window)
    window_sum = jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params)
    for batch in window:
      window_sum = jax.tree.map(
        lambda s, g: s + g.astype(jnp.float32),
        window_sum,
        micro_grads(grad_dtype)(params, batch),
      )
    return jax.tree.map(lambda s: (s / total).astype(grad_dtype), window_sum)

  return gradient


def reference(inner, params, windows, grad_dtype):
  """Full-batch training whose inner state keeps its dtypes, as
  ``optax.MultiSteps`` keeps them (``helpers.full_batch``)."""
  return helpers.full_batch(
    inner,
    params,
    windows,
    gradient_fn=mixed_precision_gradient(grad_dtype),
    keep_state_dtypes=True,
  )


def expected_update_dtypes(inner, params, grad_dtype):
  """The dtypes of ``inner``'s updates of gradients in ``grad_dtype``
  (``jax.eval_shape``)."""
  grads = jax.tree.map(lambda p: jnp.zeros(p.shape, grad_dtype), params)
  updates, _ = jax.eval_shape(inner.update, grads, inner.init(params), params)
  return dtypes_of(updates)


def dtypes_of(tree):
  return jax.tree.map(lambda x: jnp.result_type(x), tree)


def optimizers_for(param_name):
  names = ['adam', 'adamw']
  return names + ['adam_mu_f32'] if param_name == 'bf16' else names


@pytest.mark.parametrize(
  ('param_name', 'grad_name'),
  [
    pytest.param(
      param_name,
      grad_name,
      # all but float32 with float32 gradients take 5 s or more of a core
      marks=pytest.mark.slow
      if (param_name, grad_name) != ('f32', 'f32')
      else (),
    )
    for grad_name in DTYPES
    for param_name in DTYPES
  ],
)
def test_dtype_pair_equals_full_batch(param_name, grad_name):
  param_dtype, grad_dtype = DTYPES[param_name], DTYPES[grad_name]
  names = optimizers_for(param_name)
  inners = {name: OPTIMIZERS[name]() for name in names}
  txs = {
    name: tokacc.token_weighted_multistep(inner, K)
    for name, inner in inners.items()
  }
  windows = make_windows()
  param_tolerance, state_tolerance = tolerances(param_name, grad_name)
  grad_fn = micro_grads(grad_dtype)

  @jax.jit
  def step(params, states, grads, num_tokens):
    """One micro-step of every optimizer: one compilation per dtype pair."""
    results = {}
    for name, tx in txs.items():
      updates, state = tx.update(
        grads[name], states[name], params[name], num_tokens=num_tokens
      )
      results[name] = (optax.apply_updates(params[name], updates), state)
      results[name] += (updates,)
    return results

  params = {name: helpers.init_params(param_dtype) for name in names}
  states = {name: txs[name].init(params[name]) for name in names}
  trained = run(step, params, states, windows, grad_fn)
  for name, inner in inners.items():
    expected = reference(
      OPTIMIZERS[name](), helpers.init_params(param_dtype), windows, grad_dtype
    ).windows
    inner_dtypes = dtypes_of(inner.init(params[name]))
    update_dtypes = expected_update_dtypes(inner, params[name], grad_dtype)
    actual_params, actual_states, actual_updates = trained[name]
    for w in range(len(windows)):
      expected_params, expected_state = expected[w][:2]
      chex.assert_trees_all_close(
        actual_params[w],
        expected_params,
        rtol=param_tolerance[0],
        atol=param_tolerance[1],
        custom_message=f'{name}, parameters after window {w}',
      )
      chex.assert_trees_all_close(
        actual_states[w].inner_state,
        expected_state,
        rtol=state_tolerance,
        atol=state_tolerance,
        custom_message=f'{name}, inner state after window {w}',
      )
      assert int(actual_states[w].gradient_step) == w + 1, name
    for updates in actual_updates:
      assert dtypes_of(updates) == update_dtypes, (
        f'{name}: updates of dtypes {dtypes_of(updates)}, but '
        f'jax.eval_shape(inner.update, ...) gives {update_dtypes}'
      )
    for state in actual_states:
      assert dtypes_of(state.inner_state) == inner_dtypes, (
        f'{name}: the inner state changed dtypes'
      )
      assert set(jax.tree.leaves(dtypes_of(state.grad_sums))) == {
        jnp.dtype(jnp.float32)
      }, f'{name}: grad_sums not float32'
    for window_params in actual_params:
      assert dtypes_of(window_params) == dtypes_of(params[name]), (
        f'{name}: the parameters changed dtypes'
      )


def run(step, params, states, windows, grad_fn):
  """Trains every optimizer; returns, per optimizer, the parameters and the
  state after every window and the updates of every micro-step."""
  trained = {name: ([], [], []) for name in params}
  for window in windows:
    for batch in window:
      num_tokens = np.int32(np.sum(batch['mask']))
      grads = {name: grad_fn(p, batch) for name, p in params.items()}
      results = step(params, states, grads, num_tokens)
      params = {name: result[0] for name, result in results.items()}
      states = {name: result[1] for name, result in results.items()}
      for name, result in results.items():
        trained[name][2].append(result[2])
    for name in params:
      trained[name][0].append(params[name])
      trained[name][1].append(states[name])
  return trained


@pytest.mark.parametrize('dtype', [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize('in_buffer', [True, False])
def test_micro_steps_keep_parameters_bit_identical_negative_zero(
  dtype, in_buffer
):
  """Micro-steps leave every bit of the parameters as it was, -0.0
  included: the zero updates are -0.0 (x + -0.0 == x for every x, while
  -0.0 + 0.0 is +0.0). Both ways of producing them: held in the
  accumulator's buffer, and fresh zeros (an inner whose updates the buffer
  cannot hold)."""
  params = {'w': jnp.array([-0.0, 0.0, 1.5, -2.0], dtype)}
  # An accumulator dtype that cannot hold the updates' dtype exactly.
  narrow = {jnp.float32: jnp.bfloat16, jnp.bfloat16: jnp.float16}[dtype]
  tx = tokacc.token_weighted_multistep(
    optax.sgd(0.1), 4, accumulator_dtype=None if in_buffer else narrow
  )
  state = tx.init(params)
  step = jax.jit(
    lambda p, s: (lambda u, s: (optax.apply_updates(p, u), s))(
      *tx.update({'w': jnp.ones(4, dtype)}, s, p, num_tokens=3)
    )
  )
  new_params, _ = step(params, state)
  unsigned = np.uint16 if dtype == jnp.bfloat16 else np.uint32

  def bits(tree):
    return np.asarray(tree['w']).view(unsigned)

  np.testing.assert_array_equal(bits(new_params), bits(params))


# bf16 parameters with Adam, data parallel: f32 gradients (Adam's mu is
# promoted by the update), and mu_dtype=float32 with bf16 gradients (f32
# updates).
BF16 = jnp.bfloat16
MIXED_PRECISION = {
  'adam_f32_grads': (lambda: optax.adam(LEARNING_RATE, eps=EPS), jnp.float32),
  'adam_mu_f32_bf16_grads': (
    lambda: optax.adam(LEARNING_RATE, eps=EPS, mu_dtype=jnp.float32),
    jnp.bfloat16,
  ),
}
PMAP_K = 3


@pytest.mark.slow
def test_bf16_parameters_with_adam_under_pmap():
  """Regression (issue 11, defect 2): both settings of ``MIXED_PRECISION``
  in one pmapped step over 2 devices: the updates have the dtypes of
  ``inner``'s, and every device's parameters are those of full-batch
  training that keeps the inner state's dtypes."""
  devices = jax.devices()[:2]
  inners = {name: make() for name, (make, _) in MIXED_PRECISION.items()}
  txs = {
    name: tokacc.token_weighted_multistep(inner, PMAP_K, axis_name='data')
    for name, inner in inners.items()
  }
  # Device d holds micro-batches of its own: both together make the window.
  per_device = [
    helpers.windows_of(((5, 0, 8), (2, 7, 1))),
    helpers.windows_of(((1, 8, 0), (6, 3, 4)), seed=50),
  ]
  reference_windows = [a + b for a, b in zip(*per_device)]

  def step(params, states, batch):
    results = {}
    for name, tx in txs.items():
      grad_dtype = MIXED_PRECISION[name][1]
      grads = jax.grad(helpers.loss_sum)(
        jax.tree.map(lambda p, g=grad_dtype: p.astype(g), params[name]),
        jax.tree.map(lambda x, g=grad_dtype: x.astype(g), batch),
      )
      updates, state = tx.update(
        grads, states[name], params[name], num_tokens=helpers.token_count(batch)
      )
      new_params = optax.apply_updates(params[name], updates)
      results[name] = (new_params, state, updates)
    return results

  def stack(*xs):
    return np.stack(xs)

  # Sharded over the axis of the step's outputs, so that it compiles once.
  replicate = jax.pmap(lambda x: x, axis_name='data', devices=devices)
  params = {
    name: replicate(
      jax.tree.map(lambda x: stack(x, x), helpers.init_params(BF16))
    )
    for name in txs
  }
  states = {
    name: jax.pmap(tx.init, axis_name='data', devices=devices)(params[name])
    for name, tx in txs.items()
  }
  p_step = jax.pmap(step, axis_name='data', devices=devices)
  updates = {name: [] for name in txs}
  for w in range(len(reference_windows)):
    for m in range(PMAP_K):
      batch = jax.tree.map(stack, per_device[0][w][m], per_device[1][w][m])
      results = p_step(params, states, batch)
      for name, (new_params, state, new_updates) in results.items():
        params[name], states[name] = new_params, state
        updates[name].append(new_updates)
  for name, inner in inners.items():
    grad_dtype = MIXED_PRECISION[name][1]
    expected = reference(
      inner, helpers.init_params(BF16), reference_windows, grad_dtype
    ).params
    update_dtypes = expected_update_dtypes(
      inner, helpers.init_params(BF16), grad_dtype
    )
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
  accumulation and by full-batch training that keeps the inner state's
  dtypes (``reference``).

  bfloat16 keeps 8 significant bits (u = 2**-8): each run rounds every
  parameter to bfloat16 once per window (by at most u |p|), so the two may
  end a window a unit in the last place (2 u |p|) further apart: rtol 2 u
  per window. A window's float32 gradient differs by round-off
  (``helpers.round_off_atol``'s 2 (n + m) u, u = 2**-24), and by about 2 u
  (u = 2**-8) where it is taken at parameters a unit apart or cast to
  bfloat16 (each): Adam's update moves by at most twice a relative change
  of its gradient, times the learning rate: atol, per window. Measured: one
  unit apart at |p| = 0.68 (3.9e-3), 0.37 of the bound.
  """
  bf16_round_off = 2.0**-8
  n = helpers.window_tokens(windows)
  gradient = 2 * (n + helpers.TERM_ROUNDINGS) * 2.0**-24
  gradient += 2 * bf16_round_off * (2 if grad_dtype == BF16 else 1)
  rtol = len(windows) * 2 * bf16_round_off
  atol = len(windows) * 2 * gradient * LEARNING_RATE
  return rtol, atol
