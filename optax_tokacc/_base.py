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
"""The data model every module shares: the configuration, the window's
values, the state.

Nothing here depends on the rest of the package (as optax's
``_src/base.py``): :class:`Config` is the transform's checked
configuration; :class:`Window`, :class:`MicroBatch`, :class:`Closed` and
:class:`WindowNorms` are what the window algebra (``_window``) and the
closing (``_closing``) pass between them; :class:`Reduced` and
:class:`Norms` are what a placement (``_placement``) gives back;
:class:`TokenWeightedMultiStepState` is the optimizer state, with its
per-device fields; :class:`SavedState` its checkpoint form.
"""

from collections.abc import Callable
import dataclasses
from typing import Any, NamedTuple, Optional, Union
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax

from optax_tokacc import _errors
from optax_tokacc import _typing

AxisName = Union[str, tuple[str, ...]]


def axis_names(axis_name: AxisName) -> tuple[str, ...]:
  """``axis_name`` (one name or several) as a tuple of names."""
  return (axis_name,) if isinstance(axis_name, str) else tuple(axis_name)


@dataclasses.dataclass(frozen=True)
class Config:
  """The transform's configuration, checked and canonicalized."""

  inner: optax.GradientTransformationExtraArgs
  schedule: Callable[[jax.Array], Any]
  axis_name: Optional[Union[str, tuple[str, ...]]]
  mean_loss: bool
  accumulator_dtype: Optional[jnp.dtype]
  compensated: bool
  should_skip_update_fn: Optional[Callable]
  token_dtype: jnp.dtype
  # Close a window once it holds this many counted tokens (all devices).
  tokens_per_update: Optional[Union[int, float]] = None
  # Whether the closing step computes the window's two norms, and (then)
  # each leaf's (window_norms='per_leaf').
  norms: bool = True
  leaf_norms: bool = False

  def acc_dtype(self, leaf: jax.typing.ArrayLike) -> jnp.dtype:
    """The accumulator dtype of a leaf: configured, or at least float32."""
    if self.accumulator_dtype is not None:
      return self.accumulator_dtype
    return jnp.promote_types(jnp.result_type(leaf), jnp.float32)

  def window_size(self, gradient_step: jax.Array) -> jax.Array:
    """``k``, the micro-steps of the window that ``gradient_step`` opens
    (``every_k_schedule``'s value there: an integer scalar, else a
    ``TypeError`` naming it)."""
    k = self.schedule(gradient_step)
    check_k(k)
    return k

  @property
  def loss_dtype(self) -> jnp.dtype:
    """float64 under ``jax_enable_x64``, float32 otherwise."""
    return jax.dtypes.canonicalize_dtype(jnp.float64)


def check_k(k: Any) -> None:
  """``every_k_schedule``'s value must be an integer scalar."""
  fix = ' Round a floating schedule, e.g. jnp.round(k).astype(jnp.int32).'
  name = 'every_k_schedule(gradient_step)'
  _errors.check_scalar(
    k, name, 'an integer scalar', (jnp.integer,), fix, TypeError
  )


class Window(NamedTuple):
  """The window's sums so far, this device's share (see the state)."""

  grad_sums: _typing.Updates
  acc_compensation: _typing.Updates
  acc_tokens: jax.Array
  acc_loss: jax.Array


class MicroBatch(NamedTuple):
  """What one micro-step brings: ``keep`` None means always kept."""

  grads: _typing.Updates
  count: jax.Array
  loss: jax.Array  # summed over its tokens
  keep: Optional[jax.Array]


class WindowNorms(NamedTuple):
  """The window's norms (``window_norms``), float32: the global L2 norm of
  its token-mean gradient and of the emitted update, and where asked
  (``window_norms='per_leaf'``) each leaf's, trees like the gradients
  (``()`` otherwise)."""

  grad_norm: jax.Array
  update_norm: jax.Array
  grad_norms: Any = ()
  update_norms: Any = ()


class Closed(NamedTuple):
  """What closing the window gave (all False or zero on a micro-step)."""

  emitted: jax.Array  # whether inner ran: a valid window with tokens
  valid: jax.Array  # whether the window's count was valid
  tokens: jax.Array  # the window's counted tokens, over all devices
  mean_loss: jax.Array  # its token-mean loss
  norms: WindowNorms  # NaN where none were computed


class Reduced(NamedTuple):
  """The window summed over the devices: what its one reduction gives."""

  sums: _typing.Updates  # the gradients' sums (a tree)
  token_parts: jax.Array  # the count as exact parts (``_tokens.to_parts``)
  loss: jax.Array  # the token-summed loss


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
      shaped (and sharded) like the parameters. Scratch right after a window
      closes (``mini_step`` 0): the buffer holds the updates that the
      device's close emitted, or the closed window's sums, until the next
      window's first micro-step zeroes it (a select or a write of zeros,
      never a multiplication by zero); a TPU zeroes it where the window
      closes. Log :func:`window_metrics` instead.
      (Named ``acc_grads`` before 0.5; that name is a read-only alias now,
      which warns.)
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
      scratch between windows, like ``grad_sums``; ``()`` otherwise.
    dropped_windows: windows dropped because their token count was invalid
      (a total beyond the counter, or outside the range a floating one
      honours, included; int32, saturating). A dropped window emits zero
      updates and no step.
    last_grad_norm: global L2 norm of the last emitted window's token-mean
      gradient (what ``inner`` received), float32; NaN before the first.
    last_update_norm: global L2 norm of its emitted update, likewise.
      With ``window_norms='per_leaf'`` each of these two fields is the pair
      of that norm and a tree like the parameters of each leaf's norm
      (float32 scalars, NaN before the first window).

  Example:
    >>> import jax.numpy as jnp, optax
    >>> import optax_tokacc as tokacc
    >>> tx = tokacc.token_weighted_multistep(optax.sgd(0.1), 2)
    >>> state = tx.init({'w': jnp.zeros(2)})
    >>> _, state = tx.update({'w': jnp.ones(2)}, state, num_tokens=3)
    >>> int(state.mini_step), int(state.acc_tokens), state.grad_sums['w']
    (1, 3, Array([1., 1.], dtype=float32))
  """

  mini_step: jax.typing.ArrayLike
  gradient_step: jax.typing.ArrayLike
  grad_sums: _typing.Updates
  acc_tokens: jax.typing.ArrayLike
  acc_loss: jax.typing.ArrayLike
  inner_state: _typing.OptState
  last_loss: jax.typing.ArrayLike
  last_tokens: jax.typing.ArrayLike
  skip_state: Any = ()
  emitted: jax.typing.ArrayLike = np.bool_(False)
  acc_compensation: _typing.Updates = ()
  dropped_windows: jax.typing.ArrayLike = np.int32(0)
  last_grad_norm: Any = np.float32(np.nan)
  last_update_norm: Any = np.float32(np.nan)

  @property
  def acc_grads(self) -> _typing.Updates:
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


# The name scope of ``inner.update`` where a window closes: it names every
# instruction of the optimizer's work in the compiled program's metadata,
# which ``optax_tokacc.testing`` reads (no optimizer work on an open
# micro-step).
INNER_UPDATE_SCOPE = 'tokacc_inner_update'

# The per-device fields of the state: the window's sums and the skip state.
PER_DEVICE_FIELDS = Window._fields + ('skip_state',)


def per_device(state: 'TokenWeightedMultiStepState') -> dict[str, Any]:
  """``state``'s per-device fields by name."""
  return {name: getattr(state, name) for name in PER_DEVICE_FIELDS}


def map_per_device(
  fn: Callable, state: 'TokenWeightedMultiStepState'
) -> 'TokenWeightedMultiStepState':
  """``state`` with ``fn`` applied to every leaf of its per-device fields."""
  return state._replace(**jax.tree.map(fn, per_device(state)))


def is_abstract(tree: Any) -> bool:
  """Whether any leaf of ``tree`` is a ``jax.ShapeDtypeStruct``: values
  ahead of time, which the helpers lay out or read without data."""
  return any(isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree.leaves(tree))


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
