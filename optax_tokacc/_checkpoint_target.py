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
"""The target orbax restores a checkpoint into (:func:`checkpoint_target`),
and the paths by which the checkpoint's modules name a tree's leaves.

The target is ``to_checkpoint(like)`` as shapes, dtypes and shardings, with
the rows each window was saved with. ``like`` may hold arrays, or abstract
values laid out on devices that only compile (ahead of time): the target is
then traced in ``jax.eval_shape`` and laid out on ``like``'s meshes.
"""

import contextlib
import functools
from typing import Any, Callable, Optional

import jax
import jax.numpy as jnp
import numpy as np

from optax_tokacc import _base
from optax_tokacc import _checkpoint_0_5
from optax_tokacc import _layouts
from optax_tokacc import _shares
from optax_tokacc import _state
from optax_tokacc import _typed_sharding
from optax_tokacc import _typing


def on_its_mesh(tree: _typing.ArrayTree) -> contextlib.AbstractContextManager:
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


def path_key(entry: Any) -> str:
  """A key of a pytree path as a string: orbax's metadata spells a
  NamedTuple's fields as a dict's keys and a tuple as a list."""
  for attribute in ('name', 'key', 'idx'):
    if hasattr(entry, attribute):
      return str(getattr(entry, attribute))
  return str(entry)


def paths(tree: Any) -> dict[tuple[str, ...], Any]:
  leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
  return {tuple(map(path_key, path)): leaf for path, leaf in leaves}


def where(path: tuple[str, ...]) -> str:
  return '/'.join(path) or 'the tree'


def _abstract(
  x: _typed_sharding.ArrayOrShape, shape: Optional[tuple] = None
) -> jax.ShapeDtypeStruct:
  """``x`` as a restore target of ``shape`` (``x``'s where None), on its
  devices: a row axis whose new length its sharding does not divide is
  replicated."""
  shape = tuple(jnp.shape(x)) if shape is None else shape
  sharding = getattr(x, 'sharding', None)
  if shape != jnp.shape(x) and isinstance(sharding, jax.NamedSharding):
    spec = _typed_sharding.partitions(sharding.spec)
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

  Example:
    ``like`` may be abstract (``jax.eval_shape``, or abstract values laid
    out on devices that only compile): the target is the same.

    >>> import jax, jax.numpy as jnp, optax
    >>> import optax_tokacc as tokacc
    >>> tx = tokacc.token_weighted_multistep(optax.sgd(0.1), 2)
    >>> params = {'w': jnp.zeros(3)}
    >>> like = jax.eval_shape(lambda p: (p, tx.init(p)), params)
    >>> saved = jax.eval_shape(tokacc.to_checkpoint, like)  # as orbax reads it
    >>> target = tokacc.checkpoint_target(like, saved)
    >>> target[1].state.grad_sums['w']  # the window: one row, one device
    ShapeDtypeStruct(shape=(1, 3), dtype=float32)
  """
  saved = paths(getattr(metadata, 'item_metadata', metadata))
  rows, of_0_5 = set(), {}

  def target_of(path, node):
    if not _state.is_state(node):
      return _layouts.leaf_rows(node)
    prefix = tuple(map(path_key, path))
    if _checkpoint_0_5.saved_by_0_5(prefix, saved):
      found = _checkpoint_0_5.target(node)
      # its shape, not the value: abstract, it is traced here only
      of_0_5[prefix] = jnp.shape(found.acc_tokens)
      return found
    form = _shares.save_state(node)
    per_device = paths(_base.per_device(form.state))
    rows.update(prefix + ('state',) + sub for sub in per_device)
    return form

  with on_its_mesh(like):
    target = jax.tree_util.tree_map_with_path(
      functools.partial(_abstract_if_needed, target_of),
      like,
      is_leaf=_state.is_state,
    )
  expected = paths(target)
  _check_same_leaves(expected, saved)
  out = []
  for path, x in expected.items():
    found = saved[path]
    shape, dtype = tuple(found.shape), jnp.dtype(found.dtype)
    rows_as_saved = path in rows and shape[1:] == jnp.shape(x)[1:]
    if (
      dtype != jnp.result_type(x) or shape != jnp.shape(x) and not rows_as_saved
    ):
      _refuse_leaf(path, shape, dtype, x, of_0_5, saved)
    out.append(_abstract(x, shape if rows_as_saved else None))
  return jax.tree.unflatten(jax.tree.structure(target), out)


def _abstract_if_needed(
  target_of: Callable[[tuple, Any], Any], path: tuple, node: Any
) -> Any:
  """``target_of(path, node)``; for a ``node`` of abstract values (ahead of
  time: ``jax.ShapeDtypeStruct`` on devices that may only compile), traced
  in ``jax.eval_shape`` and laid out on ``node``'s mesh."""
  if not _base.is_abstract(node):
    return target_of(path, node)
  found = jax.eval_shape(lambda n: target_of(path, n), node)
  leaves = jax.tree.leaves(node)
  meshes = [m for m in map(_concrete_mesh, leaves) if m is not None]
  mesh = meshes[0] if meshes else None
  if isinstance(found, _base.SavedState):  # the state's leaves, then rows
    state = jax.tree.map(
      functools.partial(_laid_out, mesh=mesh), found.state, node
    )
    return found._replace(state=state, rows=_laid_out(found.rows, None, mesh))
  return jax.tree.map(functools.partial(_laid_out, mesh=mesh), found, node)


def _concrete_mesh(x: Any) -> Optional[jax.sharding.Mesh]:
  mesh = getattr(getattr(x, 'sharding', None), 'mesh', None)
  return mesh if isinstance(mesh, jax.sharding.Mesh) else None


def _laid_out(
  found: jax.ShapeDtypeStruct,
  ref: Optional[_typed_sharding.ArrayOrShape],
  mesh: Optional[jax.sharding.Mesh],
) -> jax.ShapeDtypeStruct:
  """``found`` (traced from ``ref``) on ``ref``'s concrete mesh: a type's
  spec there (``jax.eval_shape`` gives the abstract mesh of an explicit
  one); on an Auto mesh, whose types carry no layout, ``ref``'s sharding,
  behind a replicated row axis where one was added."""
  sharding = found.sharding
  if isinstance(sharding, jax.NamedSharding) and mesh is not None:
    sharding = jax.NamedSharding(mesh, sharding.spec)
  elif isinstance(getattr(ref, 'sharding', None), jax.NamedSharding):
    spec = _typed_sharding.partitions(ref.sharding.spec)
    extra = (None,) * (len(found.shape) - len(jnp.shape(ref)))
    sharding = jax.NamedSharding(ref.sharding.mesh, jax.P(*extra, *spec))
  elif mesh is not None:
    sharding = jax.NamedSharding(mesh, jax.P())
  return jax.ShapeDtypeStruct(found.shape, found.dtype, sharding=sharding)


def _check_same_leaves(expected: dict, saved: dict) -> None:
  missing = sorted(set(expected) - set(saved))
  extra = sorted(set(saved) - set(expected))
  if missing or extra:
    raise ValueError(
      'checkpoint_target: the checkpoint does not hold the leaves like would '
      f'have: missing {[where(p) for p in missing[:3]]}, unexpected '
      f'{[where(p) for p in extra[:3]]}: another optimizer (inner), other '
      'parameters, or another transform configuration.'
    )


def _refuse_leaf(
  path: tuple[str, ...],
  shape: tuple[int, ...],
  dtype: jnp.dtype,
  x: _typed_sharding.ArrayOrShape,
  of_0_5: dict,
  saved: dict,
) -> None:
  """The error for a saved leaf that does not fit its target ``x``."""
  for prefix, now in of_0_5.items():
    if path[: len(prefix)] == prefix:
      raise _checkpoint_0_5.refusal(prefix, now, saved, where(prefix))
  raise ValueError(
    f'checkpoint_target: {where(path)} was saved as {dtype}{list(shape)}, '
    f'and is {jnp.result_type(x)}{list(jnp.shape(x))} here: the checkpoint '
    'is of another configuration (accumulator_dtype, token_dtype, inner, or '
    'the parameters).'
  )
