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
"""Closing the window and applying its updates in the same call
(``update_and_apply``, on one device, where the buffer the call returns
is its updates): :func:`closed` gives ``_closing``'s result and the
parameters with the updates applied.

On a GPU or CPU the window closes as ``_closing`` closes it, and the
updates are added after the call from the buffer that holds them, in a
loop of 0 or 1 trips (``_held_updates.applied``). A TPU restarts the
buffer where the window closes; there, where the device closes it,
without compensation, the closing trip applies the updates itself
(:func:`_in_trip`), so that an open micro-step reads and writes nothing
of the parameters. The host's close (``close=True``) is ``_closing``'s,
the updates added after it as ``optax.apply_updates`` adds them: on a
GPU and a TPU it is written out, and XLA fuses that add with ``inner``'s
step, in the program ``tx.update`` then ``optax.apply_updates`` makes.
"""

from typing import Union

import jax
import optax

from optax_tokacc import _base
from optax_tokacc import _closing
from optax_tokacc import _held_updates
from optax_tokacc import _inner_step
from optax_tokacc import _norms
from optax_tokacc import _typing
from optax_tokacc import _window


def closed(
  ctx: _inner_step.Context,
  close: Union[bool, jax.Array],
  window: _base.Window,
  inner_state: _typing.OptState,
  params: _typing.Params,
) -> tuple[_closing.CallResult, _typing.Params]:
  """The window closed if ``close`` (the device's flag, or the host's
  ``True`` or ``False``), and ``params`` with the call's updates
  applied."""
  if close is False:
    found = _closing.keep_open(ctx, window, inner_state)
    return found, optax.apply_updates(params, found.updates)

  def after(args):
    if close is True:
      found = _closing.close_now(ctx, *args[:2])
    else:
      found = _closing.close_if(ctx, close, *args[:2])
    if found.held:
      applied = _held_updates.applied(
        args[2], found.updates, found.window.grad_sums, found.closed.emitted
      )
    else:
      applied = optax.apply_updates(args[2], found.updates)
    return *found[:4], applied

  def in_trip(args):
    return _in_trip(ctx, inner, held, close, *args)

  args = (window, inner_state, params)
  if close is True or ctx.config.compensated:
    found = after(args)
  else:  # the device's flag: the TPU may close it in the loop's trip
    inner = _inner_step.inner_of(ctx, inner_state)
    held = _held_updates.of(ctx.place, window.grad_sums, inner.shapes)
    if held.in_buffer():
      found = jax.lax.platform_dependent(args, tpu=in_trip, default=after)
    else:
      found = after(args)
  return _closing.CallResult(*found[:4]), found[4]


def _in_trip(
  ctx: _inner_step.Context,
  inner: _inner_step.Inner,
  held: _held_updates.HeldUpdates,
  close: jax.Array,
  window: _base.Window,
  inner_state: _typing.OptState,
  params: _typing.Params,
) -> tuple:
  """:func:`closed` on a TPU: ``_closing.close_if`` with the updates
  applied to ``params`` in the closing trip, which restarts the window
  too. The loop carries the parameters, and the updates out (-0.0 where
  it takes no trip; XLA drops them where nothing reads them). Nothing is
  reduced on one device: ``inner``'s updates are written into the sums'
  own buffer and added to the parameters from there, in the loop of 0 or
  1 trips on whether the window emits, which carries the sums once (as
  ``_closing._into_sums``). ``inner`` and ``held``: as :func:`closed`
  found them."""
  place = ctx.place

  def trip(carry):
    _, window, inner_state, _, params = carry
    summed, closed = _closing.reduced(ctx, window)
    emitted = closed.emitted

    def step(carry):
      summed, inner_state, _, params = carry
      found, new_inner, norms = inner.step(summed, inner_state, params, True)
      # The updates as a value of their own: without the barrier XLA:TPU
      # holds a layer's updates beside the sums (+0.25 P on a v5e).
      sums = held.written(found, summed.sums)
      sums = jax.tree.map(jax.lax.optimization_barrier, sums)

      # Added in a loop's body, which no compiler fuses with what is
      # outside it: their last multiply and the add round twice, as
      # ``optax.apply_updates`` after the call (a fused multiply-add
      # rounds once; XLA:CPU of jax 0.10.2 and 0.8.2 fused them across
      # the barrier).
      def add(params):
        return optax.apply_updates(params, optax.tree.cast_like(sums, found))

      params = place.loop_if(emitted, add, params)
      return summed._replace(sums=sums), new_inner, norms, params

    carry = (summed, inner_state, _norms.nan(ctx.config, summed.sums), params)
    summed, inner_state, norms, params = place.loop_if(emitted, step, carry)
    window = window._replace(grad_sums=summed.sums)
    updates = held.released(window, (), emitted)
    window = _window.counts_restarted(place, window)
    window = _window.sums_restarted(place, window)
    return updates, window, inner_state, closed._replace(norms=norms), params

  updates = _held_updates.zeros(inner.shapes)
  carry = (
    updates,
    window,
    inner_state,
    _closing.nothing_emitted(ctx.config, window),
    params,
  )
  return place.loop_if(close, trip, carry)
