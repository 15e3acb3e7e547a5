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
"""The window's per-device shares, as rows of ordinary arrays.

An open window is held per device: a slot per device under ``axis_name``
(``pmap`` stacks every field, ``shard_map`` the per-device ones), partial
sums typed *unreduced* under explicit sharding, the whole window on one
device or under ``jax.jit`` over global arrays. Every device's share is a
share of a sum (``_manual.Manual.share_of``), so the shares of any number of
devices merge by summing. :func:`save_state` lays a state's shares out as
rows (a :class:`~optax_tokacc.SavedState`); :func:`put_back` returns each
row to its device, on as many devices; :func:`merged` sums the rows into
the window's totals and gives them to the first device of another layout.
How a state holds its shares is one of three layouts (:class:`Pmap`,
:class:`Slots`, :class:`Typed`), chosen once per state by
:func:`layout_of`; the functions here ask the layout, never which it is.
"""

import abc
from collections.abc import Callable
import dataclasses
import functools
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np

from optax_tokacc import _base
from optax_tokacc import _compensated
from optax_tokacc import _tokens
from optax_tokacc import _typed_sharding
from optax_tokacc import _typing

PER_DEVICE = _base.PER_DEVICE_FIELDS
State = _base.TokenWeightedMultiStepState  # arrays, or their shapes
Tree = _typing.ArrayTree
Leaf = _typed_sharding.ArrayOrShape


def per_device(state: State) -> dict[str, Tree]:
  return {name: getattr(state, name) for name in PER_DEVICE}


def leading(x: Leaf) -> int:
  return int(jnp.shape(x)[0])


class Layout(abc.ABC):
  """How a state (arrays or their shapes) holds its per-device fields, and
  so how they are saved as rows, put back, and given a merged window."""

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

  def rows(self, leaf: Leaf) -> int:
    """The rows :meth:`save` gives a per-device leaf: its leading axis."""
    return leading(leaf)

  def spread(
    self,
    total: jax.Array,
    ref: Leaf,
    everywhere: bool,
  ) -> jax.Array:
    """A window's ``total`` in the slots of ``ref`` (devices, [1,] *total's
    shape): on its first device (zeros on the others), or on every device
    (``everywhere``)."""
    shape = jnp.shape(ref)
    if everywhere:
      return jnp.broadcast_to(total, shape)
    first = (0,) * (len(shape) - jnp.ndim(total))
    return jnp.zeros(shape, total.dtype).at[first].set(total)

  def merge(self, merge: Callable, rows: dict, refs: dict) -> dict:
    """``merge(rows)`` placed like ``refs``: in one program for every
    leaf."""
    shardings = jax.tree.map(_out_sharding, refs)
    return jax.jit(merge, out_shardings=shardings)(rows)


@dataclasses.dataclass(frozen=True)
class Pmap(Layout):
  """``pmap``: every leaf stacked over its ``devices``, with the slot of
  ``axis_name`` inside the per-device fields."""

  devices: int

  def save(self, state: State) -> State:
    whole = jax.tree.map(lambda x: x[0], state)  # one copy of each field
    return whole._replace(**jax.tree.map(lambda x: x[:, 0], per_device(state)))

  def put_back(self, rows: dict[str, Tree], refs: dict[str, Tree]) -> dict:
    return _placed(jax.tree.map(lambda x: x[:, None], rows), refs)

  def whole_field(self, value: Tree, like: Tree) -> Tree:
    stacked = jax.tree.map(lambda x: _stacked(x, self.devices), value)
    return _placed(stacked, like)

  def merge(self, merge: Callable, rows: dict, refs: dict) -> dict:
    """Op by op, then placed as ``pmap`` holds its values."""
    return _placed(merge(rows), refs)


class Slots(Layout):
  """``shard_map`` with ``axis_name``: the per-device fields with a leading
  axis of one slot per device, the others whole."""

  def save(self, state: State) -> State:
    return state

  def put_back(self, rows: dict[str, Tree], refs: dict[str, Tree]) -> dict:
    return _placed(rows, refs)

  def whole_field(self, value: Tree, like: Tree) -> Tree:
    return _placed(value, like)


class Typed(Layout):
  """Each leaf whole, or partial sums typed unreduced: explicit sharding,
  one device, ``jax.jit`` over global arrays."""

  def save(self, state: State) -> State:
    shares = jax.tree.map(_shares, per_device(state))
    return jax.tree.map(leaf_rows, state)._replace(**shares)

  def put_back(self, rows: dict[str, Tree], refs: dict[str, Tree]) -> dict:
    return jax.tree.map(_from_shares, rows, refs)

  def whole_field(self, value: Tree, like: Tree) -> Tree:
    return jax.tree.map(restore_leaf, value, like)

  def rows(self, leaf: Leaf) -> int:
    """The devices whose partial sums ``leaf`` holds: 1 for a whole leaf."""
    sizes = dict(getattr(_typed_sharding.mesh_of(leaf), 'shape', {}))
    return int(np.prod([sizes[a] for a in _typed_sharding.unreduced(leaf)]))

  def spread(
    self,
    total: jax.Array,
    ref: Leaf,
    everywhere: bool,
  ) -> jax.Array:
    """Typed like ``ref``: partial sums on its first device, unless
    ``everywhere``."""
    if _typed_sharding.unreduced(ref) and not everywhere:
      return _on_first_device(total, ref)
    return _typed_sharding.like(total, ref)


def layout_of(state: State) -> Layout:
  """How ``state`` (arrays or their shapes) holds its per-device fields,
  read once from its ranks: ``pmap`` stacks every field (``mini_step``
  too), ``shard_map`` with ``axis_name`` only the per-device ones (the
  count too); else every leaf is whole or typed."""
  if jnp.ndim(state.mini_step) == 1:
    return Pmap(leading(state.mini_step))
  return Slots() if jnp.ndim(state.acc_tokens) == 1 else Typed()


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


def _shares(x: jax.typing.ArrayLike) -> jax.typing.ArrayLike:
  """A per-device leaf of a :class:`Typed` state as rows of shares: its
  partial sums where typed unreduced, else itself as one row."""
  return leaf_rows(x) if _typed_sharding.unreduced(x) else _one_row(x)


def save_state(state: State) -> _base.SavedState:
  """``state`` as :func:`optax_tokacc.to_checkpoint` saves it."""
  saved = layout_of(state).save(state)
  counts = [leading(x) for x in jax.tree.leaves(per_device(saved))]
  return _base.SavedState(saved, jnp.asarray(counts, jnp.int32))


def row_counts(state: State) -> list[int]:
  """The rows :func:`save_state` gives each per-device leaf of
  ``state`` (arrays or their shapes, ``like``'s)."""
  layout = layout_of(state)
  return [layout.rows(x) for x in jax.tree.leaves(per_device(state))]


def put_back(
  state: State,
  ref: State,
) -> State:
  """Each device's share where it was saved, typed like ``ref``."""
  layout = layout_of(ref)
  shares = layout.put_back(per_device(state), per_device(ref))
  return _whole_fields(layout, state, ref)._replace(**shares)


def _whole_fields(
  layout: Layout,
  state: State,
  ref: State,
) -> State:
  """``state`` with its fields other than the per-device ones laid out
  like ``ref``'s (the per-device ones left as they are)."""
  fields = {
    name: layout.whole_field(getattr(state, name), getattr(ref, name))
    for name in state._fields
    if name not in PER_DEVICE
  }
  return state._replace(**fields)


def merged(
  state: State,
  ref: State,
) -> State:
  """The window of ``state``'s rows (the shares of another number of
  devices) merged into its totals, held by the first device of ``ref``'s
  layout."""
  if any(isinstance(x, jax.core.Tracer) for x in jax.tree.leaves(state)):
    raise ValueError(
      'from_checkpoint merges a window saved on another number of devices '
      'eagerly: call it outside jax.jit.'
    )
  rows = jax.tree.map(_gathered, per_device(state))
  layout = layout_of(ref)
  refs = per_device(ref)

  def merge(rows):
    totals = _window_totals(rows)
    return {
      name: jax.tree.map(
        functools.partial(layout.spread, everywhere=name == 'skip_state'),
        totals[name],
        refs[name],
      )
      for name in PER_DEVICE
    }

  shares = layout.merge(merge, rows, refs)
  return _whole_fields(layout, state, ref)._replace(**shares)


def _out_sharding(ref: Leaf) -> Optional[jax.NamedSharding]:
  """Where a merged leaf is put: ``ref``'s sharding, or where its types
  say (partial sums typed unreduced, reduced types, shapes without one)."""
  sharding = getattr(ref, 'sharding', None)
  typed = _typed_sharding.unreduced(ref) or _typed_sharding.reduced(ref)
  if isinstance(sharding, jax.NamedSharding) and not typed:
    return sharding
  return None


def _gathered(x: jax.typing.ArrayLike) -> jax.typing.ArrayLike:
  """``x`` with its row axis whole on each of its devices (its other
  dimensions split as they are): the rows' sums then need no collective."""
  sharding = getattr(x, 'sharding', None)
  if not isinstance(sharding, jax.NamedSharding):
    return x
  spec = _typed_sharding.partitions(sharding.spec)
  if not spec or spec[0] is None:
    return x
  return jax.device_put(
    x, jax.NamedSharding(sharding.mesh, jax.P(None, *spec[1:]))
  )


def _window_totals(
  rows: dict[str, Tree],
) -> dict[str, Tree]:
  """The window's totals from the rows of its devices' shares: gradient
  sums with their compensation, the count (invalid if any share is), the
  loss, and the skip state (any device's booleans, the sum of its
  numbers)."""
  grads, errors = rows['grad_sums'], rows['acc_compensation']
  compensated = bool(jax.tree.leaves(errors))
  if compensated:
    merged = jax.tree.map(_compensated.merge_rows, grads, errors)
    structure = jax.tree.structure(grads)
    grad_totals, error_totals = jax.tree.transpose(structure, None, merged)
  else:
    grad_totals = jax.tree.map(
      lambda g: _compensated.merge_rows(g, None)[0], grads
    )
    error_totals = errors
  counts = rows['acc_tokens']
  tokens = functools.reduce(
    _tokens.add, [counts[i] for i in range(leading(counts))]
  )
  return {
    'grad_sums': grad_totals,
    'acc_compensation': error_totals,
    'acc_tokens': tokens,
    'acc_loss': jnp.sum(rows['acc_loss'], axis=0),
    'skip_state': jax.tree.map(_combined, rows['skip_state']),
  }


def _combined(rows: jax.Array) -> jax.Array:
  """A skip state's rows as one: any device's booleans, the sum of their
  numbers (as explicit sharding keeps it)."""
  if jnp.result_type(rows) == jnp.bool_:
    return jnp.any(rows, axis=0)
  return jnp.sum(rows, axis=0, dtype=jnp.result_type(rows))


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


def _from_shares(rows: jax.typing.ArrayLike, ref: Leaf) -> jax.typing.ArrayLike:
  """The inverse of :func:`_shares` on as many devices."""
  if _typed_sharding.unreduced(ref):
    return restore_leaf(rows, ref)
  return _placed(rows[0], ref)


def _stacked(x: jax.typing.ArrayLike, count: int) -> jax.Array:
  """``x`` stacked ``count`` times, as ``pmap`` holds a replicated value."""
  return jnp.broadcast_to(x, (count, *jnp.shape(x)))


def _placed(tree: Tree, like: Tree) -> Tree:
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
