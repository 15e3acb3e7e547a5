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
"""The state of the transform, and helpers that read it.

:class:`~optax_tokacc.TokenWeightedMultiStepState` is a NamedTuple of arrays, saved and
restored by orbax as a plain pytree. The helpers find it inside a chain's
state (:func:`find_state`) and read what users log: whether the last call
emitted an update (:func:`has_updated`) and the exact token-mean loss of the
last window (:func:`window_loss`), and its norms (:func:`window_metrics`).
Each reads an abstract state (``jax.ShapeDtypeStruct``, ahead of time) into
abstract values (:func:`_reads_abstract`).
"""

from collections.abc import Callable
import functools
from typing import Any

import jax
import jax.numpy as jnp
import optax

from optax_tokacc import _base
from optax_tokacc import _norms
from optax_tokacc import _typing

# Pickles of states written before 0.6 name the class by this module.
TokenWeightedMultiStepState = _base.TokenWeightedMultiStepState


def _reads_abstract(read: Callable) -> Callable:
  """``read`` of a state, which gives, for a state of abstract values
  (``jax.ShapeDtypeStruct``), what ``jax.eval_shape(read, state)`` gives:
  shapes and dtypes, as for a traced state inside ``jax.eval_shape``."""

  @functools.wraps(read)
  def reads(opt_state: _typing.OptState) -> Any:
    if _base.is_abstract(opt_state):
      return jax.eval_shape(read, opt_state)
    return read(opt_state)

  return reads


def is_state(x: Any) -> bool:
  """Whether ``x`` is a :class:`~optax_tokacc.TokenWeightedMultiStepState`."""
  return isinstance(x, _base.TokenWeightedMultiStepState)


def find_state(
  opt_state: _typing.OptState,
) -> _base.TokenWeightedMultiStepState:
  """The :class:`~optax_tokacc.TokenWeightedMultiStepState` inside an optimizer state.

  Args:
    opt_state: the state of :func:`token_weighted_multistep`, or of a
      transformation containing it (e.g. ``optax.chain``); of abstract
      values (``jax.ShapeDtypeStruct``), it gives abstract values.

  Returns:
    The one :class:`~optax_tokacc.TokenWeightedMultiStepState` found.

  Raises:
    ValueError: if ``opt_state`` holds none, or more than one.

  Example:
    >>> import jax.numpy as jnp, optax
    >>> import optax_tokacc as tokacc
    >>> tx = optax.chain(
    ...     tokacc.token_weighted_multistep(optax.sgd(0.1), 2),
    ...     optax.clip(1.0))
    >>> state = tx.init({'w': jnp.zeros(2)})
    >>> int(tokacc.find_state(state).gradient_step)
    0
  """
  leaves = jax.tree.leaves(opt_state, is_leaf=is_state)
  found = [leaf for leaf in leaves if is_state(leaf)]
  if len(found) != 1:
    raise ValueError(
      'opt_state must hold exactly one TokenWeightedMultiStepState; found '
      f'{len(found)}.'
    )
  return found[0]


@_reads_abstract
def has_updated(opt_state: _typing.OptState) -> jax.Array:
  """Whether the call that returned ``opt_state`` emitted an optimizer update.

  False after a micro-step, a rejected micro-batch, and a window that was
  dropped or had no counted tokens. A wrapper that returns an older state
  (``optax.apply_if_finite`` rejecting a step) returns its flag with it; to
  count updates, use differences of ``gradient_step``, which cannot go stale.

  Args:
    opt_state: the state of :func:`token_weighted_multistep`, or of a
      transformation containing it (e.g. ``optax.chain``); of abstract
      values (``jax.ShapeDtypeStruct``), it gives abstract values.

  Returns:
    A boolean scalar.

  Example:
    >>> import jax.numpy as jnp, optax
    >>> import optax_tokacc as tokacc
    >>> tx = tokacc.token_weighted_multistep(optax.sgd(0.1), 2)
    >>> params, grads = {'w': jnp.zeros(2)}, {'w': jnp.ones(2)}
    >>> state = tx.init(params)
    >>> for _ in range(2):
    ...   _, state = tx.update(grads, state, params, num_tokens=1)
    ...   print(bool(tokacc.has_updated(state)))
    False
    True
  """
  return jnp.asarray(find_state(opt_state).emitted, jnp.bool_)


@_reads_abstract
def window_loss(opt_state: _typing.OptState) -> jax.Array:
  """Token-mean loss of the last emitted window, over all devices.

  .. math::

    L = \\frac{\\sum_k \\sum_{i \\le N_k} \\ell_{ki}}{\\sum_k N_k},

  the loss that full-batch training on the window reports. It is NaN before
  the first window, and for a window where a micro-step did not pass
  ``loss`` to ``update``: it is never mistaken for a measured loss.

  Args:
    opt_state: the state of :func:`token_weighted_multistep`, or of a
      transformation containing it (e.g. ``optax.chain``); of abstract
      values (``jax.ShapeDtypeStruct``), it gives abstract values.

  Returns:
    A floating scalar.

  Example:
    >>> import jax.numpy as jnp, optax
    >>> import optax_tokacc as tokacc
    >>> tx = tokacc.token_weighted_multistep(optax.sgd(0.1), every_k_schedule=2)
    >>> params = {'w': jnp.zeros(2)}
    >>> state = tx.init(params)
    >>> tokacc.window_loss(state)  # no window yet
    Array(nan, dtype=float32)
    >>> grads = {'w': jnp.ones(2)}
    >>> _, state = tx.update(grads, state, params, num_tokens=3, loss=6.0)
    >>> _, state = tx.update(grads, state, params, num_tokens=1, loss=4.0)
    >>> tokacc.window_loss(state)  # (6 + 4) / (3 + 1)
    Array(2.5, dtype=float32)
  """
  return jnp.asarray(find_state(opt_state).last_loss)


@_reads_abstract
def window_metrics(opt_state: _typing.OptState) -> _base.WindowMetrics:
  """The last emitted window's metrics, as full-batch training logs them.

  Computed once, when the window closes, in every placement: its token-mean
  loss (:func:`window_loss`), its counted tokens over all devices, the
  global L2 norm of its token-mean gradient (what ``inner`` received,
  before any clipping in ``inner``) and that of the emitted update. Loss
  and norms are NaN before the first window; a window that emits nothing
  (no tokens, or an invalid count: dropped) keeps the last emitted
  window's metrics, as ``gradient_step`` keeps its count. Reading them
  costs nothing; computing them costs no micro-step any work and no
  parameter-sized temporary. The closing step pays one collective (the
  two norms' squares) where the gradient is split over devices by
  ``shard_map`` or explicit types (FSDP, HSDP, ZeRO-1), and none where it
  is whole on every device (data parallelism). Where only the compiler
  knows it is split (``AxisType.Auto`` axes, and explicit types on
  jax < 0.10, which cannot type the partial sums), it pays two scalar
  all-reduces: the gradient's squares are summed before ``inner`` writes
  its updates into their buffer, and XLA cannot defer that sum's
  all-reduce to the update's without copying the buffer. The
  gradient's norm is that of the window's sums, in the accumulator's
  precision, over its token count. With ``window_norms=False`` the norms
  stay NaN and cost nothing. With ``window_norms='per_leaf'``,
  ``grad_norms`` and ``update_norms`` hold each leaf's norms, trees like the
  parameters (the per-layer statistics trainers log), from the same squares
  and in the same collectives as the global norms (where the gradient is
  split, their vector holds one more entry per leaf); ``None`` otherwise.

  Args:
    opt_state: the state of :func:`token_weighted_multistep`, or of a
      transformation containing it (e.g. ``optax.chain``); of abstract
      values (``jax.ShapeDtypeStruct``), it gives abstract values.

  Returns:
    A :class:`~optax_tokacc.WindowMetrics` of scalars (and, per leaf, trees of scalars).

  Example:
    >>> import jax.numpy as jnp, optax
    >>> import optax_tokacc as tokacc
    >>> tx = tokacc.token_weighted_multistep(optax.sgd(0.5), every_k_schedule=2)
    >>> params = {'w': jnp.zeros(2)}
    >>> state = tx.init(params)
    >>> tokacc.window_metrics(state).grad_norm  # no window yet
    Array(nan, dtype=float32)
    >>> _, state = tx.update({'w': jnp.array([6., 0.])}, state, params,
    ...                      num_tokens=3, loss=6.0)
    >>> _, state = tx.update({'w': jnp.array([0., 8.])}, state, params,
    ...                      num_tokens=1, loss=2.0)
    >>> m = tokacc.window_metrics(state)  # mean gradient [6, 8] / 4
    >>> print(m.loss, m.tokens, m.grad_norm, m.update_norm)
    2.0 4 2.5 1.25
  """
  state = find_state(opt_state)
  grad_norm, grad_norms = _norms.read(state.last_grad_norm)
  update_norm, update_norms = _norms.read(state.last_update_norm)
  return _base.WindowMetrics(
    loss=jnp.asarray(state.last_loss),
    tokens=jnp.asarray(state.last_tokens),
    grad_norm=grad_norm,
    update_norm=update_norm,
    grad_norms=grad_norms,
    update_norms=update_norms,
  )


def apply_if_updated(
  params: _typing.Params, updates: _typing.Updates, opt_state: _typing.OptState
) -> _typing.Params:
  """Applies ``updates`` to ``params``; kept from 0.1, now ``apply_updates``.

  In 0.1 this applied the updates only after an emitting step, which lost
  the micro-step updates of other transforms (``optax.multi_transform``,
  ``optax.masked``). Since 0.2 it gives exactly ``optax.apply_updates(params,
  updates)`` in every composition, at the same cost: micro-steps return zero
  updates from the transform, so they leave its parameters bit-identical.

  Args:
    params: the parameters.
    updates: the updates returned with ``opt_state``.
    opt_state: the optimizer state containing the transform's state (checked,
      not used).

  Returns:
    The new parameters.

  Example:
    >>> import jax.numpy as jnp, optax
    >>> import optax_tokacc as tokacc
    >>> tx = tokacc.token_weighted_multistep(optax.sgd(1.0), 1)
    >>> params = {'w': jnp.ones(2)}
    >>> state = tx.init(params)
    >>> updates, state = tx.update(
    ...     {'w': jnp.full(2, 4.0)}, state, params, num_tokens=2)
    >>> tokacc.apply_if_updated(params, updates, state)['w']
    Array([-1., -1.], dtype=float32)
  """
  find_state(opt_state)
  return optax.apply_updates(params, updates)
