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

:class:`TokenWeightedMultiStepState` is a NamedTuple of arrays, saved and
restored by orbax as a plain pytree. The helpers find it inside a chain's
state (:func:`find_state`) and read what users log: whether the last call
emitted an update (:func:`has_updated`) and the exact token-mean loss of the
last window (:func:`window_loss`), and its norms (:func:`window_metrics`).
"""

from typing import Any, NamedTuple
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax

from optax_tokacc import _window


class TokenWeightedMultiStepState(NamedTuple):
  """State of :func:`optax_tokacc.token_weighted_multistep`.

  A window is the run of micro-steps that ends with one optimizer update.
  Fields marked *per device* hold this device's share under ``axis_name``;
  there each of their leaves carries a leading axis of length 1 (the
  device's slot), so that the global state stacks the devices' shares along
  it (:func:`optax_tokacc.state_partition_specs` gives the layout). The
  other fields are the same on every device. Under explicit sharding
  (parameters typed reduced, ``axis_name=None``) the per-device fields are
  typed *unreduced* instead: each device holds its partial sum
  (:func:`optax_tokacc.to_checkpoint` reads them out for a checkpoint).

  Attributes:
    mini_step: micro-steps taken in the current window (int32); 0 right
      after a window closed. Without ``axis_name`` a micro-batch rejected by
      ``should_skip_update_fn`` does not advance it; with ``axis_name`` it
      advances on every call, so that all devices close the window together.
    gradient_step: optimizer updates emitted so far (int32, saturating).
    grad_sums: *per device*. During a window, the token-*summed*
      gradients of its micro-batches so far (not their mean: not what
      ``optax.MultiSteps``' ``acc_grads`` holds), in the accumulator dtype,
      shaped (and sharded) like the parameters. Right after an emitting step
      the buffer is scratch: it may hold the emitted updates (reusing it
      saves a parameter-sized write on every micro-step); the next
      micro-step zeroes it before adding (a ``lax.cond``), never reads it.
      Log :func:`window_metrics` instead. (Named ``acc_grads`` before 0.5;
      that name is a read-only alias now, which warns.)
    acc_tokens: *per device*. Counted tokens of the current window; -1 once
      the window is invalid (a negative, NaN, fractional or out-of-range
      ``num_tokens``), and such a window is dropped when it closes.
    acc_loss: *per device*. Token-summed loss of the current window; NaN if
      a micro-step did not pass ``loss``.
    inner_state: state of the wrapped optimizer; advances once per window and
      keeps its dtypes.
    last_loss: token-mean loss of the last emitted window over all devices;
      NaN before the first window and when ``loss`` was not passed.
    last_tokens: counted tokens of the last emitted window over all devices.
    skip_state: *per device*. What ``should_skip_update_fn`` returned at the
      last call; ``()`` without one.
    emitted: whether the call that returned this state emitted an update.
    acc_compensation: *per device*. With ``compensated=True``, the rounding
      error of ``grad_sums`` (Kahan summation), a tree like ``grad_sums``;
      scratch right after an emitting step, like ``grad_sums`` (the next
      micro-step restarts it); ``()`` otherwise.
    dropped_windows: windows dropped because their token count was invalid
      (int32, saturating). A dropped window emits zero updates and no step.
    last_grad_norm: global L2 norm of the last emitted window's token-mean
      gradient (what ``inner`` received), float32; NaN before the first.
    last_update_norm: global L2 norm of its emitted update, likewise.
      With ``window_norms='per_leaf'`` each of these two fields is the pair
      of that norm and a tree like the parameters of each leaf's norm
      (float32 scalars, NaN before the first window).
  """

  mini_step: jax.typing.ArrayLike
  gradient_step: jax.typing.ArrayLike
  grad_sums: optax.Updates
  acc_tokens: jax.typing.ArrayLike
  acc_loss: jax.typing.ArrayLike
  inner_state: optax.OptState
  last_loss: jax.typing.ArrayLike
  last_tokens: jax.typing.ArrayLike
  skip_state: Any = ()
  emitted: jax.typing.ArrayLike = np.bool_(False)
  acc_compensation: optax.Updates = ()
  dropped_windows: jax.typing.ArrayLike = np.int32(0)
  last_grad_norm: Any = np.float32(np.nan)
  last_update_norm: Any = np.float32(np.nan)

  @property
  def acc_grads(self) -> optax.Updates:
    """Renamed :attr:`grad_sums` (a read-only alias that warns): the
    window's token-summed gradients, not ``optax.MultiSteps``' running
    mean, and scratch right after a window closes.

    It warns with a ``FutureWarning``, which Python's default filters show
    wherever the read happens: a ``DeprecationWarning`` is shown only in
    ``__main__``, and trainers read the field in their own library modules
    (nanodo's ``metrics.py``), where it printed nothing while they logged
    gradient norms 77-96x off. It does not raise: code that only touches
    the name (restoring a checkpoint) keeps working. Under ``jax.jit`` it
    warns once per trace: the property runs when the function is traced.
    """
    warnings.warn(
      'state.acc_grads reads grad_sums: the token-summed gradients of the '
      'open window, scratch right after a window closes, not '
      "optax.MultiSteps' running mean of the gradients. To log the "
      "window's gradient statistics, read "
      'tokacc.window_metrics(state).grad_norm and .update_norm.',
      FutureWarning,
      stacklevel=2,  # the line that reads .acc_grads
    )
    return self.grad_sums


# The window's sums (``_window.Window``) and the skip state.
PER_DEVICE_FIELDS = _window.Window._fields + ('skip_state',)


class SavedState(NamedTuple):
  """What :func:`to_checkpoint` saves of a ``TokenWeightedMultiStepState``.

  Attributes:
    state: the state, its per-device fields (``grad_sums``,
      ``acc_compensation``, ``acc_tokens``, ``acc_loss``, ``skip_state``)
      with a leading axis of rows, one per device that holds a share of
      the window (one row where the window is whole), every other field
      whole.
    rows: int32, per leaf of the per-device fields (in their tree order),
      its number of rows when saved: a restore that padded or truncated
      them (orbax's ``strict=False``) is refused.
  """

  state: Any
  rows: Any


def map_per_device(fn: Any, state: 'TokenWeightedMultiStepState'):
  """``state`` with ``fn`` applied to every leaf of its per-device fields."""
  per_device = {name: getattr(state, name) for name in PER_DEVICE_FIELDS}
  return state._replace(**jax.tree.map(fn, per_device))


def without_device_slot(state: 'TokenWeightedMultiStepState'):
  """This device's share: the per-device fields without their slot axis.

  With ``axis_name`` the per-device fields carry a leading axis of length 1
  (this device's slot), so that the global state stacks the devices' shares
  along it and ``shard_map`` / ``pmap`` need no hand-written layout.
  """
  for name in PER_DEVICE_FIELDS:
    for leaf in jax.tree.leaves(getattr(state, name)):
      if jnp.shape(leaf)[:1] != (1,):
        raise ValueError(
          f'state.{name} needs a leading device-slot axis of length 1; got '
          f'{jnp.shape(leaf)}: use tokacc.init_sharded or jax.pmap(tx.init).'
        )
  return map_per_device(lambda x: x[0], state)


def with_device_slot(state: 'TokenWeightedMultiStepState'):
  """The inverse of :func:`without_device_slot`."""
  return map_per_device(lambda x: jnp.asarray(x)[None], state)


def is_state(x: Any) -> bool:
  """Whether ``x`` is a :class:`TokenWeightedMultiStepState`."""
  return isinstance(x, TokenWeightedMultiStepState)


def find_state(opt_state: optax.OptState) -> TokenWeightedMultiStepState:
  """The :class:`TokenWeightedMultiStepState` inside an optimizer state.

  Args:
    opt_state: the state of :func:`token_weighted_multistep`, or of a
      transformation containing it (e.g. ``optax.chain``).

  Returns:
    The one :class:`TokenWeightedMultiStepState` found.

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


def has_updated(opt_state: optax.OptState) -> jax.Array:
  """Whether the call that returned ``opt_state`` emitted an optimizer update.

  False after a micro-step, a rejected micro-batch, and a window that was
  dropped or had no counted tokens. A wrapper that returns an older state
  (``optax.apply_if_finite`` rejecting a step) returns its flag with it; to
  count updates, use differences of ``gradient_step``, which cannot go stale.

  Args:
    opt_state: the state of :func:`token_weighted_multistep`, or of a
      transformation containing it (e.g. ``optax.chain``).

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


def window_loss(opt_state: optax.OptState) -> jax.Array:
  """Token-mean loss of the last emitted window, over all devices.

  .. math::

    L = \\frac{\\sum_k \\sum_{i \\le N_k} \\ell_{ki}}{\\sum_k N_k},

  the loss that full-batch training on the window reports. It is NaN before
  the first window, and for a window where a micro-step did not pass
  ``loss`` to ``update``: it is never mistaken for a measured loss.

  Args:
    opt_state: the state of :func:`token_weighted_multistep`, or of a
      transformation containing it (e.g. ``optax.chain``).

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


class WindowMetrics(NamedTuple):
  """What a trainer logs of the last emitted window (:func:`window_metrics`)."""

  loss: jax.Array  # token-mean loss (window_loss)
  tokens: jax.Array  # counted tokens, over all devices
  grad_norm: jax.Array  # global L2 norm of the token-mean gradient
  update_norm: jax.Array  # global L2 norm of the emitted update
  # With window_norms='per_leaf': each leaf's norms, trees like the
  # parameters (None otherwise).
  grad_norms: Any = None
  update_norms: Any = None


def window_metrics(opt_state: optax.OptState) -> WindowMetrics:
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
      transformation containing it (e.g. ``optax.chain``).

  Returns:
    A :class:`WindowMetrics` of scalars (and, per leaf, trees of scalars).

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
  grad_norm, grad_norms = _norms(state.last_grad_norm)
  update_norm, update_norms = _norms(state.last_update_norm)
  return WindowMetrics(
    loss=jnp.asarray(state.last_loss),
    tokens=jnp.asarray(state.last_tokens),
    grad_norm=grad_norm,
    update_norm=update_norm,
    grad_norms=grad_norms,
    update_norms=update_norms,
  )


def _norms(field: Any) -> tuple[jax.Array, Any]:
  """A state's norm field as the global norm and each leaf's (None where
  the transform computes no per-leaf norms)."""
  if isinstance(field, tuple):  # window_norms='per_leaf'
    total, leaves = field
    return jnp.asarray(total), jax.tree.map(jnp.asarray, leaves)
  return jnp.asarray(field), None


def apply_if_updated(
  params: optax.Params, updates: optax.Updates, opt_state: optax.OptState
) -> optax.Params:
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
