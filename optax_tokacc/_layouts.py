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
"""Where each placement keeps the window's per-device fields.

A layout is one placement's answer, in one class, to three questions:
where the per-device fields (``_base.PER_DEVICE_FIELDS``) live in its
trace (:meth:`Layout.local`, :meth:`Layout.global_`), their specs in the
global state (:meth:`Layout.gradient_spec`, :meth:`Layout.scalar_spec`,
which ``_state_layout`` lays the whole state out from), and their rows in
a checkpoint (:meth:`Layout.save`, :meth:`Layout.put_back`, which
``_shares`` calls). The placements hold theirs (``Placement.layout``):

- :class:`Slots`, ``_manual.Manual``'s: a leading slot axis per device;
  :class:`Pmap` is the same state stacked again by ``pmap``.
- :class:`Typed`, ``_single.Single``'s and ``_partial_sums.PartialSums``':
  each leaf whole, or partial sums typed unreduced.

A saved state names no placement, and the saved format stays as it is: a
bare state tells its layout by the form of its fields, which every layout
states in :meth:`Layout.read` (``pmap`` stacks ``mini_step``, a scalar in
every other layout; a slot axis gives the count ``acc_tokens`` rank 1;
else each leaf is whole or typed). :func:`of_state` asks them in that
order. The interface is abstract-or-final, as ``_placement``'s.
"""

import abc
from collections.abc import Callable
import dataclasses
from typing import Optional, final

import jax
import jax.numpy as jnp
import numpy as np

from optax_tokacc import _base
from optax_tokacc import _typed_sharding
from optax_tokacc import _typing

State = _base.TokenWeightedMultiStepState  # arrays, or their shapes
Tree = _typing.ArrayTree
Leaf = _typed_sharding.ArrayOrShape


def leading(x: Leaf) -> int:
  return int(jnp.shape(x)[0])


class Layout(abc.ABC):
  """Where a placement keeps the per-device fields: in its trace, in the
  global state's specs, and as a checkpoint's rows."""

  @classmethod
  @abc.abstractmethod
  def read(cls, state: State) -> Optional['Layout']:
    """This layout, if ``state`` (arrays or their shapes: a global state)
    has its form, else None."""

  @abc.abstractmethod
  def local(self, state: State) -> State:
    """The state as the placement's trace reads it."""

  @abc.abstractmethod
  def global_(self, state: State) -> State:
    """The inverse of :meth:`local`."""

  @abc.abstractmethod
  def gradient_spec(self, spec: jax.P) -> jax.P:
    """The spec of an accumulator leaf, from its parameter's."""

  @abc.abstractmethod
  def scalar_spec(self, param_specs: list[jax.P]) -> jax.P:
    """The spec of the window's count and loss."""

  @abc.abstractmethod
  def save(self, state: State) -> State:
    """``state`` with its per-device fields as rows of shares."""

  @abc.abstractmethod
  def put_back(self, rows: dict[str, Tree], refs: dict[str, Tree]) -> dict:
    """The per-device fields from their rows, each device's share where it
    was saved, typed like ``refs`` (the target's)."""

  @abc.abstractmethod
  def whole_field(self, value: Tree, like: Tree) -> Tree:
    """A field other than the per-device ones laid out like ``like``."""

  @abc.abstractmethod
  def rows(self, leaf: Leaf) -> int:
    """The rows :meth:`save` gives a per-device leaf."""

  @abc.abstractmethod
  def spread(self, total: jax.Array, ref: Leaf, everywhere: bool) -> jax.Array:
    """A window's ``total`` laid out like ``ref``: on its first device
    (zeros on the others), or on every device (``everywhere``)."""

  @abc.abstractmethod
  def merge(self, merge: Callable, rows: dict, refs: dict) -> dict:
    """``merge(rows)`` placed like ``refs``."""


@final
@dataclasses.dataclass(frozen=True)
class Slots(Layout):
  """``shard_map`` and ``pmap`` with ``axis_name`` over ``axes``: the
  per-device fields with a leading slot axis, one slot per device (each
  device's trace sees a slot of length 1, so that ``shard_map`` and
  ``pmap`` need no written layout), the other fields whole."""

  axes: tuple[str, ...] = ()

  @classmethod
  def read(cls, state: State) -> Optional['Slots']:
    return cls() if jnp.ndim(state.acc_tokens) == 1 else None

  def local(self, state: State) -> State:
    """This device's share: the per-device fields without their slot."""
    for name in _base.PER_DEVICE_FIELDS:
      for leaf in jax.tree.leaves(getattr(state, name)):
        if jnp.shape(leaf)[:1] != (1,):
          raise ValueError(
            f'state.{name} needs a leading device-slot axis of length 1; got '
            f'{jnp.shape(leaf)}: use tokacc.init_sharded or jax.pmap(tx.init).'
          )
    return _base.map_per_device(lambda x: x[0], state)

  def global_(self, state: State) -> State:
    return _base.map_per_device(lambda x: jnp.asarray(x)[None], state)

  def gradient_spec(self, spec: jax.P) -> jax.P:
    """Behind a slot axis split over the data axes along which the
    parameter is not sharded (DDP: a whole accumulator per device; FSDP
    and HSDP: a shard of it)."""
    split = jax.tree.leaves(_typed_sharding.partitions(spec))
    return jax.P(tuple(a for a in self.axes if a not in split), *spec)

  def scalar_spec(self, param_specs: list[jax.P]) -> jax.P:
    return self.gradient_spec(jax.P())

  def save(self, state: State) -> State:
    return state

  def put_back(self, rows: dict[str, Tree], refs: dict[str, Tree]) -> dict:
    return placed(rows, refs)

  def whole_field(self, value: Tree, like: Tree) -> Tree:
    return placed(value, like)

  def rows(self, leaf: Leaf) -> int:
    return leading(leaf)

  def spread(self, total: jax.Array, ref: Leaf, everywhere: bool) -> jax.Array:
    return _in_slots(total, ref, everywhere)

  def merge(self, merge: Callable, rows: dict, refs: dict) -> dict:
    return _merged_in_one_program(merge, rows, refs)


@final
@dataclasses.dataclass(frozen=True)
class Pmap(Layout):
  """:class:`Slots` as ``pmap`` holds it: every leaf stacked over its
  ``devices``, so the per-device fields hold a slot of length 1 behind
  that axis."""

  devices: int

  @classmethod
  def read(cls, state: State) -> Optional['Pmap']:
    stacked = jnp.ndim(state.mini_step) == 1
    return cls(leading(state.mini_step)) if stacked else None

  def local(self, state: State) -> State:
    return Slots().local(state)

  def global_(self, state: State) -> State:
    return Slots().global_(state)

  def gradient_spec(self, spec: jax.P) -> jax.P:
    raise ValueError('pmap takes no specs: lay the state out with jax.pmap.')

  def scalar_spec(self, param_specs: list[jax.P]) -> jax.P:
    raise ValueError('pmap takes no specs: lay the state out with jax.pmap.')

  def save(self, state: State) -> State:
    whole = jax.tree.map(lambda x: x[0], state)  # one copy of each field
    return whole._replace(
      **jax.tree.map(lambda x: x[:, 0], _base.per_device(state))
    )

  def put_back(self, rows: dict[str, Tree], refs: dict[str, Tree]) -> dict:
    return placed(jax.tree.map(lambda x: x[:, None], rows), refs)

  def whole_field(self, value: Tree, like: Tree) -> Tree:
    stacked = jax.tree.map(lambda x: _stacked(x, self.devices), value)
    return placed(stacked, like)

  def rows(self, leaf: Leaf) -> int:
    return leading(leaf)

  def spread(self, total: jax.Array, ref: Leaf, everywhere: bool) -> jax.Array:
    return _in_slots(total, ref, everywhere)

  def merge(self, merge: Callable, rows: dict, refs: dict) -> dict:
    """Op by op, then placed as ``pmap`` holds its values."""
    return placed(merge(rows), refs)


@final
class Typed(Layout):
  """Each leaf whole, or partial sums typed unreduced: one device,
  ``jax.jit`` over global arrays, explicit sharding. The trace reads the
  state as it is."""

  @classmethod
  def read(cls, state: State) -> 'Typed':
    return cls()

  def local(self, state: State) -> State:
    return state

  def global_(self, state: State) -> State:
    return state

  def gradient_spec(self, spec: jax.P) -> jax.P:
    """Typed like the parameter's gradient: its reduced axes unreduced
    (partial sums over one device are the sum)."""
    mesh = jax.sharding.get_abstract_mesh()
    unreduced = _typed_sharding.deferred(spec.reduced, mesh)
    return jax.P(*_typed_sharding.partitions(spec), unreduced=unreduced)

  def scalar_spec(self, param_specs: list[jax.P]) -> jax.P:
    """Like the gradient of a scalar reduced over every axis some
    parameter is reduced over."""
    data_axes = frozenset().union(*(s.reduced for s in param_specs))
    return self.gradient_spec(jax.P(reduced=data_axes))

  def save(self, state: State) -> State:
    shares = jax.tree.map(_typed_rows, _base.per_device(state))
    return jax.tree.map(leaf_rows, state)._replace(**shares)

  def put_back(self, rows: dict[str, Tree], refs: dict[str, Tree]) -> dict:
    return jax.tree.map(_from_typed_rows, rows, refs)

  def whole_field(self, value: Tree, like: Tree) -> Tree:
    return jax.tree.map(restore_leaf, value, like)

  def rows(self, leaf: Leaf) -> int:
    """The devices whose partial sums ``leaf`` holds: 1 for a whole leaf."""
    sizes = dict(getattr(_typed_sharding.mesh_of(leaf), 'shape', {}))
    return int(np.prod([sizes[a] for a in _typed_sharding.unreduced(leaf)]))

  def spread(self, total: jax.Array, ref: Leaf, everywhere: bool) -> jax.Array:
    """Typed like ``ref``: partial sums on its first device, unless
    ``everywhere``."""
    if _typed_sharding.unreduced(ref) and not everywhere:
      return _on_first_device(total, ref)
    return _typed_sharding.like(total, ref)

  def merge(self, merge: Callable, rows: dict, refs: dict) -> dict:
    return _merged_in_one_program(merge, rows, refs)


def of_state(state: State) -> Layout:
  """The layout of ``state`` (arrays or their shapes), read once from the
  form its fields take in each layout (the module's docstring)."""
  for layout in (Pmap, Slots):
    found = layout.read(state)
    if found is not None:
      return found
  return Typed.read(state)


def _in_slots(total: jax.Array, ref: Leaf, everywhere: bool) -> jax.Array:
  """``total`` in the slots of ``ref`` (devices, [1,] *total's shape)."""
  shape = jnp.shape(ref)
  if everywhere:
    return jnp.broadcast_to(total, shape)
  first = (0,) * (len(shape) - jnp.ndim(total))
  return jnp.zeros(shape, total.dtype).at[first].set(total)


def _merged_in_one_program(merge: Callable, rows: dict, refs: dict) -> dict:
  """``merge(rows)`` placed like ``refs``: in one program for every
  leaf."""
  shardings = jax.tree.map(_out_sharding, refs)
  return jax.jit(merge, out_shardings=shardings)(rows)


def _out_sharding(ref: Leaf) -> Optional[jax.NamedSharding]:
  """Where a merged leaf is put: ``ref``'s sharding, or where its types
  say (partial sums typed unreduced, reduced types, shapes without one)."""
  sharding = getattr(ref, 'sharding', None)
  typed = _typed_sharding.unreduced(ref) or _typed_sharding.reduced(ref)
  if isinstance(sharding, jax.NamedSharding) and not typed:
    return sharding
  return None


def leaf_rows(x: Leaf) -> Leaf:
  """An unreduced ``x`` of shape ``s`` as its devices' partial sums,
  ``(n, *s)`` split over the axes it is unreduced over (no data moves);
  a reduced ``x`` typed replicated; any other ``x`` as it is."""
  axes = _typed_sharding.unreduced(x)
  if not axes:
    return _typed_sharding.without_reduced(x)
  lead = tuple(a for a in _typed_sharding.mesh_of(x).axis_names if a in axes)
  out = jax.P(lead, *_typed_sharding.partitions(_typed_sharding.spec(x)))
  return _typed_sharding.local(lambda v: v[None], (x,), out)


def _one_row(x: jax.typing.ArrayLike) -> jax.Array:
  """A whole ``x`` as one row (its unreduced axes of one device reduced,
  its reduced types replicated: ordinary arrays)."""
  (x,) = _typed_sharding.reduce_trivial(x)
  return jnp.expand_dims(_typed_sharding.without_reduced(x), 0)


def _typed_rows(x: jax.typing.ArrayLike) -> jax.typing.ArrayLike:
  """A per-device leaf of a :class:`Typed` state as rows of shares: its
  partial sums where typed unreduced, else itself as one row."""
  return leaf_rows(x) if _typed_sharding.unreduced(x) else _one_row(x)


def _on_first_device(total: jax.Array, ref: Leaf) -> jax.Array:
  """``total`` typed like ``ref`` (unreduced): held by the first device
  along the axes ``ref`` is unreduced over, zeros on the others."""
  axes = sorted(_typed_sharding.unreduced(ref))
  total = _typed_sharding.to_type(
    total, _typed_sharding.spec(ref, unreduced=False)
  )

  def first(v):
    index = sum(jax.lax.axis_index(a) for a in axes)  # 0 on the first only
    return jnp.where(index == 0, v, jnp.zeros_like(v))

  return _typed_sharding.local(first, (total,), _typed_sharding.spec(ref))


def _from_typed_rows(
  rows: jax.typing.ArrayLike, ref: Leaf
) -> jax.typing.ArrayLike:
  """The inverse of :func:`_typed_rows` on as many devices."""
  if _typed_sharding.unreduced(ref):
    return restore_leaf(rows, ref)
  return placed(rows[0], ref)


def _stacked(x: jax.typing.ArrayLike, count: int) -> jax.Array:
  """``x`` stacked ``count`` times, as ``pmap`` holds a replicated value."""
  return jnp.broadcast_to(x, (count, *jnp.shape(x)))


def placed(tree: Tree, like: Tree) -> Tree:
  """``tree`` typed like ``like`` and on its devices (where ``like`` holds
  arrays or shapes with a sharding, and no partial sums)."""

  def place(x, ref):
    x = _typed_sharding.like(x, ref)
    sharding = getattr(ref, 'sharding', None)
    if (
      sharding is None
      or _typed_sharding.reduced(ref)
      or _typed_sharding.unreduced(ref)
    ):
      return x
    return jax.device_put(x, sharding)

  return jax.tree.map(place, tree, like)


def restore_leaf(x: jax.typing.ArrayLike, ref: Leaf) -> jax.typing.ArrayLike:
  """A leaf that :func:`leaf_rows` saved, typed like ``ref`` again."""
  if not _typed_sharding.unreduced(ref):
    return _typed_sharding.like(x, ref)
  if jnp.shape(x) != jax.eval_shape(leaf_rows, ref).shape:
    raise ValueError(
      f'from_checkpoint: a leaf of shape {jnp.shape(x)} does not hold the '
      f'partial sums of {jax.typeof(ref)}: like must be the tree given to '
      'to_checkpoint.'
    )
  return _typed_sharding.local(lambda v: v[0], (x,), _typed_sharding.spec(ref))
