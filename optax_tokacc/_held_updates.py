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

Where the accumulator's buffer can hold ``inner``'s updates exactly
(:func:`holds_exactly`), the closing trip of ``_closing.close_if`` writes
them there (:func:`held`) and the call reads them back (:func:`released`):
a micro-step then writes no parameter-sized zeros and copies nothing, and
the buffer holds them until the next window's first micro-step restarts
it. Elsewhere, and on a host's micro-step, the updates are zeros of
``inner``'s shapes (:func:`zeros`): -0.0, so that adding them leaves every
parameter bit-identical.
"""

import jax
import jax.numpy as jnp
import optax

from optax_tokacc import _placement
from optax_tokacc import _typed_sharding
from optax_tokacc import _typing


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


def held(
  place: _placement.Placement,
  buffer: bool,
  updates: _typing.Updates,
  holder: _typing.Updates,
) -> _typing.Updates:
  """``updates`` as the closing trip leaves them in ``holder``: written
  into the accumulator's buffer where it holds them exactly (``buffer``;
  cast like it, and typed like it where it is typed otherwise: partial
  sums); as they are otherwise (``holder``: zeros of their shapes)."""
  if not buffer:
    return updates
  cast = optax.tree.cast_like(updates, holder)
  return jax.tree.map(place.retype_same_values, cast, holder)


def released(
  place: _placement.Placement,
  buffer: _typing.Updates,
  shapes: _typing.Updates,
  emitted: jax.Array,
) -> _typing.Updates:
  """The updates from the ``buffer`` that held them: -0.0 unless ``emitted``
  (the buffer holds the window's sums on a micro-step), typed and cast like
  ``inner``'s. The value picked is the same on every device."""

  def release(h, s):
    return place.on_each_device(or_zeros, (h, emitted), s).astype(s.dtype)

  return jax.tree.map(release, buffer, shapes)


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
  params: _typing.Params, updates: _typing.Updates, state: _typing.ArrayTree
) -> _typing.Params:
  """``optax.apply_updates(params, updates)`` where ``updates`` and the
  transform's ``state`` are what one device-decided call returned, whose
  buffer holds the updates where it emitted (``_multistep``'s ``held``):
  on a GPU or CPU the buffer's values are added in a loop of 0 or 1 trips
  on ``state.emitted`` (where it emitted nothing, the updates are -0.0 and
  the parameters keep their bits); on a TPU, where the buffer restarts
  where the window closes, ``optax.apply_updates``."""

  def in_loop(params):
    def body(carry):
      held = optax.tree.cast_like(state.grad_sums, updates)
      return jnp.zeros_like(carry[0]), optax.apply_updates(carry[1], held)

    carry = (state.emitted, params)
    return jax.lax.while_loop(lambda carry: carry[0], body, carry)[1]

  return jax.lax.platform_dependent(
    params,
    tpu=lambda params: optax.apply_updates(params, updates),
    default=in_loop,
  )
