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
"""Checkpoints of states whose arrays cannot be read to the host as they are.

Under explicit sharding the accumulator is *unreduced* between two window
closes (``jax.device_get`` refuses it) and moments and parameters may be
typed *reduced* (orbax cannot write their metadata). :func:`to_checkpoint`
turns every leaf into an ordinary array, moving no data, and
:func:`from_checkpoint` restores the types bit for bit.
"""

from typing import Any

import jax
import jax.numpy as jnp

from optax_tokacc import _explicit


def to_checkpoint(tree: Any) -> Any:
  """Every leaf as an ordinary array, for ``jax.device_get`` and orbax.

  Under explicit sharding the state holds arrays that cannot be read to the
  host as they are: the accumulator is *unreduced* between two window
  closes (``jax.device_get`` refuses it), and moments and parameters may be
  typed *reduced* (orbax 0.12 cannot write their metadata). This gives each
  unreduced leaf a new leading axis, split over the axes it is unreduced
  over, that holds the devices' partial sums, and types each reduced leaf
  replicated; other leaves are returned as they are. Nothing is summed or
  rounded, and no data moves: :func:`from_checkpoint` restores the same
  state bit for bit.

  Args:
    tree: a pytree of arrays, e.g. ``(params, opt_state)``.

  Returns:
    The tree with every unreduced leaf of shape ``s`` replaced by an array
    of shape ``(n, *s)``, ``n`` the number of devices it is unreduced over,
    and every reduced leaf typed replicated.

  Example:
    >>> import jax, jax.numpy as jnp, optax
    >>> import optax_tokacc as tokacc
    >>> mesh = jax.make_mesh((2,), ('data',), devices=jax.devices()[:2])
    >>> tx = tokacc.token_weighted_multistep(optax.sgd(0.1), 2)
    >>> with jax.set_mesh(mesh):
    ...   params = jax.device_put(
    ...       {'w': jnp.ones(3)}, jax.P(None, reduced={'data'}))
    ...   state = tx.init(params)
    ...   saved = tokacc.to_checkpoint(state)  # what orbax saves
    ...   restored = tokacc.from_checkpoint(saved, like=state)
    >>> print(jax.typeof(state.grad_sums['w']))  # partial sums
    float32[3]{U:data}
    >>> print(jax.typeof(saved.grad_sums['w']))  # one row per device
    float32[2@data,3]
    >>> print(jax.typeof(restored.grad_sums['w']))
    float32[3]{U:data}

    With orbax, restore into the structure of ``tx.init`` of parameters
    placed as in training::

      ckptr.save(path, tokacc.to_checkpoint((params, opt_state)))
      like = (params0, tx.init(params0))
      target = jax.tree.map(ocp.utils.to_shape_dtype_struct,
                            tokacc.to_checkpoint(like))
      params, opt_state = tokacc.from_checkpoint(
          ckptr.restore(path, target), like)
  """
  return jax.tree.map(_rows, tree)


def _rows(x: Any) -> Any:
  """``x`` as :func:`to_checkpoint` saves it."""
  axes = _explicit.unreduced(x)
  if not axes:
    return _explicit.without_reduced(x)
  lead = tuple(a for a in _explicit.mesh_of(x).axis_names if a in axes)
  out = jax.P(lead, *_explicit.partitions(_explicit.spec(x)))
  return _explicit.local(lambda v: v[None], (x,), out)


def from_checkpoint(tree: Any, like: Any) -> Any:
  """The inverse of :func:`to_checkpoint`: the types of ``like`` again.

  Args:
    tree: what :func:`to_checkpoint` gave, e.g. restored by orbax.
    like: a tree with the target types, e.g. ``(params, tx.init(params))``
      for parameters placed as in training, or its ``jax.eval_shape``.

  Returns:
    ``tree`` typed like ``like``: bit for bit the tree that was saved.

  Raises:
    ValueError: if a leaf does not hold the partial sums of its target.
  """

  def merge(x, ref):
    if not _explicit.unreduced(ref):
      return _explicit.like(x, ref)
    if jnp.shape(x) != jax.eval_shape(_rows, ref).shape:
      raise ValueError(
        f'from_checkpoint: a leaf of shape {jnp.shape(x)} does not hold the '
        f'partial sums of {jax.typeof(ref)}: like must be the tree given to '
        'to_checkpoint.'
      )
    return _explicit.local(lambda v: v[0], (x,), _explicit.spec(ref))

  return jax.tree.map(merge, tree, like)
