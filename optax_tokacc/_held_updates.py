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
"""Where the closing step's updates are held until the call returns them.

A strategy chosen once per call (:func:`of`), whose methods the closing
trip of ``_closing.close_if`` calls alike. Where the accumulator's buffer
can hold ``inner``'s updates exactly (:func:`holds_exactly`),
:class:`InBuffer`: the trip writes them there and the call reads them
back, so that a micro-step writes no parameter-sized zeros and copies
nothing, and the buffer holds them until the next window's first
micro-step restarts it. Elsewhere :class:`Carried`: the closing loop
carries them, zeros of ``inner``'s shapes where it takes no trip
(:func:`zeros`): -0.0, so that adding them leaves every parameter
bit-identical.
"""

import abc
from typing import final

import jax
import jax.numpy as jnp
import optax

from optax_tokacc import _base
from optax_tokacc import _placement
from optax_tokacc import _typed_sharding
from optax_tokacc import _typing


class HeldUpdates(abc.ABC):
  """Where the closing step holds ``inner``'s updates: in the window's
  buffer, or in the updates the closing loop carries."""

  @abc.abstractmethod
  def carried(self) -> _typing.Updates:
    """The updates the closing loop carries in (what it gives where it
    takes no trip)."""

  @abc.abstractmethod
  def holder(
    self, window: _base.Window, carried: _typing.Updates
  ) -> _typing.Updates:
    """What the closing trip writes the updates into."""

  @abc.abstractmethod
  def in_sums(self, sums: _typing.Updates, holder: _typing.Updates) -> bool:
    """Whether ``holder`` is the window's reduced ``sums`` themselves (the
    same arrays: nothing was reduced), which the closing trip then carries
    once."""

  @abc.abstractmethod
  def written(
    self, updates: _typing.Updates, holder: _typing.Updates
  ) -> _typing.Updates:
    """``updates`` as the closing trip leaves them in ``holder``."""

  @abc.abstractmethod
  def kept(
    self, window: _base.Window, holder: _typing.Updates
  ) -> tuple[_base.Window, _typing.Updates]:
    """The window and the loop's updates once the trip has written the
    updates into ``holder``."""

  @abc.abstractmethod
  def passed(self, window: _base.Window) -> dict[str, _typing.Updates]:
    """The values of the window that the closing trip hands on unchanged."""

  @abc.abstractmethod
  def released(
    self, window: _base.Window, carried: _typing.Updates, emitted: jax.Array
  ) -> _typing.Updates:
    """The call's updates, from the window and the updates the loop
    carried out: -0.0 unless ``emitted``."""

  @abc.abstractmethod
  def in_buffer(self) -> bool:
    """Whether the window's buffer holds the updates once the call returns
    (``update_and_apply`` adds them from there)."""


@final
class InBuffer(HeldUpdates):
  """The updates written into the accumulator's buffer: cast like it, and
  typed like it where it is typed otherwise (partial sums)."""

  def __init__(self, place: _placement.Placement, shapes: _typing.Updates):
    self.place = place
    self.shapes = shapes  # inner's updates: their shapes, dtypes and types

  def carried(self) -> _typing.Updates:
    return ()

  def holder(
    self, window: _base.Window, carried: _typing.Updates
  ) -> _typing.Updates:
    return window.grad_sums

  def in_sums(self, sums: _typing.Updates, holder: _typing.Updates) -> bool:
    leaves = zip(jax.tree.leaves(sums), jax.tree.leaves(holder))
    return all(x is y for x, y in leaves)

  def written(
    self, updates: _typing.Updates, holder: _typing.Updates
  ) -> _typing.Updates:
    cast = optax.tree.cast_like(updates, holder)
    return jax.tree.map(self.place.retype_same_values, cast, holder)

  def kept(
    self, window: _base.Window, holder: _typing.Updates
  ) -> tuple[_base.Window, _typing.Updates]:
    return window._replace(grad_sums=holder), ()

  def passed(self, window: _base.Window) -> dict[str, _typing.Updates]:
    return {'acc_compensation': window.acc_compensation}

  def released(
    self, window: _base.Window, carried: _typing.Updates, emitted: jax.Array
  ) -> _typing.Updates:
    """Read from the buffer (it holds the window's sums on a micro-step),
    typed and cast like ``inner``'s. The value picked is the same on every
    device."""

    def release(h, s):
      found = self.place.on_each_device(or_zeros, (h, emitted), s)
      return found.astype(s.dtype)

    return jax.tree.map(release, window.grad_sums, self.shapes)

  def in_buffer(self) -> bool:
    return True


@final
class Carried(HeldUpdates):
  """The updates carried by the closing loop, as ``inner`` gives them."""

  def __init__(self, shapes: _typing.Updates):
    self.shapes = shapes  # inner's updates: their shapes, dtypes and types

  def carried(self) -> _typing.Updates:
    return zeros(self.shapes)

  def holder(
    self, window: _base.Window, carried: _typing.Updates
  ) -> _typing.Updates:
    return carried

  def in_sums(self, sums: _typing.Updates, holder: _typing.Updates) -> bool:
    return False  # the holder is zeros this call made

  def written(
    self, updates: _typing.Updates, holder: _typing.Updates
  ) -> _typing.Updates:
    return updates

  def kept(
    self, window: _base.Window, holder: _typing.Updates
  ) -> tuple[_base.Window, _typing.Updates]:
    return window, holder

  def passed(self, window: _base.Window) -> dict[str, _typing.Updates]:
    return {
      'acc_compensation': window.acc_compensation,
      'grad_sums': window.grad_sums,
    }

  def released(
    self, window: _base.Window, carried: _typing.Updates, emitted: jax.Array
  ) -> _typing.Updates:
    return carried

  def in_buffer(self) -> bool:
    return False


def of(
  place: _placement.Placement,
  grad_sums: _typing.Updates,
  shapes: _typing.Updates,
) -> HeldUpdates:
  """Where a call holds ``inner``'s updates (of ``shapes``): in the
  accumulator's buffer where it holds them exactly."""
  if holds_exactly(place, grad_sums, shapes):
    return InBuffer(place, shapes)
  return Carried(shapes)


def holds_exactly(
  place: _placement.Placement,
  grad_sums: _typing.Updates,
  updates: _typing.Updates,
) -> bool:
  """Whether the accumulator's buffer can hold ``updates`` exactly: same
  shapes, a dtype that holds theirs, and what the placement allows."""

  def holds(a, u):
    dtype_holds = jnp.promote_types(a.dtype, u.dtype) == a.dtype
    return a.shape == u.shape and dtype_holds and place.buffer_holds(a, u)

  same_tree = jax.tree.structure(grad_sums) == jax.tree.structure(updates)
  return same_tree and jax.tree.all(jax.tree.map(holds, grad_sums, updates))


def zeros(shapes: _typing.Updates, fold: bool = False) -> _typing.Updates:
  """Zero updates of the given shapes, dtypes and shardings, varying over
  no axis (``zeros_like`` of a gradient would inherit its per-device
  variance and make the parameters vary). They are -0.0, so that adding
  them leaves every parameter bit-identical (-0.0 + 0.0 is +0.0).

  ``fold``: zeros the program computes nothing else from (the host's
  micro-step), whose addition XLA should remove. It folds ``p + -0.0``
  only through the negation (``p - 0.0``); under a mesh with explicit axes
  (``jax.set_mesh``) a sharding constraint sits between the zeros and
  their negation, so these are +0.0 there: XLA folds ``p + 0.0`` into
  ``p``, bit-identical. (Run op by op, a -0.0 parameter would become +0.0,
  an equal value.)
  """
  mesh = jax.sharding.get_abstract_mesh()  # its axis_types: () if none
  positive = fold and jax.sharding.AxisType.Explicit in mesh.axis_types

  def zero(shape):
    sharding = None if _typed_sharding.untyped(shape) else shape.sharding
    found = jnp.zeros(shape.shape, shape.dtype, out_sharding=sharding)
    return found if positive else _signed(found)

  return jax.tree.map(zero, shapes)


def or_zeros(x: jax.Array, keep: jax.Array) -> jax.Array:
  """``x`` where ``keep``, else -0.0 (see :func:`zeros`)."""
  return jnp.where(keep, x, _signed(jnp.zeros_like(x)))


def _signed(zeros: jax.Array) -> jax.Array:
  """-0.0 for floating zeros (other dtypes have one zero)."""
  return -zeros if jnp.issubdtype(zeros.dtype, jnp.inexact) else zeros


def applied(
  params: _typing.Params,
  updates: _typing.Updates,
  buffer: _typing.Updates,
  emitted: jax.Array,
) -> _typing.Params:
  """``optax.apply_updates(params, updates)`` where ``updates`` and the
  window's ``buffer`` are what one device-decided call gave, whose buffer
  holds the updates where it emitted (:class:`InBuffer`): on a GPU or CPU
  the buffer's values are added in a loop of 0 or 1 trips on ``emitted``
  (where it emitted nothing, the updates are -0.0 and the parameters keep
  their bits); on a TPU, where the buffer restarts where the window
  closes, ``optax.apply_updates``."""

  def in_loop(params):
    def body(carry):
      held = optax.tree.cast_like(buffer, updates)
      return jnp.zeros_like(carry[0]), optax.apply_updates(carry[1], held)

    carry = (emitted, params)
    return jax.lax.while_loop(lambda carry: carry[0], body, carry)[1]

  return jax.lax.platform_dependent(
    params,
    tpu=lambda params: optax.apply_updates(params, updates),
    default=in_loop,
  )
