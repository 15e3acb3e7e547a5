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
"""Closing the window: its one reduction, and ``inner`` run once.

On the device (``close=None``) the closing step is a loop of 0 or 1 trips
(:func:`close_if`): micro-steps run no optimizer work and no collective.
On the host's decision (a Python ``close``) the window is closed or left
open without a conditional (:func:`close_now`, :func:`keep_open`). Where
the sums live and how they are reduced is the placement's
(``_placement``); where the closing step holds its updates,
``_held_updates``'.
"""

from collections.abc import Callable
import functools
from typing import NamedTuple

import jax
from jax.experimental import layout
import jax.numpy as jnp
import optax

from optax_tokacc import _base
from optax_tokacc import _compensated
from optax_tokacc import _held_updates
from optax_tokacc import _inner_step
from optax_tokacc import _norms
from optax_tokacc import _placement
from optax_tokacc import _tokens
from optax_tokacc import _typing
from optax_tokacc import _window

# The platforms where the host's close is written out (``close_now``).
WRITTEN_OUT_ON = ('cuda', 'rocm', 'tpu')
# The platforms where a window reduced over devices emits in a ``cond``,
# not a loop (``_if_emitted``).
BRANCHED_ON = ('tpu',)


class CallResult(NamedTuple):
  """What a call gives back once the window is closed or left open (the
  window's close itself is :class:`~optax_tokacc._base.Closed`)."""

  updates: _typing.Updates
  window: _base.Window
  inner_state: _typing.OptState
  closed: _base.Closed
  # Whether the window's buffer holds the updates where they are emitted
  # (a device's close on a GPU or CPU: ``_held_updates.InBuffer``).
  held: bool = False


def nothing_emitted(config: _base.Config, window: _base.Window) -> _base.Closed:
  """What a call that leaves the window open gives: nothing emitted."""
  return _base.Closed(
    emitted=jnp.asarray(False),
    valid=jnp.asarray(True),
    tokens=jnp.zeros([], window.acc_tokens.dtype),
    mean_loss=jnp.zeros([], window.acc_loss.dtype),
    norms=_norms.nan(config, window.grad_sums),
  )


def reduced(
  ctx: _inner_step.Context, window: _base.Window
) -> tuple[_inner_step.Sums, _base.Closed]:
  """The window summed over the devices (its one reduction), and what
  closing it gives."""
  config = ctx.config
  sums = _compensated.window_sums(window, config.compensated)
  sums, parts, loss_sum = ctx.place.reduce_window(
    sums, window.acc_tokens, window.acc_loss
  )
  total, valid = _tokens.from_parts(parts, config.token_dtype)
  divisor = _tokens.divisor(total)
  mean_loss = loss_sum / divisor.astype(loss_sum.dtype)
  closed = _base.Closed(
    emitted=jnp.logical_and(valid, total > 0),
    valid=valid,
    tokens=total,
    mean_loss=mean_loss,
    norms=_norms.nan(config, sums),
  )
  return _inner_step.Sums(sums, divisor, mean_loss), closed


def close_now(
  ctx: _inner_step.Context, window: _base.Window, inner_state: _typing.OptState
) -> CallResult:
  """Closes the window (the host decided: ``close=True``): its reduction
  sits in the program beside the backward pass.

  On a GPU, and on a TPU where the sums' types carry no sharding,
  ``inner``'s step is written out (:func:`_written_out`), so that XLA
  fuses it with the parameters' update (``optax.apply_updates`` in the
  same program). Elsewhere it is :func:`close_if`'s closing trip
  (:func:`_in_trip`)."""

  def in_trip(window, inner_state):
    return _in_trip(ctx, window, inner_state)

  def written_out(window, inner_state):
    return _written_out(ctx, window, inner_state)

  platforms = WRITTEN_OUT_ON
  if ctx.place.typed_over_a_mesh(window.grad_sums):
    # Sums typed over a mesh: XLA:TPU partitions the written-out step into
    # more collectives than the trip's (ZeRO-1: a second reduce-scatter
    # and all-gathers; FSDP: one scalar all-reduce more).
    platforms = tuple(p for p in platforms if p != 'tpu')
  written = dict.fromkeys(platforms, written_out)
  updates, window, inner_state, closed = jax.lax.platform_dependent(
    window, inner_state, **written, default=in_trip
  )
  return CallResult(updates, window, inner_state, closed)


def _in_trip(
  ctx: _inner_step.Context, window: _base.Window, inner_state: _typing.OptState
) -> tuple[_typing.Updates, _base.Window, _typing.OptState, _base.Closed]:
  """:func:`close_now` as :func:`close_if`'s closing trip, out of a loop:
  its ``inner`` step (and the norms' squares) runs in a loop of 1 trip as
  where the device closes, so it rounds alike wherever the window closes
  (written out, the CPU sums the squares in another order), and XLA:TPU
  writes less around a loop than around selects."""
  summed = reduced(ctx, window)
  inner = _inner_step.inner_of(ctx, inner_state)
  held = _held_updates.of(ctx.place, window.grad_sums, inner.shapes)
  updates = held.carried()
  carry = (window, inner_state, nothing_emitted(ctx.config, window), updates)
  found = _trip(ctx, inner, held, lambda window: summed, carry)
  window, inner_state, closed, updates = found
  updates = held.released(window, updates, closed.emitted)
  window = _window.restarted_if(ctx.place, closed_for_certain(), window)
  return updates, window, inner_state, closed


def closed_for_certain() -> jax.Array:
  """``True``, the host's close, as a flag XLA cannot fold."""
  return jax.lax.optimization_barrier(jnp.asarray(True))


def _written_out(
  ctx: _inner_step.Context, window: _base.Window, inner_state: _typing.OptState
) -> tuple[_typing.Updates, _base.Window, _typing.OptState, _base.Closed]:
  """:func:`close_now` without a loop: ``inner``'s step, its updates -0.0
  and its state kept unless the window emits (selects, which XLA fuses
  with that step); the window's count and loss zeroed, its sums left to
  the next window's first micro-step (``_window.restart_if``) on a GPU,
  zeroed here on a TPU (``_window.restarted_if``), where they are laid out
  as the parameters (:func:`_as_the_parameters`)."""
  inner = _inner_step.inner_of(ctx, inner_state)
  summed, closed = reduced(ctx, window)
  summed = summed._replace(sums=_as_the_parameters(summed.sums))
  updates, new_inner, norms = inner.step(summed, inner_state, ctx.params)
  emitted = closed.emitted
  updates = jax.tree.map(lambda u: _held_updates.or_zeros(u, emitted), updates)
  new_inner = optax.tree.where(emitted, new_inner, inner_state)
  window = _window.counts_restarted(ctx.place, window)
  window = _window.restarted_if(ctx.place, closed_for_certain(), window)
  return updates, window, new_inner, closed._replace(norms=norms)


def _as_the_parameters(sums: _typing.Updates) -> _typing.Updates:
  """On a TPU, the window's sums laid out in memory as the parameters are
  (row-major), elsewhere as they are. XLA:TPU fuses the last gradient's
  GEMM, the sums and ``inner``'s step, and a v6e lays that fusion out as
  the GEMM's output, transposed: it copied every parameter, moment and
  sum into that layout and back (the closing step 2.25x the ideal's,
  3.8 parameter-sized temporaries)."""

  def row_major(sums):
    def constrained(s):
      return layout.with_layout_constraint(
        s, layout.Layout(tuple(range(s.ndim)))
      )

    return jax.tree.map(constrained, sums)

  return jax.lax.platform_dependent(
    sums, tpu=row_major, default=lambda sums: sums
  )


def keep_open(
  ctx: _inner_step.Context, window: _base.Window, inner_state: _typing.OptState
) -> CallResult:
  """The window left open (the host decided: ``close=False``): zero
  updates shaped like ``inner``'s (``_held_updates.zeros``, ``fold``),
  and no ``inner`` work."""
  shapes = _inner_step.inner_of(ctx, inner_state).shapes
  closed = nothing_emitted(ctx.config, window)
  return CallResult(
    _held_updates.zeros(shapes, fold=True), window, inner_state, closed
  )


def close_if(
  ctx: _inner_step.Context,
  close: jax.Array,
  window: _base.Window,
  inner_state: _typing.OptState,
) -> CallResult:
  """Closes the window if ``close``, which the device decides, in a loop of
  0 or 1 trips (``place.loop_if``): an open micro-step reads and writes
  nothing of it.

  The updates have the shapes and dtypes of ``inner``'s (``jax.eval_shape``,
  as in ``optax.MultiSteps``). Where the accumulator's buffer can hold them
  exactly, the closing trip writes them there and the call reads them back
  (``_held_updates.InBuffer``): the buffer goes on holding them until the
  next window's first micro-step zeroes it (``_window.restart_if``).
  Elsewhere the loop carries them, zeros where it takes no trip
  (``_held_updates.Carried``).
  """
  place = ctx.place
  inner = _inner_step.inner_of(ctx, inner_state)
  held = _held_updates.of(place, window.grad_sums, inner.shapes)
  updates = held.carried()
  carry = (window, inner_state, nothing_emitted(ctx.config, window), updates)
  reduce = functools.partial(reduced, ctx)
  closing = functools.partial(_trip, ctx, inner, held, reduce)
  window, inner_state, closed, updates = place.loop_if(close, closing, carry)
  updates = held.released(window, updates, closed.emitted)
  window = _window.restarted_if(place, close, window)
  return CallResult(updates, window, inner_state, closed, held.in_buffer())


def _trip(
  ctx: _inner_step.Context,
  inner: _inner_step.Inner,
  held: _held_updates.HeldUpdates,
  reduce: Callable,
  carry: tuple,
) -> tuple:
  """The closing trip: the window reduced (``reduce``), ``inner``'s step
  if it emits, its count and loss zeroed, the updates left where ``held``
  holds them. A window without tokens or with an invalid count emits no
  updates and keeps the inner state: a nested loop, which reads nothing of
  the inner state where it is not taken."""
  window, inner_state, _, updates = carry
  summed, closed = reduce(window)
  holder = held.holder(window, updates)
  norms = _norms.nan(ctx.config, summed.sums)
  place, emitted = ctx.place, closed.emitted
  if held.in_sums(summed.sums, holder):
    # Nothing reduced: the loop carries the sums once, and ``inner``'s
    # updates are written into them; a loop everywhere, which moves less
    # than a ``cond``.
    carry = (summed, (), inner_state, norms)
    step = _into_sums(ctx, inner, held)
    summed, _, inner_state, norms = place.loop_if(emitted, step, carry)
    holder = summed.sums
  else:
    carry = (summed, holder, inner_state, norms)
    step = _beside(ctx, inner, held)
    _, holder, inner_state, norms = _if_emitted(place, emitted, step, carry)
  window = _window.counts_restarted(place, window)
  window, updates = held.kept(window, holder)
  # Values the trip hands on unchanged become the loop's body consts (jax
  # forwards them past the loop). XLA reduces an unreduced const before
  # the loop, on every call: where they carry a sharding in their type,
  # hand them on as new values. Elsewhere they stay consts: returned from
  # the loop, XLA:CPU wrote a compensated micro-step's sums into new
  # buffers and copied them into the state's.
  passed = held.passed(window)
  if ctx.place.typed_over_a_mesh(passed):
    passed = jax.lax.optimization_barrier(passed)
  window = window._replace(**passed)
  return window, inner_state, closed._replace(norms=norms), updates


def _beside(
  ctx: _inner_step.Context,
  inner: _inner_step.Inner,
  held: _held_updates.HeldUpdates,
) -> Callable:
  """``inner``'s step, its updates written into the holder the loop
  carries beside the reduced sums."""

  def step(carry):
    summed, holder, inner_state, _ = carry
    found, new_inner, norms = inner.step(summed, inner_state, ctx.params)
    return summed, held.written(found, holder), new_inner, norms

  return step


def _into_sums(
  ctx: _inner_step.Context,
  inner: _inner_step.Inner,
  held: _held_updates.HeldUpdates,
) -> Callable:
  """``inner``'s step where the holder is the reduced sums themselves,
  which the loop carries once (carried twice, XLA copies it): its updates
  written into the sums' own buffer (``in_place``)."""

  def step(carry):
    summed, _, inner_state, _ = carry
    found, new_inner, norms = inner.step(summed, inner_state, ctx.params, True)
    sums = held.written(found, summed.sums)
    return summed._replace(sums=sums), (), new_inner, norms

  return step


def _if_emitted(
  place: _placement.Placement,
  emitted: jax.Array,
  step: Callable,
  carry: _typing.ArrayTree,
) -> _typing.ArrayTree:
  """``step(carry)`` if the window emits, else ``carry``: a loop of 0 or 1
  trips (``place.loop_if``), but a ``cond`` on a TPU, where the loop would
  carry the window's reduced sums beside the buffer: XLA:TPU keeps both
  alive through a loop, one parameter-sized buffer more."""

  def looped(carry):
    return place.loop_if(emitted, step, carry)

  def branched(carry):
    return place.cond(emitted, step, lambda carry: carry, carry)

  branches = {platform: branched for platform in BRANCHED_ON}
  return jax.lax.platform_dependent(carry, **branches, default=looped)
