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

The interface is abstract-or-final: a method is abstract, or written once
here and never overridden, so that what a placement does is read in its
own class. Each concrete placement is final. A new layout is a new
placement, not an edit of the algebra. The norms' arithmetic is
``_norms``'.
"""

import abc
from collections.abc import Callable
from typing import Optional, final

import jax
import jax.numpy as jnp

from optax_tokacc import _base
from optax_tokacc import _layouts
from optax_tokacc import _norms
from optax_tokacc import _typed_sharding
from optax_tokacc import _typing


class Placement(abc.ABC):
  """Where a window's sums live and how they are reduced.

  The state the algebra reads holds this device's share of the window
  (:meth:`local_state`, as its :attr:`layout` keeps it); a micro-batch's
  values are added as shares (:meth:`share_of`, :meth:`gradient_shares`);
  what is not linear runs on each device's share (:meth:`on_each_device`);
  the window is summed over the devices once, when it closes
  (:meth:`reduce_window`), and ``inner``'s updates are typed like the
  parameters again (:meth:`typed_like`). The methods marked
  ``typing.final`` are the same in every placement.
  """

  @abc.abstractmethod
  def share_of(self, x: jax.Array) -> jax.Array:
    """A micro-batch's count or loss as this device's share of it."""

  @abc.abstractmethod
  def reduce_window(
    self, sums: _typing.Updates, acc_tokens: jax.Array, acc_loss: jax.Array
  ) -> _base.Reduced:
    """The window's one reduction: its sums, its count as exact parts
    (``_tokens.to_parts``) and its loss, summed over the devices."""

  @abc.abstractmethod
  def rejected_micro_batch_advances(self) -> bool:
    """Whether a micro-batch that ``should_skip_update_fn`` rejects still
    counts as a micro-step: where devices may decide differently, so that
    they close their windows together."""

  @property
  @abc.abstractmethod
  def layout(self) -> _layouts.Layout:
    """Where this placement keeps the per-device fields: in its trace, in
    the global state's specs, and in a checkpoint (``_layouts``)."""

  @final
  def local_state(
    self, state: _base.TokenWeightedMultiStepState
  ) -> _base.TokenWeightedMultiStepState:
    """The state as the algebra reads it: this device's share."""
    return self.layout.local(state)

  @final
  def global_state(
    self, state: _base.TokenWeightedMultiStepState
  ) -> _base.TokenWeightedMultiStepState:
    """The inverse of :meth:`local_state`: the state as ``update``
    returns it."""
    return self.layout.global_(state)

  @abc.abstractmethod
  def scalar_zeros(self, dtype: jax.typing.DTypeLike) -> jax.Array:
    """A zero count or loss of the window, typed as this placement holds
    its shares."""

  @abc.abstractmethod
  def gradient_shares(self, grads: _typing.Updates) -> _typing.Updates:
    """A micro-batch's gradients as this device's shares of them."""

  @abc.abstractmethod
  def scale(self, grad: jax.Array, factor: jax.Array) -> jax.Array:
    """``grad * factor`` for a scalar ``factor`` the same on every
    device, in the types of ``grad``."""

  @abc.abstractmethod
  def on_each_device(
    self, fn: Callable, args: tuple, like: _typing.ArrayTree
  ) -> _typing.ArrayTree:
    """``fn(*args)`` on each device's share; its outputs are typed like
    ``like`` (a tree of values, or of their shapes)."""

  @abc.abstractmethod
  def skip_decision(
    self,
    skip_fn: Callable,
    grads: _typing.Updates,
    gradient_step: jax.Array,
    params: Optional[_typing.Params],
  ) -> tuple[jax.Array, _typing.ArrayTree]:
    """``should_skip_update_fn``'s decision on the micro-batch, the same
    on every device, and its skip state."""

  @abc.abstractmethod
  def sum_over_devices(self, fn: Callable, x: jax.Array) -> jax.Array:
    """``fn`` of each device's share of ``x``, summed over the devices."""

  @abc.abstractmethod
  def on_any_device(self, flag: jax.Array) -> jax.Array:
    """Whether ``flag`` is true on any device."""

  @abc.abstractmethod
  def buffer_holds(self, acc: jax.Array, update: jax.Array) -> bool:
    """Whether an accumulator leaf's buffer may hold an update's value (the
    closing step writes the updates there: see ``_closing``)."""

  @abc.abstractmethod
  def buffer_is_the_updates(self) -> bool:
    """Whether the state ``update`` returns holds, where its buffer holds
    the updates, the very values the call returns (same shapes and types),
    so that ``update_and_apply`` adds them from there
    (``_held_updates.applied``)."""

  @abc.abstractmethod
  def cond(
    self,
    pred: jax.Array,
    true_fn: Callable,
    false_fn: Callable,
    *ops: Optional[_typing.ArrayTree],
  ) -> _typing.ArrayTree:
    """``lax.cond``, where the two branches' outputs may differ in the
    types this placement gives them."""

  @abc.abstractmethod
  def loop_if(
    self, pred: jax.Array, fn: Callable, values: _typing.ArrayTree
  ) -> _typing.ArrayTree:
    """``fn(values)`` if ``pred``, else ``values`` as they are
    (:func:`flag_loop`), ``fn`` returning values typed as this placement
    carries them."""

  @abc.abstractmethod
  def squares(self, trees: tuple, per_leaf: bool = False) -> tuple[dict, ...]:
    """Each of ``trees``' squares summed on each device's share, for
    :meth:`norms` (``_norms.local_squares``: the trees' leaves at one
    position in one reduction)."""

  @abc.abstractmethod
  def norms(
    self,
    grads: _typing.Updates,
    updates: _typing.Updates,
    squares: tuple[dict, dict],
    per_leaf: bool = False,
  ) -> _norms.Norms:
    """The L2 norms of ``grads`` and ``updates``, given by their
    :meth:`squares`, from each device's share of the squares: one ``psum``
    of all of them per set of mesh axes they are split over; each leaf's
    too where ``per_leaf``."""

  # What ``inner`` sees.

  @abc.abstractmethod
  def reduced_types(self, grads: _typing.Updates) -> _typing.Updates:
    """Values typed as :meth:`reduce_window` types the window's sums (for
    their types only: ``jax.eval_shape`` of ``inner``)."""

  @abc.abstractmethod
  def refusal_of(
    self, error: Exception, runs_on: Callable[['Placement'], bool]
  ) -> Optional[Exception]:
    """Our error for ``inner`` failing to trace here with ``error`` (None:
    its own). ``runs_on(place)``: whether ``inner`` traces on another
    placement of the same gradients."""

  @abc.abstractmethod
  def typed_like(
    self, tree: _typing.ArrayTree, reference: _typing.ArrayTree
  ) -> _typing.ArrayTree:
    """``tree``, whole values such as ``inner``'s updates, typed and
    laid out like ``reference`` (the parameters, ``inner``'s state)."""

  # The same in every placement.

  @final
  def gradient_zeros(
    self, param: jax.typing.ArrayLike, dtype: jax.typing.DTypeLike
  ) -> jax.Array:
    """The accumulator's zeros for ``param``'s gradient, typed like it."""
    return _typed_sharding.gradient_zeros(param, dtype)

  @final
  def summed_now(self, x: jax.Array) -> jax.Array:
    """``x`` summed over the devices that hold parts of it, now (a value
    typed unreduced is reduced; any other is already whole)."""
    return _typed_sharding.reduce_now(x)

  @final
  def retype_same_values(
    self, x: jax.Array, like: _typed_sharding.ArrayOrShape
  ) -> jax.Array:
    """``x``, held whole and alike on every device, typed like ``like``."""
    return _typed_sharding.retype_same_values(x, like)

  @final
  def typed_over_a_mesh(self, tree: _typing.ArrayTree) -> bool:
    """Whether a leaf of ``tree`` carries a sharding in its type: a split
    dimension, a reduced or an unreduced axis (an explicit mesh's, or a
    manual region's automatic axes)."""
    return not all(map(_typed_sharding.untyped, jax.tree.leaves(tree)))

  @final
  def inner_types(self, tree: _typing.ArrayTree) -> _typing.ArrayTree:
    """``tree`` in the types that optax's nonlinear updates take (reduced
    types dropped, free)."""
    return _typed_sharding.without_reduced(tree)


def flag_loop(
  pred: jax.Array, fn: Callable, values: _typing.ArrayTree
) -> _typing.ArrayTree:
  """``fn(values)`` if ``pred``, else ``values`` as they are: a loop of 0 or
  1 trips on a flag (``lax.while_loop``), ``fn`` returning values typed as
  its operand. A trip not taken reads and writes nothing: XLA:GPU copies
  the operands a ``cond``'s branch returns, and flattens a ``cond`` whose
  branches look cheap into selects; neither happens to a loop."""

  def body(carry):
    return jnp.zeros_like(pred), fn(carry[1])

  return jax.lax.while_loop(lambda carry: carry[0], body, (pred, values))[1]
