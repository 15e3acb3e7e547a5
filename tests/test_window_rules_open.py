"""The rules of the window that issue 22 found open, as decided and
written in "Rules of the window" (docs/getting_started.md).

1. A micro-batch that adds to the window must bring its loss, else
   ``window_loss`` is NaN. Under ``'mean'`` a micro-batch of no tokens adds
   nothing (its NaN or missing loss is ignored); a rejected micro-batch adds
   nothing; under ``'sum'`` one of no tokens adds its gradients and loss as
   given.
2. An invalid count with ``tokens_per_update``: the device's tokens in that
   window count 0 toward the budget, the window closes by the same rule on
   every device, and is dropped.
3. The count of a rejected micro-batch is ignored even if invalid;
   ``with_input_checks`` still reports it.
5. bf16 parameters with ``optax.inject_hyperparams``: optax casts the
   hyperparameters to bf16 (``b2 = 0.999`` becomes 1.0) unless
   ``hyperparam_dtype=jnp.float32``.

Gradients and losses are given directly, small numbers whose float32 sums
are exact; references are written plainly here.
"""

import chex
import jax
from jax.experimental import checkify
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import test_boundaries as boundaries

import optax_tokacc as tokacc

# Sums of small numbers exact in float32, one rounded division by the count
# (see test_boundaries).
DIVISION_RTOL = boundaries.DIVISION_RTOL
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
    tokacc.window_loss(state), expected, rtol=DIVISION_RTOL
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
  np.testing.assert_allclose(updates['w'], expected, rtol=DIVISION_RTOL)
  np.testing.assert_allclose(
    tokacc.window_loss(state), (2 * 4.0 + 3 * 6.0) / 5, rtol=DIVISION_RTOL
  )
  assert int(state.last_tokens) == 5


def test_sum_micro_batch_of_no_tokens_adds_what_it_brings():
  """``'sum'``: a micro-batch of no tokens adds its gradients and loss as
  given; without its loss the window's loss is NaN."""
  counts = [2, 0, 3]
  updates, state = window(counts, GRADS, [4.0, 2.5, 6.0])[-1]
  expected = -np.sum(GRADS, axis=0) / 5
  np.testing.assert_allclose(updates['w'], expected, rtol=DIVISION_RTOL)
  np.testing.assert_allclose(
    tokacc.window_loss(state), (4.0 + 2.5 + 6.0) / 5, rtol=DIVISION_RTOL
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
  np.testing.assert_allclose(updates['w'], expected, rtol=DIVISION_RTOL)
  np.testing.assert_allclose(
    tokacc.window_loss(state), (4.0 + 6.0) / 5, rtol=DIVISION_RTOL
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
    updates['w'], -np.array(grads[5]) / 10, rtol=DIVISION_RTOL
  )


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
  device 2's 5 would), and is dropped on every device."""
  counts = [[2, 3, -1, 4], [3, 3, 5, 2], [1, 1, 1, 1]]
  assert reference_budget_close(counts, 20, 8) == 3
  tx = tokacc.token_weighted_multistep(
    optax.sgd(1.0), 8, axis_name='data', tokens_per_update=20
  )
  history = boundaries.pmap_counts(tx, counts, every_device=True)
  for step, (updates, state) in enumerate(history, start=1):
    np.testing.assert_array_equal(state.dropped_windows, int(step == 3))
    np.testing.assert_array_equal(state.mini_step, step % 3)
    np.testing.assert_array_equal(state.gradient_step, 0)
    assert np.all(np.signbit(updates['w'])) and not np.any(updates['w'])


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
  np.testing.assert_allclose(updates['w'], expected, rtol=DIVISION_RTOL)
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
