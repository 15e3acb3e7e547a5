"""Property tests: the transform equals full-batch training.

Hypothesis draws k, per-micro-step and per-device token counts (zeros
included), where ``emit_now`` closes a window early, and the optimizer. The
reference below trains plainly on each closed window's full batch.
"""

import functools

import chex
import hypothesis
from hypothesis import strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import test_multistep

import optax_tokacc as tokacc

MAX_TOKENS = 6  # token positions per micro-batch
FEATURES = 3

OPTIMIZERS = {
  'sgd': lambda: optax.sgd(0.1, momentum=0.9),
  'adam': lambda: optax.adam(0.05),
  'adamw_clip': lambda: optax.chain(
    optax.clip_by_global_norm(0.5), optax.adamw(0.05, weight_decay=0.1)
  ),
}


def init_params():
  return {'w': jnp.array([0.5, -1.0, 0.25]), 'b': jnp.array(0.1)}


def loss_sum(params, x, y, mask):
  """Squared error summed over the counted tokens."""
  return jnp.sum(mask * (jnp.tanh(x @ params['w']) + params['b'] - y) ** 2)


@functools.cache
def accumulated_step(k, optimizer_name, num_devices):
  """Our micro-step, compiled once per (k, optimizer, devices)."""
  tx = tokacc.token_weighted_multistep(
    OPTIMIZERS[optimizer_name](),
    k,
    axis_name=None if num_devices == 1 else 'data',
  )

  def step(params, state, x, y, mask, emit_now):
    grads = jax.grad(loss_sum)(params, x, y, mask)
    num_tokens = jnp.sum(mask).astype(jnp.int32)
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
  params = init_params()
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


def train_full_batch(k, optimizer_name, data, emit_on):
  """Reference: one optimizer step per closed window on its full batch.

  Returns the parameters, the number of steps, and the bound of
  ``test_multistep.round_off_atol`` (derived there) on how far float32
  round-off can take accumulation from them: this model's token terms
  take fewer roundings than that module's (one dot product of FEATURES
  against two), and its optimizers are linear in the gradient (momentum
  SGD) or homogeneous of degree 0 (Adam, AdamW's decay aside, which is
  linear in the parameters; a global-norm clip that binds).
  """
  x, y, mask = data
  optimizer = OPTIMIZERS[optimizer_name]()
  params = init_params()
  opt_state = optimizer.init(params)
  window, num_steps = [], 0
  windows, largest_updates = [], []
  largest_param = test_multistep.largest(params)
  for i in range(x.shape[0]):
    window.append(i)
    if len(window) < k and emit_on[i] < 0:
      continue
    # All micro-batches of the window, on all devices, as one batch.
    batch = [a[window].reshape(-1, *a.shape[3:]) for a in (x, y, mask)]
    total_tokens = batch[2].sum()
    window = []
    if total_tokens == 0:
      continue  # no tokens: no step
    grads = jax.grad(loss_sum)(params, *batch)  # full-batch token mean:
    grads = jax.tree.map(lambda g: g / total_tokens, grads)  # noqa: B023
    updates, opt_state = optimizer.update(grads, opt_state, params)
    params = optax.apply_updates(params, updates)
    num_steps += 1
    windows.append([{'mask': batch[2]}])
    largest_updates.append(test_multistep.largest(updates))
    largest_param = max(largest_param, test_multistep.largest(params))
  if not windows:
    return params, num_steps, 0.0  # never updated: equal bit for bit
  atol = test_multistep.round_off_atol(largest_updates, largest_param, windows)
  return params, num_steps, atol


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
  x = rng.normal(size=shape + (FEATURES,)).astype(np.float32)
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
  expected, num_steps, atol = train_full_batch(
    k, name, data, scenario['emit_on']
  )
  # Within the round-off bound of train_full_batch (derived there).
  chex.assert_trees_all_close(params, expected, rtol=0, atol=atol)
  assert int(state.gradient_step) == num_steps
