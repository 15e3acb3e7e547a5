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
"""A state checked against the transform that reads it: built, or restored
from a checkpoint, for this configuration and these gradients.

Under explicit sharding the accumulator of each gradient must be unreduced
over the same axes as the gradient, and never over an axis along which its
parameter is split; the errors say how to rebuild or restore the state.
"""

from typing import Optional

import jax
import jax.numpy as jnp

from optax_tokacc import _base
from optax_tokacc import _inputs
from optax_tokacc import _norms
from optax_tokacc import _typed_sharding
from optax_tokacc import _typing


def state_matches(
  config: _base.Config,
  grads: _typing.Updates,
  state: _base.TokenWeightedMultiStepState,
  params: Optional[_typing.Params],
) -> None:
  """Refuses a state made (or restored) for another configuration, or for
  gradients of another tree, shape, dtype or (explicit sharding) type.

  Under explicit sharding the accumulator of each gradient must be
  unreduced over the same axes as the gradient (a state built, or restored,
  for the parameters as they are typed now), and never over an axis along
  which the parameter is split (each device would add a different shard
  into one sum).
  """
  _inputs.tree(grads, state.grad_sums, 'the accumulator')
  acc_leaves = jax.tree.leaves(state.grad_sums)
  compensated = bool(jax.tree.leaves(state.acc_compensation))
  if acc_leaves and compensated != config.compensated:
    raise TypeError(
      f'state has compensated={compensated}, unlike this transform: restore '
      f'into its tx.init(params), or build it with compensated={compensated}.'
    )
  per_leaf = _norms.per_leaf(state.last_grad_norm)
  if acc_leaves and per_leaf != config.leaf_norms:
    saved = "'per_leaf'" if per_leaf else 'True or False'
    raise TypeError(
      f'state has window_norms={saved}, unlike this transform: restore into '
      f'its tx.init(params), or build it with window_norms={saved}.'
    )
  for name in ('acc_tokens', 'last_tokens', 'acc_loss', 'last_loss'):
    dtype = config.loss_dtype if 'loss' in name else config.token_dtype
    _state_dtype(name, getattr(state, name), dtype)
  axes = _typed_sharding.unreduced(state.acc_tokens)
  if _typed_sharding.unreduced(state.acc_loss) != axes:
    raise TypeError(
      f'state.acc_loss is {jax.typeof(state.acc_loss)} but state.acc_tokens '
      f'{jax.typeof(state.acc_tokens)}: restored with another type. Restore '
      'it with tokacc.from_checkpoint into tx.init(params).'
    )
  grad_leaves = jax.tree.leaves(grads)
  param_leaves = jax.tree.leaves(params) or [None] * len(grad_leaves)
  for grad, acc, param in zip(grad_leaves, acc_leaves, param_leaves):
    _state_dtype('grad_sums', acc, config.acc_dtype(grad))
    _leaf_matches(grad, acc, param, axes)


def _state_dtype(
  field: str, value: jax.typing.ArrayLike, expected: jax.typing.DTypeLike
) -> None:
  """``state.field`` (``value``) must have the dtype this transform keeps."""
  if jnp.result_type(value) != expected:
    raise TypeError(
      f'state.{field} has dtype {jnp.result_type(value)}, not {expected}: '
      'restore into its tx.init(params), or set accumulator_dtype/token_dtype.'
    )


def _leaf_matches(
  grad: jax.Array,
  acc: jax.Array,
  param: Optional[jax.typing.ArrayLike],
  axes: frozenset,
) -> None:
  """A gradient must match its accumulator's shape and type (see above)."""
  if jnp.shape(grad) != jnp.shape(acc):
    raise ValueError(
      f'A gradient has shape {jnp.shape(grad)} where the parameter has shape '
      f'{jnp.shape(acc)}: under pmap or shard_map, use tokacc.init_sharded.'
    )
  split = _typed_sharding.unreduced(grad) & _typed_sharding.sharded(
    param
  )  # None: {}
  if split:
    raise ValueError(
      f'A gradient is unreduced over {sorted(split)}, along which its '
      f'parameter {jax.typeof(param)} is split. Type the parameter reduced '
      "only where replicated: P('fsdp', reduced={'replica'})."
    )
  partial = _typed_sharding.unreduced(acc)
  if _typed_sharding.unreduced(grad) != partial or not partial <= axes:
    typed = '' if param is None else f' (the parameter is {jax.typeof(param)})'
    raise TypeError(
      f'A gradient is {jax.typeof(grad)}{typed} but its accumulator is '
      f'{jax.typeof(acc)}: the state was built or restored for other types. '
      'Build it with tx.init(params) or tokacc.init_sharded(tx, params, mesh).'
    )
