"""Property tests: the transform equals full-batch training.

Hypothesis draws k, per-micro-step and per-device token counts (zeros
included), where ``emit_now`` closes a window early, and the optimizer. The
reference is ``helpers.full_batch`` on each closed window's full batch.
"""

import functools

import helpers
import hypothesis
from hypothesis import strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import optax_tokacc as tokacc

MAX_TOKENS = 6  # token positions per micro-batch
OPTIMIZERS = {
  'sgd': lambda: optax.sgd(0.1, momentum=0.9),
  'adam': lambda: optax.adam(0.05),
  'adamw_clip': lambda: optax.chain(
    optax.clip_by_global_norm(0.5), optax.adamw(0.05, weight_decay=0.1)
  ),
}


@functools.cache
def accumulated_step(k, optimizer_name, num_devices):
  """Our micro-step, compiled once per (k, optimizer, devices)."""
  tx = tokacc.token_weighted_multistep(
    OPTIMIZERS[optimizer_name](),
    k,
    axis_name=None if num_devices == 1 else 'data',
  )

  def step(params, state, x, y, mask, emit_now):
    batch = {'x': x, 'y': y, 'mask': mask}
    grads = jax.grad(helpers.loss_sum)(params, batch)
    num_tokens = helpers.token_count(batch)
    updates, state = tx.update(
      grads, state, params, num_tokens=num_tokens, emit_now=emit_now
    )
    return optax.apply_updates(params, updates), state

  if num_devices == 1:
    return tx, jax.jit(step)
  return tx, jax.pmap(step, axis_name='data')


def train_accumulated(k, optimizer_name, data, emit_on):
  """data: x [steps, devices, T, F], y and mask [steps, devices, T]."""
  x, y, mask = data
  num_devices = x.shape[1]
  tx, step = accumulated_step(k, optimizer_name, num_devices)
  params = jax.tree.map(jnp.asarray, helpers.init_params())
  if num_devices == 1:
    state = tx.init(params)
    for i in range(x.shape[0]):
      params, state = step(
        params, state, x[i, 0], y[i, 0], mask[i, 0], emit_on[i] == 0
      )
    return params, state
  params = jax.tree.map(lambda p: jnp.stack([p] * num_devices), params)
  state = jax.vmap(tx.init)(params)
  for i in range(x.shape[0]):
    emit_now = np.arange(num_devices) == emit_on[i]  # on one device only
    params, state = step(params, state, x[i], y[i], mask[i], emit_now)
  return jax.tree.map(lambda p: p[0], params), jax.tree.map(
    lambda s: s[0], state
  )


def closed_windows(k, data, emit_on):
  """The windows the transform closes: ``k`` micro-steps, or fewer where
  ``emit_now`` is raised; each micro-batch all devices' rows at once."""
  x, y, mask = data
  windows, window = [], []
  for i in range(x.shape[0]):
    window.append(
      {
        'x': x[i].reshape(-1, *x.shape[3:]),
        'y': y[i].reshape(-1),
        'mask': mask[i].reshape(-1),
      }
    )
    if len(window) == k or emit_on[i] >= 0:
      windows.append(window)
      window = []
  return windows


@st.composite
def scenarios(draw):
  k = draw(st.integers(1, 3))
  num_devices = draw(st.sampled_from([1, 2]))
  num_steps = draw(st.integers(1, 8))
  counts = st.sampled_from([0, 0, 1, 2, 5, MAX_TOKENS])
  tokens = draw(
    st.lists(
      st.lists(counts, min_size=num_devices, max_size=num_devices),
      min_size=num_steps,
      max_size=num_steps,
    )
  )
  # -1: no emit_now; d: device d raises emit_now at this micro-step.
  emit_on = draw(
    st.lists(
      st.sampled_from([-1, -1, -1] + list(range(num_devices))),
      min_size=num_steps,
      max_size=num_steps,
    )
  )
  return {
    'k': k,
    'optimizer_name': draw(st.sampled_from(sorted(OPTIMIZERS))),
    'tokens': np.array(tokens),
    'emit_on': np.array(emit_on),
    'seed': draw(st.integers(0, 2**16)),
  }


def make_data(tokens, seed):
  rng = np.random.default_rng(seed)
  shape = tokens.shape + (MAX_TOKENS,)
  x = rng.normal(size=shape + (helpers.FEATURES,)).astype(np.float32)
  y = rng.normal(size=shape).astype(np.float32)
  mask = (np.arange(MAX_TOKENS) < tokens[..., None]).astype(np.float32)
  return x, y, mask


@pytest.mark.slow
@hypothesis.settings(max_examples=25, deadline=None, derandomize=True)
@hypothesis.given(scenarios())
def test_equals_full_batch_training(scenario):
  k, name = scenario['k'], scenario['optimizer_name']
  data = make_data(scenario['tokens'], scenario['seed'])
  params, state = train_accumulated(k, name, data, scenario['emit_on'])
  windows = closed_windows(k, data, scenario['emit_on'])
  expected = helpers.full_batch(
    OPTIMIZERS[name](), helpers.init_params(), windows
  )
  helpers.assert_within_round_off(params, expected)
  # a window without tokens takes no step
  steps = [w for w in expected.windows if w.grads is not None]
  assert int(state.gradient_step) == len(steps)
