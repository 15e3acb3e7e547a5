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
"""Resume anywhere (issue 40): a checkpoint saved on N devices restores, with
orbax, onto M devices, at a window boundary and mid-window, in every layout,
and training then equals full-batch training within round-off (the order of
summation changes); on the same number of devices, bit for bit. What cannot
be exact is refused, never silently wrong.

The global micro-batch is the same whatever the number of devices (8
sequences, split over the devices of the data axes), so the windows are the
same full batches on N and on M devices; the reference is plain optax on one
device, with the round-off bound of ``multihost_worker.full_batch_with_bounds``.
"""

import functools
from typing import Any, Callable, NamedTuple

import chex
import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
import multihost_worker as harness
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
import test_explicit

import optax_tokacc as tokacc
from optax_tokacc import _explicit

# A hang (devices in different branches of a collective) fails the test
# instead of stalling the run; the longest test here, a new process
# included, takes about 30 s on a quiet 2-core machine.
pytestmark = pytest.mark.timeout(300)

K = 4
WINDOW_SIZES = (K, K, K)
DEVICES_PER_BATCH = 4  # the global micro-batch: 4 x SEQS sequences
AUTO = jax.sharding.AxisType.Auto
BOUNDARY, MID_WINDOW = K, K + 2  # micro-steps before the checkpoint


def sgd():
  return optax.sgd(harness.LEARNING_RATE, momentum=0.9)


def make_tx(variant='plain', axis_name=None):
  options = {}
  if variant == 'compensated_skip':
    options = dict(
      compensated=True, should_skip_update_fn=tokacc.skip_not_finite
    )
  return tokacc.token_weighted_multistep(
    sgd(), K, axis_name=axis_name, **options
  )


def micro_batches():
  windows = harness.make_windows(WINDOW_SIZES, DEVICES_PER_BATCH)
  return [batch for window in windows for batch in window], windows


class Run(NamedTuple):
  """One layout on ``n`` devices: the parameters and state it starts from,
  its jitted step ``(params, state, batch) -> (params, state)``, how it
  places a global micro-batch, and host copies of its parameters."""

  params: Any
  state: Any
  step: Callable
  place: Callable
  host: Callable
  mesh: Any = None
  # pmap holds the parameters stacked per device: the checkpoint has one
  # copy (as flax's unreplicate), stacked again on restore
  unstack: Callable = lambda params: params
  stack: Callable = lambda params: params


def _mesh(n, names=('data',), shape=None, explicit=False):
  types = (jax.sharding.AxisType.Explicit if explicit else AUTO,) * len(names)
  return jax.make_mesh(
    shape or (n,), names, axis_types=types, devices=jax.devices()[:n]
  )


def _shard_map_run(n, variant, mark_varying=True):
  mesh = _mesh(n)
  tx = make_tx(variant, 'data')
  params = harness.init_params()
  with_emit_now = False
  state = harness.shard_map_state(tx, params, mesh, 'data')
  step = harness.shard_map_step(
    tx, mesh, 'data', state, with_emit_now, mark_varying
  )
  replicated = NamedSharding(mesh, P())
  data = NamedSharding(mesh, P('data'))
  return Run(
    jax.tree.map(lambda x: harness.put(x, replicated), params),
    state,
    step,
    lambda batch: jax.tree.map(lambda x: harness.put(x, data), batch),
    harness.fetch,
    mesh,
  )


def _pmap_run(n, variant):
  tx = make_tx(variant, 'data')
  devices = jax.devices()[:n]
  params = jax.tree.map(
    lambda x: np.broadcast_to(x, (n, *np.shape(x))), harness.init_params()
  )
  state = jax.pmap(tx.init, devices=devices)(params)

  def local_step(params, state, batch):
    loss, grads = jax.value_and_grad(harness.loss_sum)(params, batch)
    updates, state = tx.update(
      grads, state, params, num_tokens=harness.token_count(batch), loss=loss
    )
    return optax.apply_updates(params, updates), state

  step = jax.pmap(local_step, axis_name='data', devices=devices)

  def place(batch):
    return jax.tree.map(lambda x: x.reshape(n, -1, *x.shape[1:]), batch)

  def stack(params):
    return jax.tree.map(
      lambda x: np.broadcast_to(np.asarray(x), (n, *x.shape)), params
    )

  return Run(
    params,
    state,
    step,
    place,
    lambda p: jax.tree.map(lambda x: x[0], harness.fetch(p)),
    unstack=lambda params: jax.tree.map(lambda x: x[0], params),
    stack=stack,
  )


def _jit_run(n, variant, mesh, param_specs, data_axes, shard_over=None):
  """``jax.jit`` over global arrays (GSPMD or explicit types)."""
  tx = make_tx(variant)
  step = test_explicit.make_step(tx)
  with jax.set_mesh(mesh):
    params = test_explicit.place_params(
      harness.init_params(), mesh, param_specs
    )
    if shard_over is None:
      state = tx.init(params)
    else:
      state = tokacc.init_sharded(
        tx, params, mesh, shard_optimizer_over=shard_over
      )
  data = NamedSharding(mesh, P(data_axes))

  def host(params):
    return harness.fetch(tokacc.to_checkpoint(params))

  return Run(
    params,
    state,
    lambda p, s, b: step(p, s, b, jnp.asarray(False)),
    lambda batch: jax.tree.map(lambda x: jax.device_put(x, data), batch),
    host,
    mesh,
  )


def _hsdp_shape(n):
  return {4: (2, 2), 2: (2, 1), 1: (1, 1)}[n]


LAYOUTS = {
  'pmap': _pmap_run,
  'shard_map': _shard_map_run,
  # gradients of replicated parameters, summed by autodiff (Manual.share)
  'shard_map_summed': functools.partial(_shard_map_run, mark_varying=False),
  'gspmd': lambda n, variant: _jit_run(
    n, variant, _mesh(n), {'w': P('data'), 'v': P('data')}, 'data'
  ),
  'explicit_ddp': lambda n, variant: _jit_run(
    n, variant, _mesh(n, explicit=True), _reduced('data'), 'data'
  ),
  'explicit_fsdp': lambda n, variant: _jit_run(
    n,
    variant,
    _mesh(n, explicit=True),
    {'w': P('data'), 'v': P('data')},
    'data',
  ),  # fmt: skip
  'explicit_hsdp': lambda n, variant: _jit_run(
    n,
    variant,
    _mesh(n, ('replica', 'fsdp'), _hsdp_shape(n), explicit=True),
    {'w': P('fsdp', reduced={'replica'}), 'v': P('fsdp', reduced={'replica'})},
    ('replica', 'fsdp'),
  ),  # fmt: skip
  'zero1': lambda n, variant: _jit_run(
    n, variant, _mesh(n, explicit=True), _reduced('data'), 'data', ('data',)
  ),
}
EXPLICIT = ('explicit_ddp', 'explicit_fsdp', 'explicit_hsdp', 'zero1')


def _reduced(axis):
  return {'w': P(reduced={axis}), 'v': P(reduced={axis})}


def _skip_unsupported(layout, n):
  if layout in EXPLICIT and not _explicit.SUPPORTED:
    pytest.skip('explicit sharding needs jax >= 0.10')
  if layout == 'zero1' and n == 1:
    pytest.skip('no data devices to shard the optimizer over')


def _mesh_context(run):
  return jax.set_mesh(run.mesh) if run.mesh is not None else _nothing()


class _nothing:
  def __enter__(self):
    return self

  def __exit__(self, *args):
    return False


def train(run, params, state, batches):
  with _mesh_context(run):
    for batch in batches:
      params, state = run.step(params, state, run.place(batch))
  return params, state


def save(path, tree):
  checkpointer = ocp.StandardCheckpointer()
  checkpointer.save(path, tokacc.to_checkpoint(tree))
  checkpointer.wait_until_finished()


def restore(path, run, strict=True):
  """The documented flow: a target from the checkpoint's metadata and the
  state made on the devices at hand."""
  checkpointer = ocp.StandardCheckpointer()
  like = (run.unstack(run.params), run.state)
  with _mesh_context(run):
    target = tokacc.checkpoint_target(like, checkpointer.metadata(path))
    restored = checkpointer.restore(path, target)
    return tokacc.from_checkpoint(restored, like)


@functools.cache
def reference():
  """Plain optax on one device, on the windows' full batches."""
  _, windows = micro_batches()
  return harness.full_batch_with_bounds(sgd(), harness.init_params(), windows)


def resume(tmp_path, layout, saved_on, restored_on, stop, variant='plain'):
  """Trains ``stop`` micro-steps on ``saved_on`` devices, checkpoints, and
  finishes on ``restored_on``: the final host parameters and state."""
  for n in (saved_on, restored_on):
    _skip_unsupported(layout, n)
  batches, _ = micro_batches()
  first = LAYOUTS[layout](saved_on, variant)
  params, state = train(first, first.params, first.state, batches[:stop])
  save(tmp_path / 'ckpt', (first.unstack(params), state))
  second = LAYOUTS[layout](restored_on, variant)
  params, state = restore(tmp_path / 'ckpt', second)
  params = second.stack(params)
  params, state = train(second, params, state, batches[stop:])
  return second.host(params), state


PAIRS = [(4, 2), (4, 1), (2, 4), (1, 4)]
FAST = {
  ('explicit_ddp', (4, 2), MID_WINDOW),
  ('shard_map_summed', (4, 2), MID_WINDOW),
}


def _cases():
  for layout in LAYOUTS:
    for pair in PAIRS:
      for stop in (BOUNDARY, MID_WINDOW):
        marks = () if (layout, pair, stop) in FAST else (pytest.mark.slow,)
        name = (
          f'{layout}-{pair[0]}to{pair[1]}-{"mid" if stop != K else "boundary"}'
        )
        yield pytest.param(layout, pair, stop, marks=marks, id=name)


@pytest.mark.parametrize("layout, pair, stop", list(_cases()))
def test_resumed_on_another_device_count_equals_full_batch(
  tmp_path, layout, pair, stop
):
  if layout == 'shard_map_summed':
    context = pytest.warns(UserWarning, match='already summed')
  else:
    context = _nothing()
  with context:
    params, state = resume(tmp_path, layout, *pair, stop)
  expected = reference()
  chex.assert_trees_all_close(
    params,
    jax.tree.map(np.asarray, expected.params),
    rtol=0,
    atol=expected.atol,
  )
  assert int(np.ravel(np.asarray(state.gradient_step))[0]) == len(WINDOW_SIZES)
