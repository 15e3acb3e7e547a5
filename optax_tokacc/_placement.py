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
"""Where the window's sums live and how they are reduced: one strategy.

The window algebra (``_window``) is written once and calls only the small
interface of :class:`Single`; a placement is chosen once per trace, at the
top of ``init`` and ``update`` (``_multistep.placement``):

- :class:`Single`: one device, or global arrays under ``jax.jit`` (the
  compiler reduces the gradients before they arrive): every value is whole.
- ``_manual.Manual``: ``pmap`` / ``shard_map`` with ``axis_name``: each
  device holds its share, summed with collectives when the window closes.
- ``_partial_sums.PartialSums``: explicit sharding under ``jax.jit``
  (parameters typed reduced): the shares are typed unreduced, and what is
  not linear runs on each device's share in a manual region.
"""

from collections.abc import Callable
import functools
import sys
from typing import Any, Optional
import warnings

import jax
import jax.numpy as jnp

from optax_tokacc import _base
from optax_tokacc import _errors
from optax_tokacc import _explicit
from optax_tokacc import _tokens

_LIBRARIES = ('optax_tokacc', 'optax', 'flax')  # frames warn() skips


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


class Single:
  """Every value is whole: nothing to reduce, no device to ask.

  The methods are the whole interface the window algebra calls; the other
  placements override some of them. Values may still carry types of
  sharding (global arrays on a mesh); they are kept as they come.
  """

  # Whether a rejected micro-batch still counts as a micro-step, so that
  # devices that may decide differently close their windows together.
  advances_rejected = False
  # Whether the values' arithmetic must run on each device's share, as
  # with partial sums (:meth:`squares`).
  on_shares = False

  def enter(self, state: Any) -> Any:
    """The state as the algebra reads it (this device's share)."""
    return state

  #: ``(state)``: the inverse of :meth:`enter` (here, the state itself).
  leave = enter

  #: ``(param, dtype)``: the accumulator's zeros for ``param``'s gradient,
  #: typed like it.
  gradient_zeros = staticmethod(_explicit.gradient_zeros)

  def scalar_zeros(self, dtype: Any) -> jax.Array:
    """A zero count or loss of the window."""
    return jnp.zeros([], dtype)

  #: ``x`` summed over the devices that hold parts of it, now (a value
  #: typed unreduced is reduced; any other is already whole).
  whole = staticmethod(_explicit.reduce_now)

  def reduced_types(self, grads: Any) -> Any:
    """Values typed as :meth:`reduce` types the window's sums (for shapes
    only: ``jax.eval_shape`` of ``inner``)."""
    return jax.tree.map(self.whole, grads)

  def refusal(self, error: Exception) -> Optional[Exception]:
    """Our error for ``inner`` failing to trace here (None: its own)."""
    del error
    return None

  #: ``(x)``: a micro-batch's count or loss as this device's share of it
  #: (here, all of it).
  share = whole

  def gradient_shares(self, grads: Any) -> Any:
    """A micro-batch's gradients as this device's shares of them (here,
    as they come: whole, or partial sums typed unreduced)."""
    return grads

  #: ``(grad, factor)``: ``grad * factor`` for a scalar ``factor`` the same
  #: on all devices.
  scale = staticmethod(jnp.multiply)

  def per_device(self, fn: Callable, args: tuple, like: Any) -> Any:
    """``fn(*args)`` on each device's share; its outputs are typed like
    ``like`` (a tree of values, or of their shapes)."""
    return jax.tree.map(self.same_values, fn(*args), like)

  #: ``(x, like)``: ``x``, held whole and alike on every device, typed like
  #: ``like``.
  same_values = staticmethod(_explicit.retype_same_values)

  #: ``(skip_fn, grads, step, params)``: ``skip_fn``'s decision on the
  #: micro-batch, and its skip state.
  judge = staticmethod(call_skip_fn)

  def total(self, fn: Callable, x: jax.Array) -> jax.Array:
    """``fn`` of each device's share of ``x``, summed over the devices."""
    return fn(x)

  def any(self, flag: jax.Array) -> jax.Array:
    """Whether ``flag`` is true on any device."""
    return flag

  def reduce(
    self, sums: Any, acc_tokens: jax.Array, acc_loss: jax.Array
  ) -> _base.Reduced:
    """The window's one reduction: its sums, its count as exact parts
    (``_tokens.to_parts``) and its loss, summed over the devices."""
    return _base.Reduced(sums, _tokens.to_parts(acc_tokens), acc_loss)

  #: A tree in the types that optax's nonlinear updates take (reduced types
  #: dropped, free).
  for_inner = staticmethod(_explicit.without_reduced)

  #: ``(tree, reference)``: ``tree`` (whole values) typed like ``reference``
  #: again.
  like = staticmethod(_explicit.like)

  #: ``(acc, update)``: whether an accumulator leaf's buffer may hold an
  #: update's value: where typed, it splits its dimensions alike.
  can_hold = staticmethod(_explicit.same_layout)

  #: ``(pred, true_fn, false_fn, *ops)``: ``lax.cond``, where the branches'
  #: outputs may differ in type.
  cond = staticmethod(jax.lax.cond)

  def _split_axes(self, leaves: list) -> list[frozenset]:
    """Per leaf, the mesh axes over which :meth:`squares` leaves its sum of
    squares split, for :meth:`norms` to sum: those its type splits it over
    (none where no type says so, or on jax < 0.10, which cannot type the
    partial sums unreduced: there the compiler sums a leaf it split, in a
    scalar all-reduce of its own)."""
    over = [_explicit.sharded(x) for x in leaves]
    mesh = next(map(_explicit.mesh_of, leaves), None)
    deferred = [_explicit.deferred(a, mesh) for a in over]
    if self.on_shares or _explicit.SUPPORTED and any(deferred):
      return over
    return [frozenset()] * len(over)

  def squares(self, tree: Any, per_leaf: bool = False) -> dict:
    """``tree``'s squares summed on each device's share
    (:func:`local_squares`, each leaf's too where ``per_leaf``): partial
    sums typed unreduced over the axes :meth:`_split_axes` gives, so that
    :meth:`norms` sums them in one collective."""
    leaves = jax.tree.leaves(tree)
    over = self._split_axes(leaves)
    if not (self.on_shares or any(over)):
      return local_squares(tree, over, per_leaf)
    mesh = next(map(_explicit.mesh_of, leaves), None)
    split = {tuple(sorted(a)): _explicit.deferred(a, mesh) for a in over}
    specs = {a: jax.P(unreduced=d) if d else jax.P() for a, d in split.items()}
    squares = functools.partial(local_squares, over=over, per_leaf=per_leaf)
    return _explicit.local(squares, (tree,), specs)

  def norms(
    self, grads: Any, grad_squares: dict, updates: Any, per_leaf: bool = False
  ) -> _base.Norms:
    """The L2 norms of ``grads``, given by its :meth:`squares`, and of
    ``updates``, from each device's share of the squares: one ``psum`` of
    all of them per set of mesh axes they are split over (none in data
    parallelism); each leaf's too where ``per_leaf``."""
    squares = (grad_squares, self.squares(updates, per_leaf))
    overs = tuple(
      self._split_axes(jax.tree.leaves(tree)) for tree in (grads, updates)
    )
    norms = functools.partial(global_norms, overs=overs)
    if any(axes for s in squares for axes in s):  # split: in a manual region
      return _explicit.local(norms, squares, jax.P())
    return self.per_device(norms, squares, jax.eval_shape(norms, *squares))


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
