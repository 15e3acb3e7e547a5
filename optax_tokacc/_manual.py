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
"""The placement under ``pmap`` and ``shard_map`` with ``axis_name``.

Each device holds its share of the window; the state's per-device fields
carry a leading slot axis (``_layouts.Slots``). A value that
arrives the same on every device of some data axes (already summed: the
gradient of a parameter not marked varying, a count the caller summed) is
held by the first device along them (:meth:`Manual.share_of`), so that every
device's slot is a share: the window is summed over the data axes when it
closes, a gradient never over an axis along which its parameter is sharded
(each device holds a different shard), and a checkpoint's shares merge by
summing them. Under ``pmap`` or ``shard_map(check_vma=False)`` JAX does not
track variance, and everything is summed over all of ``axis_name``.
"""

from collections.abc import Callable
import dataclasses
from typing import Optional, final

import jax
from jax import lax
import jax.numpy as jnp

from optax_tokacc import _base
from optax_tokacc import _errors
from optax_tokacc import _inputs
from optax_tokacc import _layouts
from optax_tokacc import _norms
from optax_tokacc import _placement
from optax_tokacc import _typed_sharding
from optax_tokacc import _typing
from optax_tokacc import _window_reduction
from optax_tokacc._compat import varying_axes


@final
@dataclasses.dataclass(frozen=True)
class Manual(_placement.Placement):
  """Shares held per device, summed with collectives over ``axes``."""

  axes: tuple[str, ...]
  tracked: bool = False  # whether JAX tracks what varies (check_vma)
  grad_axes: tuple = ()  # per gradient leaf, the axes to sum it over

  @classmethod
  def of(
    cls,
    config: _base.Config,
    params: Optional[_typing.Params],
    grads: Optional[_typing.Updates],
    num_tokens: Optional[jax.typing.ArrayLike],
  ) -> 'Manual':
    """The placement of ``update`` (of ``init`` without ``grads``): checks
    that the window can be summed exactly, or raises at trace time."""
    axes = _base.axis_names(config.axis_name)
    if grads is None:
      return cls(axes)
    # every axis bound (else NameError); whether JAX tracks which values
    # vary over ``axes`` (check_vma)
    try:
      tracked = all([a in varying_axes(lax.axis_index(a)) for a in axes])
    except NameError as e:
      raise ValueError(
        f'axis_name={config.axis_name!r} is not bound here. Call update inside '
        'jax.pmap or jax.shard_map over that axis; under jax.jit with '
        'NamedSharding, leave axis_name=None.'
      ) from e
    if not tracked:
      check_untracked(axes)
      return cls(axes, grad_axes=(axes,) * len(jax.tree.leaves(grads)))
    leaves = jax.tree.leaves(params)
    param_axes = None if params is None else tuple(map(varying_axes, leaves))
    over = grad_sum_axes(num_tokens, grads, param_axes, axes, config.mean_loss)
    return cls(axes, tracked, over)

  def rejected_micro_batch_advances(self) -> bool:
    return True  # devices may decide differently: they close together

  @property
  def layout(self) -> _layouts.Layout:
    return _layouts.Slots(self.axes)

  def share_of(self, x: jax.Array) -> jax.Array:
    """``x`` as this device's share: where it is the same on every device
    of some data axes (already summed there), held by the first device
    along them, zeros elsewhere (a select: no data moves)."""
    same = [a for a in self.axes if a not in varying_axes(x)]
    if not self.tracked or not same:
      return x
    first = jnp.all(jnp.stack([lax.axis_index(a) == 0 for a in same]))
    return jnp.where(first, x, jnp.zeros_like(x))

  def gradient_shares(self, grads: _typing.Updates) -> _typing.Updates:
    return jax.tree.map(self.share_of, grads)

  def scalar_zeros(self, dtype: jax.typing.DTypeLike) -> jax.Array:
    return jnp.zeros([], dtype)

  def scale(self, grad: jax.Array, factor: jax.Array) -> jax.Array:
    return grad * factor

  def on_each_device(
    self, fn: Callable, args: tuple, like: _typing.ArrayTree
  ) -> _typing.ArrayTree:
    """``fn(*args)`` here: already on each device's share."""
    return jax.tree.map(self.retype_same_values, fn(*args), like)

  def skip_decision(
    self,
    skip_fn: Callable,
    grads: _typing.Updates,
    gradient_step: jax.Array,
    params: Optional[_typing.Params],
  ) -> tuple[jax.Array, _typing.ArrayTree]:
    """Each device's own decision: a rejected micro-batch still advances
    the window (:meth:`rejected_micro_batch_advances`)."""
    return _inputs.call_skip_fn(skip_fn, grads, gradient_step, params)

  def _over(self, x: jax.Array) -> tuple[str, ...]:
    """The axes to sum a per-device value over: those it varies over."""
    varying = varying_axes(x) if self.tracked else self.axes
    return tuple(a for a in self.axes if a in varying)

  def sum_over_devices(self, fn: Callable, x: jax.Array) -> jax.Array:
    return lax.psum(fn(x), self._over(x))  # no axes: fn(x) itself

  def on_any_device(self, flag: jax.Array) -> jax.Array:
    over = self._over(flag)
    if not over:
      return flag
    return lax.pmax(flag.astype('int32'), over) > 0

  def reduce_window(
    self, sums: _typing.Updates, acc_tokens: jax.Array, acc_loss: jax.Array
  ) -> _base.Reduced:
    """Each value summed over its axes, the count and the loss with the
    leaves (``_window_reduction.sum_with_scalars``): in data parallelism,
    a single all-reduce per window; in fully manual HSDP, one across
    ``replica``."""
    leaves, treedef = jax.tree.flatten(sums)
    leaves, parts, loss = _window_reduction.sum_with_scalars(
      leaves, list(self.grad_axes), acc_tokens, acc_loss,
      self._over(acc_tokens), self._can_carry,
    )  # fmt: skip
    return _base.Reduced(treedef.unflatten(leaves), parts, loss)

  def _can_carry(self, leaf: jax.Array) -> bool:
    """Whether ``leaf``'s reduction may carry the window's count and loss:
    where it varies over the data axes only (the scalars are then typed
    invariant once summed), and no axis outside the manual ones splits it
    (partial-manual ``shard_map``: the partitioner would regather a leaf
    it splits to append the scalars)."""
    mesh = jax.sharding.get_abstract_mesh()
    auto = [
      name
      for name, kind in zip(mesh.axis_names, mesh.axis_types)
      if kind != jax.sharding.AxisType.Manual and mesh.shape[name] > 1
    ]
    return not auto and varying_axes(leaf) <= set(self.axes)

  def buffer_holds(self, acc: jax.Array, update: jax.Array) -> bool:
    """Where the accumulator is invariant over the manual axes (a
    gradient's share varies: its buffer cannot hold an invariant update)."""
    return not varying_axes(acc) and _typed_sharding.same_layout(acc, update)

  def buffer_is_the_updates(self) -> bool:
    return False  # the state returned holds it behind each device's slot

  def cond(
    self,
    pred: jax.Array,
    true_fn: Callable,
    false_fn: Callable,
    *ops: Optional[_typing.ArrayTree],
  ) -> _typing.ArrayTree:
    """``lax.cond`` whose branches may differ in the axes their outputs
    vary over: each output is marked varying over the union of what the
    two branches give, as ``lax.cond`` requires."""
    outs = [jax.eval_shape(fn, *ops) for fn in (true_fn, false_fn)]
    target = jax.tree.map(lambda a, b: varying_axes(a) | varying_axes(b), *outs)

    def matched(fn):
      return lambda *args: jax.tree.map(make_varying, fn(*args), target)

    return lax.cond(pred, matched(true_fn), matched(false_fn), *ops)

  def loop_if(
    self, pred: jax.Array, fn: Callable, values: _typing.ArrayTree
  ) -> _typing.ArrayTree:
    """:func:`_placement.flag_loop`, whose ``fn`` may return values varying
    over more axes than its operand: the loop carries the union of both."""
    outs = jax.eval_shape(fn, values)
    target = jax.tree.map(
      lambda a, b: varying_axes(a) | varying_axes(b), values, outs
    )

    def matched(tree):
      return jax.tree.map(make_varying, tree, target)

    return _placement.flag_loop(pred, lambda v: matched(fn(v)), matched(values))

  def reduced_types(self, grads: _typing.Updates) -> _typing.Updates:
    return jax.tree.map(self.summed_now, grads)

  def refusal_of(
    self, error: Exception, runs_on: Callable[[_placement.Placement], bool]
  ) -> Optional[Exception]:
    del error, runs_on
    return None

  def typed_like(
    self, tree: _typing.ArrayTree, reference: _typing.ArrayTree
  ) -> _typing.ArrayTree:
    return _typed_sharding.like(tree, reference)

  def _split_axes(self, leaves: list) -> list[frozenset]:
    """Per leaf, the manual axes it varies over (is split over; none
    without variance tracking, where every leaf is whole)."""
    if not self.tracked:
      return [frozenset()] * len(leaves)
    return [varying_axes(x) for x in leaves]

  def squares(self, trees: tuple, per_leaf: bool = False) -> tuple[dict, ...]:
    """Each leaf's squares summed over its shard, per set of manual axes
    it is split over (already in a manual region)."""
    overs = [self._split_axes(jax.tree.leaves(tree)) for tree in trees]
    return _norms.local_squares(trees, overs, per_leaf)

  def norms(
    self,
    grads: _typing.Updates,
    updates: _typing.Updates,
    squares: tuple[dict, dict],
    per_leaf: bool = False,
  ) -> _norms.Norms:
    """One ``psum`` of both trees' squares per set of axes (already in a
    manual region)."""
    overs = tuple(
      self._split_axes(jax.tree.leaves(tree)) for tree in (grads, updates)
    )
    return _norms.global_norms(*squares, overs=overs)


def make_varying(x: jax.Array, axes: frozenset) -> jax.Array:
  """Marks ``x`` as varying over ``axes`` too (no work at run time)."""
  return lax.pcast(x, tuple(sorted(axes - varying_axes(x))), to='varying')


def check_untracked(axes: tuple[str, ...]) -> None:
  """Without variance tracking (``pmap``, ``shard_map(check_vma=False)``),
  refuses what could not be told apart: several data axes (sharded from
  replicated parameters), or manual axes that ``axis_name`` leaves out
  (the batch may be split over them)."""
  if len(axes) > 1:
    raise ValueError(
      f'axis_name={axes!r} names several data axes, which need variance '
      'tracking: use jax.shard_map with check_vma=True (the default).'
    )
  mesh = jax.typeof(lax.axis_index(axes[0])).sharding.mesh
  others = set(mesh.manual_axes) - set(axes)
  if others:
    raise ValueError(
      f'shard_map is manual over {sorted(others)} too, which axis_name='
      f'{axes!r} leaves out: without check_vma the batch may be split there. '
      'Name every axis it is split over, or use check_vma=True (the default).'
    )


def grad_sum_axes(
  count: jax.Array,
  grads: _typing.Updates,
  param_axes: Optional[tuple],
  axes: tuple[str, ...],
  mean_loss: bool,
) -> tuple:
  """Per gradient leaf, the axes to sum it over when the window closes,
  where JAX tracks variance; refuses layouts where the sums would be
  silently wrong.

  Never an axis along which the parameter is sharded. A gradient that is
  already invariant over an axis (``shard_map`` autodiff summed it on this
  micro-step) is held by the first device there (:meth:`Manual.share_of`)
  and so summed once more, exactly; a warning says how to avoid the
  all-reduce per micro-step.
  Under a mean loss such a gradient is the sum of the devices' means,
  which no scaling makes token-weighted: refused.

  A count (or a gradient of a parameter not sharded there) that varies over
  an axis ``axis_name`` leaves out would be summed over only some of the
  devices holding the window's data; parameters that all vary over every
  data axis (replicas stacked per device, typed as varying) would not be
  summed at all. Both are errors at trace time.
  """
  if param_axes and all(set(axes) <= varying for varying in param_axes):
    raise ValueError(
      f'Every parameter varies over all of axis_name={axes!r}, so no gradient'
      ' would be summed. Pass the parameters replicated (in_specs P()), the '
      'state laid out by tokacc.state_partition_specs / tokacc.init_sharded.'
    )
  grad_leaves = jax.tree.leaves(grads)
  per_leaf, summed, outside = [], set(), set()
  no_params = [frozenset()] * len(grad_leaves)
  for grad, sharded in zip(grad_leaves, param_axes or no_params):
    kept = [a for a in axes if a not in sharded]
    per_leaf.append(tuple(kept))  # shares (Manual.share_of): summed over all
    summed |= {a for a in kept if a not in varying_axes(grad)}
    outside |= varying_axes(grad) - set(axes) - sharded
  count_outside = varying_axes(count) - set(axes)
  if count_outside:
    missing, what = count_outside, 'num_tokens'
  elif param_axes is None and outside:
    raise ValueError(
      f'A gradient varies over the mesh axes {sorted(outside)}, which '
      f'axis_name={axes!r} leaves out: pass params to tx.update, which say '
      'whether it is sharded there or must be summed there too.'
    )
  elif param_axes:
    missing, what = outside, 'a gradient of a parameter replicated there'
  else:
    missing = frozenset()
  if missing:
    raise ValueError(
      f'{what} varies over the mesh axes {sorted(missing)}, which axis_name='
      f'{axes!r} leaves out: the window would miss some of its devices. '
      f'Pass axis_name={axes + tuple(sorted(missing))!r}.'
    )
  pcast = f'jax.lax.pcast(params, {axes!r}, to="varying")'
  if summed and mean_loss:
    raise ValueError(
      "loss_reduction='mean' cannot be exact: the gradients arrive already "
      f'summed over {sorted(summed)} (the parameters are invariant there). '
      f"Differentiate with respect to {pcast}, or pass loss_reduction='sum'."
    )
  if summed:
    _errors.warn(
      f'gradients arrive already summed over {sorted(summed)}, an all-reduce'
      f' per micro-step (exact). For one per window, differentiate with '
      f'respect to {pcast}.'
    )
  return tuple(per_leaf)
