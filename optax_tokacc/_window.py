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
"""The window algebra, written once over NamedTuples.

A micro-step adds the micro-batch's gradients, token count and loss into the
window's sums (:func:`add`); :func:`should_close` decides, on the device,
whether this call closes the window, and ``_closing`` closes it (sums it
over the devices in one reduction, divides by its token count, runs the
wrapped optimizer once). Where the sums live and how they are reduced is the
placement's (``_placement``); nothing here asks which parallel mode it runs
in.
"""

from typing import Optional, Union

import jax
import jax.numpy as jnp
import optax

from optax_tokacc import _base
from optax_tokacc import _compensated
from optax_tokacc import _placement
from optax_tokacc import _tokens


def micro_batch(
  config: _base.Config,
  place: _placement.Placement,
  grads: optax.Updates,
  num_tokens: jax.typing.ArrayLike,
  loss: Optional[jax.typing.ArrayLike],
  keep: Optional[jax.Array],
) -> _base.MicroBatch:
  """The micro-batch as the window adds it. Under a mean loss the gradient
  (in :func:`add`) and the loss are scaled by the count they are the mean
  over, validated now; otherwise the count is validated on each device's
  share when it is added."""
  count = jnp.asarray(num_tokens)
  # No loss: the window's is NaN.
  loss = jnp.asarray(jnp.nan if loss is None else loss, config.loss_dtype)
  if config.mean_loss:
    count = _tokens.as_count(place.summed_now(count), config.token_dtype)
    loss = place.scale(loss, count.astype(loss.dtype))
  return _base.MicroBatch(place.gradient_shares(grads), count, loss, keep)


def add(
  config: _base.Config,
  place: _placement.Placement,
  window: _base.Window,
  micro: _base.MicroBatch,
) -> _base.Window:
  """The window with the micro-batch added: a plain add into its sums (the
  window restarts where it closes, :func:`reset_if`). Contributions are
  selected, never multiplied by zero."""
  adds = micro.keep  # whether the micro-batch adds anything (None: always)
  if config.mean_loss:  # without tokens its mean is undefined: it adds nothing
    has_tokens = micro.count > 0
    adds = has_tokens if micro.keep is None else micro.keep & has_tokens

  def addend(acc, grad):
    dtype = jnp.promote_types(acc.dtype, jnp.float32)
    grad = grad.astype(dtype if config.compensated else acc.dtype)
    if config.mean_loss:
      grad = place.scale(grad, micro.count.astype(grad.dtype))
    return grad if adds is None else jnp.where(adds, grad, jnp.zeros_like(grad))

  def accumulate(sums, addends):
    return _compensated.accumulate(sums, addends, config.compensated)

  addends = jax.tree.map(addend, window.grad_sums, micro.grads)
  sums = (window.grad_sums, window.acc_compensation)
  if config.compensated:  # not linear: on each device's share
    args = (sums, addends)
    grad_sums, acc_compensation = place.on_each_device(accumulate, args, sums)
  else:
    grad_sums, acc_compensation = accumulate(sums, addends)
  acc_tokens, acc_loss = _add_scalars(config, place, window, micro, adds)
  return _base.Window(grad_sums, acc_compensation, acc_tokens, acc_loss)


def _add_scalars(
  config: _base.Config,
  place: _placement.Placement,
  window: _base.Window,
  micro: _base.MicroBatch,
  adds: Optional[jax.Array],
) -> tuple[jax.Array, jax.Array]:
  """The window's count and loss with the micro-batch's, on each device's
  share: the count is validated there, and selecting on a share moves no
  data. A rejected micro-batch's count is ignored, even if invalid."""

  def add_shares(acc_tokens, acc_loss, count, loss, keep, adds):
    if keep is not None:
      count = jnp.where(keep, count, jnp.zeros_like(count))
    if adds is not None:
      loss = jnp.where(adds, loss, jnp.zeros_like(loss))
    count = _tokens.as_count(count, config.token_dtype)
    return _tokens.add(acc_tokens, count), acc_loss + loss

  sums = (window.acc_tokens, window.acc_loss)
  shares = (place.share_of(micro.count), place.share_of(micro.loss))
  args = (*sums, *shares, micro.keep, adds)
  return place.on_each_device(add_shares, args, sums)


def should_close(
  config: _base.Config,
  place: _placement.Placement,
  gradient_step: jax.Array,
  mini_step: jax.Array,
  acc_tokens: jax.Array,
  emit_now: Optional[jax.Array],
) -> jax.Array:
  """Whether this call closes the window: the same on every device."""
  k = config.window_size(gradient_step)
  close = mini_step >= jnp.maximum(jnp.asarray(k, jnp.int32), 1)
  if config.tokens_per_update is not None:
    close |= window_tokens(place, acc_tokens) >= config.tokens_per_update
  if emit_now is not None:
    close |= place.on_any_device(emit_now)
  return close


def window_tokens(
  place: _placement.Placement, acc_tokens: jax.Array
) -> jax.Array:
  """The window's counted tokens so far, over all devices (for
  ``tokens_per_update``; an invalid count counts 0, a total beyond the
  counter counts as its maximum). Where the window is split over devices,
  a scalar all-reduce on every micro-step."""
  parts = place.sum_over_devices(
    lambda n: _tokens.to_parts(jnp.maximum(n, 0)), acc_tokens
  )
  total, fits = _tokens.from_parts(parts, acc_tokens.dtype)
  integer = jnp.issubdtype(acc_tokens.dtype, jnp.integer)
  top = (jnp.iinfo if integer else jnp.finfo)(acc_tokens.dtype).max
  return jnp.where(fits, total, jnp.asarray(top, acc_tokens.dtype))


def reset_if(
  place: _placement.Placement,
  close: Union[bool, jax.Array],
  window: Union[_base.Window, optax.Updates],
) -> Union[_base.Window, optax.Updates]:
  """The window zeroed if ``close`` (its sums, compensation, count and
  loss, or any of them in a tree): where a window closes, the next one
  starts, so that a micro-step only adds. A select, never a
  multiplication by zero (a NaN of the closed window does not survive
  it); on each device's share (a select on partial sums would make the
  compiler reduce them)."""

  def reset(window, close):
    return optax.tree.where(close, optax.tree.zeros_like(window), window)

  if isinstance(close, bool):
    # Closed for certain (by the host, or in the closing branch): zeros
    # from a broadcast, which XLA may write into the donated buffer before
    # the window is read, and so copies the buffer first (a 4-layer 512 x
    # 512 MLP's closing step: temporaries 2.27x the parameters' bytes,
    # against 1.53x; memory_analysis()). A predicate it cannot fold makes
    # them a select that reads the sums last.
    close = jax.lax.optimization_barrier(jnp.asarray(close))
  args = (window, jnp.asarray(close))
  return place.on_each_device(reset, args, window)
