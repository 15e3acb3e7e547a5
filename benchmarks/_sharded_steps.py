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
"""The training steps of ``collectives.py`` with ``shard_map`` or GSPMD.

Each builder ``(devices, k, params) -> Setup`` lays the pattern's mesh over
``devices`` and returns a :class:`Setup`: the jitted step ``(params, state,
batch) -> (params, state)`` (parameters and state donated), the global
parameters and optimizer state laid out on its mesh (state layouts from
``tokacc.state_partition_specs`` and ``tokacc.init_sharded``, none written
by hand), and the sharding of a micro-batch. The explicit-sharding patterns
are in ``_explicit_steps.py``; the model, data and reference are here.
"""

from collections.abc import Callable
import contextlib
import dataclasses
import functools
from typing import Any

import jax
from jax import lax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
import numpy as np
import optax

import optax_tokacc as tokacc

WIDTH = 64
OUTPUTS = 8
ROWS_PER_DEVICE = 4
LEARNING_RATE = 1e-3
AUTO = jax.sharding.AxisType.Auto
# FSDP: every parameter sharded along its first dimension.
FSDP_SPECS = {'w1': P('fsdp', None), 'b1': P('fsdp'), 'w2': P('fsdp', None)}


@dataclasses.dataclass
class Setup:
  """A pattern's step and what it trains, laid out on its mesh.

  Attributes:
    mesh: the mesh.
    step: ``(params, state, batch) -> (params, state)``, jitted, parameters
      and state donated.
    params: the parameters, placed.
    state: the optimizer state, placed.
    batch_spec: the partition spec of a micro-batch's rows.
    explicit: whether the mesh's axes are explicit: the step is then traced
      and called under ``jax.set_mesh(mesh)``, as a user's would be.
  """

  mesh: jax.sharding.Mesh
  step: Callable[..., Any]
  params: Any
  state: Any
  batch_spec: P
  explicit: bool = False

  @property
  def mesh_axes(self):
    return tuple(self.mesh.shape.items())

  def mesh_context(self):
    """``jax.set_mesh(mesh)`` for an explicit mesh, else no context."""
    if self.explicit:
      return jax.set_mesh(self.mesh)
    return contextlib.nullcontext()


def init_params(seed=0):
  rng = np.random.default_rng(seed)
  return {
    'w1': rng.normal(size=(WIDTH, WIDTH)).astype(np.float32) / 8,
    'b1': np.zeros((WIDTH,), np.float32),
    'w2': rng.normal(size=(WIDTH, OUTPUTS)).astype(np.float32) / 8,
  }


def make_windows(num_devices, k, num_windows=2, seed=1):
  """Windows of ``k`` micro-batches, ``ROWS_PER_DEVICE`` rows per device,
  about 80% of the rows counted (at least one per micro-batch)."""
  rng = np.random.default_rng(seed)
  rows = ROWS_PER_DEVICE * num_devices

  def micro_batch():
    mask = (rng.random(rows) < 0.8).astype(np.float32)
    mask[0] = 1.0
    return {
      'x': rng.normal(size=(rows, WIDTH)).astype(np.float32),
      'y': rng.normal(size=(rows, OUTPUTS)).astype(np.float32),
      'mask': mask,
    }

  return [[micro_batch() for _ in range(k)] for _ in range(num_windows)]


def loss_sum(params, batch, constrain=lambda x: x):
  """Squared error summed over the counted rows, and their count."""
  hidden = jnp.tanh(constrain(batch['x'] @ params['w1'] + params['b1']))
  error = constrain(hidden @ params['w2']) - batch['y']
  loss = jnp.sum(jnp.sum(error**2, axis=-1) * batch['mask'])
  return loss, jnp.sum(batch['mask']).astype(jnp.int32)


def loss_mean(params, batch):
  loss, num_tokens = loss_sum(params, batch)
  return loss / jnp.maximum(num_tokens, 1)


def adamw():
  return optax.adamw(LEARNING_RATE)


def reference(params, windows):
  """Single-device full-batch AdamW on each window's token-mean loss."""
  optimizer = adamw()

  @jax.jit
  def step(params, opt_state, batch):
    grads, num_tokens = jax.grad(loss_sum, has_aux=True)(params, batch)
    grads = jax.tree.map(lambda g: g / num_tokens, grads)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state

  params = jax.tree.map(jnp.asarray, params)
  opt_state = optimizer.init(params)
  for window in windows:
    batch = jax.tree.map(lambda *xs: np.concatenate(xs), *window)
    params, opt_state = step(params, opt_state, batch)
  return params


def put(tree, mesh, specs=None):
  if specs is None:
    specs = jax.tree.map(lambda _: P(), tree)
  return jax.device_put(
    tree, jax.tree.map(lambda s: NamedSharding(mesh, s), specs)
  )


def _varying(params, axes):
  """Parameters marked varying over ``axes``: autodiff then leaves the
  gradients per device instead of summing them on every micro-step."""
  return jax.tree.map(lambda p: lax.pcast(p, axes, to='varying'), params)


def _constrain_rows(spec, mesh):
  """Constrains an activation's rows (batch) to ``spec`` on ``mesh`` (on
  the abstract mesh inside ``shard_map``), so that GSPMD all-gathers the
  parameters instead of splitting the activations (FSDP)."""

  def constrain(x):
    current = jax.sharding.get_abstract_mesh()
    on = mesh if current.empty else current
    return lax.with_sharding_constraint(x, NamedSharding(on, P(spec)))

  return constrain


def tokacc_update(tx, grads, state, params, loss, num_tokens):
  updates, state = tx.update(
    grads, state, params, num_tokens=num_tokens, loss=loss
  )
  return optax.apply_updates(params, updates), state


def ddp(devices, k, params):
  mesh = data_mesh(devices)
  tx = tokacc.token_weighted_multistep(adamw(), k, axis_name='data')
  specs = tokacc.state_partition_specs(tx, params, axis_name='data')

  def step(params, state, batch):
    (loss, num_tokens), grads = _value_and_grad(loss_sum)(
      _varying(params, 'data'), batch
    )
    return tokacc_update(tx, grads, state, params, loss, num_tokens)

  step = jax.shard_map(
    step,
    mesh=mesh,
    in_specs=(P(), specs, P('data')),
    out_specs=(P(), specs),
  )
  params = put(params, mesh)
  state = tokacc.init_sharded(tx, params, mesh, axis_name='data')
  return Setup(mesh, jit_donated(step), params, state, P('data'))


def jit_donated(step):
  return jax.jit(step, donate_argnums=(0, 1))


def _value_and_grad(fn):
  """``((loss, num_tokens), grads)`` of ``fn(params, batch)``."""
  return jax.value_and_grad(fn, has_aux=True)


def fsdp_gspmd(devices, k, params):
  mesh = data_mesh(devices, 'fsdp')
  tx = tokacc.token_weighted_multistep(adamw(), k)
  constrain = _constrain_rows('fsdp', mesh)

  def step(params, state, batch):
    (loss, num_tokens), grads = _value_and_grad(
      functools.partial(loss_sum, constrain=constrain)
    )(params, batch)
    return tokacc_update(tx, grads, state, params, loss, num_tokens)

  params = put(params, mesh, FSDP_SPECS)
  state = tokacc.init_sharded(tx, params, mesh, param_specs=FSDP_SPECS)
  return Setup(mesh, jit_donated(step), params, state, P('fsdp'))


def data_mesh(devices, axis='data', axis_type=AUTO):
  """A 1-D mesh over ``devices``."""
  return jax.make_mesh(
    (len(devices),), (axis,), axis_types=(axis_type,), devices=devices
  )


def hybrid_mesh(devices, axis_type=AUTO):
  """A ``replica=2 x fsdp=G/2`` mesh over ``devices``."""
  if len(devices) < 4 or len(devices) % 2:
    raise ValueError('HSDP needs an even number >= 4 of devices.')
  return jax.make_mesh(
    (2, len(devices) // 2),
    ('replica', 'fsdp'),
    axis_types=(axis_type, axis_type),
    devices=devices,
  )


def hsdp_partial_manual(devices, k, params):
  """``shard_map`` manual over ``replica``; ``fsdp`` left to GSPMD."""
  mesh = hybrid_mesh(devices)
  tx = tokacc.token_weighted_multistep(adamw(), k, axis_name='replica')
  # Only the manual axis appears in shard_map's specs (manual_axes drops
  # fsdp); the arrays carry the full layout from init_sharded.
  specs = tokacc.state_partition_specs(
    tx,
    params,
    param_specs=FSDP_SPECS,
    axis_name='replica',
    manual_axes=('replica',),
  )
  constrain = _constrain_rows('fsdp', mesh)

  def step(params, state, batch):
    (loss, num_tokens), grads = _value_and_grad(
      functools.partial(loss_sum, constrain=constrain)
    )(_varying(params, 'replica'), batch)
    return tokacc_update(tx, grads, state, params, loss, num_tokens)

  step = jax.shard_map(
    step,
    mesh=mesh,
    in_specs=(P(), specs, P('replica')),
    out_specs=(P(), specs),
    axis_names={'replica'},
  )
  params = put(params, mesh, FSDP_SPECS)
  state = tokacc.init_sharded(
    tx, params, mesh, param_specs=FSDP_SPECS, axis_name='replica'
  )
  return Setup(mesh, jit_donated(step), params, state, P(('replica', 'fsdp')))


def hsdp_fully_manual(devices, k, params):
  """``shard_map`` over both axes; parameter shards gathered over ``fsdp``
  in the forward pass, so autodiff reduce-scatters their gradients."""
  mesh = hybrid_mesh(devices)
  axes = ('replica', 'fsdp')
  tx = tokacc.token_weighted_multistep(adamw(), k, axis_name=axes)
  specs = tokacc.state_partition_specs(
    tx, params, param_specs=FSDP_SPECS, axis_name=axes
  )

  def gathered_loss(shards, batch):
    full = jax.tree.map(
      lambda p: lax.all_gather(p, 'fsdp', axis=0, tiled=True), shards
    )
    return loss_sum(full, batch)

  def step(params, state, batch):
    (loss, num_tokens), grads = _value_and_grad(gathered_loss)(
      _varying(params, 'replica'), batch
    )
    return tokacc_update(tx, grads, state, params, loss, num_tokens)

  step = jax.shard_map(
    step,
    mesh=mesh,
    in_specs=(FSDP_SPECS, specs, P(axes)),
    out_specs=(FSDP_SPECS, specs),
  )
  params = put(params, mesh, FSDP_SPECS)
  state = tokacc.init_sharded(
    tx, params, mesh, param_specs=FSDP_SPECS, axis_name=axes
  )
  return Setup(mesh, jit_donated(step), params, state, P(axes))


def pmean_multisteps(devices, k, params):
  mesh = data_mesh(devices)
  tx = optax.MultiSteps(adamw(), k)

  def step(params, state, batch):
    grads = jax.grad(loss_mean)(_varying(params, 'data'), batch)
    grads = lax.pmean(grads, 'data')
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  params = put(params, mesh)
  state = put(tx.init(params), mesh)
  specs = jax.tree.map(lambda _: P(), state)
  step = jax.shard_map(
    step,
    mesh=mesh,
    in_specs=(P(), specs, P('data')),
    out_specs=(P(), specs),
  )
  return Setup(mesh, jit_donated(step), params, state, P('data'))


def sharded_jit(devices, k, params):
  mesh = data_mesh(devices)
  tx = tokacc.token_weighted_multistep(adamw(), k)

  def step(params, state, batch):
    (loss, num_tokens), grads = _value_and_grad(loss_sum)(params, batch)
    return tokacc_update(tx, grads, state, params, loss, num_tokens)

  params = put(params, mesh)
  state = tokacc.init_sharded(tx, params, mesh)
  return Setup(mesh, jit_donated(step), params, state, P('data'))


def optimizer_bytes_per_device(state):
  """Bytes of the inner optimizer's state (AdamW's moments and counter)
  held by one device."""
  if isinstance(state, optax.MultiStepsState):
    inner = state.inner_opt_state
  else:
    inner = tokacc.find_state(state).inner_state
  return sum(
    leaf.addressable_shards[0].data.nbytes for leaf in jax.tree.leaves(inner)
  )


def accumulator_bytes_per_device(state):
  """Bytes of the gradient accumulator held by one device."""
  if isinstance(state, optax.MultiStepsState):
    acc = state.acc_grads
  else:
    acc = tokacc.find_state(state).grad_sums
  return sum(
    leaf.addressable_shards[0].data.nbytes for leaf in jax.tree.leaves(acc)
  )
