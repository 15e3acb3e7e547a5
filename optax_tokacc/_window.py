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
"""The window: adding a micro-batch, and closing it in one ``lax.cond``."""

import functools
from typing import Any, Optional

import jax
import jax.numpy as jnp
import optax

from optax_tokacc import _collectives
from optax_tokacc import _compensated
from optax_tokacc import _tokens
from optax_tokacc import _validation


def keep(config, grads, state, params) -> tuple[Optional[jax.Array], Any]:
  """Whether to keep the micro-batch (None: always), and the skip state."""
  if config.should_skip_update_fn is None:
    return None, state.skip_state
  skip, skip_state = _validation.call_skip_fn(
    config.should_skip_update_fn, grads, state.gradient_step, params
  )
  return jnp.logical_not(skip), skip_state


def add_micro_batch(config, state, grads, count, loss, keep) -> tuple:
  """The window with this micro-batch added: grads, compensation, tokens,
  loss. Contributions are selected, never multiplied by zero."""
  adds = keep
  if config.mean_loss:
    adds = count > 0 if adds is None else jnp.logical_and(adds, count > 0)

  def addend(acc, grad):
    dtype = jnp.promote_types(acc.dtype, jnp.float32)
    grad = grad.astype(dtype if config.compensated else acc.dtype)
    if config.mean_loss:
      grad = grad * count.astype(grad.dtype)
    return grad if adds is None else jnp.where(adds, grad, 0).astype(grad.dtype)

  acc_grads, acc_compensation = _compensated.accumulate(
    state.acc_grads,
    state.acc_compensation,
    jax.tree.map(addend, state.acc_grads, grads),
    state.mini_step == 0,
    config.compensated,
  )
  acc_tokens = _tokens.add(
    state.acc_tokens, count if keep is None else jnp.where(keep, count, 0)
  )
  if loss is None:  # No loss: the window's loss is unknown, NaN.
    loss_sum = jnp.full([], jnp.nan, config.loss_dtype)
  else:
    loss_sum = jnp.asarray(loss, config.loss_dtype)
    if config.mean_loss:
      loss_sum = loss_sum * count.astype(loss_sum.dtype)
    if adds is not None:
      loss_sum = jnp.where(adds, loss_sum, 0).astype(loss_sum.dtype)
  acc_loss = state.acc_loss + loss_sum
  return acc_grads, acc_compensation, acc_tokens, acc_loss


def _sum_over_devices(grads, params, window, compensated, dp):
  """The window's sums, token parts and loss, summed over the data axes."""
  acc_grads, acc_compensation, acc_tokens, acc_loss = window
  sums = _compensated.window_sums(acc_grads, acc_compensation, compensated)
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


def _close(config, grads, window, inner_state, params, extra_args, dp, hold):
  """Runs ``inner`` once on the window's token-mean gradient.

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

  def step(acc_grads, sums, divisor, inner_state, params):
    def mean(s):
      wide = jnp.promote_types(s.dtype, jnp.float32)
      return s.astype(wide) / divisor.astype(wide)

    updates, new_inner = config.inner.update(
      optax.tree.cast_like(jax.tree.map(mean, sums), grads),
      inner_state,
      params,
      **extra_args,
    )
    return hold(updates, acc_grads), optax.tree.cast_like(
      new_inner, inner_state
    )

  def no_step(acc_grads, sums, divisor, inner_state, params):
    del sums, divisor, params
    return hold(None, acc_grads), inner_state

  held, new_inner = _collectives.cond(
    emitted, step, no_step, window[0], sums, divisor, inner_state, params
  )
  mean_loss = loss_sum / divisor.astype(loss_sum.dtype)
  return held, new_inner, (emitted, valid, total, mean_loss)


def _held(updates, acc_grads, *, shapes, in_buffer):
  """What the closing branch returns in place of the updates (None: no
  updates): written into the accumulator's buffer where it holds them
  exactly, so that a micro-step writes no parameter-sized zeros."""
  if in_buffer:
    if updates is None:
      return acc_grads
    return optax.tree.cast_like(updates, acc_grads)
  return _zeros(shapes) if updates is None else updates


def close_if(config, emit, grads, window, inner_state, params, extra_args, dp):
  """Closes the window if ``emit``, in one ``lax.cond``.

  Returns ``(updates, acc_grads, inner_state, (emitted, valid, tokens,
  mean_loss))``. The updates have the shapes and dtypes of ``inner``'s
  (``jax.eval_shape``, as in ``optax.MultiSteps``). Everything the branches
  read is an operand, never a closure: a buffer that reaches the ``cond``
  twice is copied on every micro-step.
  """
  acc_grads, _, acc_tokens, acc_loss = window
  shapes = jax.eval_shape(
    lambda g, s, p: config.inner.update(g, s, p, **extra_args)[0],
    grads,
    inner_state,
    params,
  )
  in_buffer = _holds_exactly(acc_grads, shapes)
  hold = functools.partial(_held, shapes=shapes, in_buffer=in_buffer)

  def closing(window, inner_state, params):
    return _close(
      config, grads, window, inner_state, params, extra_args, dp, hold
    )

  def accumulating(window, inner_state, params):
    closed = (False, True, jnp.zeros([], acc_tokens.dtype))
    closed += (jnp.zeros([], acc_loss.dtype),)
    return hold(None, window[0]), inner_state, jax.tree.map(jnp.asarray, closed)

  held, inner_state, closed = _collectives.cond(
    emit, closing, accumulating, window, inner_state, params
  )
  if not in_buffer:
    return held, acc_grads, inner_state, closed
  updates = jax.tree.map(
    lambda h, s: jnp.where(closed[0], h, 0).astype(s.dtype), held, shapes
  )
  return updates, held, inner_state, closed


def _holds_exactly(acc_grads: optax.Updates, updates: Any) -> bool:
  """Whether the accumulator's buffer can hold ``updates`` exactly."""
  acc_leaves = jax.tree.leaves(acc_grads)
  update_leaves = jax.tree.leaves(updates)
  if jax.tree.structure(acc_grads) != jax.tree.structure(updates):
    return False
  return all(
    a.shape == u.shape
    and jnp.promote_types(a.dtype, u.dtype) == a.dtype
    and not _collectives.varying_axes(a)
    for a, u in zip(acc_leaves, update_leaves)
  )


def _zeros(shapes: Any) -> Any:
  """Zeros of the given shapes, dtypes and explicit shardings, varying over
  no axis (``zeros_like`` of a gradient would inherit its per-device
  variance and make the parameters vary)."""

  def zeros(shape):
    sharding = getattr(shape, 'sharding', None)
    spec = getattr(sharding, 'spec', None)
    if spec is not None and any(entry is not None for entry in spec):
      return jnp.zeros(shape.shape, shape.dtype, out_sharding=sharding)
    return jnp.zeros(shape.shape, shape.dtype)

  return jax.tree.map(zeros, shapes)
