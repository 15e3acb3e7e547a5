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
"""Collectives and sharding rules under ``pmap`` and ``shard_map``.

One rule decides what is summed over the data axes (``axis_name``) when a
window closes: a per-device value is summed over the axes it varies over.
A gradient is, in addition, never summed over an axis along which its
parameter is sharded (the parameter varies there: each device holds a
different shard). Under ``pmap`` or ``shard_map(check_vma=False)`` JAX does
not track variance, and everything is summed over all of ``axis_name``.
Under explicit sharding (plain ``jax.jit``) the window's unreduced partial
sums are summed over the axes their type names, in the same single
reduction.
"""

from collections.abc import Callable, Sequence
from typing import Any, Optional, Union
import warnings

import jax
from jax import lax
import jax.numpy as jnp
import optax

from optax_tokacc import _compat
from optax_tokacc import _explicit
from optax_tokacc import _tokens
from optax_tokacc._compat import varying_axes

AxisName = Union[str, tuple[str, ...]]


def as_tuple(axis_name: AxisName) -> tuple[str, ...]:
  return (axis_name,) if isinstance(axis_name, str) else tuple(axis_name)


def make_varying(x: jax.Array, axes: frozenset) -> jax.Array:
  """Marks ``x`` as varying over ``axes`` too (no work at run time)."""
  missing = sorted(axes - varying_axes(x))
  return _compat.pcast_to_varying(x, missing) if missing else x


def check_bound(axis_name: AxisName) -> None:
  """Raises if ``axis_name`` is not bound by ``pmap`` / ``shard_map``."""
  try:
    for axis in as_tuple(axis_name):
      lax.axis_index(axis)
  except NameError as e:
    raise ValueError(
      f'axis_name={axis_name!r} is not bound here: update the transform '
      'inside jax.pmap(..., axis_name=...) or jax.shard_map over a mesh with '
      'that axis. Under jax.jit with NamedSharding (global arrays), leave '
      'axis_name=None.'
    ) from e


def check_untracked(axes: Sequence[str]) -> None:
  """Without variance tracking (``pmap``, ``shard_map(check_vma=False)``),
  refuses what could not be told apart: several data axes (sharded from
  replicated parameters), or manual axes that ``axis_name`` leaves out
  (the batch may be split over them)."""
  axes = tuple(axes)
  if len(axes) > 1:
    raise ValueError(
      f'axis_name={axes!r} names several data axes, but JAX does not track '
      'here which values vary over them (pmap, or shard_map with '
      'check_vma=False), so sharded and replicated parameters cannot be '
      'told apart. Use jax.shard_map with check_vma=True (the default).'
    )
  others = _compat.manual_axes(lax.axis_index(axes[0])) - set(axes)
  if others:
    raise ValueError(
      f'shard_map is manual over {sorted(others)} too, which '
      f'axis_name={axes!r} leaves out, and JAX does not track here which '
      'values vary over them (check_vma=False): whether the batch is split '
      'there cannot be told. Use jax.shard_map with check_vma=True (the '
      'default), or name every axis the batch is split over.'
    )


def tracks_variance(axes: Sequence[str]) -> bool:
  """Whether JAX tracks which values vary over ``axes`` (``check_vma``)."""
  return all(a in varying_axes(lax.axis_index(a)) for a in axes)


def sum_axes(x: Any, axes: Sequence[str], tracked: bool) -> tuple[str, ...]:
  """The axes to sum a per-device value over: those it varies over."""
  if not tracked:
    return tuple(axes)
  return tuple(a for a in axes if a in varying_axes(x))


def grad_sum_axes(
  grads: optax.Updates,
  params: Optional[optax.Params],
  axes: Sequence[str],
  tracked: bool,
) -> list[tuple[str, ...]]:
  """Per gradient leaf, the axes to sum it over when the window closes.

  Never an axis along which the parameter is sharded. A gradient that is
  already invariant over an axis (``shard_map`` autodiff summed it on this
  micro-step) is not summed again; a warning says how to avoid that cost.
  """
  grad_leaves = jax.tree.leaves(grads)
  if params is None:
    param_axes = [frozenset()] * len(grad_leaves)
  else:
    param_axes = [varying_axes(p) for p in jax.tree.leaves(params)]
  if not tracked:
    return [tuple(axes)] * len(grad_leaves)
  per_leaf = [
    tuple(a for a in sum_axes(g, axes, tracked) if a not in sharded)
    for g, sharded in zip(grad_leaves, param_axes)
  ]
  summed = {
    a
    for g, sharded in zip(grad_leaves, param_axes)
    for a in axes
    if a not in varying_axes(g) and a not in sharded
  }
  if summed:
    warnings.warn(
      f'token_weighted_multistep: gradients arrive already summed over '
      f'{sorted(summed)} (shard_map autodiff reduced them on this '
      'micro-step, since the parameters are invariant there). They are not '
      'summed again, so the result is exact, but each micro-step pays an '
      'all-reduce. For one reduction per window, differentiate with respect '
      f'to jax.lax.pcast(params, {tuple(axes)!r}, to="varying").',
      stacklevel=5,
    )
  return per_leaf


def reduce_window(
  sums: optax.Updates,
  grad_axes: list[tuple[str, ...]],
  scalars: Any,
  scalar_axes: tuple[str, ...],
  params: Optional[optax.Params],
  axes: Sequence[str],
) -> tuple[optax.Updates, Any]:
  """Sums the window over devices: one ``psum`` per distinct set of axes.

  In data parallelism every leaf and the scalars (token parts, loss) share
  the same axes, so this is a single all-reduce per window.
  """
  leaves, treedef = jax.tree.flatten(sums)
  groups: dict[tuple[str, ...], list[Any]] = {}
  for index, leaf_axes in enumerate(grad_axes):
    groups.setdefault(leaf_axes, []).append(index)
  groups.setdefault(scalar_axes, [])
  for group_axes, indices in groups.items():
    operands = [leaves[i] for i in indices]
    with_scalars = group_axes == scalar_axes
    if group_axes:
      operands, summed_scalars = lax.psum(
        (operands, scalars if with_scalars else ()), group_axes
      )
      scalars = summed_scalars if with_scalars else scalars
    for i, leaf in zip(indices, operands):
      leaves[i] = leaf
  if params is not None:
    sharded = [varying_axes(p) for p in jax.tree.leaves(params)]
    leaves = [_invariant(x, s, axes) for x, s in zip(leaves, sharded)]
  return treedef.unflatten(leaves), scalars


def _invariant(x: jax.Array, sharded: frozenset, axes: Sequence[str]):
  """``x``, equal on the devices of ``axes`` it is not sharded over, made
  invariant there (a gradient summed by autodiff, held per device)."""
  same = tuple(a for a in axes if a in varying_axes(x) and a not in sharded)
  return lax.pmean(x, same) if same else x


def any_device(flag: jax.Array, axes: Sequence[str], tracked: bool):
  """Whether ``flag`` is true on any device of ``axes``."""
  over = sum_axes(flag, axes, tracked)
  if not over:
    return flag
  return lax.pmax(flag.astype('int32'), over) > 0


def cond(pred: jax.Array, true_fn: Callable, false_fn: Callable, *operands):
  """``lax.cond`` whose branches may differ in the axes their outputs vary.

  Inside ``shard_map`` the accumulators vary over the data axes while the
  summed window does not; each output is marked varying over the union of
  what the two branches give, as ``lax.cond`` requires. Elsewhere this is
  ``lax.cond``.
  """
  true_out = jax.eval_shape(true_fn, *operands)
  false_out = jax.eval_shape(false_fn, *operands)
  target = jax.tree.map(
    lambda a, b: varying_axes(a) | varying_axes(b), true_out, false_out
  )

  def matched(fn):
    def fn_with_vma(*args):
      return jax.tree.map(make_varying, fn(*args), target)

    return fn_with_vma

  return lax.cond(pred, matched(true_fn), matched(false_fn), *operands)


def check_complete(
  count: jax.Array,
  grads: optax.Updates,
  params: Optional[optax.Params],
  axes: Sequence[str],
) -> None:
  """Refuses layouts where the sums would be silently wrong.

  A count (or a gradient of a parameter not sharded there) that varies over
  an axis ``axis_name`` leaves out would be summed over only some of the
  devices holding the window's data; parameters that all vary over every
  data axis (replicas stacked per device, typed as varying) would not be
  summed at all. Both are errors at trace time.
  """
  param_leaves = [] if params is None else jax.tree.leaves(params)
  if param_leaves and all(set(axes) <= varying_axes(p) for p in param_leaves):
    raise ValueError(
      f'Every parameter varies over all of axis_name={tuple(axes)!r}, so '
      'no gradient would be summed over the devices. Parameters that are '
      'replicas stacked per device (pmap style) must enter shard_map '
      'replicated (in_specs P()): lay the state out with '
      'tokacc.state_partition_specs / tokacc.init_sharded. Parameters '
      'sharded over the data axes are summed only where they are replicated.'
    )
  missing = varying_axes(count) - set(axes)
  what = 'num_tokens'
  if not missing and params is not None:
    for grad, param in zip(jax.tree.leaves(grads), jax.tree.leaves(params)):
      missing |= varying_axes(grad) - set(axes) - varying_axes(param)
    what = 'a gradient of a parameter replicated there'
  if missing:
    raise ValueError(
      f'{what} varies over the mesh axes {sorted(missing)}, which '
      f'axis_name={tuple(axes)!r} leaves out: the window would be summed '
      'over only some of the devices that hold its data. Pass axis_name='
      f'{tuple(axes) + tuple(sorted(missing))!r} (every axis the batch is '
      'split over).'
    )


def window_tokens(acc_tokens, dp) -> jax.Array:
  """The window's counted tokens so far, over all devices (for
  ``tokens_per_update``; an invalid count counts 0, a total beyond the
  counter counts as its maximum). Where the window is split over devices,
  a scalar all-reduce on every micro-step."""
  axes = tuple(sorted(_explicit.unreduced(acc_tokens)))

  def parts_over(acc_tokens, axes):
    parts = _tokens.to_parts(jnp.maximum(acc_tokens, 0))
    return lax.psum(parts, axes) if axes else parts

  if axes:
    parts = _explicit.local(
      lambda acc: parts_over(acc, axes),
      (acc_tokens,),
      jax.sharding.PartitionSpec(),
    )
  else:
    data_axes, tracked = dp
    over = sum_axes(acc_tokens, data_axes, tracked)
    parts = parts_over(acc_tokens, over)
  total, fits = _tokens.from_parts(parts, acc_tokens.dtype)
  if jnp.issubdtype(acc_tokens.dtype, jnp.integer):
    top = jnp.iinfo(acc_tokens.dtype).max
  else:
    top = jnp.finfo(acc_tokens.dtype).max
  return jnp.where(fits, total, jnp.asarray(top, acc_tokens.dtype))


def reduce_partial_sums(sums, acc_tokens, acc_loss):
  """Explicit sharding: the window's partial sums reduced on each device in
  one ``psum`` per distinct set of axes (one all-reduce in data
  parallelism), the count split into exact float32 parts first."""
  leaves, treedef = jax.tree.flatten(sums)
  partial = [i for i, leaf in enumerate(leaves) if _explicit.unreduced(leaf)]
  leaf_axes = [tuple(sorted(_explicit.unreduced(leaves[i]))) for i in partial]
  scalar_axes = tuple(sorted(_explicit.unreduced(acc_tokens)))

  def reduce(partial_leaves, acc_tokens, acc_loss):
    scalars = (_tokens.to_parts(acc_tokens), acc_loss)
    return reduce_window(
      partial_leaves, leaf_axes, scalars, scalar_axes, None, scalar_axes
    )

  partial_leaves = [leaves[i] for i in partial]
  out_specs = (
    [_explicit.spec(leaf, unreduced=False) for leaf in partial_leaves],
    (jax.sharding.PartitionSpec(),) * 2,
  )
  reduced, scalars = _explicit.local(
    reduce, (partial_leaves, acc_tokens, acc_loss), out_specs
  )
  for i, leaf in zip(partial, reduced):
    leaves[i] = leaf
  return treedef.unflatten(leaves), scalars
