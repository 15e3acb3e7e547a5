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
"""Checkpoints that resume anywhere: on any number of devices, exactly.

An open window is held per device: its sums are the devices' shares (a
slot per device under ``axis_name``, partial sums typed *unreduced* under
explicit sharding). :func:`to_checkpoint` saves each share as a row of an
ordinary array, and records how many rows each leaf has (a
:class:`SavedState`). :func:`checkpoint_target` gives orbax the target to
restore into, on the devices of ``like``, with as many rows as were saved;
:func:`from_checkpoint` puts the rows back where they were saved on as many
devices (bit for bit), and otherwise merges them into the window's totals
(sums are linear: exact, in another order of summation) and hands the
totals to the first device of the new layout.
"""

import contextlib
import functools
from typing import Any, NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np

from optax_tokacc import _compensated
from optax_tokacc import _explicit
from optax_tokacc import _state
from optax_tokacc import _tokens

_PER_DEVICE = _state.PER_DEVICE_FIELDS
# How a state holds its per-device fields (see :func:`_layout_of`).
_PMAP, _SLOTS, _TYPED = 'pmap', 'slots', 'typed'


class SavedState(NamedTuple):
  """What :func:`to_checkpoint` saves of a ``TokenWeightedMultiStepState``.

  Attributes:
    state: the state, its per-device fields (``grad_sums``,
      ``acc_compensation``, ``acc_tokens``, ``acc_loss``, ``skip_state``)
      with a leading axis of rows, one per device that holds a share of
      the window (one row where the window is whole), every other field
      whole.
    rows: int32, per leaf of the per-device fields (in their tree order),
      its number of rows when saved: a restore that padded or truncated
      them (orbax's ``strict=False``) is refused.
  """

  state: Any
  rows: Any


def _layout_of(state: Any) -> str:
  """How ``state`` (arrays or their shapes) holds its per-device fields:
  ``pmap`` (every leaf stacked per device, with the slot of ``shard_map``
  inside), ``slots`` (``shard_map`` with ``axis_name``: a leading axis of
  one slot per device), or ``typed`` (each leaf whole, or partial sums
  typed unreduced: explicit sharding, one device, ``jax.jit`` over global
  arrays)."""
  if jnp.ndim(state.mini_step) == 1:
    return _PMAP
  return _SLOTS if jnp.ndim(state.acc_tokens) == 1 else _TYPED


def _on_its_mesh(tree: Any) -> Any:
  """``jax.set_mesh`` of the mesh in ``tree``'s types, where none is set
  (typed arrays are retyped with specs, which need it)."""
  if not jax.sharding.get_abstract_mesh().empty:
    return contextlib.nullcontext()
  for leaf in jax.tree.leaves(tree):
    sharding = getattr(leaf, 'sharding', None)
    mesh = getattr(sharding, 'mesh', None)
    explicit = jax.sharding.AxisType.Explicit in getattr(mesh, 'axis_types', ())
    if explicit and isinstance(mesh, jax.sharding.Mesh):
      return jax.set_mesh(mesh)
  return contextlib.nullcontext()


def _is_saved(x: Any) -> bool:
  return isinstance(x, SavedState)


def _per_device(state: Any) -> dict[str, Any]:
  return {name: getattr(state, name) for name in _PER_DEVICE}


def _leading(x: Any) -> int:
  return int(jnp.shape(x)[0])


# Saving.


def _rows(x: Any) -> Any:
  """An unreduced ``x`` of shape ``s`` as its devices' partial sums,
  ``(n, *s)`` split over the axes it is unreduced over (no data moves);
  a reduced ``x`` typed replicated; any other ``x`` as it is."""
  axes = _explicit.unreduced(x)
  if not axes:
    return _explicit.without_reduced(x)
  lead = tuple(a for a in _explicit.mesh_of(x).axis_names if a in axes)
  out = jax.P(lead, *_explicit.partitions(_explicit.spec(x)))
  return _explicit.local(lambda v: v[None], (x,), out)


def _one_row(x: Any) -> Any:
  """A whole ``x`` as one row (its unreduced axes of one device reduced,
  its reduced types replicated: ordinary arrays)."""
  (x,) = _explicit.reduce_trivial(x)
  return jnp.expand_dims(_explicit.without_reduced(x), 0)


def _shares(x: Any) -> Any:
  """A per-device leaf of a ``typed`` state as rows of shares: its partial
  sums where typed unreduced, else itself as one row."""
  return _rows(x) if _explicit.unreduced(x) else _one_row(x)


def _save_state(state: Any) -> SavedState:
  layout = _layout_of(state)
  if layout == _PMAP:  # every device holds every field: one copy, rows
    whole = jax.tree.map(lambda x: x[0], state)
    saved = whole._replace(
      **jax.tree.map(lambda x: x[:, 0], _per_device(state))
    )
  elif layout == _SLOTS:
    saved = state
  else:
    per_device = jax.tree.map(_shares, _per_device(state))
    saved = jax.tree.map(_rows, state)._replace(**per_device)
  counts = [_leading(x) for x in jax.tree.leaves(_per_device(saved))]
  return SavedState(saved, jnp.asarray(counts, jnp.int32))


def to_checkpoint(tree: Any) -> Any:
  """``tree`` in a form that orbax saves and restores on any devices.

  Every :class:`~optax_tokacc.TokenWeightedMultiStepState` in ``tree``
  becomes a :class:`SavedState`: its window's per-device shares as rows
  of ordinary arrays (the devices' slots under ``axis_name``, their
  partial sums under explicit sharding, one row on one device), with the
  number of rows recorded. Other leaves typed *reduced* are typed
  replicated (orbax cannot write their metadata), and other *unreduced*
  leaves get a leading axis of their devices' partial sums; the rest is
  returned as it is. Nothing is summed or rounded and no data moves:
  :func:`from_checkpoint` restores the same state bit for bit on as many
  devices, and merges the shares exactly on any other number.

  Args:
    tree: a pytree of arrays, e.g. ``(params, opt_state)``.

  Returns:
    The tree to save, e.g. with ``orbax.checkpoint``.

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
    >>> print(jax.typeof(saved.state.grad_sums['w']))  # one row per device
    float32[2@data,3]
    >>> print(jax.typeof(restored.grad_sums['w']))
    float32[3]{U:data}

    With orbax, restore into :func:`checkpoint_target`, built from the
    checkpoint's metadata and a state made on the devices at hand::

      ckptr.save(path, tokacc.to_checkpoint((params, opt_state)))
      like = (params0, tx.init(params0))  # or tokacc.init_sharded(...)
      target = tokacc.checkpoint_target(like, ckptr.metadata(path))
      params, opt_state = tokacc.from_checkpoint(
          ckptr.restore(path, target), like)
  """
  with _on_its_mesh(tree):
    return jax.tree.map(
      lambda x: _save_state(x) if _state.is_state(x) else _rows(x),
      tree,
      is_leaf=_state.is_state,
    )


# The target of a restore.


def _path_key(entry: Any) -> str:
  """A key of a pytree path as a string: orbax's metadata spells a
  NamedTuple's fields as a dict's keys and a tuple as a list."""
  for attribute in ('name', 'key', 'idx'):
    if hasattr(entry, attribute):
      return str(getattr(entry, attribute))
  return str(entry)


def _paths(tree: Any) -> dict[tuple[str, ...], Any]:
  leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
  return {tuple(map(_path_key, path)): leaf for path, leaf in leaves}


def _where(path: tuple[str, ...]) -> str:
  return '/'.join(path) or 'the tree'


def _abstract(x: Any, shape: Optional[tuple] = None) -> jax.ShapeDtypeStruct:
  """``x`` as a restore target of ``shape`` (``x``'s where None), on its
  devices: a row axis whose new length its sharding does not divide is
  replicated."""
  shape = tuple(jnp.shape(x)) if shape is None else shape
  sharding = getattr(x, 'sharding', None)
  if shape != jnp.shape(x) and isinstance(sharding, jax.NamedSharding):
    spec = _explicit.partitions(sharding.spec)
    lead = spec[0] if spec else None
    size = np.prod([sharding.mesh.shape[a] for a in jax.tree.leaves(lead)])
    if shape[0] % int(size):
      rest = spec[1:] + (None,) * (len(shape) - len(spec))
      sharding = jax.NamedSharding(sharding.mesh, jax.P(None, *rest[:-1]))
  return jax.ShapeDtypeStruct(shape, jnp.result_type(x), sharding=sharding)


def checkpoint_target(like: Any, metadata: Any) -> Any:
  """The target orbax restores a checkpoint of :func:`to_checkpoint` into.

  It is ``to_checkpoint(like)`` as shapes, dtypes and shardings on the
  devices of ``like``, except that each per-device leaf of a window keeps
  the number of rows it was saved with, whatever the number of devices
  then and now: :func:`from_checkpoint` merges them. A checkpoint of
  another configuration is refused here, before orbax would cast or
  reshape what it reads.

  Args:
    like: a tree with the target types: e.g. ``(params, tx.init(params))``
      for parameters placed on the devices at hand (with ``axis_name``,
      ``tokacc.init_sharded``), as given to :func:`from_checkpoint`.
    metadata: the saved tree's shapes and dtypes, as orbax reads them:
      ``ckptr.metadata(path)`` (or its ``.item_metadata``), or any tree
      whose leaves have ``shape`` and ``dtype``.

  Returns:
    A tree of ``jax.ShapeDtypeStruct``, e.g. for
    ``ckptr.restore(path, target)``.

  Raises:
    ValueError: if the checkpoint holds other leaves than ``like`` would
      (another optimizer, other parameters), a leaf of another shape or
      dtype (another ``accumulator_dtype``, ``token_dtype``), or a window
      saved by 0.5 on another number of devices.
  """
  saved = _paths(getattr(metadata, 'item_metadata', metadata))
  rows, legacy = set(), {}

  def target_of(path, node):
    if not _state.is_state(node):
      return _rows(node)
    prefix = tuple(map(_path_key, path))
    if prefix + ('state', 'mini_step') not in saved:  # written by 0.5
      legacy[prefix] = node
      return jax.tree.map(_rows, node)
    form = _save_state(node)
    per_device = _paths(_per_device(form.state))
    rows.update(prefix + ('state',) + sub for sub in per_device)
    return form

  with _on_its_mesh(like):
    target = jax.tree_util.tree_map_with_path(
      target_of, like, is_leaf=_state.is_state
    )
  expected = _paths(target)
  _check_same_leaves(expected, saved)
  out = []
  for path, x in expected.items():
    found = saved[path]
    shape, dtype = tuple(found.shape), jnp.dtype(found.dtype)
    if path in rows and shape[1:] == jnp.shape(x)[1:]:
      out.append(_abstract(x, shape))  # the rows as saved
      continue
    if shape != jnp.shape(x) or dtype != jnp.result_type(x):
      _refuse_leaf(path, shape, dtype, x, legacy, saved)
    out.append(_abstract(x))
  return jax.tree.unflatten(jax.tree.structure(target), out)


def _check_same_leaves(expected: dict, saved: dict) -> None:
  missing = sorted(set(expected) - set(saved))
  extra = sorted(set(saved) - set(expected))
  if missing or extra:
    raise ValueError(
      'checkpoint_target: the checkpoint does not hold the leaves like would '
      f'have: missing {[_where(p) for p in missing[:3]]}, unexpected '
      f'{[_where(p) for p in extra[:3]]}: another optimizer (inner), other '
      'parameters, or another transform configuration.'
    )


def _refuse_leaf(path, shape, dtype, x, legacy: dict, saved: dict) -> None:
  """The error for a saved leaf that does not fit its target ``x``."""
  for prefix, node in legacy.items():
    if path[: len(prefix)] == prefix:
      before = saved[prefix + ('acc_tokens',)].shape
      now = jnp.shape(_rows(node.acc_tokens))
      raise ValueError(
        f'checkpoint_target: {_where(prefix)} was saved by optax_tokacc 0.5 '
        f'with the window of {before[0] if before else 1} device(s), and is '
        f'restored onto {now[0] if now else 1}: 0.5 did not record how to '
        'merge its shares. Restore it on the devices it was saved on, then '
        'save it again with this version: it then moves to any number.'
      )
  raise ValueError(
    f'checkpoint_target: {_where(path)} was saved as {dtype}{list(shape)}, '
    f'and is {jnp.result_type(x)}{list(jnp.shape(x))} here: the checkpoint '
    'is of another configuration (accumulator_dtype, token_dtype, inner, or '
    'the parameters).'
  )


# Restoring.


def from_checkpoint(tree: Any, like: Any) -> Any:
  """The inverse of :func:`to_checkpoint`, on the devices of ``like``.

  Each saved state's window is put back as it was where it was saved on
  as many devices (bit for bit: each device gets its own share back).
  Saved on another number of devices (its rows are not ``like``'s), the
  window's shares are merged exactly into its totals: the gradient sums
  (with Kahan compensation, their error terms too), the token count (an
  invalid count, -1 on any device, keeps the window invalid) and the
  loss; the first device of ``like``'s layout holds the totals, the others
  zeros, and training resumes as full-batch training would, in another
  order of summation. At a window boundary there is nothing to merge. A
  skip state (``should_skip_update_fn``'s) is the last micro-step's
  decision on each device: merged, its booleans are any device's and its
  numbers their sum (as under explicit sharding), held by every device;
  the next micro-step replaces it.

  Merging runs eagerly (call this outside ``jax.jit``), with a collective
  of the window's size. ``k`` is not part of the state (as in
  ``optax.MultiSteps``): a transform of another ``every_k_schedule``
  closes the open window once ``mini_step`` reaches its ``k``, as a
  schedule that changes ``k`` would.

  Args:
    tree: what :func:`to_checkpoint` gave, e.g. restored by orbax into
      :func:`checkpoint_target`.
    like: a tree with the target types, as given to
      :func:`checkpoint_target`: e.g. ``(params, tx.init(params))`` for
      parameters placed as in training (``tokacc.init_sharded`` with
      ``axis_name``), or its ``jax.eval_shape``.

  Returns:
    ``tree`` typed and laid out like ``like``.

  Raises:
    ValueError: if ``tree`` is not the form :func:`to_checkpoint` gives
      for ``like``: rows padded or truncated by a restore (orbax's
      ``strict=False`` with a target of another number of devices), a leaf
      of another shape or dtype, or shares that cannot be told from whole
      sums (rows that repeat one non-zero value under ``shard_map``).
  """

  def restore(saved, ref):
    if _state.is_state(ref):
      if _is_saved(saved):
        return _restore_state(saved, ref)
      return _restore_0_5(saved, ref)
    return _restore_leaf(saved, ref)

  with _on_its_mesh(like):
    return jax.tree.map(restore, tree, like, is_leaf=_is_state_form)


def _is_state_form(x: Any) -> bool:
  return _is_saved(x) or _state.is_state(x)


def _restore_leaf(x: Any, ref: Any) -> Any:
  """A leaf that :func:`_rows` saved, typed like ``ref`` again."""
  if not _explicit.unreduced(ref):
    return _explicit.like(x, ref)
  if jnp.shape(x) != jax.eval_shape(_rows, ref).shape:
    raise ValueError(
      f'from_checkpoint: a leaf of shape {jnp.shape(x)} does not hold the '
      f'partial sums of {jax.typeof(ref)}: like must be the tree given to '
      'to_checkpoint.'
    )
  return _explicit.local(lambda v: v[0], (x,), _explicit.spec(ref))


def _restore_0_5(saved: Any, ref: Any) -> Any:
  """A state in the form 0.5's ``to_checkpoint`` saved (no rows record),
  restored on as many devices as it was saved on."""
  if not _state.is_state(saved):
    raise ValueError(
      f'from_checkpoint: got {type(saved).__name__} where like holds a '
      'TokenWeightedMultiStepState: restore into tokacc.checkpoint_target.'
    )
  return jax.tree.map(_restore_leaf, saved, ref)


def _row_counts(state: Any) -> list[int]:
  """The rows :func:`to_checkpoint` gives each per-device leaf of
  ``state`` (arrays or their shapes, ``like``'s)."""
  layout = _layout_of(state)
  leaves = jax.tree.leaves(_per_device(state))
  if layout != _TYPED:
    return [_leading(x) for x in leaves]
  mesh_sizes = lambda x: dict(getattr(_explicit.mesh_of(x), 'shape', {}))  # noqa: E731
  return [
    int(np.prod([mesh_sizes(x)[a] for a in _explicit.unreduced(x)]))
    for x in leaves
  ]


def _restore_state(saved: SavedState, ref: Any) -> Any:
  """``saved`` (a :class:`SavedState`) laid out like the state ``ref``."""
  state = saved.state
  _check_like(state, ref)
  counts = [_leading(x) for x in jax.tree.leaves(_per_device(state))]
  recorded = [int(n) for n in np.asarray(saved.rows)]
  now = _row_counts(ref)
  if counts != recorded:
    raise ValueError(
      f'from_checkpoint: the window was saved with the shares of '
      f'{max(recorded)} device(s), but {max(counts)} rows were restored: '
      "padded or truncated (orbax's strict=False). Restore into "
      'tokacc.checkpoint_target(like, ckptr.metadata(path)).'
    )
  if counts == now:  # as many devices: each gets its own share back
    return _put_back(state, ref)
  return _merged(state, ref)


def _check_like(state: Any, ref: Any) -> None:
  """``state`` must be a saved state of ``ref``'s configuration."""
  per_device = _paths(_per_device(state))
  targets = _paths(_per_device(ref))
  same_tree = jax.tree.structure(state) == jax.tree.structure(ref)
  if not same_tree or set(per_device) != set(targets):
    raise ValueError(
      'from_checkpoint: the saved state has another structure than like '
      f'(saved {jax.tree.structure(state)}, like {jax.tree.structure(ref)}):'
      ' another inner optimizer or configuration (compensated, '
      'should_skip_update_fn).'
    )
  saved_leaves = _paths(state)
  for path, x in _paths(ref).items():
    dtype = jnp.result_type(saved_leaves[path])
    if dtype != jnp.result_type(x):
      raise ValueError(
        f'from_checkpoint: {_where(path)} was saved as {dtype} and is '
        f'{jnp.result_type(x)} here: another accumulator_dtype or '
        'token_dtype, or another optimizer.'
      )


def _put_back(state: Any, ref: Any) -> Any:
  """Each device's share where it was saved, typed like ``ref``."""
  layout = _layout_of(ref)
  rows = _per_device(state)
  if layout == _PMAP:
    shares = _placed(jax.tree.map(lambda x: x[:, None], rows), _per_device(ref))
  elif layout == _SLOTS:
    shares = _placed(rows, _per_device(ref))
  else:
    shares = jax.tree.map(_from_shares, rows, _per_device(ref))
  return _whole_fields(state, ref)._replace(**shares)


def _whole_fields(state: Any, ref: Any) -> Any:
  """``state`` with its fields other than the per-device ones laid out
  like ``ref``'s (the per-device ones left as they are)."""
  layout = _layout_of(ref)
  fields = {}
  for name in state._fields:
    value, like = getattr(state, name), getattr(ref, name)
    if name in _PER_DEVICE:
      continue
    if layout == _PMAP:
      count = _leading(ref.mini_step)
      value = jax.tree.map(lambda x: _stacked(x, count), value)  # noqa: B023
    if layout == _TYPED:
      fields[name] = jax.tree.map(_restore_leaf, value, like)
    else:
      fields[name] = _placed(value, like)
  return state._replace(**fields)


def _merged(state: Any, ref: Any) -> Any:
  """The window of ``state``'s rows (the shares of another number of
  devices) merged into its totals, held by the first device of ``ref``'s
  layout."""
  if any(isinstance(x, jax.core.Tracer) for x in jax.tree.leaves(state)):
    raise ValueError(
      'from_checkpoint merges a window saved on another number of devices '
      'eagerly: call it outside jax.jit.'
    )
  rows = jax.tree.map(_gathered, _per_device(state))
  totals = _window_totals(rows, at_boundary=int(state.mini_step) == 0)
  layout = _layout_of(ref)
  shares = {
    name: jax.tree.map(
      functools.partial(_spread, layout, everywhere=name == 'skip_state'),
      totals[name],
      getattr(ref, name),
    )
    for name in _PER_DEVICE
  }
  return _whole_fields(state, ref)._replace(**shares)


def _gathered(x: Any) -> Any:
  """``x`` with its row axis whole on each of its devices (its other
  dimensions split as they are): the rows' sums then need no collective."""
  sharding = getattr(x, 'sharding', None)
  if not isinstance(sharding, jax.NamedSharding):
    return x
  spec = _explicit.partitions(sharding.spec)
  if not spec or spec[0] is None:
    return x
  return jax.device_put(
    x, jax.NamedSharding(sharding.mesh, jax.P(None, *spec[1:]))
  )


def _window_totals(rows: dict[str, Any], at_boundary: bool) -> dict[str, Any]:
  """The window's totals from the rows of its devices' shares: gradient
  sums with their compensation (none at a window boundary, where the
  buffers are scratch), the count (invalid if any share is), the loss, and
  the skip state (any device's booleans, the sum of its numbers)."""
  grads, errors = rows['grad_sums'], rows['acc_compensation']
  compensated = bool(jax.tree.leaves(errors))
  if at_boundary:
    zeros = lambda x: jnp.zeros_like(x[0])  # noqa: E731
    grad_totals, error_totals = jax.tree.map(zeros, (grads, errors))
  elif compensated:
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
    _tokens.add, [counts[i] for i in range(_leading(counts))]
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


def _spread(layout: str, total: jax.Array, ref: Any, everywhere: bool) -> Any:
  """A window's ``total`` in ``ref``'s layout: on its first device (zeros
  on the others), or on every device (``everywhere``)."""
  if layout == _TYPED:
    if _explicit.unreduced(ref) and not everywhere:
      return _on_first_device(total, ref)
    return _placed(total, ref)
  shape = jnp.shape(ref)  # (devices, [1,] *total's shape)
  first = (0,) * (len(shape) - jnp.ndim(total))

  def build(t):
    if everywhere:
      return jnp.broadcast_to(t, shape)
    return jnp.zeros(shape, t.dtype).at[first].set(t)

  sharding = getattr(ref, 'sharding', None)
  if isinstance(sharding, jax.NamedSharding):  # built on the devices
    return jax.jit(build, out_shardings=sharding)(total)
  return _placed(build(total), ref)


def _on_first_device(total: jax.Array, ref: Any) -> jax.Array:
  """``total`` typed like ``ref`` (unreduced): held by the first device
  along the axes ``ref`` is unreduced over, zeros on the others."""
  axes = sorted(_explicit.unreduced(ref))
  total = _explicit.to_type(total, _explicit.spec(ref, unreduced=False))

  def first(v):
    index = sum(jax.lax.axis_index(a) for a in axes)  # 0 on the first only
    return jnp.where(index == 0, v, jnp.zeros_like(v))

  return _explicit.local(first, (total,), _explicit.spec(ref))


def _from_shares(rows: Any, ref: Any) -> Any:
  """The inverse of :func:`_shares` on as many devices."""
  if _explicit.unreduced(ref):
    return _restore_leaf(rows, ref)
  return _placed(rows[0], ref)


def _stacked(x: Any, count: int) -> jax.Array:
  """``x`` stacked ``count`` times, as ``pmap`` holds a replicated value."""
  return jnp.broadcast_to(x, (count, *jnp.shape(x)))


def _placed(tree: Any, like: Any) -> Any:
  """``tree`` typed like ``like`` and on its devices (where ``like`` holds
  arrays or shapes with a sharding, and no partial sums)."""

  def place(x, ref):
    x = _explicit.like(x, ref)
    sharding = getattr(ref, 'sharding', None)
    if sharding is None or _explicit.reduced(ref) or _explicit.unreduced(ref):
      return x
    return jax.device_put(x, sharding)

  return jax.tree.map(place, tree, like)
