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
(:func:`close_if`): micro-steps run no optimizer work and no collective,
and the accumulator's buffer holds the updates. On
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
from optax_tokacc import _compat
from optax_tokacc import _compensated
from optax_tokacc import _held_updates
from optax_tokacc import _inputs
from optax_tokacc import _norms
from optax_tokacc import _placement
from optax_tokacc import _tokens
from optax_tokacc import _typed_sharding
from optax_tokacc import _typing
from optax_tokacc import _window

# The platforms where the host's close is written out (``close_now``).
WRITTEN_OUT_ON = ('cuda', 'rocm')
# The platforms where a window reduced over devices emits in a ``cond``,
# not a loop (``_if_emitted``).
BRANCHED_ON = ('tpu',)
# The platforms where the means wait for the norms' squares
# (``_after_squares``).
ORDERED_ON = ('cpu',)


class CallResult(NamedTuple):
  """What a call gives back once the window is closed or left open (the
  window's close itself is :class:`~optax_tokacc._base.Closed`)."""

  updates: _typing.Updates
  window: _base.Window
  inner_state: _typing.OptState
  closed: _base.Closed
  # Whether the window's buffer holds the updates where they are emitted
  # (a device's close on a GPU or CPU: ``_held_updates.released``).
  held: bool = False


class Extra(NamedTuple):
  """What ``inner.update`` gets beside its three arguments."""

  args: dict[str, Any]  # the extra args passed to ``tx.update``
  with_loss: bool  # whether it gets ``value=``, the window's loss


class Context(NamedTuple):
  """What closing a window (or keeping it open) reads beside the window and
  ``inner``'s state: the same for every way to close it."""

  config: _base.Config
  place: _placement.Placement
  grads: _typing.Updates  # this micro-batch's: their tree and dtypes only
  params: Optional[_typing.Params]
  extra: Extra


class _Sums(NamedTuple):
  """The window summed over the devices: what ``inner``'s step reads."""

  sums: _typing.Updates
  divisor: jax.Array  # its count, or 1 where it has none (``_tokens``)
  mean_loss: jax.Array


class _Inner(NamedTuple):
  """``inner`` as the closing runs it: the shapes, dtypes and types of its
  updates, and its step (:func:`_step`, bound to its :class:`Context`)."""

  shapes: _typing.Updates
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
  return _Sums(sums, divisor, mean_loss), closed


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
  ctx: Context, sums: _typing.Updates, divisor: jax.Array
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
  opt_state: _typing.OptState,
  params: Optional[_typing.Params],
  in_place: bool = False,
) -> tuple[_typing.Updates, _typing.OptState, _base.WindowNorms]:
  """``inner.update`` run once on the window's token-mean gradient, with
  ``value=`` the window's token-mean loss where ``ctx.extra`` says so, its
  state's dtypes kept, in the types optax's nonlinear updates take; the
  updates come typed like the parameters, so that ``optax.apply_updates``
  keeps their type. ``in_place``: the updates are written into the sums'
  own buffer (:func:`_after_squares`)."""
  config, place = ctx.config, ctx.place
  if config.norms:
    # Taken before ``inner`` runs: a norm of the mean taken beside it kept
    # the sums alive, and the buffer that holds the updates was copied (a
    # parameter-sized temporary). On a GPU, of the sums as a value of
    # their own (an optimization barrier): XLA:GPU kept them alive through
    # ``inner`` otherwise; the CPU copies them for a barrier, and XLA:TPU
    # moves more around one. One barrier per leaf: jax 0.10 types one
    # barrier's outputs as varying over every axis any operand varies over.
    def barrier(sums):
      return jax.tree.map(jax.lax.optimization_barrier, sums)

    kept_apart = jax.lax.platform_dependent(
      summed.sums, cuda=barrier, rocm=barrier, default=lambda sums: sums
    )
    squares, squares_divisor = _squares(ctx, kept_apart, summed.divisor)
  if config.norms and in_place:
    divisor = _after_squares(summed.divisor, squares)
  else:
    divisor = summed.divisor
  value = {'value': summed.mean_loss} if ctx.extra.with_loss else {}
  means = jax.tree.map(lambda s: _mean(s, divisor), summed.sums)
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
    found = place.norms(summed.sums, squares, updates, config.leaf_norms)
    norms = _norms.of_window(
      found, squares_divisor, ctx.grads, config.leaf_norms
    )
  if params is not None:
    updates = place.typed_like(updates, params)
  return updates, place.typed_like(new_inner, opt_state), norms


def _after_squares(divisor: jax.Array, squares: dict) -> jax.Array:
  """``divisor`` on the CPU (``ORDERED_ON``) as a value XLA computes once
  the ``squares`` are summed: plus the count of negative squares (none),
  the same value, since a window that reaches ``inner`` has a positive
  count. The means are divided by it, so the squares' reads of the sums
  come before ``inner``'s updates are written into the sums' buffer;
  XLA:CPU copied every leaf of the sums otherwise (an optimization
  barrier orders nothing there). Used only where the updates are written
  into the sums' own buffer (nothing reduced: a sharded window's squares
  would be summed over devices before the means, a collective of their
  own); ``divisor`` as it is where the squares are typed otherwise than
  the count (each device's share in ``shard_map``, a sharding in the
  type)."""

  def ordered(both):
    divisor, squares = both
    leaves = jax.tree.leaves(squares)
    axes = _compat.varying_axes(divisor)
    if not all(
      _typed_sharding.untyped(s) and _compat.varying_axes(s) <= axes
      for s in leaves
    ):
      return divisor
    negative = sum(jnp.sum(s < 0, dtype=divisor.dtype) for s in leaves)
    return divisor + negative

  branches = {platform: ordered for platform in ORDERED_ON}
  return jax.lax.platform_dependent(
    (divisor, squares), **branches, default=lambda both: both[0]
  )


def close_now(
  ctx: Context, window: _base.Window, inner_state: _typing.OptState
) -> CallResult:
  """Closes the window (the host decided: ``close=True``): its reduction
  sits in the program beside the backward pass.

  On a GPU ``inner``'s step is written out (:func:`_written_out`), so that
  XLA fuses it with the parameters' update (``optax.apply_updates`` in the
  same program). Elsewhere the rest is :func:`close_if`'s closing trip,
  whose ``inner`` step (and the norms' squares) runs in a loop of 1 trip as
  where the device closes: it rounds alike wherever the window closes
  (written out, the CPU sums the squares in another order), and XLA:TPU
  writes less around a loop than around selects."""

  def in_trips(window, inner_state):
    return _close(ctx, None, window, inner_state, _reduce(ctx, window))[:4]

  def written_out(window, inner_state):
    return _written_out(ctx, window, inner_state)

  written = {platform: written_out for platform in WRITTEN_OUT_ON}
  updates, window, inner_state, closed = jax.lax.platform_dependent(
    window, inner_state, **written, default=in_trips
  )
  return CallResult(updates, window, inner_state, closed)


def _written_out(
  ctx: Context, window: _base.Window, inner_state: _typing.OptState
) -> tuple[_typing.Updates, _base.Window, _typing.OptState, _base.Closed]:
  """:func:`close_now` without a loop: ``inner``'s step, its updates -0.0
  and its state kept unless the window emits (selects, which XLA fuses
  with that step); the window's count and loss zeroed, its sums left to
  the next window's first micro-step (``_window.restart_if``)."""
  inner = _inner(ctx, inner_state)
  summed, closed = _reduce(ctx, window)
  updates, new_inner, norms = inner.step(summed, inner_state, ctx.params)
  emitted = closed.emitted
  updates = jax.tree.map(lambda u: _held_updates.or_zeros(u, emitted), updates)
  new_inner = optax.tree.where(emitted, new_inner, inner_state)
  window = _window.counts_restarted(ctx.place, window)
  return updates, window, new_inner, closed._replace(norms=norms)


def keep_open(
  ctx: Context, window: _base.Window, inner_state: _typing.OptState
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
  inner_state: _typing.OptState,
) -> CallResult:
  """Closes the window if ``close``, which the device decides: see
  :func:`_close`."""
  return _close(ctx, close, window, inner_state, None)


def _close(
  ctx: Context,
  close: Optional[jax.Array],
  window: _base.Window,
  inner_state: _typing.OptState,
  reduced: Optional[tuple[_Sums, _base.Closed]],
) -> CallResult:
  """Closes the window if ``close``, in a loop of 0 or 1 trips
  (``place.loop_if``): an open micro-step reads and writes nothing of it.

  Returns a :class:`CallResult`. The updates have the shapes and dtypes of
  ``inner``'s (``jax.eval_shape``, as in ``optax.MultiSteps``). Where the
  accumulator's buffer can hold them exactly, the closing trip writes them
  there and the call reads them back (``_held_updates``): the buffer goes
  on holding them until the next window's first micro-step zeroes it
  (``_window.restart_if``). Elsewhere the loop carries the updates, zeros
  where it takes no trip. A window without tokens or with an invalid count
  emits no updates and keeps the inner state: a nested loop, which reads
  nothing of the inner state where it is not taken. ``reduced``: the
  window's reduction made by the host's closing step (``close`` None),
  which runs the closing trip out of a loop.
  """
  config, place = ctx.config, ctx.place
  inner = _inner(ctx, inner_state)
  buffer = _held_updates.holds_exactly(place, window.grad_sums, inner.shapes)

  def closing(carry):
    window, inner_state, _, updates = carry
    summed, closed = reduced or _reduce(ctx, window)
    held = window.grad_sums if buffer else updates
    # Where the buffer is the sums themselves (nothing to reduce), the
    # loop carries it once: carried twice, XLA copies it.
    alone = buffer and _same(summed.sums, held)

    def step(carry):
      summed, held, inner_state, _ = carry
      found, new_inner, norms = inner.step(
        summed, inner_state, ctx.params, alone
      )
      held = _held_updates.held(
        place, buffer, found, summed.sums if alone else held
      )
      if alone:
        return summed._replace(sums=held), (), new_inner, norms
      return summed, held, new_inner, norms

    norms = _norms.nan(config, summed.sums)
    carry = (summed, () if alone else held, inner_state, norms)
    summed, held, inner_state, norms = _if_emitted(
      place, closed.emitted, step, carry, alone
    )
    held = summed.sums if alone else held
    window = _window.counts_restarted(place, window)
    if buffer:
      window, updates = window._replace(grad_sums=held), ()
    else:
      updates = held
    # Values the trip hands on unchanged become the loop's
    # body consts (jax forwards them), and XLA reduces an unreduced const
    # before the loop, on every call: hand them on as new values.
    passed = {'acc_compensation': window.acc_compensation}
    if not buffer:
      passed['grad_sums'] = window.grad_sums
    window = window._replace(**jax.lax.optimization_barrier(passed))
    return window, inner_state, closed._replace(norms=norms), updates

  updates = () if buffer else _held_updates.zeros(inner.shapes)
  carry = (window, inner_state, _open(config, window), updates)
  if reduced is None:
    window, inner_state, closed, updates = place.loop_if(close, closing, carry)
  else:  # closed for certain: the window's trip, out of a loop
    window, inner_state, closed, updates = closing(carry)
  if buffer:
    updates = _held_updates.released(
      place, window.grad_sums, inner.shapes, closed.emitted
    )
  held = buffer and close is not None
  if close is None:  # closed for certain: a flag XLA cannot fold
    close = jax.lax.optimization_barrier(jnp.asarray(True))
  window = _window.restarted_if(place, close, window)
  return CallResult(updates, window, inner_state, closed, held)


def _if_emitted(
  place: _placement.Placement,
  emitted: jax.Array,
  step: Callable,
  carry: _typing.ArrayTree,
  alone: bool,
) -> _typing.ArrayTree:
  """``step(carry)`` if the window emits, else ``carry``: a loop of 0 or 1
  trips (``place.loop_if``), but a ``cond`` on a TPU where the loop would
  carry the window's reduced sums beside the buffer (``alone`` False):
  XLA:TPU keeps both alive through a loop, one parameter-sized buffer
  more. Where the buffer is the sums, its loop moves less than a
  ``cond``."""

  def looped(carry):
    return place.loop_if(emitted, step, carry)

  if alone:
    return looped(carry)

  def branched(carry):
    return place.cond(emitted, step, lambda carry: carry, carry)

  branches = {platform: branched for platform in BRANCHED_ON}
  return jax.lax.platform_dependent(carry, **branches, default=looped)


def _same(a: _typing.Updates, b: _typing.Updates) -> bool:
  """Whether two trees are the same arrays (the same tracers)."""
  return all(x is y for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


def _inner(ctx: Context, inner_state: _typing.OptState) -> _Inner:
  """``inner`` as the closing runs it: given the window's loss as ``value=``
  where ``loss`` was passed, unless ``inner`` raises a ``TypeError`` with it
  and runs without it (``optax.contrib.sam``'s update takes no ``value``).
  Where ``loss`` was not passed, an ``inner`` that raises a ``TypeError``
  and runs with a ``value`` gets the error that names ``loss``. Both are
  decided by tracing ``inner`` the other way, not by reading its error."""
  try:
    return _traced(ctx, inner_state)
  except TypeError as e:
    error = e
  with_loss = ctx.extra.with_loss
  other = ctx._replace(extra=ctx.extra._replace(with_loss=not with_loss))
  try:
    found = _traced(other, inner_state)
  except Exception:  # neither way: inner's first error stands
    found = None
  if found is None:
    raise error
  if with_loss:
    return found
  raise _inputs.needs_value_error(error) from error


def _traced(ctx: Context, inner_state: _typing.OptState) -> _Inner:
  """:class:`_Inner` from ``jax.eval_shape`` of its step on values typed
  as the window's sums will be; our error where the placement has one for
  ``inner`` failing there."""
  config, place = ctx.config, ctx.place
  step = functools.partial(_step, ctx)
  try:
    sums = place.reduced_types(ctx.grads)  # unused values: for their types
    summed = _Sums(
      sums,
      divisor=jax.ShapeDtypeStruct([], config.token_dtype),
      mean_loss=jax.ShapeDtypeStruct([], config.loss_dtype),
    )
    shapes = jax.eval_shape(step, summed, inner_state, ctx.params)[0]
  except Exception as e:
    _raise(e, place.refusal_of(e, functools.partial(_runs_on, ctx)))
  return _Inner(shapes, step)


def _runs_on(ctx: Context, place: _placement.Placement) -> bool:
  """Whether ``inner`` traces on ``place`` (another layout of the same
  gradients), from the state its ``init`` makes there."""
  try:
    sums = place.reduced_types(ctx.grads)
    _traced(
      ctx._replace(place=place), jax.eval_shape(ctx.config.inner.init, sums)
    )
  except Exception:  # it fails there too
    return False
  return True


def _raise(error: Exception, ours: Optional[Exception]) -> NoReturn:
  """Raises ``ours`` (our error for ``error``), or ``error`` where None."""
  if ours is None:
    raise error
  raise ours from error
