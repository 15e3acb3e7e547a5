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
import sys
from typing import Any, NamedTuple, Optional
import warnings

import jax
import jax.numpy as jnp

from optax_tokacc import _explicit
from optax_tokacc import _tokens
from optax_tokacc import _validation

_LIBRARIES = ('optax_tokacc', 'optax', 'flax')  # frames warn() skips


def warn(message: str) -> None:
  """Warns at the line that calls into the libraries (``tx.update`` in the
  user's step), however deep in optax or Flax the transform is nested."""
  frame, level = sys._getframe(1), 2
  while frame.f_globals.get('__name__', '').split('.')[0] in _LIBRARIES:
    frame, level = frame.f_back, level + 1
  warnings.warn(f'token_weighted_multistep: {message}', stacklevel=level)


class Reduced(NamedTuple):
  """The window summed over the devices: what its one reduction gives."""

  sums: Any  # the gradients' sums (a tree)
  token_parts: jax.Array  # the count as exact parts (``_tokens.to_parts``)
  loss: jax.Array  # the token-summed loss


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
  judge = staticmethod(_validation.call_skip_fn)

  def total(self, fn: Callable, x: jax.Array) -> jax.Array:
    """``fn`` of each device's share of ``x``, summed over the devices."""
    return fn(x)

  def any(self, flag: jax.Array) -> jax.Array:
    """Whether ``flag`` is true on any device."""
    return flag

  def reduce(
    self, sums: Any, acc_tokens: jax.Array, acc_loss: jax.Array
  ) -> Reduced:
    """The window's one reduction: its sums, its count as exact parts
    (``_tokens.to_parts``) and its loss, summed over the devices."""
    return Reduced(sums, _tokens.to_parts(acc_tokens), acc_loss)

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

  def squares(self, tree: Any) -> dict:
    """``tree``'s squares summed on each device's share
    (:func:`local_squares`): partial sums typed unreduced over the axes a
    leaf's type splits it over, so that :meth:`norms` sums them in one
    collective (whole values where no type says so: the compiler sums a
    leaf it split, in a scalar all-reduce of its own)."""
    leaves = jax.tree.leaves(tree)
    over = [_explicit.sharded(x) for x in leaves]
    mesh = next(map(_explicit.mesh_of, leaves), None)
    split = {tuple(sorted(a)): _explicit.deferred(a, mesh) for a in over}
    # (jax < 0.10 cannot type them unreduced: there the compiler sums them)
    if not (self.on_shares or _explicit.SUPPORTED and any(split.values())):
      return local_squares(tree, [()] * len(over))
    specs = {a: jax.P(unreduced=d) if d else jax.P() for a, d in split.items()}
    return _explicit.local(lambda t: local_squares(t, over), (tree,), specs)

  def norms(self, grad_squares: dict, updates: Any) -> jax.Array:
    """The global L2 norms of a tree given by its :meth:`squares` and of
    ``updates``, a float32 vector, from each device's share of the squares:
    one ``psum`` of both per set of mesh axes they are split over (none in
    data parallelism)."""
    squares = (grad_squares, self.squares(updates))
    if any(axes for s in squares for axes in s):  # split: in a manual region
      return _explicit.local(global_norms, squares, jax.P())
    vector = jax.ShapeDtypeStruct([len(squares)], jnp.float32)
    return self.per_device(global_norms, squares, vector)


def local_squares(tree: Any, over: list) -> dict:
  """``{axes: s}``: the squares of ``tree``'s leaves (in float32 or wider)
  summed on this device, one float32 scalar ``s`` per set of mesh axes in
  ``over`` (one entry per leaf: the axes its sum is split over)."""
  sums = {}
  for x, axes in zip(jax.tree.leaves(tree), over):
    axes = tuple(sorted(axes))
    wide = jnp.abs(x).astype(jnp.promote_types(x.dtype, jnp.float32))
    square = jnp.sum(wide * wide).astype(jnp.float32)
    sums[axes] = sums[axes] + square if axes in sums else square
  return sums


def global_norms(*squares: dict) -> jax.Array:
  """The L2 norms of trees given by their :func:`local_squares` (float32):
  for each set of axes, the trees' squares stacked and summed over those
  axes by ``lax.psum`` (in a manual region): one collective per set."""
  total = jnp.zeros(len(squares), jnp.float32)
  for axes in sorted({a for s in squares for a in s}):
    some = next(s[axes] for s in squares if axes in s)
    vector = jnp.stack([s.get(axes, jnp.zeros_like(some)) for s in squares])
    total = total + (jax.lax.psum(vector, axes) if axes else vector)
  return jnp.sqrt(total)
