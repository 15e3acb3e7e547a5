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
"""The optimizer's state sharded over the data axes: the distributed-optimizer
(ZeRO-1) layout of ``shard_optimizer_over``.

Megatron calls this layout the distributed optimizer, and ZeRO its stage 1;
the keyword says what it does: it shards ``inner``'s parameter-shaped state
over data axes (:func:`state_specs`, for ``init_sharded`` and the layout
helpers). The placement of explicit partial sums (``_partial_sums``) reads
the layout back from the state's types, leaf by leaf
(:func:`shard_targets`): each gradient's window is reduce-scattered into the
shards of its parameter's state (optax's ``tree_map_params`` says which
state belongs to which parameter), so moments resharded by hand are
followed.
"""

import math
from typing import Any, NamedTuple, Optional

import jax
import optax

from optax_tokacc import _base
from optax_tokacc import _typed_sharding
from optax_tokacc import _typing


def inner_shard_specs(
  params: _typing.Params,
  param_specs: _typing.Specs,
  shard_over: _base.AxisName,
  axis_name: Optional[_base.AxisName],
  mesh: Optional[jax.sharding.Mesh],
) -> _typing.Specs:
  """The specs of ``inner``'s parameter-shaped state, per parameter, with
  ``shard_optimizer_over=shard_over``: the parameter's spec, sharded over
  the axes on its first dimension that is not already split and that the
  axes' size divides (the parameter's spec where none does)."""
  if axis_name is not None:
    raise ValueError(
      f'shard_optimizer_over={shard_over!r} needs explicit sharding, not '
      f'axis_name={axis_name!r}: leave it None and type the parameters reduced.'
    )
  axes = _base.axis_names(shard_over)
  mesh = _mesh(params) if mesh is None else mesh
  specs = jax.tree.leaves(param_specs)
  split = jax.tree.leaves([_typed_sharding.partitions(s) for s in specs])
  for axis in axes:  # refuse axes the state cannot be sharded over
    if axis not in mesh.axis_names:
      problem = f'{axis!r} is not an axis of the mesh {mesh.axis_names}'
    elif axis in split:
      problem = f'the parameters are sharded over {axis!r}'
    elif not any(axis in s.reduced for s in specs):
      problem = f'{axis!r} is not a data axis'
    else:
      continue
    raise ValueError(
      f'shard_optimizer_over={shard_over!r}: {problem}. Name data axes, over '
      "which the parameters are typed reduced (jax.P(reduced={'data'}))."
    )
  size = math.prod(mesh.shape[axis] for axis in axes)

  def shard(x, found):
    parts = _typed_sharding.partitions(found)
    parts += (None,) * (len(x.shape) - len(parts))
    for dim, (length, entry) in enumerate(zip(x.shape, parts)):
      if entry is None and length % size == 0 and length >= size:
        return jax.P(*parts[:dim], axes, *parts[dim + 1 :])
    return jax.P(*parts)

  return jax.tree.map(shard, params, param_specs)


def _mesh(params: _typing.Params) -> _typed_sharding.MeshLike:
  """The mesh of ``jax.set_mesh``, else that of the parameters (plain
  arrays are typed on JAX's empty mesh)."""
  mesh = jax.sharding.get_abstract_mesh()
  leaves = jax.tree.leaves(params)
  placed = [
    x for x in leaves if not getattr(_typed_sharding.mesh_of(x), 'empty', 1)
  ]
  if mesh.empty and not placed:
    raise ValueError(
      'shard_optimizer_over needs the mesh: call inside jax.set_mesh(mesh), '
      'pass mesh=, or pass parameters placed on it.'
    )
  return _typed_sharding.mesh_of(placed[0]) if mesh.empty else mesh


class ShardTarget(NamedTuple):
  """Where a gradient's window goes: scattered on ``dim`` over ``axes``
  (an entry of a spec), into shards typed ``spec``."""

  dim: int
  axes: _base.AxisName
  spec: jax.P


def shard_targets(
  inner: optax.GradientTransformation,
  inner_state: _typing.OptState,
  grads: _typing.Updates,
  axes: frozenset,
) -> tuple:
  """Per gradient leaf, the :class:`ShardTarget` of the shards of its
  parameter's state that its window is reduce-scattered into, or None where
  that state is whole or the gradient holds no partial sums over the
  target's axes (all-reduced, or kept); ``()`` where none of ``inner``'s
  state is sharded over ``axes``."""
  states = jax.tree.leaves(inner_state)
  if not any(_typed_sharding.sharded(x) & axes for x in states):
    return ()
  targets = _targets(inner, inner_state, grads, axes)
  if all(target is None for target in targets):
    return ()
  # the window's sums are typed like the gradients (_state_checks)
  return tuple(map(_scattered, jax.tree.leaves(grads), targets))


def _scattered(
  leaf: jax.Array, target: Optional[ShardTarget]
) -> Optional[ShardTarget]:
  """``target``, where ``leaf`` holds partial sums over its axes."""
  axes = set(jax.tree.leaves(target.axes)) if target else None
  return target if target and _typed_sharding.unreduced(leaf) >= axes else None


def _targets(
  inner: optax.GradientTransformation,
  inner_state: _typing.OptState,
  grads: _typing.Updates,
  axes: frozenset,
) -> tuple:
  """Per gradient leaf, the ``ShardTarget`` its parameter's state gives."""
  leaves, treedef = jax.tree.flatten(grads)
  found = [set() for _ in leaves]

  def record(leaf, index):
    sharded = _typed_sharding.sharded(leaf) & axes  # none for a MaskedNode
    if sharded and jax.numpy.shape(leaf) == jax.numpy.shape(leaves[index]):
      found[index].add(
        jax.P(*_typed_sharding.partitions(_typed_sharding.spec(leaf)))
      )
    return leaf

  indices = treedef.unflatten(range(len(leaves)))
  optax.tree_map_params(inner, record, inner_state, indices, is_leaf=is_masked)
  return tuple(_target(x, specs, axes) for x, specs in zip(leaves, found))


def is_masked(x: Any) -> bool:
  """Whether ``x`` is a ``MaskedNode`` of ``optax.masked`` (a state leaf
  that stands for no parameter)."""
  return isinstance(x, optax.MaskedNode)


def _target(
  grad: jax.Array, specs: set, axes: frozenset
) -> Optional[ShardTarget]:
  """The one ``ShardTarget`` of ``grad`` its state's ``specs`` describe."""
  if not specs:
    return None
  spec = min(specs, key=str)
  parts = _typed_sharding.partitions(spec)
  grad_parts = _typed_sharding.partitions(_typed_sharding.spec(grad))
  changed = [d for d, (a, b) in enumerate(zip(parts, grad_parts)) if a != b]
  if len(specs) == 1 and len(changed) == 1:
    (dim,) = changed
    if grad_parts[dim] is None and set(jax.tree.leaves(parts[dim])) <= axes:
      return ShardTarget(dim, parts[dim], spec)
  raise ValueError(
    f'The optimizer state of a gradient typed {jax.typeof(grad)} is sharded '
    f'as {sorted(map(str, specs))}, not like the gradient with one dimension '
    'more split over data axes, as shard_optimizer_over=... lays it out.'
  )
