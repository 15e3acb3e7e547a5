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
"""The window: adding a micro-batch, and closing it in one ``lax.cond``.

A micro-step adds the micro-batch's gradients, token count and loss into the
window's sums. The call that closes the window sums it over the devices in
one reduction, divides by its token count and runs the wrapped optimizer
once, inside one ``lax.cond`` whose other branch does nothing: micro-steps
run no optimizer work and no collective.
"""

import functools
from typing import Any
import warnings

import jax
import jax.numpy as jnp
import optax

from optax_tokacc import _collectives
from optax_tokacc import _compensated
from optax_tokacc import _explicit
from optax_tokacc import _tokens
from optax_tokacc import _validation


def keep(config, grads, gradient_step, params, skip_state):
  """Whether to keep the micro-batch (None: always), and the skip state.

  Gradients kept as partial sums (explicit sharding) are judged on every
  device's share and rejected everywhere if any device rejects them: a
  scalar all-reduce per micro-step. That is exact for ``skip_not_finite``
  (a sum is not finite when a partial sum is not); any other function sees
  the reduced gradients, at the cost of their all-reduce per micro-step.
  """
  if config.should_skip_update_fn is None:
    return None, skip_state
  if not any(_explicit.unreduced(g) for g in jax.tree.leaves(grads)):
    skip, skip_state = _validation.call_skip_fn(
      config.should_skip_update_fn, grads, gradient_step, params
    )
    return jnp.logical_not(skip), skip_state
  params = _explicit.without_reduced(params)
  if not config.skip_on_partial_sums:
    _warn_reduced_skip()
    reduced = jax.tree.map(_explicit.reduce_now, grads)
    return keep(config, reduced, gradient_step, params, skip_state)
  axes = tuple(
    sorted(set().union(*map(_explicit.unreduced, jax.tree.leaves(grads))))
  )

  def decide(grads, gradient_step, params):
    skip, skip_state = _validation.call_skip_fn(
      config.should_skip_update_fn, grads, gradient_step, params
    )
    return _explicit.psum_tree((skip, skip_state), axes)

  out_shape = jax.eval_shape(
    lambda *args: _validation.call_skip_fn(config.should_skip_update_fn, *args),
    *_explicit.unsharded_shapes((grads, gradient_step, params)),
  )
  skip, skip_state = _explicit.local(
    decide, (grads, gradient_step, params), _explicit.replicated(out_shape)
  )
  return jnp.logical_not(skip), skip_state


def _warn_reduced_skip():
  warnings.warn(
    'token_weighted_multistep: should_skip_update_fn sees the reduced '
    'gradients, which are unreduced partial sums here (explicit sharding): '
    'this costs an all-reduce of the gradients on every micro-step. '
    'tokacc.skip_not_finite decides on the partial sums instead (a scalar '
    'all-reduce).',
    stacklevel=6,
  )


def add_micro_batch(config, state, grads, count, loss, keep) -> tuple:
  """The window with this micro-batch added: grads, compensation, tokens,
  loss. Contributions are selected, never multiplied by zero.

  ``count`` is the validated count (``_tokens.as_count``); where the window
  is kept as partial sums it is replicated and only counted on one device.
  """
  adds = keep
  if config.mean_loss:
    adds = count > 0 if adds is None else jnp.logical_and(adds, count > 0)

  def addend(acc, grad):
    dtype = jnp.promote_types(acc.dtype, jnp.float32)
    grad = grad.astype(dtype if config.compensated else acc.dtype)
    if config.mean_loss:
      grad = _explicit.scale(grad, count.astype(grad.dtype))
    if adds is None:
      return grad
    return jnp.where(adds, grad, jnp.zeros_like(grad))

  acc_grads, acc_compensation = _accumulate(
    config, state, jax.tree.map(addend, state.acc_grads, grads)
  )
  acc_tokens, acc_loss = _add_scalars(config, state, count, loss, keep, adds)
  return acc_grads, acc_compensation, acc_tokens, acc_loss


def _accumulate(config, state, addends):
  """``_compensated.accumulate``, on each device's partial sums where the
  compensated (nonlinear) sum meets unreduced values."""
  args = (
    state.acc_grads,
    state.acc_compensation,
    addends,
    state.mini_step == 0,
  )

  def accumulate(acc_grads, acc_compensation, addends, restart):
    return _compensated.accumulate(
      acc_grads, acc_compensation, addends, restart, config.compensated
    )

  if not config.compensated or not _explicit.any_unreduced(state.acc_grads):
    return accumulate(*args)
  out_specs = (_explicit.specs(state.acc_grads),) * 2
  return _explicit.local(accumulate, args, out_specs)


def _add_scalars(config, state, count, loss, keep, adds):
  """The window's token count and loss with this micro-batch's added.

  Where the window is kept as partial sums, a replicated count or loss is
  put on one device (free) and the count is validated on each device.
  """
  axes = _explicit.unreduced(state.acc_tokens)
  if loss is None:  # No loss: the window's loss is unknown, NaN.
    loss = jnp.full([], jnp.nan, config.loss_dtype)
  loss = jnp.asarray(loss).astype(config.loss_dtype)
  if config.mean_loss:
    loss = _explicit.scale(loss, count.astype(loss.dtype))
  count = jnp.asarray(count)
  if axes:
    count = _explicit.partial_sums(count, axes)
    loss = _explicit.partial_sums(loss, axes)
  else:  # a loss of partial sums meets a replicated window: sum it
    loss = _explicit.reduce_now(loss)
  if adds is not None:
    loss = jnp.where(adds, loss, jnp.zeros_like(loss))
  if keep is not None:
    count = jnp.where(keep, count, jnp.zeros_like(count))

  def add(acc_tokens, count):
    return _tokens.add(acc_tokens, _tokens.as_count(count, config.token_dtype))

  acc_loss = state.acc_loss + loss  # linear: partial sums add as they are
  if not axes:
    return add(state.acc_tokens, count), acc_loss
  acc_tokens = _explicit.local(
    add, (state.acc_tokens, count), _explicit.spec(state.acc_tokens)
  )
  return acc_tokens, acc_loss


def _sum_over_devices(grads, params, window, compensated, dp):
  """The window's sums, token parts and loss, summed over the data axes."""
  acc_grads, acc_compensation, acc_tokens, acc_loss = window
  sums = _compensated.window_sums(acc_grads, acc_compensation, compensated)
  if _explicit.unreduced(acc_tokens):
    return _collectives.reduce_partial_sums(sums, acc_tokens, acc_loss)
  scalars = (_tokens.to_parts(acc_tokens), acc_loss)
  axes, tracked = dp
  if not axes:
    return sums, scalars
  return _collectives.reduce_window(
    sums,
    _collectives.grad_sum_axes(grads, params, axes, tracked),
    scalars,
    _collectives.sum_axes(acc_tokens, axes, tracked),
    params,
    axes,
  )


def inner_update(config, grads, inner_state, params, extra_args):
  """``inner.update``, its state's dtypes kept. Reduced types (explicit
  sharding) are dropped around it and restored (free): optax's nonlinear
  updates are not defined on them. The updates come typed like the
  parameters, so that ``optax.apply_updates`` keeps their type."""
  updates, new_inner = config.inner.update(
    grads,
    _explicit.without_reduced(inner_state),
    _explicit.without_reduced(params),
    **extra_args,
  )
  if params is not None:
    updates = _explicit.like(updates, params)
  new_inner = optax.tree.cast_like(new_inner, inner_state)
  return updates, _explicit.like(new_inner, inner_state)


def _close(config, grads, window, inner_state, params, extra, dp, hold):
  """Runs ``inner`` once on the window's token-mean gradient, with
  ``value=`` the window's token-mean loss when ``loss`` was passed.

  Returns ``(held, inner_state, (emitted, valid, tokens, mean_loss))``, with
  ``held = hold(updates, acc_grads)``. A window without tokens or with an
  invalid count emits no updates and keeps the inner state: a nested
  ``cond``, since selecting between the new and the old inner state would
  keep both alive (temporaries the size of the inner state on every step).
  """
  sums, (parts, loss_sum) = _sum_over_devices(
    grads, params, window, config.compensated, dp
  )
  total, valid = _tokens.from_parts(parts, config.token_dtype)
  emitted = jnp.logical_and(valid, total > 0)
  divisor = jnp.maximum(total, 1)
  mean_loss = loss_sum / divisor.astype(loss_sum.dtype)
  extra_args, with_value = extra

  def step(acc_grads, sums, divisor, inner_state, params, mean_loss):
    def mean(s):
      wide = jnp.promote_types(s.dtype, jnp.float32)
      return s.astype(wide) / divisor.astype(wide)

    updates, new_inner = inner_update(
      config,
      optax.tree.cast_like(jax.tree.map(mean, sums), grads),
      inner_state,
      params,
      dict(extra_args, value=mean_loss) if with_value else extra_args,
    )
    return hold(updates, acc_grads), new_inner

  def no_step(acc_grads, sums, divisor, inner_state, params, mean_loss):
    del sums, divisor, params, mean_loss
    return hold(None, acc_grads), inner_state

  held, new_inner = _collectives.cond(
    emitted,
    step,
    no_step,
    *(window[0], sums, divisor, inner_state, params, mean_loss),
  )
  return held, new_inner, (emitted, valid, total, mean_loss)


def _held(updates, acc_grads, *, shapes, buffer):
  """What the closing branch returns in place of the updates (None: no
  updates): written into the accumulator's buffer where it can hold them
  exactly (``buffer``), so that a micro-step writes no parameter-sized
  zeros and copies nothing; fresh zeros otherwise. Under explicit sharding
  the buffer holds the updates typed like itself (see :func:`_release`)."""
  if not buffer:
    return _zeros(shapes) if updates is None else updates
  if updates is None:
    return acc_grads
  held = optax.tree.cast_like(updates, acc_grads)
  return jax.tree.map(_explicit.retype_same_values, held, acc_grads)


def _release(held, shapes, emitted):
  """The updates from the buffer that held them: -0.0 unless ``emitted``
  (the buffer holds the window's partial sums on a micro-step), typed and
  cast like ``inner``'s updates. Where the buffer is typed otherwise (an
  unreduced accumulator, updates typed reduced like the parameters), the
  value is the same on every device, so the type is changed in place."""

  def pick(h, emitted):
    return jnp.where(emitted, h, _signed(jnp.zeros_like(h)))

  def release(h, s):
    if _explicit.unreduced(h):  # the same on every device once picked
      picked = _explicit.local(pick, (h, emitted), _explicit.spec(s))
    else:
      picked = _explicit.retype_same_values(pick(h, emitted), s)
    return picked.astype(s.dtype)

  return jax.tree.map(release, held, shapes)


def close_if(config, emit, grads, window, inner_state, params, extra, dp):
  """Closes the window if ``emit``, in one ``lax.cond``; ``extra`` is
  ``(extra_args, whether loss was passed)``.

  Returns ``(updates, acc_grads, inner_state, (emitted, valid, tokens,
  mean_loss))``. The updates have the shapes and dtypes of ``inner``'s
  (``jax.eval_shape``, as in ``optax.MultiSteps``). Everything the branches
  read is an operand, never a closure: a buffer that reaches the ``cond``
  twice is copied on every micro-step.
  """
  acc_grads, _, acc_tokens, acc_loss = window
  shapes, with_value = _update_shapes(config, grads, inner_state, params, extra)
  extra = (extra[0], with_value)
  buffer = _holds_exactly(acc_grads, shapes)
  hold = functools.partial(_held, shapes=shapes, buffer=buffer)

  def closing(window, inner_state, params):
    return _close(config, grads, window, inner_state, params, extra, dp, hold)

  def accumulating(window, inner_state, params):
    closed = (False, True, jnp.zeros([], acc_tokens.dtype))
    closed += (jnp.zeros([], acc_loss.dtype),)
    held = hold(None, window[0])
    return held, inner_state, jax.tree.map(jnp.asarray, closed)

  held, inner_state, closed = _collectives.cond(
    emit, closing, accumulating, window, inner_state, params
  )
  if not buffer:
    return held, acc_grads, inner_state, closed
  return _release(held, shapes, closed[0]), held, inner_state, closed


def _update_shapes(config, grads, inner_state, params, extra):
  """The shapes, dtypes and types of ``inner``'s updates, and whether
  ``inner`` takes ``value``: with ``loss`` passed it gets the window's
  loss unless it accepts no ``value`` keyword (``optax.contrib.sam``).
  Without ``loss``, if ``inner`` needs ``value``, the error names ``loss``.
  """
  extra_args, with_loss = extra

  def shapes(extra_args):
    return jax.eval_shape(
      lambda g, s, p: inner_update(config, g, s, p, extra_args)[0],
      jax.tree.map(_explicit.reduce_now, grads),
      inner_state,
      params,
    )

  if with_loss:
    value = jnp.zeros([], config.loss_dtype)
    try:
      return shapes(dict(extra_args, value=value)), True
    except TypeError as e:
      if "unexpected keyword argument 'value'" not in str(e):
        raise
  try:
    return shapes(extra_args), False
  except TypeError as e:
    error = _validation.needs_value_error(e)
    if error is None or with_loss:
      raise
    raise error from e


def _holds_exactly(acc_grads: optax.Updates, updates: Any) -> bool:
  """Whether the accumulator's buffer can hold ``updates`` exactly: same
  shapes, a dtype that holds theirs, and, where typed otherwise, the same
  layout (an unreduced accumulator holds updates typed reduced)."""
  acc_leaves = jax.tree.leaves(acc_grads)
  update_leaves = jax.tree.leaves(updates)
  if jax.tree.structure(acc_grads) != jax.tree.structure(updates):
    return False
  return all(
    a.shape == u.shape
    and jnp.promote_types(a.dtype, u.dtype) == a.dtype
    and not _collectives.varying_axes(a)
    and _explicit.same_layout(a, u)
    for a, u in zip(acc_leaves, update_leaves)
  )


def _zeros(shapes: Any) -> Any:
  """Zero updates of the given shapes, dtypes and explicit shardings,
  varying over no axis (``zeros_like`` of a gradient would inherit its
  per-device variance and make the parameters vary). They are -0.0, so that
  adding them leaves every parameter bit-identical (-0.0 + 0.0 is +0.0)."""

  def zeros(shape):
    sharding = getattr(shape, 'sharding', None)
    spec = getattr(sharding, 'spec', None)
    if spec is not None and (
      any(e is not None for e in _explicit.partitions(spec))
      or spec.reduced
      or spec.unreduced
    ):
      return _signed(jnp.zeros(shape.shape, shape.dtype, out_sharding=sharding))
    return _signed(jnp.zeros(shape.shape, shape.dtype))

  return jax.tree.map(zeros, shapes)


def _signed(zeros: jax.Array) -> jax.Array:
  """-0.0 for floating zeros (other dtypes have one zero)."""
  return -zeros if jnp.issubdtype(zeros.dtype, jnp.inexact) else zeros
