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
"""Token-summed gradients of a large batch, one micro-batch at a time.

:func:`microbatched_value_and_grad` splits a batch inside one jitted step
and sums the token-summed losses, token counts and gradients of its
micro-batches in a loop, so that peak activation memory is that of one
micro-batch. The sums feed :func:`optax_tokacc.token_weighted_multistep` or,
divided by the count, a plain optimizer.
"""

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from optax_tokacc import _config
from optax_tokacc import _typed_sharding
from optax_tokacc import _typing

Batch = Any
TokenLossFn = Callable[[_typing.Params, Batch], tuple[jax.Array, jax.Array]]
TokenValueAndGradFn = Callable[
  [_typing.Params, Batch], tuple[tuple[jax.Array, jax.Array], _typing.Updates]
]


def _batch_size(batch: Batch, microbatch_size: int) -> int:
  """The common leading axis of the batch's leaves, checked at trace time."""
  leaves = jax.tree.leaves(batch)
  sizes = {np.shape(leaf)[0] if np.ndim(leaf) else None for leaf in leaves}
  if None in sizes or len(sizes) != 1:
    raise ValueError(
      'batch must hold arrays with the same leading (batch) axis to split '
      f'into micro-batches; got shapes {[np.shape(x) for x in leaves]}.'
    )
  (batch_size,) = sizes
  if batch_size % microbatch_size:
    raise ValueError(
      f'The batch size {batch_size} is not divisible by microbatch_size='
      f'{microbatch_size}. Use a divisor such as '
      f'{np.gcd(batch_size, microbatch_size)}, or pad the batch with rows '
      'whose tokens do not count.'
    )
  return batch_size


def microbatched_value_and_grad(
  loss_fn: TokenLossFn, microbatch_size: int
) -> TokenValueAndGradFn:
  r"""Token-summed loss and gradients of a batch, in micro-batches.

  The batch's leading axis is split into :math:`M` micro-batches of
  ``microbatch_size`` examples, evaluated one after the other in a loop
  (``lax.fori_loop``, splitting the batch as ``optax.microbatching`` does)
  inside the same jitted step, and

  .. math::

    L = \sum_m L_m, \qquad N = \sum_m N_m, \qquad
    G = \sum_m \nabla_\theta L_m

  are returned, where ``(L_m, N_m) = loss_fn(params, batch_m)``. Because the
  loss is a token sum, ``G / N`` is exactly the gradient of the batch's
  token-mean loss, whatever the number of tokens in each micro-batch. Peak
  activation memory is that of one micro-batch. Gradients are summed in at
  least float32 and returned in the parameters' dtype.

  The result feeds :func:`optax_tokacc.token_weighted_multistep` (``grads=G,
  num_tokens=N, loss=L``) or, divided by ``N``, a plain optimizer.

  Args:
    loss_fn: ``loss_fn(params, batch) -> (loss_sum, num_tokens)``, e.g.
      built on :func:`optax_tokacc.token_cross_entropy`.
    microbatch_size: examples per micro-batch (a Python int >= 1); it must
      divide the batch size.

  Returns:
    A function ``(params, batch) -> ((loss_sum, num_tokens), grads_sum)``,
    where every leaf of ``batch`` has the batch on its leading axis.

  Example:
    >>> import jax, jax.numpy as jnp
    >>> import optax_tokacc as tokacc
    >>> def loss_fn(params, batch):
    ...   losses = (batch['x'] * params['w'] - batch['y']) ** 2
    ...   return (losses * batch['mask']).sum(), batch['mask'].sum()
    >>> batch = {'x': jnp.arange(8.0).reshape(4, 2), 'y': jnp.ones((4, 2)),
    ...          'mask': jnp.array([[1, 1], [1, 0], [0, 0], [1, 0]])}
    >>> grad_fn = jax.jit(tokacc.microbatched_value_and_grad(loss_fn, 2))
    >>> (loss_sum, num_tokens), grads = grad_fn({'w': jnp.array(1.0)}, batch)
    >>> loss_sum, num_tokens
    (Array(27., dtype=float32), Array(4, dtype=int32))
    >>> grads['w']
    Array(64., dtype=float32)
  """
  kinds = 'a Python int >= 1 (examples per micro-batch)'
  size = _config.positive_int(microbatch_size, 'microbatch_size', kinds)
  value_and_grad = jax.value_and_grad(loss_fn, has_aux=True)

  def microbatched_fn(params, batch):
    num_microbatches = _batch_size(batch, size) // size
    split = jax.tree.map(lambda x: _split(x, size), batch)

    def one(m):  # micro-batch m
      sums, grads = value_and_grad(params, jax.tree.map(lambda x: x[m], split))
      return sums, jax.tree.map(_at_least_float32, grads)

    def add(m, total):
      return jax.tree.map(jnp.add, total, one(m))

    # zeros typed like the sums (unreduced gradients included)
    zeros = optax.tree.zeros_like(jax.eval_shape(one, 0))
    sums, grads_sum = jax.lax.fori_loop(0, num_microbatches, add, zeros)
    return sums, optax.tree.cast_like(grads_sum, params)

  return microbatched_fn


def _split(x: jax.Array, microbatch_size: int) -> jax.Array:
  """``x``'s leading axis as ``(num_microbatches, microbatch_size)``,
  column-major as in ``optax.microbatching``: micro-batch ``m`` takes rows
  ``m, m + M, ...``, so a batch split over devices keeps each micro-batch
  split over them. On an explicit mesh the layout is given, as JAX asks
  (optax 0.2.8 compares JAX versions as strings and does not)."""
  rows = (microbatch_size, -1) + tuple(jnp.shape(x)[1:])
  parts = _typed_sharding.partitions(_typed_sharding.spec(x) or jax.P())
  layout = None  # as JAX gives it, unless the batch is split over devices
  if any(p is not None for p in parts):
    splits = x.shape[0] // jax.typeof(x).sharding.shard_shape(x.shape)[0]
    if microbatch_size % splits:
      raise ValueError(
        f'microbatch_size={microbatch_size} must be a multiple of the '
        f'{splits} devices the batch is split over.'
      )
    layout = jax.P(parts[0], None, *parts[1:])
  return jnp.swapaxes(jnp.reshape(x, rows, out_sharding=layout), 0, 1)


def _at_least_float32(x: jax.Array) -> jax.Array:
  return x.astype(jnp.promote_types(x.dtype, jnp.float32))
