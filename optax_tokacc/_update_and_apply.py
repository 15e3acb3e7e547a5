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
"""``update_and_apply``: ``tx.update`` then ``optax.apply_updates`` in one
call, which applies the updates where the window closes
(``_applied.closed``)."""

import functools
from typing import Any

import optax

from optax_tokacc import _multistep
from optax_tokacc import _typing


def update_and_apply(
  tx: optax.GradientTransformation,
  grads: _typing.Updates,
  opt_state: _typing.OptState,
  params: _typing.Params,
  **kwargs: Any,
) -> tuple[_typing.Params, _typing.OptState]:
  """``tx.update`` then ``optax.apply_updates``, in one call: the same
  parameters and state, bit for bit, and cheaper where it can be.

  Where ``tx`` is :func:`token_weighted_multistep`'s transformation itself
  (not in a chain), on one device:

  - where the device decides the window (no ``close=``), an open
    micro-step reads and writes nothing of the parameters. On a GPU or CPU
    the updates are added from the accumulator's buffer, which holds them,
    in a loop of 0 or 1 trips on whether the call emitted; on a TPU the
    step that closes the window applies them (with ``compensated``, as
    ``optax.apply_updates`` does). ``optax.apply_updates`` adds the
    returned updates (zeros on an open micro-step) to every parameter on
    every call, a parameter-sized pass that XLA cannot remove, since only
    the device knows which calls close a window.

  Everywhere else (the host's ``close=``, chains, several devices) this
  is ``tx.update`` then ``optax.apply_updates``. The
  linen ``TrainState`` and the nnx ``Optimizer`` of
  :mod:`optax_tokacc.flax` use it.

  Args:
    tx: the optimizer: any ``optax.GradientTransformation``.
    grads: the micro-batch's gradients.
    opt_state: ``tx``'s state.
    params: the parameters.
    **kwargs: further keyword arguments of ``tx.update`` (``num_tokens``,
      ``loss``, ...).

  Returns:
    ``(params, opt_state)`` after the call.

  Raises:
    TypeError: if ``tx`` is not an ``optax.GradientTransformation``.

  Example:
    >>> import jax.numpy as jnp, optax, optax_tokacc as tokacc
    >>> tx = tokacc.token_weighted_multistep(optax.sgd(1.0), 1)
    >>> params = {'w': jnp.zeros(2)}
    >>> state = tx.init(params)
    >>> grads = {'w': jnp.ones(2)}
    >>> params, state = tokacc.update_and_apply(
    ...   tx, grads, state, params, num_tokens=1
    ... )
    >>> params['w']
    Array([-1., -1.], dtype=float32)
  """
  params, state, _ = applied_with_updates(
    tx, grads, opt_state, params, **kwargs
  )
  return params, state


def applied_with_updates(
  tx: optax.GradientTransformation,
  grads: _typing.Updates,
  opt_state: _typing.OptState,
  params: _typing.Params,
  **kwargs: Any,
) -> tuple[_typing.Params, _typing.OptState, _typing.Updates]:
  """:func:`update_and_apply`, with the updates the call returned too (what
  ``nnx.Optimizer.update`` returns; XLA drops them where nothing reads
  them)."""
  if not isinstance(tx, optax.GradientTransformation):
    raise TypeError(
      'update_and_apply(tx, ...): tx must be an optax.GradientTransformation'
      f' (for example tokacc.token_weighted_multistep(...)); got'
      f' {type(tx).__name__}.'
    )
  update = tx.update
  if isinstance(update, functools.partial) and update.func is _multistep.update:
    updates, state, applied = _multistep.call(
      *update.args, grads, opt_state, params, _apply=True, **kwargs
    )
    return applied, state, updates
  updates, state = update(grads, opt_state, params, **kwargs)
  return optax.apply_updates(params, updates), state, updates
