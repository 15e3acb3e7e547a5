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
"""``update_and_apply`` adds the updates in a loop of 0 or 1 trips that
reads the accumulator's buffer, where it may, or on a TPU in the step
that closes the window (issue 55): the parameters
and the state are those of ``tx.update`` then ``optax.apply_updates``, bit
for bit, in every case, and an open micro-step of the device-decided step
adds nothing to the parameters."""

import functools

import helpers
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import optax_tokacc as tokacc
from optax_tokacc import _update_and_apply
from optax_tokacc.testing import hlo

K = 3
COUNTS = (5, 0, 9, 3, 7, 2, 8, 1, 4)  # a micro-batch without tokens too


def plain(tx, grads, state, params, **kwargs):
  """The reference: ``tx.update`` then ``optax.apply_updates``."""
  updates, state = tx.update(grads, state, params, **kwargs)
  return optax.apply_updates(params, updates), state


def plain_with_updates(tx, grads, state, params, **kwargs):
  """:func:`plain`, and the updates."""
  updates, state = tx.update(grads, state, params, **kwargs)
  return optax.apply_updates(params, updates), state, updates


def with_updates(tx, grads, state, params, **kwargs):
  """``update_and_apply``, and the updates of the call (what the nnx
  ``Optimizer`` returns)."""
  return _update_and_apply.applied_with_updates(
    tx, grads, state, params, **kwargs
  )


def runs(tx, apply, dtype=np.float32, nan_at=None, closes=None):
  """``(params, state)`` after each call of a step that applies with
  ``apply`` (and the updates, where ``apply`` gives them); ``closes``: the
  host's ``close`` per call (None: the device)."""
  params = jax.tree.map(jnp.asarray, helpers.init_params(dtype))
  state = tx.init(params)

  @functools.partial(jax.jit, static_argnames='close')
  def step(params, state, batch, close=None):
    grads = jax.grad(helpers.loss_sum)(params, batch)
    count = helpers.token_count(batch)
    kwargs = {'num_tokens': count}
    if close is not None:
      kwargs['close'] = close
    return apply(tx, grads, state, params, **kwargs)

  found = []
  for i, count in enumerate(COUNTS):
    batch = helpers.micro_batch(i, count, dtype)
    if i == nan_at:
      batch['x'][0, 0, 0] = np.nan
    close = None if closes is None else closes[i]
    params, state, *updates = step(params, state, batch, close=close)
    found.append((params, state, *updates))
  return found


def assert_same_runs(ours, theirs):
  whats = ('params', 'state', 'updates')
  for i, (found, expected) in enumerate(zip(ours, theirs)):
    assert len(found) == len(expected)
    for what, a, e in zip(whats, found, expected):
      helpers.assert_same_bits(a, e, f'{what} after call {i}')
  moved = jax.tree.map(
    lambda a, b: bool(jnp.any(a != b)), ours[-1][0], ours[0][0]
  )
  assert any(jax.tree.leaves(moved))  # the windows did update them


def with_every_k(inner, **options):
  return tokacc.token_weighted_multistep(inner, K, **options)


CASES = {
  'adamw': (lambda: with_every_k(helpers.adamw()), np.float32, None),
  'sgd': (lambda: with_every_k(helpers.sgd()), np.float32, None),
  'bfloat16_params': (
    lambda: with_every_k(helpers.adamw()),
    jnp.bfloat16,
    None,
  ),
  'nan_window': (lambda: with_every_k(helpers.adamw()), np.float32, 1),
  'compensated_bfloat16': (
    lambda: with_every_k(
      helpers.adamw(), accumulator_dtype=jnp.bfloat16, compensated=True
    ),
    np.float32,
    None,
  ),
  'rejected_micro_batch': (
    lambda: with_every_k(
      helpers.adamw(), should_skip_update_fn=tokacc.skip_not_finite
    ),
    np.float32,
    4,
  ),
  'in_a_chain': (
    lambda: optax.chain(with_every_k(helpers.adamw()), optax.scale(2.0)),
    np.float32,
    None,
  ),
}


@pytest.mark.parametrize('name', sorted(CASES))
def test_tx_update_then_optax_apply_updates_bit_for_bit(name):
  make, dtype, nan_at = CASES[name]
  tx = make()
  ours = runs(tx, tokacc.update_and_apply, dtype, nan_at)
  assert_same_runs(ours, runs(tx, plain, dtype, nan_at))


@pytest.mark.parametrize('form', ['here', 'written_out', 'tpu'])
def test_windows_closed_by_the_host_bit_for_bit(form, monkeypatch):
  """Host-closed calls mixed with device-decided ones, also where the
  host's close is written out (a GPU's form, here in its place): its
  buffer does not hold the updates; and in a TPU's forms, where the
  host's close is written out too, its sums restarted and laid out as
  the parameters."""
  if form == 'written_out':
    helpers.written_out_here(monkeypatch)
  if form == 'tpu':
    helpers.force_tpu_forms(monkeypatch)
  tx = with_every_k(helpers.adamw())
  closes = (None, False, True, None, None, None, False, False, True)
  ours = runs(tx, with_updates, closes=closes)
  assert_same_runs(ours, runs(tx, plain_with_updates, closes=closes))


def state_bytes(state):
  return [np.asarray(x).tobytes() for x in jax.tree.leaves(state)]


@pytest.mark.parametrize('name', sorted(CASES))
def test_a_tpus_forms_run_here_bit_for_bit(name, monkeypatch):
  """A TPU's forms are compiled by the accelerator tier, never run: the
  window restarted where it closes (``_window.restarted_if``), the
  emitting trip in a ``cond`` (``_closing.BRANCHED_ON``), the host's
  close written out (``_closing.WRITTEN_OUT_ON``), ``update_and_apply``
  applying the updates in the device's closing trip (``_applied``). Run
  here in their place, ``update_and_apply`` is ``tx.update`` then
  ``optax.apply_updates`` bit for bit (the updates it returns too), and
  the parameters are this platform's forms', bit for bit, though the
  states differ (the sums zeroed where a window closes, not at the next
  one's first micro-step)."""
  make, dtype, nan_at = CASES[name]
  tx = make()
  here = runs(tx, plain, dtype, nan_at)
  helpers.force_tpu_forms(monkeypatch)
  ours = runs(tx, with_updates, dtype, nan_at)
  assert_same_runs(ours, runs(tx, plain_with_updates, dtype, nan_at))
  for i, (found, expected) in enumerate(zip(ours, here)):
    helpers.assert_same_bits(found[0], expected[0], f'params after call {i}')
  assert any(
    state_bytes(found[1]) != state_bytes(expected[1])
    for found, expected in zip(ours, here)
  ), "the forms forced are this platform's"


def open_step_program(apply):
  tx = with_every_k(helpers.adamw())
  params = jax.tree.map(jnp.asarray, helpers.init_params())

  @functools.partial(jax.jit, donate_argnums=(0, 1))
  def step(params, state, batch):
    grads = jax.grad(helpers.loss_sum)(params, batch)
    return apply(tx, grads, state, params, num_tokens=5)

  batch = helpers.micro_batch(0, 5)
  text = hlo.compiled_text(step, params, tx.init(params), batch)
  return hlo.parse_hlo(text)


def test_an_open_micro_step_adds_nothing_to_the_parameters():
  """Outside the loop's trip nothing adds to the parameters (the gradient
  alone reads them); with ``optax.apply_updates`` an add does on every
  call (the check can fail)."""
  ours = hlo.first_uses(open_step_program(tokacc.update_and_apply), 'params')
  theirs = hlo.first_uses(open_step_program(plain), 'params')
  assert all('add' not in found for found in ours.values()), ours
  assert any('add' in found for found in theirs.values()), theirs


@pytest.mark.parametrize('tx', [None, optax.sgd, 'adamw'])
def test_a_tx_that_is_not_a_transformation_is_refused(tx):
  params = {'w': jnp.zeros(2)}
  with pytest.raises(TypeError, match=r'update_and_apply\(tx, ...\): tx must'):
    tokacc.update_and_apply(tx, params, (), params, num_tokens=1)
