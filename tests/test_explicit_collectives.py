"""Explicit sharding with ``loss=``: a micro-step issues no collective.

DDP under plain ``jax.jit`` on a 4-device ``('data',)`` mesh with explicit
axes: the parameters are typed ``P(reduced={'data'})``, so their gradients
come unreduced (each device's partial sum). The loss is a partial sum
written as issue 22 writes it, the squared error summed over the outputs
with ``jnp.sum(..., -1)`` and then an einsum with the mask into
``P(unreduced={'data'})``; the token count is a partial sum too. With
partial sums everywhere, the promise is that a micro-step issues no
collective, whatever reductions the user writes inside the loss.

The compiled step (k = 4, so that a step from ``tx.init`` does not close
the window) is read with the harness's HLO reader: a collective on the
micro-step's path is one outside the closing branch (branch 1 of the
transform's conditional), i.e. on every call or in the branch a micro-step
takes. Controls: the user's loss and gradient compiled alone have no
collective at all, and the step without ``loss=`` has none on the
micro-step's path. The configuration also trains exactly as full-batch SGD
(``helpers.linear_reference``).
"""

import helpers
import hlo
import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
import numpy as np
import optax
import placements
import pytest

import optax_tokacc as tokacc
from optax_tokacc import _typed_sharding

pytestmark = pytest.mark.skipif(
  not _typed_sharding.SUPPORTED,
  reason='reduced/unreduced types need jax >= 0.10',
)

K = 4
WINDOW_SIZES = (K, K, K)
NUM_DEVICES = 4
OUTPUTS = 2
LEARNING_RATE = 0.05
PARTIAL = placements.U_DATA  # P(unreduced={'data'}): per-device sums


def linear_params():
  """The linear model with two outputs per token, no bias (``helpers``)."""
  return helpers.linear_params(OUTPUTS, seed=11, bias=False)


def partial_loss_sum(params, batch):
  """``helpers.linear_loss_sum`` as issue 22 writes it: the squared error
  summed over the outputs, then over the counted tokens into a partial sum
  per device."""
  error = batch['x'] @ params['w'] - batch['y']
  per_token = jnp.sum(error**2, axis=-1)
  return jnp.einsum('bt,bt->', per_token, batch['mask'], out_sharding=PARTIAL)


def token_count(batch):
  return jnp.einsum('bt->', batch['mask'], out_sharding=PARTIAL)


def make_step(tx, with_loss):
  @jax.jit
  def step(params, state, batch):
    loss, grads = jax.value_and_grad(partial_loss_sum)(params, batch)
    updates, state = tx.update(
      grads,
      state,
      params,
      num_tokens=token_count(batch),
      **({'loss': loss} if with_loss else {}),
    )
    return optax.apply_updates(params, updates), state

  return step


def make_windows(window_sizes):
  """``helpers.make_windows`` (unequal counts per device and micro-step,
  devices without tokens) with two targets per token."""
  windows = helpers.make_windows(window_sizes, NUM_DEVICES, seed=3)
  return helpers.with_outputs(windows, OUTPUTS, seed=12)


def placed(mesh):
  """The parameters typed reduced over 'data', a placer of batches."""
  data = NamedSharding(mesh, P('data'))
  params = jax.device_put(linear_params(), placements.DDP)
  return params, lambda batch: jax.device_put(batch, data)


def compiled_step_sites(with_loss):
  tx = tokacc.token_weighted_multistep(optax.sgd(LEARNING_RATE), K)
  mesh = placements.explicit_ddp_mesh()
  with jax.set_mesh(mesh):
    params, place = placed(mesh)
    batch = place(make_windows((1,))[0][0])
    step = make_step(tx, with_loss)
    text = step.lower(params, tx.init(params), batch).compile().as_text()
  return hlo.compiled_collectives(text)


def assert_one_reduction_when_closing(sites):
  """The closing branch holds the window's one all-reduce: the gradient,
  with the count (and loss) beside it (so the reader does see the step's
  collectives)."""
  closing = hlo.on_closing_step_only(sites)
  assert [site.collective for site in closing] == ['all-reduce'], closing
  assert ('f32', (helpers.FEATURES, OUTPUTS)) in closing[0].shapes


def test_user_loss_and_grad_alone_issue_no_collective():
  """Control: the loss, its gradient and the count, without the transform,
  are partial sums computed with no collective."""
  mesh = placements.explicit_ddp_mesh()
  with jax.set_mesh(mesh):
    params, place = placed(mesh)
    batch = place(make_windows((1,))[0][0])

    @jax.jit
    def loss_grad_count(params, batch):
      loss, grads = jax.value_and_grad(partial_loss_sum)(params, batch)
      return loss, grads, token_count(batch)

    loss, grads, _ = loss_grad_count(params, batch)
    assert str(jax.typeof(loss)) == 'float32[]{U:data}'
    assert str(jax.typeof(grads['w'])).endswith('{U:data}')
    text = loss_grad_count.lower(params, batch).compile().as_text()
  assert hlo.compiled_collectives(text) == []


def test_micro_step_without_loss_issues_no_collective():
  """Control: without ``loss=``, the micro-step's path holds no
  collective."""
  sites = compiled_step_sites(with_loss=False)
  assert hlo.on_micro_step_path(sites) == []
  assert_one_reduction_when_closing(sites)


def test_micro_step_with_loss_issues_no_collective():
  """With ``loss=`` a partial sum, the micro-step's path holds no collective
  either (0.3 issued an all-reduce of a float32 scalar on every call, from
  the select that reset the window's loss on unreduced values)."""
  sites = compiled_step_sites(with_loss=True)
  assert hlo.on_micro_step_path(sites) == []
  assert_one_reduction_when_closing(sites)


def test_with_loss_equals_full_batch_sgd():
  """The same configuration trains as full-batch SGD on each window's
  token-mean loss, window after window, within the float32 round-off bound
  of ``helpers.linear_reference``; the window loss too."""
  windows = make_windows(WINDOW_SIZES)
  tx = tokacc.token_weighted_multistep(optax.sgd(LEARNING_RATE), K)
  mesh = placements.explicit_ddp_mesh()
  trajectory = []
  with jax.set_mesh(mesh):
    params, place = placed(mesh)
    state = tx.init(params)
    step = make_step(tx, with_loss=True)
    for window in windows:
      for batch in window:
        params, state = step(params, state, place(batch))
      assert bool(tokacc.has_updated(state))
      theta = helpers.linear_theta(placements.plain(params))
      trajectory.append(([theta], np.asarray(tokacc.window_loss(state))))
  expected = helpers.linear_reference(linear_params(), windows, LEARNING_RATE)
  helpers.assert_within_linear_bound(trajectory, expected)
