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
"""The training steps of ``collectives.py`` under explicit sharding.

Plain ``jax.jit`` on an explicit mesh (``jax.make_mesh``'s default), no
``shard_map`` and no ``axis_name``, written as a user would: parameters
placed with their full partition spec, ``state = tx.init(params)`` and every
step traced and called under ``jax.set_mesh(mesh)``, ``jax.value_and_grad``,
``tx.update(grads, state, params, num_tokens=n, loss=l)``,
``optax.apply_updates``. Parameters typed *reduced* over the data axes give
*unreduced* gradients, which the accumulator keeps until the window closes.

- ``explicit_replicated``: parameters ``P()`` on a ``data`` mesh (the
  baseline: replicated gradients, reduced on every micro-step).
- ``explicit_ddp``: parameters ``P(None, None, reduced={'data'})``.
- ``explicit_fsdp``: parameters sharded over ``fsdp`` (first dimension),
  gathered in the forward pass (``jax.reshard`` to ``P(reduced={'fsdp'})``).
- ``explicit_hsdp``: mesh ``replica x fsdp``, parameters
  ``P('fsdp', None, reduced={'replica'})``, the loss computed on
  ``jax.reshard(p, P(reduced={'replica', 'fsdp'}))``.
- ``explicit_zero1``: explicit DDP with the distributed-optimizer (ZeRO-1)
  layout: AdamW's moments sharded over ``data``
  (``tokacc.init_sharded(..., shard_optimizer_over=('data',))``); the
  window closes with a reduce-scatter into the moments' shards and an
  all-gather of the updates.

The loss and the token count are left unreduced (partial sums per device,
``jnp.einsum(..., out_sharding=P(unreduced=...))``): no collective in the
forward pass. The bias is broadcast to the rows and resharded like them
before it is added (a reduced array cannot meet a sharded one; a
``jax.reshard(b, P())`` would all-reduce its gradient on every micro-step).
"""

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from benchmarks import _sharded_steps as steps
import optax_tokacc as tokacc

EXPLICIT = jax.sharding.AxisType.Explicit


def loss_sum(params, batch, axes):
  """``_sharded_steps.loss_sum`` on parameters typed reduced over the
  batch's mesh ``axes`` (or replicated): ``(loss, count)`` unreduced."""
  rows = batch['x'].shape[0]
  row_spec = P(axes, None)
  hidden = batch['x'] @ params['w1']
  bias = jnp.broadcast_to(params['b1'], (rows, params['b1'].shape[0]))
  hidden = jnp.tanh(hidden + jax.reshard(bias, row_spec))
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


def full_spec(ndim, first=None, reduced=()):
  """A parameter's full partition spec: ``first`` for its first dimension,
  its other dimensions replicated, typed reduced over ``reduced``."""
  return P(first, *(None,) * (ndim - 1), reduced=set(reduced))


def gather_to(axes):
  """The forward pass's view of a parameter: resharded to ``P(reduced=
  axes)`` (an all-gather of a shard; autodiff reduce-scatters back)."""
  return lambda p: jax.reshard(p, P(reduced=set(axes)))


def _setup(mesh, k, params, specs, gather=None, shard_optimizer_over=None):
  """The explicit step on ``mesh``, parameters placed with ``specs``;
  ``inner``'s state sharded over ``shard_optimizer_over`` (ZeRO-1) if given."""
  axes = tuple(mesh.axis_names)
  tx = tokacc.token_weighted_multistep(steps.adamw(), k)

  def forward(params, batch):
    if gather is not None:
      params = jax.tree.map(gather, params)
    return loss_sum(params, batch, axes)

  def step(params, state, batch):
    (loss, num_tokens), grads = jax.value_and_grad(forward, has_aux=True)(
      params, batch
    )
    return steps.tokacc_update(tx, grads, state, params, loss, num_tokens)

  with jax.set_mesh(mesh):
    params = jax.device_put(
      params, {name: NamedSharding(mesh, specs[name]) for name in params}
    )
    if shard_optimizer_over is None:
      state = tx.init(params)
    else:
      state = tokacc.init_sharded(
        tx, params, mesh, shard_optimizer_over=shard_optimizer_over
      )
  return steps.Setup(
    mesh, steps.jit_donated(step), params, state, P(axes), explicit=True
  )


def _specs(params, first=None, reduced=()):
  return {
    name: full_spec(value.ndim, first, reduced)
    for name, value in params.items()
  }


def replicated(devices, k, params):
  """Parameters ``P()`` on an explicit ``data`` mesh (the baseline)."""
  mesh = steps.data_mesh(devices, axis_type=EXPLICIT)
  return _setup(mesh, k, params, _specs(params))


def ddp(devices, k, params):
  """Parameters typed reduced over ``data``."""
  mesh = steps.data_mesh(devices, axis_type=EXPLICIT)
  return _setup(mesh, k, params, _specs(params, reduced=('data',)))


def zero1(devices, k, params):
  """Explicit DDP with AdamW's moments sharded over ``data`` (ZeRO-1)."""
  mesh = steps.data_mesh(devices, axis_type=EXPLICIT)
  specs = _specs(params, reduced=('data',))
  return _setup(mesh, k, params, specs, shard_optimizer_over=('data',))


def fsdp(devices, k, params):
  """Parameters sharded over ``fsdp``, gathered in the forward pass."""
  mesh = steps.data_mesh(devices, 'fsdp', axis_type=EXPLICIT)
  specs = _specs(params, first='fsdp')
  return _setup(mesh, k, params, specs, gather_to(('fsdp',)))


def hsdp(devices, k, params):
  """Shards over ``fsdp`` typed reduced over ``replica``."""
  mesh = steps.hybrid_mesh(devices, axis_type=EXPLICIT)
  specs = _specs(params, first='fsdp', reduced=('replica',))
  return _setup(mesh, k, params, specs, gather_to(('replica', 'fsdp')))
