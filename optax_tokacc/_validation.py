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
"""Checks of the arguments, at construction and at trace time.

Each check raises one error that names the argument and echoes the bad
value; what cannot be known at trace time (a traced count) is handled by
the token rules in ``_tokens``.
"""

from collections.abc import Callable
import dataclasses
from typing import Any, Optional, Union

import jax
import jax.numpy as jnp
import numpy as np
import optax

_LOSS_REDUCTIONS = ('sum', 'mean')
_CALL = 'updates, state = tx.update(grads, state, params, num_tokens=n)'


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
  # Whether should_skip_update_fn decides as well on partial sums of the
  # gradients (explicit sharding) as on their sum: skip_not_finite.
  skip_on_partial_sums: bool = False
  # Close a window once it holds this many counted tokens (all devices).
  tokens_per_update: Optional[int] = None

  def acc_dtype(self, leaf: Any) -> jnp.dtype:
    """The accumulator dtype of a leaf: configured, or at least float32."""
    if self.accumulator_dtype is not None:
      return self.accumulator_dtype
    return jnp.promote_types(jnp.result_type(leaf), jnp.float32)

  @property
  def loss_dtype(self) -> jnp.dtype:
    """float64 under ``jax_enable_x64``, float32 otherwise."""
    return jax.dtypes.canonicalize_dtype(jnp.float64)


def check_options(
  inner: Any, should_skip_update_fn: Any, loss_reduction: Any, compensated: Any
) -> None:
  """Checks the constructor's non-dtype arguments."""
  if not isinstance(inner, optax.GradientTransformation):
    raise TypeError(
      'inner must be an optax.GradientTransformation, e.g. optax.adam(1e-3)'
      f' (called, not the function itself); got {inner!r}.'
    )
  if should_skip_update_fn is not None and not callable(should_skip_update_fn):
    raise TypeError(
      'should_skip_update_fn must be None or a function (grads, '
      'gradient_step, params) -> (should_skip, skip_state), e.g. '
      f'tokacc.skip_not_finite; got {should_skip_update_fn!r}.'
    )
  if loss_reduction not in _LOSS_REDUCTIONS:
    raise ValueError(
      f'loss_reduction must be one of {_LOSS_REDUCTIONS}; got '
      f"{loss_reduction!r}. Use 'sum' when the loss is summed over the "
      "micro-batch's counted tokens, 'mean' when it is their mean."
    )
  if not isinstance(compensated, (bool, np.bool_)):
    raise TypeError(
      f'compensated must be True or False; got {compensated!r}. With '
      'optax.inject_hyperparams, list it in static_args.'
    )


def schedule(every_k_schedule: Any) -> Callable[[jax.Array], Any]:
  """``every_k_schedule`` checked and made a function of the step."""
  if callable(every_k_schedule):
    return every_k_schedule
  is_int = isinstance(every_k_schedule, (int, np.integer)) and not isinstance(
    every_k_schedule, (bool, np.bool_)
  )
  is_array = isinstance(every_k_schedule, jax.Array)
  if not (is_int or is_array):
    raise TypeError(
      'every_k_schedule must be an int >= 1 or a function of the gradient '
      f'step returning one; got {every_k_schedule!r} of type '
      f'{type(every_k_schedule).__name__}. Pass e.g. every_k_schedule=4.'
    )
  if is_array:  # From optax.inject_hyperparams.
    check_k(every_k_schedule)
    if isinstance(every_k_schedule, jax.core.Tracer):
      return lambda step: every_k_schedule
  if int(every_k_schedule) < 1:
    raise ValueError(
      f'every_k_schedule must be >= 1; got {int(every_k_schedule)}. Use 1 '
      'for no accumulation, k > 1 to accumulate k micro-batches.'
    )
  k = int(every_k_schedule)
  return lambda step: k


def check_k(k: Any) -> None:
  """``every_k_schedule``'s value must be an integer scalar."""
  if not isinstance(k, (int, float, np.number, np.ndarray, jax.Array)):
    raise TypeError(
      'every_k_schedule(gradient_step) must return an integer scalar; got '
      f'{k!r} of type {type(k).__name__}.'
    )
  if jnp.shape(k) != () or not jnp.issubdtype(jnp.result_type(k), jnp.integer):
    raise TypeError(
      'every_k_schedule(gradient_step) must return an integer scalar; got '
      'shape '
      f'{jnp.shape(k)} and dtype {jnp.result_type(k)}. Round a floating '
      'schedule, e.g. jnp.round(k).astype(jnp.int32).'
    )


def accumulator_dtype(dtype: Any) -> Optional[jnp.dtype]:
  """``accumulator_dtype`` checked and canonicalized (None stays None)."""
  if dtype is None:
    return None
  try:
    dtype = jnp.dtype(dtype)
  except TypeError as e:
    raise TypeError(
      'accumulator_dtype must be a floating dtype such as jnp.float32; got '
      f'{dtype!r}. With optax.inject_hyperparams, list it in static_args.'
    ) from e
  if not jnp.issubdtype(dtype, jnp.floating):
    raise TypeError(
      'accumulator_dtype must be a floating dtype (jnp.float32, '
      f'jnp.bfloat16, ...); got {dtype}. Use None to accumulate in the '
      'gradient dtype promoted to at least float32.'
    )
  return jax.dtypes.canonicalize_dtype(dtype)


def token_dtype(dtype: Any) -> jnp.dtype:
  """``token_dtype`` checked: int32 (exact counts) or a floating dtype."""
  try:
    dtype = jnp.dtype(jnp.int32 if dtype is None else dtype)
  except TypeError as e:
    raise TypeError(
      f'token_dtype must be int32 or a floating dtype; got {dtype!r}. With '
      'optax.inject_hyperparams, list it in static_args.'
    ) from e
  if dtype != jnp.int32 and not jnp.issubdtype(dtype, jnp.floating):
    raise TypeError(
      f'token_dtype must be int32 or a floating dtype; got {dtype}. Use '
      'None (int32) for exact token counts, jnp.float32 for fractional '
      'token weights.'
    )
  return jax.dtypes.canonicalize_dtype(dtype)


def _is_concrete(x: Any) -> bool:
  return not isinstance(x, jax.core.Tracer)


def num_tokens(value: Any, dtype: jnp.dtype) -> Any:
  """Checks ``num_tokens`` at trace time (kind, shape, concrete range)."""
  if value is None:
    raise TypeError(
      'token_weighted_multistep needs the number of counted tokens of this '
      f'micro-batch: pass the keyword argument num_tokens, as in `{_CALL}` '
      "(inside optax.chain, pass it to the chain's update)."
    )
  try:
    kind = jnp.result_type(value)
  except TypeError as e:
    raise TypeError(
      f'num_tokens must be a number; got {value!r} of type '
      f'{type(value).__name__}.'
    ) from e
  if kind == jnp.bool_ or not jnp.issubdtype(kind, jnp.number):
    raise TypeError(
      f'num_tokens must be an integer or float count; got {value!r} of '
      f'dtype {kind}. Count a boolean mask with mask.sum().'
    )
  if jnp.shape(value) != ():
    raise ValueError(
      'num_tokens must be a scalar (the counted tokens of this micro-batch '
      f'on this device); got shape {jnp.shape(value)}. Sum the mask first, '
      'e.g. num_tokens=mask.sum().'
    )
  if _is_concrete(value):
    _check_concrete_count(np.asarray(value).item(), dtype)
  return value


def _check_concrete_count(value: Any, dtype: jnp.dtype) -> None:
  if not value >= 0:  # Also NaN.
    raise ValueError(f'num_tokens must be >= 0; got num_tokens={value}.')
  if jnp.issubdtype(dtype, jnp.integer):
    top = int(jnp.iinfo(dtype).max)
    if float(value) != int(value):
      raise ValueError(
        f'num_tokens={value} is not a whole number, and tokens are counted '
        f'exactly in {dtype}. Build the transform with '
        'token_dtype=jnp.float32 to accumulate fractional token weights.'
      )
    if int(value) > top:
      raise ValueError(
        f'num_tokens={value} does not fit the {dtype} token counter (at most '
        f'{top} per window); it would wrap.'
      )


def emit_now(value: Any) -> Optional[jax.Array]:
  """``emit_now`` as a boolean scalar, or None when statically False."""
  if isinstance(value, (bool, np.bool_)) and not value:
    return None
  kind = getattr(value, 'dtype', None)
  if not isinstance(value, (bool, np.bool_)) and kind != jnp.bool_:
    raise TypeError(
      'emit_now must be a Python bool or a boolean array (close the window '
      f'at this micro-step); got {value!r} of type {type(value).__name__}.'
    )
  if jnp.shape(value) != ():
    raise ValueError(
      f'emit_now must be a boolean scalar; got shape {jnp.shape(value)}.'
    )
  return jnp.asarray(value, jnp.bool_)


def close(value: Any, emit_now: Any, tokens_per_update: Any) -> None:
  """``close``: None (the device decides), or a Python bool (the host)."""
  if value is None:
    return
  if isinstance(value, jax.core.Tracer):
    raise TypeError(
      'close must be None or a Python bool, known when the step is traced '
      '(jax.jit(step, static_argnames="close")); got a traced value. To '
      'close the window on a decision made on the device, pass emit_now.'
    )
  if not isinstance(value, bool):
    raise TypeError(
      'close must be None (the schedule decides) or a Python bool (the '
      f'host decides); got close={value!r} of type {type(value).__name__}.'
    )
  if tokens_per_update is not None:
    raise ValueError(
      f'close={value} decides on the host, but tokens_per_update='
      f"{tokens_per_update} decides on the device (it needs the window's "
      'tokens over all devices): pass close=None, or build the transform '
      'without tokens_per_update.'
    )
  if emit_now is not None:
    raise ValueError(
      f'close={value} decides on the host; emit_now decides on the device. '
      'Pass one of them.'
    )


def loss(value: Any) -> Any:
  """Checks ``loss``: None, or a real scalar."""
  if value is None:
    return None
  try:
    kind = jnp.result_type(value)
  except TypeError as e:
    raise TypeError(
      "loss must be a real scalar (this micro-batch's loss); got "
      f'{value!r} of type {type(value).__name__}.'
    ) from e
  if kind == jnp.bool_ or not jnp.issubdtype(kind, jnp.number):
    raise TypeError(f'loss must be a real scalar; got dtype {kind}.')
  if jnp.shape(value) != ():
    raise ValueError(
      "loss must be a scalar (this micro-batch's loss); got shape "
      f'{jnp.shape(value)}.'
    )
  return value


def grads(grads: Any, params: Any, accumulator: Any) -> None:
  """Checks that ``grads`` match the parameters and the accumulator."""
  references = ((params, 'the parameters'), (accumulator, 'the accumulator'))
  for reference, what in references:
    if reference is None:
      continue
    expected = jax.tree.structure(reference)
    if jax.tree.structure(grads) != expected:
      raise ValueError(
        f'The gradient tree does not match {what}: gradients have structure '
        f'{jax.tree.structure(grads)}, {what} {expected}. Pass the gradients '
        'of the parameters the transform was initialized with.'
      )
  for grad, acc in zip(jax.tree.leaves(grads), jax.tree.leaves(accumulator)):
    if jnp.shape(grad) != jnp.shape(acc):
      raise ValueError(
        f'A gradient has shape {jnp.shape(grad)} where the parameter (and the '
        f'accumulator) has shape {jnp.shape(acc)}. Pass the gradients of the parameters the '
        'transform was initialized with (under pmap / shard_map, initialize '
        'with the per-device shapes, e.g. with tokacc.init_sharded).'
      )


def call_skip_fn(
  should_skip_update_fn: Callable, grads: Any, gradient_step: Any, params: Any
) -> tuple[jax.Array, Any]:
  """Calls ``should_skip_update_fn`` and checks what it returns."""
  result = should_skip_update_fn(grads, gradient_step, params)
  if not (isinstance(result, tuple) and len(result) == 2):
    raise TypeError(
      'should_skip_update_fn must return a pair (should_skip, skip_state), '
      f'as optax.skip_not_finite does; got {type(result).__name__}.'
    )
  skip, skip_state = result
  if jnp.shape(skip) != ():
    raise ValueError(
      'should_skip_update_fn must return (should_skip, skip_state) with '
      f'should_skip a boolean scalar; got shape {jnp.shape(skip)}. '
      'Reduce it, e.g. with jnp.any(...).'
    )
  return jnp.asarray(skip, jnp.bool_), skip_state


def axis_name(value: Any) -> None:
  """``axis_name`` must be a str or a tuple of str."""
  names = (value,) if isinstance(value, str) else value
  if not (
    isinstance(names, tuple)
    and names
    and all(isinstance(n, str) for n in names)
  ):
    raise TypeError(
      f"axis_name must be a str or a tuple of str (e.g. 'data'); got {value!r}."
    )


def tokens_per_update(value: Any) -> Optional[int]:
  """``tokens_per_update``: None, or a Python int >= 1."""
  if value is None:
    return None
  if isinstance(value, (bool, np.bool_)) or not isinstance(
    value, (int, np.integer)
  ):
    raise TypeError(
      'tokens_per_update must be None or an int >= 1 (counted tokens per '
      f'optimizer update); got {value!r} of type {type(value).__name__}.'
    )
  if value < 1:
    raise ValueError(
      f'tokens_per_update must be >= 1; got tokens_per_update={value}.'
    )
  return int(value)


# Extra arguments that re-evaluate the objective at other parameters.
_OBJECTIVE_FNS = ('value_fn', 'grad_fn', 'obj_fn')


def extra_args(extra: dict[str, Any]) -> None:
  """Refuses extra args that describe the last micro-batch only.

  ``value`` is the window's token-mean loss, computed by the transform from
  ``loss``. A function of the parameters (``value_fn``, ``grad_fn``,
  ``obj_fn``, any callable) would let ``inner`` re-evaluate an objective,
  but a window of micro-batches has none to re-evaluate.
  """
  if 'value' in extra:
    raise TypeError(
      'tx.update got value=...: inner receives value= from the transform, '
      "the window's token-mean loss over all devices (what window_loss "
      "reports). Pass this micro-batch's token-summed loss as loss= instead."
    )
  for name, arg in extra.items():
    if name in _OBJECTIVE_FNS or callable(arg):
      raise TypeError(
        f'tx.update got {name}={arg!r}, a function that re-evaluates the '
        'objective; a window of micro-batches has no objective to evaluate '
        'at new parameters (inner would see the last micro-batch only). Use '
        'an optimizer that does not, e.g. optax.lbfgs(linesearch=None) or '
        'optax.contrib.sam(..., opaque_mode=False).'
      )


def needs_value_error(error: TypeError) -> Optional[TypeError]:
  """Our error for ``inner`` asking for ``value`` (or an objective function)
  when ``loss`` was not passed; None for an unrelated ``TypeError``."""
  message = str(error)
  if 'value' not in message and not any(n in message for n in _OBJECTIVE_FNS):
    return None
  return TypeError(
    'inner needs value= (e.g. optax.contrib.reduce_on_plateau): pass this '
    "micro-batch's token-summed loss as loss= to tx.update, and inner "
    "receives value=, the window's token-mean loss. (inner raised: "
    f'{message})'
  )
