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
"""The distributed-optimizer (ZeRO-1) placement: sharded optimizer state.

Under explicit sharding, with parameters typed reduced over the data axes
and ``inner``'s parameter-shaped state sharded over some of them
(:func:`optax_tokacc.init_sharded` with ``shard_optimizer_over``), the
window is kept as partial sums, as in DDP, and closed by one reduce-scatter
straight into the optimizer's shards (``lax.psum_scatter`` on each device's
share). ``inner`` runs on the shards, and its updates are all-gathered to
the parameters' type. A window moves the bytes of one all-reduce, and each
device holds 1/N of the optimizer state.

The layout is chosen by :func:`state_specs` (``shard_optimizer_over`` of
:func:`optax_tokacc.state_partition_specs`) and read back from the state's
types, leaf by leaf: each gradient is scattered as the state of its
parameter is sharded (optax's ``tree_map_params`` says which state belongs
to which parameter), so moments resharded by hand are followed.
"""

import math
from typing import Any, NamedTuple, Optional

import jax
import optax

from optax_tokacc import _base
from optax_tokacc import _explicit
from optax_tokacc import _partial_sums


def state_specs(params, param_specs, shard_over, axis_name, mesh) -> Any:
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
  split = jax.tree.leaves([_explicit.partitions(s) for s in specs])
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
    parts = _explicit.partitions(found)
    parts += (None,) * (len(x.shape) - len(parts))
    for dim, (length, entry) in enumerate(zip(x.shape, parts)):
      if entry is None and length % size == 0 and length >= size:
        return jax.P(*parts[:dim], axes, *parts[dim + 1 :])
    return jax.P(*parts)

  return jax.tree.map(shard, params, param_specs)


def _mesh(params: Any) -> Any:
  """The mesh of ``jax.set_mesh``, else that of the parameters (plain
  arrays are typed on JAX's empty mesh)."""
  mesh = jax.sharding.get_abstract_mesh()
  leaves = jax.tree.leaves(params)
  placed = [x for x in leaves if not getattr(_explicit.mesh_of(x), 'empty', 1)]
  if mesh.empty and not placed:
    raise ValueError(
      'shard_optimizer_over needs the mesh: call inside jax.set_mesh(mesh), '
      'pass mesh=, or pass parameters placed on it.'
    )
  return _explicit.mesh_of(placed[0]) if mesh.empty else mesh


class Target(NamedTuple):
  """Where a gradient's window goes: scattered on ``dim`` over ``axes``
  (an entry of a spec), into shards typed ``spec``."""

  dim: int
  axes: Any
  spec: jax.P


class DistributedOptimizer(_partial_sums.PartialSums):
  """Partial sums, reduce-scattered into the shards of ``inner``'s state
  when the window closes; ``targets``: per gradient leaf, a ``Target``, or
  None where its parameter's state is whole or the gradient holds no
  partial sums over the target's axes (all-reduced, or kept)."""

  @classmethod
  def of(cls, place, inner, inner_state, grads) -> Any:
    """``place`` itself unless some of ``inner``'s state is sharded over
    its data axes: the distributed-optimizer layout."""
    states = jax.tree.leaves(inner_state)
    if not any(_explicit.sharded(x) & place.axes for x in states):
      return place
    targets = _targets(inner, inner_state, grads, place.axes)
    if all(t is None for t in targets):
      return place
    # the window's sums are typed like the gradients (_state_checks.state_matches)
    leaves = jax.tree.leaves(grads)
    return cls(place.axes, place.mesh, tuple(map(_scattered, leaves, targets)))

  def reduced_types(self, grads):
    leaves, treedef = jax.tree.flatten(grads)
    return treedef.unflatten(
      self.whole(x) if t is None else jax.reshard(self.whole(x), t.spec)
      for x, t in zip(leaves, self.targets)
    )

  def refusal(self, error):
    """``inner`` failing on the shards of its state (a sharding error)."""
    if 'shard' not in str(error).lower():
      return None
    return ValueError(
      'inner cannot run on the shards of its state (shard_optimizer_over): it'
      ' needs whole gradients, as the orthogonalization of optax.contrib.muon'
      f' does. Leave shard_optimizer_over out. (inner raised: {error})'
    )

  def like(self, tree, reference):
    """Shards all-gathered where ``reference`` is whole, then typed like it."""

    sharded, axes = _explicit.sharded, self.axes

    def gather(x, ref):
      if not sharded(x) & axes or sharded(ref) & axes:
        return x
      return jax.reshard(x, jax.P(*_explicit.partitions(_explicit.spec(ref))))

    return _explicit.like(jax.tree.map(gather, tree, reference), reference)


def _scattered(leaf: Any, target: Optional[Target]) -> Optional[Target]:
  """``target``, where ``leaf`` holds partial sums over its axes."""
  axes = set(jax.tree.leaves(target.axes)) if target else None
  return target if target and _explicit.unreduced(leaf) >= axes else None


def _targets(inner, inner_state, grads, axes) -> tuple:
  """Per gradient leaf, the ``Target`` its parameter's state gives."""
  leaves, treedef = jax.tree.flatten(grads)
  found = [set() for _ in leaves]

  def record(leaf, index):
    sharded = _explicit.sharded(leaf) & axes  # none for a MaskedNode
    if sharded and jax.numpy.shape(leaf) == jax.numpy.shape(leaves[index]):
      found[index].add(jax.P(*_explicit.partitions(_explicit.spec(leaf))))
    return leaf

  indices = treedef.unflatten(range(len(leaves)))
  optax.tree_map_params(inner, record, inner_state, indices, is_leaf=is_masked)
  return tuple(_target(x, specs, axes) for x, specs in zip(leaves, found))


def is_masked(x: Any) -> bool:
  """Whether ``x`` is a ``MaskedNode`` of ``optax.masked`` (a state leaf
  that stands for no parameter)."""
  return isinstance(x, optax.MaskedNode)


def _target(grad: Any, specs: set, axes: frozenset) -> Optional[Target]:
  """The one ``Target`` of ``grad`` its state's ``specs`` describe."""
  if not specs:
    return None
  spec = min(specs, key=str)
  parts = _explicit.partitions(spec)
  grad_parts = _explicit.partitions(_explicit.spec(grad))
  changed = [d for d, (a, b) in enumerate(zip(parts, grad_parts)) if a != b]
  if len(specs) == 1 and len(changed) == 1:
    (dim,) = changed
    if grad_parts[dim] is None and set(jax.tree.leaves(parts[dim])) <= axes:
      return Target(dim, parts[dim], spec)
  raise ValueError(
    f'The optimizer state of a gradient typed {jax.typeof(grad)} is sharded '
    f'as {sorted(map(str, specs))}, not like the gradient with one dimension '
    'more split over data axes, as shard_optimizer_over=... lays it out.'
  )
