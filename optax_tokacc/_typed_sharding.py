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
"""Reading and writing sharding types: the vocabulary the placements speak.

Helpers over the types of arrays, not a placement (explicit sharding's is
``_partial_sums``). On an explicit mesh an array's type says how it is laid out
(``jax.typeof(x).sharding.spec``). Parameters typed *reduced* over the data
axes (``jax.P(reduced={'data'})``) get *unreduced* gradients: per-device
partial sums that no collective has summed yet. The accumulator is typed like
those gradients and stays unreduced across micro-steps; the window is reduced
once, when it closes. JAX defines only linear operations on unreduced values,
so what is not linear (validating a count, Kahan summation, a skip decision,
splitting a count into exact parts) runs on each device's partial sum inside a
fully manual ``shard_map`` with ``check_vma=False``, which moves no data.
"""

from collections.abc import Callable, Sequence
from typing import Optional, Union

import jax
import jax.numpy as jnp

from optax_tokacc import _typing
from optax_tokacc._compat import EXPLICIT_SHARDING as SUPPORTED
from optax_tokacc._compat import EXPLICIT_SHARDING_JAX as MIN_JAX
from optax_tokacc._compat import partitions

# A leaf of a tree of values or of their shapes (``jax.eval_shape``'s);
# Python and NumPy values carry no sharding.
ArrayOrShape = Union[jax.typing.ArrayLike, jax.ShapeDtypeStruct]
# The mesh in a type: an array's is abstract, a shape's may be concrete.
MeshLike = Union[jax.sharding.Mesh, jax.sharding.AbstractMesh]
# A ``PartitionSpec``, or a pytree of them (``shard_map``'s ``in_specs``).


def spec(x: ArrayOrShape, *, unreduced: bool = True) -> Optional[jax.P]:
  """The ``PartitionSpec`` in ``x``'s type, padded to its rank (None where
  the type carries no named sharding); ``unreduced=False`` drops the
  unreduced axes (the type of ``x`` once reduced)."""
  found = getattr(_sharding(x), 'spec', None)
  if not isinstance(found, jax.P):
    return None
  kept = found.unreduced if unreduced else frozenset()
  return padded(found, len(jnp.shape(x)), kept)


def padded(
  found: jax.P, rank: int, unreduced: Optional[frozenset] = None
) -> jax.P:
  """``found`` with ``None`` entries up to ``rank``, its reduced axes, and
  its unreduced axes (``unreduced`` where given)."""
  parts = partitions(found)
  parts += (None,) * (rank - len(parts))
  kept = found.unreduced if unreduced is None else unreduced
  # A new spec: P.update would keep an unreduced_kind (jax >= 0.11), which
  # JAX refuses beside no unreduced axis.
  return jax.P(*parts, reduced=found.reduced, unreduced=kept)


def untyped(x: ArrayOrShape) -> bool:
  """Whether ``x``'s type carries no named sharding, or only replication
  (no split dimension, no reduced or unreduced axis)."""
  return spec(x) in (None, jax.P(*[None] * len(jnp.shape(x))))


def _sharding(x: ArrayOrShape) -> Optional[jax.sharding.Sharding]:
  """The sharding of ``x``'s type (a shape's own); Python and NumPy values
  carry none."""
  typed = jax.typeof(x) if isinstance(x, jax.Array) else x
  return getattr(typed, 'sharding', None)


def mesh_of(x: ArrayOrShape) -> Optional[MeshLike]:
  """The mesh in ``x``'s type (None where the type carries no sharding)."""
  return getattr(_sharding(x), 'mesh', None)


def deferred(axes: Optional[frozenset], mesh: Optional[MeshLike]) -> frozenset:
  """``axes`` but those of size 1 on ``mesh`` (all of them where no mesh is
  known): partial sums over a single device are already the sum (and JAX
  0.10.2 cannot lower a ``shard_map`` with unreduced specs over a size-1
  axis)."""
  sizes = {} if mesh is None or mesh.empty else mesh.shape
  return frozenset(a for a in axes or () if sizes.get(a, 2) > 1)


def unreduced(x: ArrayOrShape) -> frozenset:
  """The mesh axes over which ``x`` holds per-device partial sums (axes of
  size 1 aside: see :func:`reduce_trivial`)."""
  return deferred(getattr(spec(x), 'unreduced', None), mesh_of(x))


def reduce_trivial(*trees: Optional[_typing.ArrayTree]) -> tuple:
  """``trees`` with every unreduced axis of size 1 reduced (no data moves):
  a partial sum over one device is the sum."""

  def reduce(x):
    found, kept = spec(x), unreduced(x)
    if found is None or kept == found.unreduced:
      return x
    parts = partitions(found)  # P(...): see spec
    return jax.reshard(x, jax.P(*parts, reduced=found.reduced, unreduced=kept))

  return jax.tree.map(reduce, trees)


def reduced(x: ArrayOrShape) -> frozenset:
  """The mesh axes over which ``x`` is typed reduced."""
  return frozenset(getattr(spec(x), 'reduced', ()))


def sharded(x: ArrayOrShape) -> frozenset:
  """The mesh axes ``x`` is split over."""
  # entries: None, an axis, or a tuple of axes (none where no spec)
  return frozenset(jax.tree.leaves(partitions(spec(x) or jax.P())))


def check_supported(tree: _typing.ArrayTree, what: str) -> None:
  """Refuses reduced or unreduced types on a JAX that cannot run them."""
  for leaf in jax.tree.leaves(tree):
    if not SUPPORTED and (reduced(leaf) or unreduced(leaf)):
      raise NotImplementedError(
        f'{what} typed reduced or unreduced ({jax.typeof(leaf)}) need '
        f'jax >= {".".join(map(str, MIN_JAX))}; found jax {jax.__version__}. '
        'Upgrade JAX, or type the parameters replicated or sharded.'
      )


def data_axes(params: _typing.Params) -> frozenset:
  """The axes whose gradient reduction is deferred: those over which some
  parameter is typed reduced."""
  leaves = jax.tree.leaves(params)
  return frozenset().union(*(deferred(reduced(x), mesh_of(x)) for x in leaves))


def gradient_zeros(
  param: jax.typing.ArrayLike, dtype: jax.typing.DTypeLike
) -> jax.Array:
  """Zeros typed like the gradient of ``param``: its spec with reduced axes
  turned unreduced (``jnp.zeros_like`` would keep them reduced)."""
  if not reduced(param):
    return jnp.zeros_like(param, dtype=dtype)
  found, mesh = spec(param), mesh_of(param)
  gradient = jax.P(*partitions(found), unreduced=deferred(found.reduced, mesh))
  return unreduced_zeros(jnp.shape(param), dtype, mesh, gradient)


def unreduced_zeros(
  shape: Sequence[int],
  dtype: jax.typing.DTypeLike,
  mesh: MeshLike,
  new_spec: jax.P,
) -> jax.Array:
  """Zeros typed ``new_spec`` (unreduced), made replicated, then retyped:
  a bare unreduced constant is merged with the program's other zeros of
  its shape, which then leave ``jax.jit`` typed unreduced too (jax >= 0.11:
  ``jax.jit(tx.init)``)."""
  plain = jax.NamedSharding(mesh, jax.P(*partitions(new_spec)))
  return to_type(jnp.zeros(shape, dtype, out_sharding=plain), new_spec)


def on_one_device(
  x: jax.typing.ArrayLike, axes: frozenset, mesh: MeshLike
) -> jax.Array:
  """A replicated ``x`` typed unreduced over ``axes``: held by the first
  device along them, zeros elsewhere (a select in a manual region).

  ``jax.reshard`` means the same, but XLA merges a constant so retyped with
  the program's equal constants and gives it whole to every device: a
  literal count was counted once per device."""

  def first(x):
    index = sum(jax.lax.axis_index(a) for a in sorted(axes))
    return jnp.where(index == 0, x, jnp.zeros_like(x))

  args = dict(mesh=mesh, in_specs=jax.P(), out_specs=jax.P(unreduced=axes))
  return jax.shard_map(first, **args, check_vma=False)(jnp.asarray(x))


def to_type(x: jax.typing.ArrayLike, new_spec: jax.P) -> jax.Array:
  """``x`` resharded to ``new_spec`` (no work when it already has it; free
  from replicated to reduced or unreduced, and from reduced to replicated).
  A replicated value meant to be summed once is put on one device by
  :func:`on_one_device` instead: XLA gives a constant so retyped to every
  device."""
  x = jnp.asarray(x)
  return x if spec(x) == new_spec else jax.reshard(x, new_spec)


def without_reduced(tree: _typing.ArrayTree) -> _typing.ArrayTree:
  """``tree`` with reduced axes dropped from every type (free): what
  optax's nonlinear updates can take."""

  def plain(x):
    return to_type(x, spec(x).update(reduced=frozenset())) if reduced(x) else x

  return jax.tree.map(plain, tree)


def like(
  tree: _typing.ArrayTree, reference: _typing.ArrayTree
) -> _typing.ArrayTree:
  """``tree`` typed like ``reference``, leaf by leaf, where ``reference``
  is typed reduced (free: the values are already replicated)."""

  def retype(x, ref):
    same = not reduced(ref) or reduced(x) == reduced(ref)
    return x if same else to_type(x, spec(ref))

  return jax.tree.map(retype, tree, reference)


def local(
  fn: Callable, args: tuple, out_specs: _typing.Specs
) -> _typing.ArrayTree:
  """``fn(*args)`` on each device's share, partial sums included.

  A fully manual ``shard_map`` with ``check_vma=False``: ``fn`` sees every
  unreduced argument as this device's partial sum and must return values
  whose partial sums (or replicated values) ``out_specs`` describes. Entering
  and leaving move no data.
  """
  mesh = mesh_of(next(x for x in jax.tree.leaves(args) if spec(x) is not None))
  return jax.shard_map(
    fn,
    mesh=mesh,
    in_specs=type_specs(args),
    out_specs=out_specs,
    check_vma=False,
  )(*args)


def type_specs(tree: _typing.ArrayTree) -> _typing.Specs:
  """The specs of a tree's types, ``P()`` where a type carries none or
  only replication."""
  return jax.tree.map(lambda x: jax.P() if untyped(x) else spec(x), tree)


def reduce_now(x: jax.Array) -> jax.Array:
  """``x`` summed over the axes it is unreduced over (an all-reduce)."""
  return jax.reshard(x, spec(x, unreduced=False)) if unreduced(x) else x


def same_layout(a: ArrayOrShape, b: ArrayOrShape) -> bool:
  """Whether ``a`` and ``b`` split their dimensions alike (reduced and
  unreduced axes aside); true where either carries no named sharding."""
  found = [partitions(s) for s in (spec(a), spec(b)) if s is not None]
  return len(found) < 2 or found[0] == found[1]


def retype_same_values(x: jax.Array, like: ArrayOrShape) -> jax.Array:
  """``x`` typed like ``like``, for a value held identically on every
  device (no data moves).

  JAX casts replicated values to reduced or unreduced, but not between
  those two: an unreduced value is the sum of the devices' shares. For a
  value that every device holds whole (an update on the step that emits
  it, or -0.0), each share is the value itself, so the type is changed in
  a manual region. The accumulator's buffer holds the updates this way
  under explicit sharding, as it does elsewhere.
  """
  if reduced(x) == reduced(like) and unreduced(x) == unreduced(like):
    return x
  if unreduced(x) or unreduced(like):
    return local(lambda v: v, (x,), spec(like))
  return to_type(x, spec(like))
