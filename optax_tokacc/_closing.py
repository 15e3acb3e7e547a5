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

On the device (``close=None``) the closing step is one ``lax.cond`` whose
other branch does nothing (:func:`close_if`): micro-steps run no optimizer
work and no collective, and the accumulator's buffer holds the updates. On
the host's decision (a Python ``close``) the window is closed or left open
without a conditional (:func:`close_now`, :func:`keep_open`). Where the sums
live and how they are reduced is the placement's (``_placement``).
"""

from collections.abc import Callable
import functools
from typing import Any, NamedTuple, NoReturn, Optional

import jax
import jax.numpy as jnp
import optax

from optax_tokacc import _base
from optax_tokacc import _compensated
from optax_tokacc import _held_updates
from optax_tokacc import _inputs
from optax_tokacc import _norms
from optax_tokacc import _placement
from optax_tokacc import _tokens
from optax_tokacc import _window


class CallResult(NamedTuple):
  """What a call gives back once the window is closed or left open (the
  window's close itself is :class:`~optax_tokacc._base.Closed`)."""

  updates: optax.Updates
  window: _base.Window
  inner_state: optax.OptState
  closed: _base.Closed


class Extra(NamedTuple):
  """What ``inner.update`` gets beside its three arguments."""

  args: dict[str, Any]  # the extra args passed to ``tx.update``
  with_loss: bool  # whether it gets ``value=``, the window's loss


class Context(NamedTuple):
  """What closing a window (or keeping it open) reads beside the window and
  ``inner``'s state: the same for every way to close it."""

  config: _base.Config
  place: _placement.Placement
  grads: optax.Updates  # this micro-batch's: their tree and dtypes only
  params: Optional[optax.Params]
  extra: Extra


class _Sums(NamedTuple):
  """The window summed over the devices: what ``inner``'s step reads."""

  sums: optax.Updates
  divisor: jax.Array  # its count, or 1 where it has none (``_tokens``)
  mean_loss: jax.Array
  # The squares (``place.squares``) of the sums or of their mean
  # (:func:`_squares`), taken before ``inner`` runs: a norm of the mean
  # taken beside ``inner`` kept the sums alive, and the buffer that holds
  # the updates was copied (a parameter-sized temporary).
  squares: dict
  squares_divisor: jax.Array  # what their norms are divided by


class _Inner(NamedTuple):
  """``inner`` as the closing runs it: the shapes, dtypes and types of its
  updates, and its step (:func:`_step`, bound to its :class:`Context`)."""

  shapes: optax.Updates
  step: Callable


def _open(config: _base.Config, window: _base.Window) -> _base.Closed:
  """What a call that leaves the window open gives: nothing emitted."""
  return _base.Closed(
    emitted=jnp.asarray(False),
    valid=jnp.asarray(True),
    tokens=jnp.zeros([], window.acc_tokens.dtype),
    mean_loss=jnp.zeros([], window.acc_loss.dtype),
    norms=_norms.nan(config, window.grad_sums),
  )


def _reduce(ctx: Context, window: _base.Window) -> tuple[_Sums, _base.Closed]:
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
  squares, squares_divisor = {}, divisor
  if config.norms:
    squares, squares_divisor = _squares(ctx, sums, divisor)
  return _Sums(sums, divisor, mean_loss, squares, squares_divisor), closed


def _mean(s: jax.Array, divisor: jax.Array) -> jax.Array:
  """A sum over its count: one reciprocal, multiplied, in the sum's
  dtype, at least float32, or the count's if wider (float64 weights)."""
  # One reciprocal: the same arithmetic in every program (XLA turns a
  # division by a broadcast scalar into this in some programs only: host-
  # and device-closed windows differed by a rounding).
  wide = jnp.promote_types(
    jnp.promote_types(s.dtype, jnp.float32), divisor.dtype
  )
  return s.astype(wide) * (1 / divisor.astype(wide))


def _squares(
  ctx: Context, sums: optax.Updates, divisor: jax.Array
) -> tuple[dict, jax.Array]:
  """The squares that the window's norms are taken from, and what those
  norms are divided by: of the sums, divided by an integer count; of the
  mean under a floating one, whose sums of small weights have squares
  below float32's range (and of large ones above it)."""
  if jnp.issubdtype(divisor.dtype, jnp.integer):
    return ctx.place.squares(sums, ctx.config.leaf_norms), divisor
  means = jax.tree.map(lambda s: _mean(s, divisor), sums)
  squares = ctx.place.squares(means, ctx.config.leaf_norms)
  return squares, jnp.ones_like(divisor)


def _step(
  ctx: Context,
  summed: _Sums,
  opt_state: optax.OptState,
  params: Optional[optax.Params],
  emitted: Optional[jax.Array] = None,
) -> tuple[optax.Updates, optax.OptState, _base.WindowNorms]:
  """``inner.update`` run once on the window's token-mean gradient, with
  ``value=`` the window's token-mean loss where ``ctx.extra`` says so, its
  state's dtypes kept, in the types optax's nonlinear updates take; the
  updates come typed like the parameters, so that ``optax.apply_updates``
  keeps their type. With ``emitted`` (a window closed by the host), the
  updates are -0.0 and the state is kept unless ``emitted``: selects,
  where the device uses a ``cond``."""
  config, place = ctx.config, ctx.place
  value = {'value': summed.mean_loss} if ctx.extra.with_loss else {}
  means = jax.tree.map(lambda s: _mean(s, summed.divisor), summed.sums)
  mean_grads = optax.tree.cast_like(means, ctx.grads)
  plain_inner = place.inner_types(opt_state)
  with jax.named_scope(_base.INNER_UPDATE_SCOPE):
    updates, new_inner = config.inner.update(
      mean_grads,
      plain_inner,
      place.inner_types(params),
      **ctx.extra.args,
      **value,
    )
  new_inner = optax.tree.cast_like(new_inner, opt_state)
  norms = _norms.nan(config, ctx.grads)
  if config.norms:
    found = place.norms(summed.sums, summed.squares, updates, config.leaf_norms)
    norms = _norms.of_window(
      found, summed.squares_divisor, ctx.grads, config.leaf_norms
    )
  if emitted is not None:
    updates = jax.tree.map(
      lambda u: _held_updates.or_zeros(u, emitted), updates
    )
    new_inner = optax.tree.where(emitted, new_inner, plain_inner)
  if params is not None:
    updates = place.typed_like(updates, params)
  return updates, place.typed_like(new_inner, opt_state), norms


def close_now(
  ctx: Context, window: _base.Window, inner_state: optax.OptState
) -> CallResult:
  """Closes the window without a conditional (the host decided: ``close=
  True``): the reduction sits in the program beside the backward pass.
  Returns a :class:`CallResult`, as :func:`close_if`."""
  inner = _inner(ctx, inner_state)
  summed, closed = _reduce(ctx, window)
  updates, new_inner, norms = inner.step(
    summed, inner_state, ctx.params, closed.emitted
  )
  closed = closed._replace(norms=norms)
  window = _window.reset_if(ctx.place, True, window)
  return CallResult(updates, window, new_inner, closed)


def keep_open(
  ctx: Context, window: _base.Window, inner_state: optax.OptState
) -> CallResult:
  """The window left open (the host decided: ``close=False``): zero
  updates shaped like ``inner``'s (``_held_updates.zeros``, ``fold``),
  and no ``inner`` work."""
  shapes = _inner(ctx, inner_state).shapes
  closed = _open(ctx.config, window)
  return CallResult(
    _held_updates.zeros(shapes, fold=True), window, inner_state, closed
  )


def close_if(
  ctx: Context,
  close: jax.Array,
  window: _base.Window,
  inner_state: optax.OptState,
) -> CallResult:
  """Closes the window if ``close``, in one ``lax.cond``.

  Returns a :class:`CallResult`. The updates have the shapes and dtypes of
  ``inner``'s (``jax.eval_shape``, as in ``optax.MultiSteps``). Everything
  the branches read is an operand, never a closure: a buffer that reaches
  the ``cond`` twice is copied on every micro-step. Where the accumulator's
  buffer can hold the updates exactly, the closing branch writes them
  there and the call reads them back (``_held_updates``): a micro-step
  then writes no parameter-sized zeros and copies nothing. The closing
  branch starts the next window (``_window.reset_if``), so that a
  micro-step only adds; the sums that the buffer held updates in are
  zeroed after the ``cond``, in a select on ``close``, once the updates
  are read.
  """
  config, place = ctx.config, ctx.place
  inner = _inner(ctx, inner_state)
  buffer = _held_updates.holds_exactly(place, window.grad_sums, inner.shapes)

  def held(updates, grad_sums):  # what the branches return for the updates
    return _held_updates.held(place, buffer, inner.shapes, updates, grad_sums)

  def step(grad_sums, summed, inner_state, params):
    updates, new_inner, norms = inner.step(summed, inner_state, params)
    return held(updates, grad_sums), new_inner, norms

  def no_step(grad_sums, summed, inner_state, params):
    del params
    norms = _norms.nan(config, summed.sums)
    return held(None, grad_sums), inner_state, norms

  def closing(window, inner_state, params):
    """Closes the window on the device, inside the outer ``cond``, and
    starts the next (``rest``: the window but for the sums the buffer
    holds). A window without tokens or with an invalid count emits no
    updates and keeps the inner state: a nested ``cond``, since selecting
    between the new and the old inner state would keep both alive
    (temporaries the size of the inner state on every step)."""
    summed, closed = _reduce(ctx, window)
    ops = (window.grad_sums, summed, inner_state, params)
    kept, new_inner, norms = place.cond(closed.emitted, step, no_step, *ops)
    rest = _window.reset_if(place, True, _held_updates.rest(window, buffer))
    return kept, rest, new_inner, closed._replace(norms=norms)

  def accumulating(window, inner_state, params):
    del params
    rest = _held_updates.rest(window, buffer)
    return (
      held(None, window.grad_sums),
      rest,
      inner_state,
      _open(config, window),
    )

  ops = (window, inner_state, ctx.params)
  kept, rest, inner_state, closed = place.cond(
    close, closing, accumulating, *ops
  )
  if not buffer:
    return CallResult(kept, rest, inner_state, closed)
  # The buffer held the updates: the next window's zeros are written after
  # they are read, in a select.
  updates = _held_updates.released(place, kept, inner.shapes, closed.emitted)
  grad_sums = _window.reset_if(place, close, kept)
  window = rest._replace(grad_sums=grad_sums)
  return CallResult(updates, window, inner_state, closed)


def _inner(ctx: Context, inner_state: optax.OptState) -> _Inner:
  """``inner`` as the closing runs it: with ``loss`` passed it gets the
  window's loss unless it accepts no ``value`` keyword (``optax.contrib.sam``:
  its ``TypeError`` says so); without ``loss``, if ``inner`` needs
  ``value``, the error names ``loss``."""
  try:
    return _traced(ctx, inner_state)
  except TypeError as e:
    with_loss = ctx.extra.with_loss
    if with_loss and "unexpected keyword argument 'value'" in str(e):
      return _traced(
        ctx._replace(extra=ctx.extra._replace(with_loss=False)), inner_state
      )
    _raise(e, None if with_loss else _inputs.needs_value_error(e))


def _traced(ctx: Context, inner_state: optax.OptState) -> _Inner:
  """:class:`_Inner` from ``jax.eval_shape`` of its step on values typed
  as the window's sums will be; our error where the placement has one for
  ``inner`` failing there."""
  config, place = ctx.config, ctx.place
  step = functools.partial(_step, ctx)
  try:
    sums = place.reduced_types(ctx.grads)  # unused values: for their types
    count = jax.ShapeDtypeStruct([], config.token_dtype)
    summed = _Sums(
      sums,
      divisor=count,
      mean_loss=jax.ShapeDtypeStruct([], config.loss_dtype),
      squares=place.squares(sums, config.leaf_norms),
      squares_divisor=count,
    )
    shapes = jax.eval_shape(step, summed, inner_state, ctx.params)[0]
  except Exception as e:
    _raise(e, place.refusal_of(e))
  return _Inner(shapes, step)


def _raise(error: Exception, ours: Optional[Exception]) -> NoReturn:
  """Raises ``ours`` (our error for ``error``), or ``error`` where None."""
  if ours is None:
    raise error
  raise ours from error
