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
"""The sharding patterns of ``collectives.py``: :data:`PATTERNS`, name ->
title and step builder (``benchmarks/README.md`` describes each).

A builder ``(devices, k, params) -> Setup`` lays the pattern's mesh over
``devices`` and returns the jitted step ``(params, state, batch) ->
(params, state)`` (parameters and state donated) of the small MLP of
``models.py``, the parameters and optimizer state laid out on its mesh
(from ``tokacc.state_partition_specs`` and ``tokacc.init_sharded``, or
``tx.init`` under explicit sharding; none written by hand), and the
sharding of a micro-batch.

The explicit patterns are written as a user would: plain ``jax.jit`` and
``jax.value_and_grad`` under ``jax.set_mesh``, no ``shard_map`` and no
``axis_name``. Parameters typed *reduced* over the data axes give
*unreduced* gradients, which the accumulator keeps until the window closes.
"""

from collections.abc import Callable
import contextlib
import dataclasses
import functools
from typing import Any, NamedTuple

import jax
from jax import lax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
import optax

from benchmarks import models
import optax_tokacc as tokacc

LEARNING_RATE = 1e-3
AUTO = jax.sharding.AxisType.Auto
EXPLICIT = jax.sharding.AxisType.Explicit
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


def adamw():
  return optax.adamw(LEARNING_RATE)


def _put(tree, mesh, specs=None):
  if specs is None:
    specs = jax.tree.map(lambda _: P(), tree)
  return jax.device_put(
    tree, jax.tree.map(lambda s: NamedSharding(mesh, s), specs)
  )


def _varying(params, axes):
  """Parameters marked varying over ``axes``: autodiff then leaves the
  gradients per device instead of summing them on every micro-step."""
  return jax.tree.map(lambda p: lax.pcast(p, axes, to='varying'), params)


def _row_constrained_loss(spec, mesh):
  """The small MLP's loss with its activations' rows (batch) constrained to
  ``spec`` on ``mesh`` (on the abstract mesh inside ``shard_map``), so that
  GSPMD all-gathers the parameters instead of splitting the activations
  (FSDP)."""

  def constrain(x):
    current = jax.sharding.get_abstract_mesh()
    on = mesh if current.empty else current
    return lax.with_sharding_constraint(x, NamedSharding(on, P(spec)))

  return functools.partial(models.small_loss_sum, constrain=constrain)


def _tokacc_step(tx, loss_sum=models.small_loss_sum, vary=None):
  """A user's step: ``(loss, num_tokens)`` and gradients of
  ``loss_sum(params, batch)`` (the parameters marked varying over ``vary``
  first, if given), ``tx.update`` with both, ``optax.apply_updates``."""

  def step(params, state, batch):
    inputs = params if vary is None else _varying(params, vary)
    (loss, num_tokens), grads = jax.value_and_grad(loss_sum, has_aux=True)(
      inputs, batch
    )
    updates, state = tx.update(
      grads, state, params, num_tokens=num_tokens, loss=loss
    )
    return optax.apply_updates(params, updates), state

  return step


def _jit(step):
  return jax.jit(step, donate_argnums=(0, 1))


def _manual(step, mesh, params_spec, state_specs, batch_spec, **kwargs):
  """``step`` jitted over ``jax.shard_map`` on ``mesh``."""
  return _jit(
    jax.shard_map(
      step,
      mesh=mesh,
      in_specs=(params_spec, state_specs, batch_spec),
      out_specs=(params_spec, state_specs),
      **kwargs,
    )
  )


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


def ddp(devices, k, params):
  mesh = data_mesh(devices)
  tx = tokacc.token_weighted_multistep(adamw(), k, axis_name='data')
  specs = tokacc.state_partition_specs(tx, params, axis_name='data')
  step = _manual(_tokacc_step(tx, vary='data'), mesh, P(), specs, P('data'))
  params = _put(params, mesh)
  state = tokacc.init_sharded(tx, params, mesh, axis_name='data')
  return Setup(mesh, step, params, state, P('data'))


def fsdp_gspmd(devices, k, params):
  mesh = data_mesh(devices, 'fsdp')
  tx = tokacc.token_weighted_multistep(adamw(), k)
  step = _tokacc_step(tx, _row_constrained_loss('fsdp', mesh))
  params = _put(params, mesh, FSDP_SPECS)
  state = tokacc.init_sharded(tx, params, mesh, param_specs=FSDP_SPECS)
  return Setup(mesh, _jit(step), params, state, P('fsdp'))


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
  loss_sum = _row_constrained_loss('fsdp', mesh)
  step = _tokacc_step(tx, loss_sum, vary='replica')
  step = _manual(step, mesh, P(), specs, P('replica'), axis_names={'replica'})
  params = _put(params, mesh, FSDP_SPECS)
  state = tokacc.init_sharded(
    tx, params, mesh, param_specs=FSDP_SPECS, axis_name='replica'
  )
  return Setup(mesh, step, params, state, P(('replica', 'fsdp')))


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
    return models.small_loss_sum(full, batch)

  step = _tokacc_step(tx, gathered_loss, vary='replica')
  step = _manual(step, mesh, FSDP_SPECS, specs, P(axes))
  params = _put(params, mesh, FSDP_SPECS)
  state = tokacc.init_sharded(
    tx, params, mesh, param_specs=FSDP_SPECS, axis_name=axes
  )
  return Setup(mesh, step, params, state, P(axes))


def pmean_multisteps(devices, k, params):
  mesh = data_mesh(devices)
  tx = optax.MultiSteps(adamw(), k)

  def step(params, state, batch):
    grads = jax.grad(models.small_loss_mean)(_varying(params, 'data'), batch)
    grads = lax.pmean(grads, 'data')
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  params = _put(params, mesh)
  state = _put(tx.init(params), mesh)
  specs = jax.tree.map(lambda _: P(), state)
  step = _manual(step, mesh, P(), specs, P('data'))
  return Setup(mesh, step, params, state, P('data'))


def sharded_jit(devices, k, params):
  mesh = data_mesh(devices)
  tx = tokacc.token_weighted_multistep(adamw(), k)
  params = _put(params, mesh)
  state = tokacc.init_sharded(tx, params, mesh)
  step = _tokacc_step(tx)
  return Setup(mesh, _jit(step), params, state, P('data'))


def _explicit_loss_sum(params, batch, axes):
  """``models.small_loss_sum`` on parameters typed reduced over the
  batch's mesh ``axes`` (or replicated): ``(loss, count)`` left unreduced
  (partial sums per device: no collective in the forward pass). The bias
  is broadcast to the rows and resharded like them before it is added (a
  reduced array cannot meet a sharded one; a ``jax.reshard(b, P())``
  would all-reduce its gradient on every micro-step)."""
  rows = batch['x'].shape[0]
  hidden = batch['x'] @ params['w1']
  bias = jnp.broadcast_to(params['b1'], (rows, params['b1'].shape[0]))
  hidden = jnp.tanh(hidden + jax.reshard(bias, P(axes, None)))
  error = hidden @ params['w2'] - batch['y']
  partial = P(unreduced=set(axes))
  # One einsum: a jnp.sum(..., axis=-1) first leaves XLA's partitioner a
  # 4-byte all-reduce of its zero init value per micro-step (jax 0.10.2).
  loss = jnp.einsum(
    'rk,rk,r->', error, error, batch['mask'], out_sharding=partial
  )
  count = jnp.einsum(
    'r->', batch['mask'].astype(jnp.int32), out_sharding=partial
  )
  return loss, count


def _explicit(mesh, k, params, first=None, reduced=(), gather=(), zero1=()):
  """The explicit step on ``mesh``: each parameter placed with spec
  ``P(first, None..., reduced=reduced)``, resharded to ``P(reduced=
  gather)`` in the forward pass if ``gather`` (an all-gather of a shard;
  autodiff reduce-scatters back), ``inner``'s state sharded over
  ``zero1`` (the distributed optimizer) if given."""
  axes = tuple(mesh.axis_names)
  tx = tokacc.token_weighted_multistep(adamw(), k)

  def forward(params, batch):
    if gather:
      to = P(reduced=set(gather))
      params = jax.tree.map(lambda p: jax.reshard(p, to), params)
    return _explicit_loss_sum(params, batch, axes)

  step = _tokacc_step(tx, forward)
  with jax.set_mesh(mesh):
    params = jax.device_put(
      params,
      {
        name: NamedSharding(
          mesh, P(first, *(None,) * (p.ndim - 1), reduced=set(reduced))
        )
        for name, p in params.items()
      },
    )
    if zero1:
      state = tokacc.init_sharded(tx, params, mesh, shard_optimizer_over=zero1)
    else:
      state = tx.init(params)
  return Setup(mesh, _jit(step), params, state, P(axes), explicit=True)


def explicit_replicated(devices, k, params):
  """Parameters ``P()`` on an explicit ``data`` mesh (the baseline)."""
  return _explicit(data_mesh(devices, axis_type=EXPLICIT), k, params)


def explicit_ddp(devices, k, params):
  """Parameters typed reduced over ``data``."""
  mesh = data_mesh(devices, axis_type=EXPLICIT)
  return _explicit(mesh, k, params, reduced=('data',))


def explicit_zero1(devices, k, params):
  """Explicit DDP with AdamW's moments sharded over ``data`` (ZeRO-1)."""
  mesh = data_mesh(devices, axis_type=EXPLICIT)
  return _explicit(mesh, k, params, reduced=('data',), zero1=('data',))


def explicit_fsdp(devices, k, params):
  """Parameters sharded over ``fsdp``, gathered in the forward pass."""
  mesh = data_mesh(devices, 'fsdp', axis_type=EXPLICIT)
  return _explicit(mesh, k, params, first='fsdp', gather=('fsdp',))


def explicit_hsdp(devices, k, params):
  """Shards over ``fsdp`` typed reduced over ``replica``."""
  mesh = hybrid_mesh(devices, axis_type=EXPLICIT)
  return _explicit(
    mesh,
    k,
    params,
    first='fsdp',
    reduced=('replica',),
    gather=('replica', 'fsdp'),
  )


class Pattern(NamedTuple):
  """A sharding pattern: its title in tables and JSON, and its step.

  Attributes:
    title: the row's name (the JSON's ``pattern``).
    build: ``(devices, k, params) -> Setup``.
    exact: whether it should equal full-batch training.
    hybrid: whether it needs a ``replica x fsdp`` mesh (an even number >= 4
      of devices; left out otherwise).
  """

  title: str
  build: Callable[..., Setup]
  exact: bool = True
  hybrid: bool = False


PATTERNS = {
  'ddp': Pattern('DDP', ddp),
  'fsdp_gspmd': Pattern('FSDP (GSPMD)', fsdp_gspmd),
  'hsdp_partial_manual': Pattern(
    'HSDP partial-manual', hsdp_partial_manual, hybrid=True
  ),
  'hsdp_fully_manual': Pattern(
    'HSDP fully manual', hsdp_fully_manual, hybrid=True
  ),
  'pmean_multisteps': Pattern(
    'pmean + MultiSteps', pmean_multisteps, exact=False
  ),
  'sharded_jit': Pattern('sharded jit', sharded_jit),
  'explicit_replicated': Pattern('explicit replicated', explicit_replicated),
  'explicit_ddp': Pattern('explicit DDP', explicit_ddp),
  'explicit_zero1': Pattern('explicit ZeRO-1', explicit_zero1),
  'explicit_fsdp': Pattern('explicit FSDP', explicit_fsdp),
  'explicit_hsdp': Pattern('explicit HSDP', explicit_hsdp, hybrid=True),
}
