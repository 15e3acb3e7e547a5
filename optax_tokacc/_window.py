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

from typing import Optional

import jax
import jax.numpy as jnp
import optax

from optax_tokacc import _base
from optax_tokacc import _compensated
from optax_tokacc import _placement
from optax_tokacc import _tokens
from optax_tokacc import _typing


def micro_batch(
  config: _base.Config,
  place: _placement.Placement,
  grads: _typing.Updates,
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
  window restarts before its first micro-step, :func:`restart_if`).
  Contributions are selected, never multiplied by zero."""
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


def restart_if(
  place: _placement.Placement, empty: jax.Array, window: _base.Window
) -> _base.Window:
  """The window with its sums and compensation zeroed if ``empty`` (no
  micro-step in it yet), on a GPU and the CPU: where a window closes, its
  buffer goes on holding the updates the call returned (``_held_updates``),
  or a dropped window's sums, until the next window's first micro-step
  zeroes it here, in a loop of 0 or 1 trips. Every other micro-step reads
  and writes nothing more than its add, and the sums stay an operand of
  the gradient's GEMMs (a select there is a pass of its own on XLA:GPU).
  On a TPU the window restarts where it closes (:func:`restarted_if`):
  XLA:TPU fuses the add into the gradient's producers only where nothing
  else reads the sums (a v6e relays them out around a select, and copies a
  loop's state)."""

  def zeros(sums):
    return place.on_each_device(optax.tree.zeros_like, (sums,), sums)

  sums = (window.grad_sums, window.acc_compensation)
  grad_sums, acc_compensation = jax.lax.platform_dependent(
    sums,
    tpu=lambda sums: sums,
    default=lambda s: place.loop_if(empty, zeros, s),
  )
  return window._replace(grad_sums=grad_sums, acc_compensation=acc_compensation)


def restarted_if(
  place: _placement.Placement, closed: jax.Array, window: _base.Window
) -> _base.Window:
  """On a TPU, the window's sums and compensation zeroed if ``closed``,
  once the call has read its updates from the buffer (see
  :func:`restart_if`): a select on each device's share (a select on
  partial sums would make the compiler reduce them). Elsewhere the window
  as it is."""

  def select(sums, closed):  # the sums first: they name the mesh
    return optax.tree.where(closed, optax.tree.zeros_like(sums), sums)

  def zeroed(sums):
    return place.on_each_device(select, (sums, closed), sums)

  sums = (window.grad_sums, window.acc_compensation)
  grad_sums, acc_compensation = jax.lax.platform_dependent(
    sums, tpu=zeroed, default=lambda sums: sums
  )
  return window._replace(grad_sums=grad_sums, acc_compensation=acc_compensation)


def sums_restarted(
  place: _placement.Placement, window: _base.Window
) -> _base.Window:
  """The window's sums and compensation zeroed, on each device's share
  (where the closing trip restarts them itself)."""
  return _zeroed(place, window, 'grad_sums', 'acc_compensation')


def counts_restarted(
  place: _placement.Placement, window: _base.Window
) -> _base.Window:
  """The window's count and loss zeroed, where it closes (its sums and
  compensation restart with the next window's first micro-step,
  :func:`restart_if`); on each device's share (a select on partial sums
  would make the compiler reduce them)."""
  return _zeroed(place, window, 'acc_tokens', 'acc_loss')


def _zeroed(
  place: _placement.Placement, window: _base.Window, *fields: str
) -> _base.Window:
  """The window with ``fields`` zeroed, on each device's share."""
  values = tuple(getattr(window, field) for field in fields)
  zeros = place.on_each_device(optax.tree.zeros_like, (values,), values)
  return window._replace(**dict(zip(fields, zeros)))
