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
"""``inner`` run once on the window's token-mean gradient: the closing's one
optimizer step (:func:`inner_of`), and what it reads (:class:`Context`).

``_closing`` runs it where the window closes; it gets the window summed
over the devices (:class:`Sums`), divides by the count, takes the window's
norms where asked, and types the updates like the parameters. Whether
``inner`` gets ``value=``, and whether a placement refuses it, is decided
by tracing it (:func:`inner_of`).
"""

from collections.abc import Callable
import functools
from typing import Any, NamedTuple, NoReturn, Optional

import jax
import jax.numpy as jnp
import optax

from optax_tokacc import _base
from optax_tokacc import _compat
from optax_tokacc import _inputs
from optax_tokacc import _norms
from optax_tokacc import _placement
from optax_tokacc import _typed_sharding
from optax_tokacc import _typing

# The platforms where the means wait for the norms' squares
# (``_after_squares``).
ORDERED_ON = ('cpu',)


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


class Sums(NamedTuple):
  """The window summed over the devices: what ``inner``'s step reads."""

  sums: _typing.Updates
  divisor: jax.Array  # its count, or 1 where it has none (``_tokens``)
  mean_loss: jax.Array


class Inner(NamedTuple):
  """``inner`` as the closing runs it: the shapes, dtypes and types of its
  updates, and its step (:func:`_step`, bound to its :class:`Context`)."""

  shapes: _typing.Updates
  step: Callable


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


def _squared(
  sums: _typing.Updates, divisor: jax.Array
) -> tuple[_typing.Updates, jax.Array]:
  """What the window's gradient norm is taken of, and what it is divided
  by: the sums, divided by an integer count; the mean under a floating
  one, whose sums of small weights have squares below float32's range
  (and of large ones above it)."""
  if jnp.issubdtype(divisor.dtype, jnp.integer):
    return sums, divisor
  means = jax.tree.map(lambda s: _mean(s, divisor), sums)
  return means, jnp.ones_like(divisor)


def _step(
  ctx: Context,
  summed: Sums,
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
    # Taken before ``inner`` runs, but on a GPU (``_norms.squares``): a
    # norm of the mean taken beside it kept the sums alive, and the buffer
    # that holds the updates was copied (a parameter-sized temporary).
    squared, squares_divisor = _squared(summed.sums, summed.divisor)
    (grad_squares,) = place.squares((squared,), config.leaf_norms)
  if config.norms and in_place:
    divisor = _after_squares(summed.divisor, grad_squares)
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
    squares = _norms.squares(
      place, squared, grad_squares, updates, config.leaf_norms
    )
    found = place.norms(summed.sums, updates, squares, config.leaf_norms)
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


def inner_of(ctx: Context, inner_state: _typing.OptState) -> Inner:
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


def _traced(ctx: Context, inner_state: _typing.OptState) -> Inner:
  """:class:`Inner` from ``jax.eval_shape`` of its step on values typed
  as the window's sums will be; our error where the placement has one for
  ``inner`` failing there."""
  config, place = ctx.config, ctx.place
  step = functools.partial(_step, ctx)
  try:
    sums = place.reduced_types(ctx.grads)  # unused values: for their types
    summed = Sums(
      sums,
      divisor=jax.ShapeDtypeStruct([], config.token_dtype),
      mean_loss=jax.ShapeDtypeStruct([], config.loss_dtype),
    )
    shapes = jax.eval_shape(step, summed, inner_state, ctx.params)[0]
  except Exception as e:
    _raise(e, place.refusal_of(e, functools.partial(_runs_on, ctx)))
  return Inner(shapes, step)


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
