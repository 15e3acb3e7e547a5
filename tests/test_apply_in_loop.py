# Copyright 2026 The optax_tokacc Authors.
#
# Licensed under the Apache License, Version 2.0 (the "License");
# you may not use this file except in compliance with the License.
# You may obtain a copy of the License at
#
#     http://www.apache.org/licenses/LICENSE-2.0
#
# Unless required by applicable law or agreed to in writing, software
# distributed under the License is distributed on an "AS IS" BASIS,
# WITHOUT WARRANTIES OR CONDITIONS OF ANY KIND, either express or implied.
# See the License for the specific language governing permissions and
# limitations under the License.
# ==============================================================================
"""``apply_if_updated`` adds the updates in a loop of 0 or 1 trips that
reads the accumulator's buffer, where it may (issue 55): the parameters
are ``optax.apply_updates``' bit for bit, in every case, and an open
micro-step of the device-decided step computes nothing of the
parameters' size beside the gradient and its add."""

import functools

import helpers
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import optax_tokacc as tokacc
from optax_tokacc.testing import hlo

K = 3
COUNTS = (5, 0, 9, 3, 7, 2, 8, 1, 4)  # a micro-batch without tokens too


def _runs(tx, apply, dtype=np.float32, nan_at=None, scale=None):
  """The parameters after each call of a device-decided step that applies
  its updates with ``apply`` (``scale``: the user scales them first)."""
  params = jax.tree.map(jnp.asarray, helpers.init_params(dtype))
  state = tx.init(params)

  @jax.jit
  def step(params, state, batch):
    grads = jax.grad(helpers.loss_sum)(params, batch)
    count = helpers.token_count(batch)
    updates, state = tx.update(grads, state, params, num_tokens=count)
    if scale is not None:
      updates = jax.tree.map(lambda u: u * scale, updates)
    return apply(params, updates, state), state

  found = []
  for i, count in enumerate(COUNTS):
    batch = helpers.micro_batch(i, count, dtype)
    if i == nan_at:
      batch['x'][0, 0, 0] = np.nan
    params, state = step(params, state, batch)
    found.append(params)
  return found


def _apply_updates(params, updates, state):
  del state
  return optax.apply_updates(params, updates)


CASES = {
  'adamw': (helpers.adamw, np.float32, None),
  'sgd': (helpers.sgd, np.float32, None),
  'bfloat16_params': (helpers.adamw, jnp.bfloat16, None),
  'nan_window': (helpers.adamw, np.float32, 1),
}


@pytest.mark.parametrize('name', CASES)
def test_the_parameters_of_optax_apply_updates_bit_for_bit(name):
  inner, dtype, nan_at = CASES[name]
  tx = tokacc.token_weighted_multistep(inner(), K)
  ours = _runs(tx, tokacc.apply_if_updated, dtype, nan_at)
  theirs = _runs(tx, _apply_updates, dtype, nan_at)
  for i, (a, e) in enumerate(zip(ours, theirs)):
    helpers.assert_same_bits(a, e, f'params after call {i}')
  moved = jax.tree.map(lambda a, b: bool(jnp.any(a != b)), ours[-1], ours[0])
  assert any(jax.tree.leaves(moved))  # the windows did update them


def test_updates_changed_by_the_user_are_applied_as_they_are():
  """Scaled updates are other arrays than the buffer's: they are applied
  (reading the buffer would drop the scale)."""
  tx = tokacc.token_weighted_multistep(optax.sgd(1.0), K)
  ours = _runs(tx, tokacc.apply_if_updated, scale=0.5)
  theirs = _runs(tx, _apply_updates, scale=0.5)
  plain = _runs(tx, _apply_updates)
  for a, e in zip(ours, theirs):
    helpers.assert_same_bits(a, e)
  assert not np.array_equal(ours[-1]['w'], plain[-1]['w'])


def test_inside_a_chain_it_is_optax_apply_updates():
  """Another transformation may update on every call: plain addition."""
  tx = optax.chain(
    tokacc.token_weighted_multistep(helpers.adamw(), K), optax.scale(2.0)
  )
  ours = _runs(tx, tokacc.apply_if_updated)
  theirs = _runs(tx, _apply_updates)
  for a, e in zip(ours, theirs):
    helpers.assert_same_bits(a, e)


def _open_step_program(apply):
  tx = tokacc.token_weighted_multistep(helpers.adamw(), K)
  params = jax.tree.map(jnp.asarray, helpers.init_params())

  @functools.partial(jax.jit, donate_argnums=(0, 1))
  def step(params, state, batch):
    grads = jax.grad(helpers.loss_sum)(params, batch)
    count = helpers.token_count(batch)
    updates, state = tx.update(grads, state, params, num_tokens=count)
    return apply(params, updates, state), state

  batch = helpers.micro_batch(0, 5)
  text = hlo.compiled_text(step, params, tx.init(params), batch)
  return hlo.parse_hlo(text)


def test_an_open_micro_step_leaves_the_parameters_alone():
  """Outside the loop's trip nothing adds to the parameters (the gradient
  alone reads them); with ``optax.apply_updates`` an add does on every
  call (the check can fail)."""

  ours = hlo.first_uses(_open_step_program(tokacc.apply_if_updated), 'params')
  theirs = hlo.first_uses(_open_step_program(_apply_updates), 'params')
  assert all('add' not in found for found in ours.values()), ours
  assert any('add' in found for found in theirs.values()), theirs
