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
"""Where the window's sums live and how they are reduced: the interface.

The window algebra (``_window``) and the closing (``_closing``) are
written once and call only the methods of :class:`Placement`. A placement
is chosen once per trace, at the top of ``init`` and ``update``
(``_multistep.placement``), and never asked which it is:

- ``_single.Single``: one device, or global arrays under ``jax.jit`` (the
  compiler reduces the gradients before they arrive): every value whole.
- ``_manual.Manual``: ``pmap`` / ``shard_map`` with ``axis_name``: each
  device holds its share in a slot, summed with collectives at the close.
- ``_partial_sums.PartialSums``: explicit sharding under ``jax.jit``
  (parameters typed reduced): the shares typed unreduced, what is not
  linear run on each device's share in a manual region, and the window
  reduce-scattered into the optimizer's shards where ``shard_optimizer_over``
  shards them.

Each concrete placement is final; the interface's methods that no
placement changes are written here once. A new layout is a new placement,
not an edit of the algebra.
"""

import abc
from collections.abc import Callable
import functools
import sys
from typing import Any, Optional
import warnings

import jax
import jax.numpy as jnp

from optax_tokacc import _base
from optax_tokacc import _errors
from optax_tokacc import _typed_sharding

_LIBRARIES = ('optax_tokacc', 'optax', 'flax')  # frames warn() skips


class Placement(abc.ABC):
  """Where a window's sums live and how they are reduced.

  The state the algebra reads holds this device's share of the window
  (:meth:`local_state`); a micro-batch's values are added as shares
  (:meth:`share_of`, :meth:`gradient_shares`); what is not linear runs on
  each device's share (:meth:`on_each_device`); the window is summed over
  the devices once, when it closes (:meth:`reduce_window`), and
  ``inner``'s updates are typed like the parameters again
  (:meth:`typed_like`).
  """

  @abc.abstractmethod
  def rejected_micro_batch_advances(self) -> bool:
    """Whether a micro-batch that ``should_skip_update_fn`` rejects still
    counts as a micro-step: where devices may decide differently, so that
    they close their windows together."""

  @abc.abstractmethod
  def local_state(self, state: _base.TokenWeightedMultiStepState) -> Any:
    """The state as the algebra reads it: this device's share."""

  @abc.abstractmethod
  def global_state(self, state: Any) -> _base.TokenWeightedMultiStepState:
    """The inverse of :meth:`local_state`: the state as ``update``
    returns it."""

  @abc.abstractmethod
  def scalar_zeros(self, dtype: Any) -> jax.Array:
    """A zero count or loss of the window, typed as this placement holds
    its shares."""

  @abc.abstractmethod
  def share_of(self, x: jax.Array) -> jax.Array:
    """A micro-batch's count or loss as this device's share of it."""

  @abc.abstractmethod
  def gradient_shares(self, grads: Any) -> Any:
    """A micro-batch's gradients as this device's shares of them."""

  @abc.abstractmethod
  def scale(self, grad: jax.Array, factor: jax.Array) -> jax.Array:
    """``grad * factor`` for a scalar ``factor`` the same on every
    device, in the types of ``grad``."""

  @abc.abstractmethod
  def on_each_device(self, fn: Callable, args: tuple, like: Any) -> Any:
    """``fn(*args)`` on each device's share; its outputs are typed like
    ``like`` (a tree of values, or of their shapes)."""

  @abc.abstractmethod
  def skip_decision(
    self, skip_fn: Callable, grads: Any, gradient_step: Any, params: Any
  ) -> tuple[jax.Array, Any]:
    """``should_skip_update_fn``'s decision on the micro-batch, the same
    on every device, and its skip state."""

  @abc.abstractmethod
  def sum_over_devices(self, fn: Callable, x: jax.Array) -> jax.Array:
    """``fn`` of each device's share of ``x``, summed over the devices."""

  @abc.abstractmethod
  def on_any_device(self, flag: jax.Array) -> jax.Array:
    """Whether ``flag`` is true on any device."""

  @abc.abstractmethod
  def reduce_window(
    self, sums: Any, acc_tokens: jax.Array, acc_loss: jax.Array
  ) -> _base.Reduced:
    """The window's one reduction: its sums, its count as exact parts
    (``_tokens.to_parts``) and its loss, summed over the devices."""

  @abc.abstractmethod
  def buffer_holds(self, acc: jax.Array, update: jax.Array) -> bool:
    """Whether an accumulator leaf's buffer may hold an update's value (the
    closing step writes the updates there: see ``_closing``)."""

  @abc.abstractmethod
  def cond(
    self, pred: jax.Array, true_fn: Callable, false_fn: Callable, *ops: Any
  ) -> Any:
    """``lax.cond``, where the two branches' outputs may differ in the
    types this placement gives them."""

  @abc.abstractmethod
  def squares(self, tree: Any, per_leaf: bool = False) -> dict:
    """``tree``'s squares summed on each device's share, for
    :meth:`norms` (:func:`local_squares`)."""

  @abc.abstractmethod
  def norms(
    self, grads: Any, grad_squares: dict, updates: Any, per_leaf: bool = False
  ) -> _base.Norms:
    """The L2 norms of ``grads``, given by its :meth:`squares`, and of
    ``updates``, from each device's share of the squares: one ``psum``
    of all of them per set of mesh axes they are split over; each leaf's
    too where ``per_leaf``."""

  # The three members below are what ``inner`` sees. They are the same in
  # every placement where ``inner`` runs on whole gradients; a placement
  # that shards ``inner``'s state (``PartialSums`` with
  # ``shard_optimizer_over``) overrides them.

  def reduced_types(self, grads: Any) -> Any:
    """Values typed as :meth:`reduce_window` types the window's sums (for
    their types only: ``jax.eval_shape`` of ``inner``)."""
    return jax.tree.map(self.summed_now, grads)

  def refusal_of(self, error: Exception) -> Optional[Exception]:
    """Our error for ``inner`` failing to trace here (None: its own)."""
    del error
    return None

  def typed_like(self, tree: Any, reference: Any) -> Any:
    """``tree``, whole values such as ``inner``'s updates, typed and
    laid out like ``reference`` (the parameters, ``inner``'s state)."""
    return _typed_sharding.like(tree, reference)

  # The members below are the same in every placement.

  def gradient_zeros(self, param: Any, dtype: Any) -> jax.Array:
    """The accumulator's zeros for ``param``'s gradient, typed like it."""
    return _typed_sharding.gradient_zeros(param, dtype)

  def summed_now(self, x: Any) -> Any:
    """``x`` summed over the devices that hold parts of it, now (a value
    typed unreduced is reduced; any other is already whole)."""
    return _typed_sharding.reduce_now(x)

  def retype_same_values(self, x: jax.Array, like: Any) -> jax.Array:
    """``x``, held whole and alike on every device, typed like ``like``."""
    return _typed_sharding.retype_same_values(x, like)

  def inner_types(self, tree: Any) -> Any:
    """``tree`` in the types that optax's nonlinear updates take (reduced
    types dropped, free)."""
    return _typed_sharding.without_reduced(tree)


def warn(message: str) -> None:
  """Warns at the line that calls into the libraries (``tx.update`` in the
  user's step), however deep in optax or Flax the transform is nested."""
  frame, level = sys._getframe(1), 2
  while frame.f_globals.get('__name__', '').split('.')[0] in _LIBRARIES:
    frame, level = frame.f_back, level + 1
  warnings.warn(f'token_weighted_multistep: {message}', stacklevel=level)


def call_skip_fn(
  should_skip_update_fn: Callable, grads: Any, gradient_step: Any, params: Any
) -> tuple[jax.Array, Any]:
  """Calls ``should_skip_update_fn`` and checks what it returns."""
  result = should_skip_update_fn(grads, gradient_step, params)
  name = 'should_skip_update_fn(grads, step, params)'
  if not (isinstance(result, tuple) and len(result) == 2):
    kinds = 'a pair (should_skip, skip_state), as optax.skip_not_finite gives'
    raise _errors.refuse(name, kinds, type(result).__name__)
  skip, skip_state = result
  fix = ' Reduce it, e.g. with jnp.any(...).'
  _errors.check_scalar(
    skip, f'{name}[0]', 'a boolean scalar', (jnp.bool_, jnp.number), fix
  )
  return jnp.asarray(skip, jnp.bool_), skip_state


def typed_split_axes(leaves: list, on_shares: bool) -> list[frozenset]:
  """Per leaf, the mesh axes over which :func:`typed_squares` leaves its
  sum of squares split: those its type splits it over, where its partial
  sums are typed (``on_shares``: explicit partial sums; or any leaf's
  type defers a reduction, on jax >= 0.10), else none: the compiler then
  sums a leaf it split, in a scalar all-reduce of its own (jax < 0.10
  cannot type the partial sums unreduced)."""
  over = [_typed_sharding.sharded(x) for x in leaves]
  mesh = next(map(_typed_sharding.mesh_of, leaves), None)
  some_deferred = any(_typed_sharding.deferred(a, mesh) for a in over)
  typed = on_shares or (_typed_sharding.SUPPORTED and some_deferred)
  return over if typed else [frozenset()] * len(over)


def typed_squares(tree: Any, per_leaf: bool, on_shares: bool) -> dict:
  """``tree``'s squares summed on each device's share (:func:`local_squares`),
  partial sums typed unreduced over the axes :func:`typed_split_axes` gives,
  so that :func:`typed_norms` sums them in one collective."""
  leaves = jax.tree.leaves(tree)
  over = typed_split_axes(leaves, on_shares)
  if not (on_shares or any(over)):
    return local_squares(tree, over, per_leaf)
  mesh = next(map(_typed_sharding.mesh_of, leaves), None)
  split = {tuple(sorted(a)): _typed_sharding.deferred(a, mesh) for a in over}
  specs = {a: jax.P(unreduced=d) if d else jax.P() for a, d in split.items()}
  squares = functools.partial(local_squares, over=over, per_leaf=per_leaf)
  return _typed_sharding.local(squares, (tree,), specs)


def typed_norms(
  place: Placement,
  grads: Any,
  grad_squares: dict,
  updates: Any,
  per_leaf: bool,
  on_shares: bool,
) -> _base.Norms:
  """:meth:`Placement.norms` where types say what is split (one device,
  ``jax.jit`` over global arrays, explicit partial sums)."""
  squares = (grad_squares, typed_squares(updates, per_leaf, on_shares))
  overs = tuple(
    typed_split_axes(jax.tree.leaves(tree), on_shares)
    for tree in (grads, updates)
  )
  norms = functools.partial(global_norms, overs=overs)
  if any(axes for s in squares for axes in s):  # split: in a manual region
    return _typed_sharding.local(norms, squares, jax.P())
  like = jax.eval_shape(norms, *squares)
  return place.on_each_device(norms, squares, like)


def local_squares(tree: Any, over: list, per_leaf: bool = False) -> dict:
  """``{axes: v}``: per set of mesh axes in ``over`` (one entry per leaf:
  the axes its sum is split over), a float32 vector ``v``: the squares of
  ``tree``'s leaves split over them (in float32 or wider) summed on this
  device, then, where ``per_leaf``, each such leaf's."""
  sums, each = {}, {}
  for x, axes in zip(jax.tree.leaves(tree), over):
    axes = tuple(sorted(axes))
    wide = jnp.abs(x).astype(jnp.promote_types(x.dtype, jnp.float32))
    square = jnp.sum(wide * wide).astype(jnp.float32)
    sums[axes] = sums[axes] + square if axes in sums else square
    each.setdefault(axes, []).append(square)
  return {
    axes: jnp.stack([total, *(each[axes] if per_leaf else ())])
    for axes, total in sums.items()
  }


def global_norms(*squares: dict, overs: tuple) -> _base.Norms:
  """The L2 norms of trees given by their :func:`local_squares` and the
  axes of their leaves (``overs``): for each set of axes, all the trees'
  squares in one vector, summed over those axes by ``lax.psum`` (in a
  manual region): one collective per set."""
  totals = [jnp.zeros([], jnp.float32) for _ in squares]
  leaves = [[None] * len(over) for over in overs]
  for axes in sorted({a for s in squares for a in s}):
    parts = [s.get(axes) for s in squares]
    vector = jnp.concatenate([part for part in parts if part is not None])
    summed = jax.lax.psum(vector, axes) if axes else vector
    start = 0
    for tree, part in enumerate(parts):
      if part is None:
        continue
      chunk, start = summed[start : start + len(part)], start + len(part)
      totals[tree] = totals[tree] + chunk[0]
      mine = [i for i, a in enumerate(overs[tree]) if tuple(sorted(a)) == axes]
      for leaf, square in zip(mine, chunk[1:]):
        leaves[tree][leaf] = jnp.sqrt(square)
  per_leaf = all(leaf is not None for tree in leaves for leaf in tree)
  return _base.Norms(
    jnp.sqrt(jnp.stack(totals)),
    tuple(map(tuple, leaves)) if per_leaf else ((), ()),
  )
