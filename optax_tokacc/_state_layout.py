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
"""The layout of the whole optimizer state on a mesh, from the parameters'.

No training step writes the state's layout by hand: the parameter-shaped
parts of the state follow the parameters' specs (optax's
``tree_map_params``), scalars are replicated, and with ``axis_name`` the
per-device fields of :class:`TokenWeightedMultiStepState` stack the
devices' shares along their leading slot axis, split over the data axes
along which the parameter is not sharded.
"""

from collections.abc import Callable
import functools
from typing import Any, Optional

import jax
import jax.numpy as jnp
import optax

from optax_tokacc import _base
from optax_tokacc import _layouts
from optax_tokacc import _optimizer_shards
from optax_tokacc import _state
from optax_tokacc import _typed_sharding
from optax_tokacc import _typing


def _state_specs_like_params(
  tx: optax.GradientTransformation,
  abstract: _typing.OptState,
  specs: _typing.Specs,
  params: _typing.Params,
) -> _typing.Specs:
  """The specs of ``tx``'s state: parameter-shaped leaves take ``specs``'
  (a ``MaskedNode`` of ``optax.masked`` or ``multi_transform`` stays
  one); the others (scalars, adafactor's factored moments) are
  replicated."""

  def param_spec(leaf, spec, param):
    if _optimizer_shards.is_masked(leaf):
      return leaf
    shape, like = jnp.shape(leaf), jnp.shape(param)  # behind a slot axis?
    return spec if shape[len(shape) - len(like) :] == like else jax.P()

  args = dict(
    transform_non_params=lambda _: jax.P(), is_leaf=_optimizer_shards.is_masked
  )
  return _traced(
    optax.tree_map_params, tx, param_spec, abstract, specs, params, **args
  )


def _traced(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
  """``fn(*args, **kwargs)``, a tree of Python values (specs), computed
  inside a ``jax.eval_shape`` trace: ``optax.tree_map_params`` runs
  ``tx.init``, whose arrays are then abstract. Made eagerly, they would be
  placed on the mesh set around the call, whose devices may only compile
  (ahead of time, for an accelerator that is not here)."""
  found = []
  jax.eval_shape(lambda: found.append(fn(*args, **kwargs)))
  return found[0]


def state_partition_specs(
  tx: optax.GradientTransformation,
  params: _typing.Params,
  *,
  param_specs: Optional[Any] = None,
  axis_name: Optional[_base.AxisName] = None,
  manual_axes: Optional[Any] = None,
  shard_optimizer_over: Optional[Any] = None,
  mesh: Optional[jax.sharding.Mesh] = None,
) -> Any:
  """The ``PartitionSpec`` of every leaf of ``tx.init(params)``.

  Parameter-shaped leaves (accumulator, optimizer moments) take their
  parameter's spec; scalars are replicated. With ``axis_name`` (the data
  axes given to :func:`token_weighted_multistep`), the per-device fields
  carry a leading slot axis split over the data axes along which the
  parameter is not sharded: DDP keeps one full accumulator per device, FSDP
  and HSDP a shard of it. Use the result as ``shard_map``'s ``in_specs`` and
  ``out_specs`` for the state, or build ``NamedSharding``'s from it.

  Args:
    tx: :func:`token_weighted_multistep`, or a transformation containing it.
    params: the parameters, or their shapes (``jax.ShapeDtypeStruct``).
    param_specs: a tree of ``PartitionSpec`` like ``params``; None means the
      specs in the parameters' types (explicit sharding), else replicated.
    axis_name: the transform's ``axis_name``; None under ``jax.jit`` with
      global arrays (the accumulator then simply follows the parameters).
    manual_axes: for a partial-manual ``jax.shard_map(...,
      axis_names=manual_axes)``, whose specs may only name its manual axes:
      the other axes (left to GSPMD) are dropped from every spec. The arrays
      keep the full layout (:func:`init_sharded` gives it).
    shard_optimizer_over: explicit sharding only: the data axes (a tuple of
      names) to shard ``inner``'s parameter-shaped state over, the
      distributed-optimizer (ZeRO-1) layout. Each such leaf is sharded on
      its first dimension that the axes' size divides and that is not split
      otherwise; a leaf that no dimension divides stays replicated. The
      accumulator stays typed like the gradients.
    mesh: the mesh, for ``shard_optimizer_over`` where neither
      ``jax.set_mesh`` nor the parameters' types give it.

  Returns:
    A tree of ``PartitionSpec`` with the structure of the state.

  Example:
    >>> import jax.numpy as jnp, optax
    >>> import optax_tokacc as tokacc
    >>> tx = tokacc.token_weighted_multistep(
    ...     optax.adam(0.1), 4, axis_name='data')
    >>> specs = tokacc.state_partition_specs(
    ...     tx, {'w': jnp.zeros((8, 2))}, axis_name='data')
    >>> tuple(specs.grad_sums['w'])  # per device: its slot axis on 'data'
    ('data',)
    >>> tuple(specs.inner_state[0].mu['w']), tuple(specs.mini_step)
    ((), ())
  """
  specs = _full_layout(
    tx, params, param_specs, axis_name, shard_optimizer_over, mesh
  )
  if manual_axes is None:
    return specs
  kept = set(_base.axis_names(manual_axes))  # the other axes are dropped
  if axis_name is not None and not set(_base.axis_names(axis_name)) <= kept:
    raise ValueError(
      f'axis_name={axis_name!r} must be among the manual axes of shard_map '
      f'(manual_axes={manual_axes!r}): the transform sums over manual axes.'
    )
  if any(spec.reduced or spec.unreduced for spec in jax.tree.leaves(specs)):
    raise ValueError(
      f'manual_axes={manual_axes!r} is for a partial-manual shard_map with '
      'axis_name; explicit sharding (parameters typed reduced) needs none.'
    )

  def manual_only(spec):  # entries: None, an axis or a tuple of axes
    return jax.P(*([a for a in jax.tree.leaves(e) if a in kept] for e in spec))

  return jax.tree.map(manual_only, specs)


def _full_layout(
  tx: optax.GradientTransformation,
  params: _typing.Params,
  param_specs: Optional[_typing.Specs],
  axis_name: Optional[_base.AxisName],
  shard_over: Optional[_base.AxisName],
  mesh: Optional[jax.sharding.Mesh],
) -> _typing.Specs:
  """:func:`state_partition_specs` but ``manual_axes``: the full layout."""
  # None: the specs in the parameters' types
  param_specs = (
    _typed_sharding.type_specs(params) if param_specs is None else param_specs
  )
  abstract = jax.eval_shape(tx.init, params)
  specs = _state_specs_like_params(tx, abstract, param_specs, params)
  inner_specs = specs  # inner's state: like the parameters, or sharded
  if shard_over is not None:
    split = _optimizer_shards.inner_shard_specs(
      params, param_specs, shard_over, axis_name, mesh
    )
    inner_specs = _state_specs_like_params(tx, abstract, split, params)
    if _inner_states(inner_specs) == _inner_states(specs):
      raise ValueError(
        f'shard_optimizer_over={shard_over!r}: inner keeps no '
        'parameter-shaped state the axes divide: nothing to shard; leave it out.'
      )
  # The placement's layout: Manual's with axis_name, else Single's or
  # PartialSums' (the parameters' types say which; both lay out alike).
  layout = (
    _layouts.Typed()
    if axis_name is None
    else _layouts.Slots(_base.axis_names(axis_name))
  )
  scalars = layout.scalar_spec(jax.tree.leaves(param_specs))

  def with_window(node, inner_node):
    if not _state.is_state(node):
      return node
    # skip_state's scalars: replicated, or slots
    return _base.map_per_device(layout.gradient_spec, node)._replace(
      acc_tokens=scalars,
      acc_loss=scalars,
      inner_state=inner_node.inner_state,
    )

  return jax.tree.map(with_window, specs, inner_specs, is_leaf=_state.is_state)


def _inner_states(specs: _typing.Specs) -> list:
  nodes = jax.tree.leaves(specs, is_leaf=_state.is_state)
  return [n.inner_state for n in nodes if _state.is_state(n)]


def state_shardings(
  tx: optax.GradientTransformation,
  params: _typing.Params,
  mesh: jax.sharding.Mesh,
  *,
  param_specs: Optional[Any] = None,
  axis_name: Optional[_base.AxisName] = None,
  shard_optimizer_over: Optional[Any] = None,
) -> Any:
  """:func:`state_partition_specs` as ``NamedSharding``'s on ``mesh``.

  Args:
    tx: :func:`token_weighted_multistep`, or a transformation containing it.
    params: the parameters, or their shapes.
    mesh: the device mesh.
    param_specs: a tree of ``PartitionSpec`` like ``params``; None means the
      specs in the parameters' types (explicit sharding), else replicated.
    axis_name: the transform's ``axis_name``.
    shard_optimizer_over: the data axes to shard ``inner``'s state over
      (see :func:`state_partition_specs`).

  Returns:
    A tree of ``NamedSharding`` with the structure of the state: the full
    layout (every mesh axis), for ``jax.device_put`` or ``out_shardings``.

  Example:
    >>> import jax, jax.numpy as jnp, optax
    >>> import optax_tokacc as tokacc
    >>> mesh = jax.make_mesh(
    ...     (2,), ('fsdp',), axis_types=(jax.sharding.AxisType.Auto,),
    ...     devices=jax.devices()[:2])
    >>> tx = tokacc.token_weighted_multistep(optax.adam(0.1), 4)
    >>> shardings = tokacc.state_shardings(
    ...     tx, {'w': jnp.zeros((8, 2))}, mesh,
    ...     param_specs={'w': jax.P('fsdp', None)})
    >>> tuple(shardings.grad_sums['w'].spec)  # split like the parameter
    ('fsdp', None)
  """
  specs = _full_layout(
    tx, params, param_specs, axis_name, shard_optimizer_over, mesh
  )
  return jax.tree.map(lambda s: jax.NamedSharding(mesh, s), specs)


def init_sharded(
  tx: optax.GradientTransformation,
  params: _typing.Params,
  mesh: jax.sharding.Mesh,
  *,
  param_specs: Optional[Any] = None,
  axis_name: Optional[_base.AxisName] = None,
  shard_optimizer_over: Optional[Any] = None,
) -> _typing.OptState:
  """``tx.init(params)`` laid out on ``mesh`` (global arrays).

  With ``axis_name`` the state is initialized inside ``jax.shard_map`` over
  the mesh, so each device gets its slot of the per-device fields; without,
  under ``jax.jit`` with the shardings of :func:`state_shardings`.

  Ahead of time (a mesh of devices that only compile), pass the
  parameters as ``jax.ShapeDtypeStruct``: the state comes back abstract,
  laid out on ``mesh``. Inside ``jax.eval_shape`` on an explicit mesh its
  types are the layout; on an Auto mesh types carry no layout, so there
  the layout is lost: pass abstract parameters instead.

  Args:
    tx: :func:`token_weighted_multistep`, or a transformation containing it.
    params: the parameters, global arrays laid out by ``param_specs``, or
      their ``jax.ShapeDtypeStruct`` (ahead of time).
    mesh: the device mesh.
    param_specs: a tree of ``PartitionSpec`` like ``params``; None means the
      specs in the parameters' types (explicit sharding), else replicated.
    axis_name: the transform's ``axis_name``.
    shard_optimizer_over: the data axes to shard ``inner``'s state over,
      the distributed-optimizer (ZeRO-1) layout (see
      :func:`state_partition_specs`); explicit sharding only.

  Returns:
    The optimizer state, global arrays sharded as
    :func:`state_partition_specs` says (``jax.ShapeDtypeStruct`` with
    those shardings for abstract parameters).

  Example:
    >>> import jax, jax.numpy as jnp, optax
    >>> import optax_tokacc as tokacc
    >>> mesh = jax.make_mesh(
    ...     (2,), ('data',), axis_types=(jax.sharding.AxisType.Auto,),
    ...     devices=jax.devices()[:2])
    >>> tx = tokacc.token_weighted_multistep(
    ...     optax.adam(0.1), 4, axis_name='data')
    >>> state = tokacc.init_sharded(
    ...     tx, {'w': jnp.zeros((8, 2))}, mesh, axis_name='data')
    >>> state.grad_sums['w'].shape  # one accumulator slot per device
    (2, 8, 2)
  """
  specs = _full_layout(
    tx, params, param_specs, axis_name, shard_optimizer_over, mesh
  )
  shardings = jax.tree.map(lambda s: jax.NamedSharding(mesh, s), specs)
  if axis_name is None:
    init = functools.partial(_typed_init, tx, specs, mesh)
  else:
    in_specs = (
      _typed_sharding.type_specs(params)
      if param_specs is None
      else param_specs,
    )
    init = jax.shard_map(tx.init, mesh=mesh, in_specs=in_specs, out_specs=specs)
  init = jax.jit(init, out_shardings=shardings)
  if _base.is_abstract(params):
    return jax.eval_shape(init, params)  # ahead of time: the layout, no data
  return init(params)


def _typed_init(
  tx: optax.GradientTransformation,
  specs: _typing.Specs,
  mesh: jax.sharding.Mesh,
  params: _typing.Params,
) -> _typing.OptState:
  """``tx.init(params)``, on an explicit mesh each leaf typed as ``specs``
  says. ``jax.jit``'s ``out_shardings`` lay the arrays out, but do not type
  what a trace around the call sees (``jax.eval_shape`` of a step that
  calls :func:`init_sharded`): the distributed optimizer's moments would
  keep the parameters' reduced type."""
  state = tx.init(params)
  if jax.sharding.AxisType.Explicit not in getattr(mesh, 'axis_types', ()):
    return state  # an Auto mesh: types carry no layout

  def typed(x, spec):
    found = _typed_sharding.mesh_of(x)
    if (
      found is not None
      and not found.empty
      and _typed_sharding.spec(x) == _typed_sharding.padded(spec, jnp.ndim(x))
    ):
      return x
    return jax.reshard(x, jax.NamedSharding(mesh, spec))

  return jax.tree.map(typed, state, specs)
