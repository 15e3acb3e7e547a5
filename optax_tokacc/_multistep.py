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
"""Exact, token-weighted gradient accumulation over several optimizer steps."""

from collections.abc import Callable
import functools
from typing import Any, NamedTuple, Optional, Union
import warnings
import weakref

import jax
from jax import lax
import jax.numpy as jnp
import numpy as np
import optax

AxisName = Union[str, tuple[str, ...]]
EveryKSchedule = Union[int, Callable[[jax.Array], jax.typing.ArrayLike]]
ShouldSkipUpdateFn = Callable[
  [optax.Updates, jax.Array, Optional[optax.Params]],
  tuple[jax.Array, Any],
]

_LOSS_REDUCTIONS = ('sum', 'mean')
_CALL_EXAMPLE = 'updates, state = tx.update(grads, state, params, num_tokens=n)'


class TokenWeightedMultiStepState(NamedTuple):
  """State of :func:`token_weighted_multistep`.

  Attributes:
    mini_step: micro-steps accumulated in the current window (int32).
    gradient_step: optimizer updates emitted so far (int32, saturating).
    acc_grads: token-summed gradients of the current window, in the
      accumulator dtype, with the structure (and sharding) of the parameters.
    acc_tokens: counted tokens of the current window on this device; -1
      once the window is invalid (a negative ``num_tokens``, or a count that
      does not fit ``token_dtype``): such a window is dropped when it closes.
    acc_loss: token-summed loss of the current window on this device.
    inner_state: state of the wrapped optimizer; advances once per window.
    last_loss: token-mean loss of the last emitted window (all devices).
    last_tokens: total counted tokens of the last emitted window.
    skip_state: what ``should_skip_update_fn`` returned at the last call.
    emitted: whether the last call emitted an optimizer update.
    acc_compensation: with ``compensated=True``, the rounding error of
      ``acc_grads`` (Kahan summation; the window's sum is ``acc_grads +
      acc_compensation``), a tree like ``acc_grads``; otherwise ``()``.
    dropped_windows: windows dropped because their token count was invalid
      (int32, saturating): a negative ``num_tokens``, or a total over the
      window and devices above the range of ``token_dtype`` (2**31 - 1 for
      int32). A dropped window emits zero updates and no optimizer step.
  """

  mini_step: jax.typing.ArrayLike
  gradient_step: jax.typing.ArrayLike
  acc_grads: optax.Updates
  acc_tokens: jax.typing.ArrayLike
  acc_loss: jax.typing.ArrayLike
  inner_state: optax.OptState
  last_loss: jax.typing.ArrayLike
  last_tokens: jax.typing.ArrayLike
  skip_state: Any = ()
  emitted: jax.typing.ArrayLike = np.bool_(False)
  acc_compensation: optax.Updates = ()
  dropped_windows: jax.typing.ArrayLike = np.int32(0)


def skip_not_finite(
  updates: optax.Updates,
  gradient_step: jax.typing.ArrayLike,
  params: Optional[optax.Params],
) -> tuple[jax.Array, dict[str, jax.Array]]:
  """Rejects a micro-batch whose gradients hold a NaN or an infinity.

  Use as ``should_skip_update_fn``: the micro-batch adds neither gradients
  nor tokens, and the window does not advance.

  Args:
    updates: the micro-batch's gradients.
    gradient_step: the optimizer step (unused).
    params: the parameters (unused).

  Returns:
    ``(should_skip, {'should_skip': ..., 'num_not_finite': ...})``.
  """
  return optax.skip_not_finite(updates, gradient_step, params)


def find_state(opt_state: optax.OptState) -> TokenWeightedMultiStepState:
  """The :class:`TokenWeightedMultiStepState` inside an optimizer state.

  Args:
    opt_state: the state of :func:`token_weighted_multistep`, or of a
      transformation containing it (e.g. ``optax.chain``).

  Returns:
    The one :class:`TokenWeightedMultiStepState` found.

  Raises:
    ValueError: if ``opt_state`` holds none, or more than one.
  """
  if isinstance(opt_state, TokenWeightedMultiStepState):
    return opt_state
  found = [
    leaf
    for leaf in jax.tree.leaves(
      opt_state,
      is_leaf=lambda x: isinstance(x, TokenWeightedMultiStepState),
    )
    if isinstance(leaf, TokenWeightedMultiStepState)
  ]
  if len(found) != 1:
    raise ValueError(
      f'Expected the optimizer state to hold exactly one '
      f'TokenWeightedMultiStepState, found {len(found)}. Pass the state of '
      'token_weighted_multistep, or of a chain containing it once.'
    )
  return found[0]


def has_updated(opt_state: optax.OptState) -> jax.Array:
  """Whether the call that produced ``opt_state`` emitted an optimizer update.

  False after a micro-step, after a rejected micro-batch, and after a window
  with no counted tokens (which emits zero updates and no step).

  Args:
    opt_state: the state of :func:`token_weighted_multistep`, or of a
      transformation containing it (e.g. ``optax.chain``).

  Returns:
    A boolean scalar.
  """
  return jnp.asarray(find_state(opt_state).emitted, jnp.bool_)


def window_loss(opt_state: optax.OptState) -> jax.Array:
  """Token-mean loss of the last emitted window, over all devices.

  This is the loss that full-batch training on the window would report:
  ``sum of token losses / sum of counted tokens``. It is only meaningful when
  ``loss`` is passed to ``update``; before the first window it is 0.

  Args:
    opt_state: the state of :func:`token_weighted_multistep`, or of a
      transformation containing it (e.g. ``optax.chain``).

  Returns:
    A floating scalar.
  """
  return jnp.asarray(find_state(opt_state).last_loss)


# Updates returned by an update call that are `where(emitted, held, 0)` of the
# state's accumulator leaves `held`, keyed by id, through weak references.
_HELD_UPDATES: dict[int, tuple[weakref.ref, weakref.ref]] = {}


def _remember_held_updates(updates: optax.Updates, held: optax.Updates):
  """Records that ``updates`` are ``held``, masked by ``emitted``."""
  for update, buffer in zip(jax.tree.leaves(updates), jax.tree.leaves(held)):
    key = id(update)
    try:
      entry = (
        weakref.ref(update, lambda _, key=key: _HELD_UPDATES.pop(key, None)),
        weakref.ref(buffer),
      )
    except TypeError:  # Not weakly referenceable: no fast path.
      return
    _HELD_UPDATES[key] = entry


def _held_updates(
  updates: optax.Updates, state: TokenWeightedMultiStepState
) -> Optional[optax.Updates]:
  """``state.acc_grads`` if ``updates`` are those returned with ``state``."""
  if jax.tree.structure(updates) != jax.tree.structure(state.acc_grads):
    return None
  for update, buffer in zip(
    jax.tree.leaves(updates), jax.tree.leaves(state.acc_grads)
  ):
    entry = _HELD_UPDATES.get(id(update))
    if entry is None or entry[0]() is not update or entry[1]() is not buffer:
      return None
  return state.acc_grads


def apply_if_updated(
  params: optax.Params,
  updates: optax.Updates,
  opt_state: optax.OptState,
) -> optax.Params:
  """Applies ``updates`` to ``params`` only after an emitting step.

  Unlike ``optax.apply_updates``, micro-steps do not rewrite the parameters:
  the addition sits in a ``lax.cond`` on :func:`has_updated`. Given exactly
  the updates returned with ``opt_state`` (traced in the same function), it
  reads the emitted updates from the state's buffer inside the ``cond``, so a
  micro-step neither materializes the zero updates nor touches the
  parameters: it costs nothing beyond the accumulation.

  Args:
    params: the parameters.
    updates: updates returned by the transform.
    opt_state: the optimizer state returned with ``updates`` (of the
      transform, or of a transformation containing it).

  Returns:
    The new parameters.
  """
  state = find_state(opt_state)
  held = _held_updates(updates, state)
  treedef = jax.tree.structure(updates)
  dtypes = [jnp.result_type(u) for u in jax.tree.leaves(updates)]
  if held is not None:
    # `updates` are `where(emitted, held, 0)`: pass `held` into the `cond`
    # (no mask, no copy) and cast it back there.
    updates = held

  def apply(params, updates):
    leaves = [u.astype(d) for u, d in zip(jax.tree.leaves(updates), dtypes)]
    return optax.apply_updates(params, treedef.unflatten(leaves))

  return lax.cond(
    jnp.asarray(state.emitted, jnp.bool_),
    apply,
    lambda params, updates: params,
    params,
    updates,
  )


def _canonical_schedule(every_k_schedule: Any) -> Callable[[jax.Array], Any]:
  """Validates ``every_k_schedule`` and returns it as a function."""
  if callable(every_k_schedule):
    return every_k_schedule
  if isinstance(every_k_schedule, (bool, np.bool_)) or not isinstance(
    every_k_schedule, (int, np.integer, jax.Array)
  ):
    raise TypeError(
      'every_k_schedule must be an int >= 1 or a function of the gradient '
      f'step returning one; got {every_k_schedule!r} of type '
      f'{type(every_k_schedule).__name__}. Pass e.g. every_k_schedule=4.'
    )
  if isinstance(every_k_schedule, jax.Array):
    # Arrays arrive through `optax.inject_hyperparams`.
    if every_k_schedule.shape or not jnp.issubdtype(
      every_k_schedule.dtype, jnp.integer
    ):
      raise TypeError(
        'every_k_schedule given as an array must be an integer scalar; got '
        f'shape {every_k_schedule.shape} and dtype {every_k_schedule.dtype}.'
      )
    if isinstance(every_k_schedule, jax.core.Tracer):
      return lambda step: every_k_schedule
  if int(every_k_schedule) < 1:
    raise ValueError(
      f'every_k_schedule must be >= 1; got {int(every_k_schedule)}. Use 1 '
      'for no accumulation, k > 1 to accumulate k micro-batches.'
    )
  k = int(every_k_schedule)
  return lambda step: k


def _accumulator_dtype(accumulator_dtype: Any, leaf: Any) -> Any:
  """The accumulator dtype of one leaf: the given one, or at least float32."""
  if accumulator_dtype is not None:
    return accumulator_dtype
  return jnp.promote_types(jnp.result_type(leaf), jnp.float32)


def _check_accumulator_dtype(accumulator_dtype: Any) -> Any:
  if accumulator_dtype is None:
    return None
  try:
    dtype = jnp.dtype(accumulator_dtype)
  except TypeError as e:
    raise TypeError(
      f'accumulator_dtype must be a floating dtype such as jnp.float32; got '
      f'{accumulator_dtype!r}. With optax.inject_hyperparams, list it in '
      'static_args.'
    ) from e
  if not jnp.issubdtype(dtype, jnp.floating):
    raise TypeError(
      f'accumulator_dtype must be a floating dtype (jnp.float32, '
      f'jnp.bfloat16, ...); got {dtype}. Use None to accumulate in the '
      'gradient dtype promoted to at least float32.'
    )
  return jax.dtypes.canonicalize_dtype(dtype)


def _loss_dtype() -> Any:
  """float64 under ``jax_enable_x64``, float32 otherwise."""
  return jax.dtypes.canonicalize_dtype(jnp.float64)


def _check_num_tokens(num_tokens: Any, token_dtype: Any) -> jax.Array:
  """Validates ``num_tokens`` at trace time and casts it to ``token_dtype``."""
  if num_tokens is None:
    raise TypeError(
      'token_weighted_multistep needs the number of counted tokens of this '
      'micro-batch: pass the keyword argument num_tokens, as in '
      f"`{_CALL_EXAMPLE}` (inside optax.chain, pass it to the chain's "
      'update).'
    )
  shape = jnp.shape(num_tokens)
  if shape != ():
    raise ValueError(
      'num_tokens must be a scalar (the counted tokens of this micro-batch '
      f'on this device); got shape {shape}. Sum the mask first, e.g. '
      'num_tokens=mask.sum().'
    )
  dtype = jnp.result_type(num_tokens)
  is_integer = jnp.issubdtype(dtype, jnp.integer) or dtype == jnp.bool_
  if jnp.issubdtype(token_dtype, jnp.integer) and not is_integer:
    if (
      isinstance(num_tokens, (float, np.floating))
      and float(num_tokens).is_integer()
    ):
      return jnp.asarray(int(num_tokens), token_dtype)
    raise TypeError(
      f'num_tokens has the floating dtype {dtype}, but tokens are counted '
      f'exactly in {jnp.dtype(token_dtype)}. Pass an integer count (e.g. '
      'mask.sum(dtype=jnp.int32)), or build the transform with '
      'token_dtype=jnp.float32 to accumulate fractional token weights.'
    )
  return jnp.asarray(num_tokens).astype(token_dtype)


def _check_grads_structure(grads: Any, reference: Any, what: str) -> None:
  grads_def = jax.tree.structure(grads)
  reference_def = jax.tree.structure(reference)
  if grads_def != reference_def:
    raise ValueError(
      f'The gradient tree does not match {what}: gradients have structure '
      f'{grads_def}, {what} {reference_def}. Pass the gradients of the same '
      'parameters the transform was initialized with.'
    )


def _check_grads_shapes(grads: Any, accumulator: Any) -> None:
  for grad, acc in zip(jax.tree.leaves(grads), jax.tree.leaves(accumulator)):
    if jnp.shape(grad) != jnp.shape(acc):
      raise ValueError(
        f'A gradient has shape {jnp.shape(grad)} where the parameter (and '
        f'the accumulator) has shape {jnp.shape(acc)}. Pass the gradients of '
        'the parameters the transform was initialized with.'
      )


def _call_skip_fn(
  should_skip_update_fn: ShouldSkipUpdateFn,
  updates: Any,
  gradient_step: jax.Array,
  params: Any,
) -> tuple[jax.Array, Any]:
  """Calls ``should_skip_update_fn`` and checks what it returns."""
  result = should_skip_update_fn(updates, gradient_step, params)
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
  return skip, skip_state


def _check_axis_name(axis_name: AxisName) -> None:
  try:
    lax.axis_size(axis_name)
  except NameError as e:
    raise ValueError(
      f'axis_name={axis_name!r} is not bound here. token_weighted_multistep '
      'with axis_name must be updated inside jax.pmap(..., axis_name=...) or '
      'jax.shard_map over a mesh with that axis. Under jax.jit with '
      'NamedSharding (global arrays), leave axis_name=None.'
    ) from e


def _varying_axes(x: Any) -> frozenset:
  """The manual mesh axes ``x`` varies over inside ``shard_map`` (its vma)."""
  aval = x if isinstance(x, jax.ShapeDtypeStruct) else jax.typeof(x)
  manual_axis_type = getattr(aval, 'manual_axis_type', None)
  if manual_axis_type is not None:
    return frozenset(manual_axis_type.varying)
  return frozenset(getattr(aval, 'vma', ()))


def _make_varying(x: jax.Array, axes: frozenset) -> jax.Array:
  """Marks ``x`` as varying over ``axes`` as well (a no-op at run time)."""
  missing = tuple(sorted(axes - _varying_axes(x)))
  if not missing:
    return x
  if hasattr(lax, 'pcast'):
    return lax.pcast(x, missing, to='varying')
  return lax.pvary(x, missing)


def _axes_to_sum(updates: optax.Updates, axis_name: AxisName) -> Any:
  """Per gradient leaf, the axes of ``axis_name`` to ``psum`` it over.

  Under ``shard_map`` with ``check_vma=True``, the gradient of a replicated
  (invariant) parameter arrives already summed over the devices: autodiff
  inserted the ``psum``. Summing it again would multiply it by the number of
  devices, so such leaves are not summed over those axes. Returns None when
  every leaf is summed over all of ``axis_name`` (``pmap``, ``check_vma=False``
  or per-device gradients: the efficient case).
  """
  axes = (axis_name,) if isinstance(axis_name, str) else tuple(axis_name)
  tracked = all(a in _varying_axes(lax.axis_index(a)) for a in axes)
  if not tracked:
    return None
  per_leaf = [
    tuple(a for a in axes if a in _varying_axes(g))
    for g in jax.tree.leaves(updates)
  ]
  if all(len(leaf_axes) == len(axes) for leaf_axes in per_leaf):
    return None
  summed_already = sorted({a for la in per_leaf for a in axes if a not in la})
  warnings.warn(
    f'token_weighted_multistep: gradients arrive already summed over '
    f'{summed_already} (they are invariant there: shard_map autodiff reduced '
    'them on this micro-step). They are not summed again, so the result is '
    'exact, but each micro-step pays an all-reduce. For one reduction per '
    'window, differentiate with respect to parameters marked varying: '
    f'jax.tree.map(lambda p: jax.lax.pcast(p, {tuple(axes)!r}, '
    "to='varying'), params).",
    stacklevel=4,
  )
  return jax.tree.unflatten(jax.tree.structure(updates), per_leaf)


def _psum_window(window_grads, token_parts, acc_loss, axis_name, grad_axes):
  """One ``psum`` of the window over ``axis_name``, once per window."""
  if grad_axes is None:
    return lax.psum((window_grads, token_parts, acc_loss), axis_name)
  all_axes = (axis_name,) if isinstance(axis_name, str) else tuple(axis_name)

  def reduce(window_leaf, sum_axes):
    if sum_axes:
      window_leaf = lax.psum(window_leaf, sum_axes)
    # Already summed by autodiff, but held in a per-device accumulator: the
    # devices hold the same value; a mean makes it replicated (invariant).
    same_axes = tuple(
      a
      for a in all_axes
      if a not in sum_axes and a in _varying_axes(window_leaf)
    )
    return lax.pmean(window_leaf, same_axes) if same_axes else window_leaf

  # `grad_axes` holds a tuple of axes where `window_grads` holds a leaf.
  window_grads = jax.tree.map(reduce, window_grads, grad_axes)
  token_parts, acc_loss = lax.psum((token_parts, acc_loss), axis_name)
  return window_grads, token_parts, acc_loss


def _cond_matching_vma(pred, true_fn, false_fn, *operands):
  """``lax.cond`` whose branches may differ in the axes their outputs vary.

  Inside ``shard_map`` (``check_vma=True``) the accumulators vary over the
  data axes while the summed window does not; each output is marked varying
  over the union of what the two branches give, as ``lax.cond`` requires.
  """
  true_out = jax.eval_shape(true_fn, *operands)
  false_out = jax.eval_shape(false_fn, *operands)
  target = jax.tree.map(
    lambda a, b: _varying_axes(a) | _varying_axes(b), true_out, false_out
  )

  def matched(fn):
    def fn_with_vma(*args):
      return jax.tree.map(_make_varying, fn(*args), target)

    return fn_with_vma

  return lax.cond(pred, matched(true_fn), matched(false_fn), *operands)


def _add_tokens(total: jax.Array, value: jax.Array) -> jax.Array:
  """``total + value``, or -1 (invalid window) if it is not a valid count.

  Invalid: ``total`` already -1, a negative (or NaN) ``value``, or a sum that
  does not fit the dtype (integers) or is not finite (floats). Never wraps.
  """
  invalid = jnp.logical_or(total < 0, jnp.logical_not(value >= 0))
  if jnp.issubdtype(total.dtype, jnp.integer):
    top = jnp.iinfo(total.dtype).max
    invalid = jnp.logical_or(invalid, value > top - jnp.maximum(total, 0))
    new_total = total + value
  else:
    new_total = total + value
    invalid = jnp.logical_or(invalid, jnp.logical_not(jnp.isfinite(new_total)))
  return jnp.where(invalid, jnp.asarray(-1, total.dtype), new_total)


def _token_parts(
  acc_tokens: jax.Array,
) -> tuple[tuple[jax.Array, ...], Callable[..., tuple[jax.Array, jax.Array]]]:
  """Parts of ``acc_tokens`` to ``psum`` exactly, and how to recombine them.

  An integer count is split into high and low halves so that the sum over
  devices cannot wrap unnoticed (exact for up to 2**15 devices with int32).
  Returns ``(parts, combine)``; ``combine(*summed_parts)`` gives ``(total,
  valid)``, where ``valid`` is false if a device's window was invalid or the
  total does not fit the dtype.
  """
  invalid = (acc_tokens < 0).astype(jnp.int32)
  count = jnp.maximum(acc_tokens, 0)
  if not jnp.issubdtype(acc_tokens.dtype, jnp.integer):

    def combine_float(total, num_invalid):
      return total, jnp.logical_and(num_invalid == 0, jnp.isfinite(total))

    return (count, invalid), combine_float
  half = jnp.iinfo(acc_tokens.dtype).bits // 2
  low_mask = (1 << half) - 1
  top_high = jnp.iinfo(acc_tokens.dtype).max >> half

  def combine_int(high, low, num_invalid):
    high = high + (low >> half)
    fits = jnp.logical_and(high >= 0, high <= top_high)
    total = (high << half) | (low & low_mask)
    return total, jnp.logical_and(num_invalid == 0, fits)

  return (count >> half, count & low_mask, invalid), combine_int


def _compensated_add(
  total: jax.Array, compensation: jax.Array, value: jax.Array
) -> tuple[jax.Array, jax.Array]:
  """Kahan-compensated ``total + value``: the new total and its error.

  The arithmetic runs in at least float32 (explicit, so that it does not
  depend on the compiler keeping excess precision); the new total is rounded
  to the accumulator dtype and its exact rounding error (TwoSum) is kept in
  ``compensation``, which is added back at the next step.
  """
  wide = jnp.promote_types(total.dtype, jnp.float32)
  total_wide = total.astype(wide)
  value = value.astype(wide) + compensation.astype(wide)
  new_total = (total_wide + value).astype(total.dtype)
  new_wide = new_total.astype(wide)
  virtual = new_wide - total_wide
  error = (total_wide - (new_wide - virtual)) + (value - virtual)
  return new_total, error.astype(total.dtype)


def token_weighted_multistep(
  inner: optax.GradientTransformation,
  every_k_schedule: EveryKSchedule,
  *,
  axis_name: Optional[AxisName] = None,
  loss_reduction: str = 'sum',
  accumulator_dtype: Optional[jax.typing.DTypeLike] = None,
  compensated: bool = False,
  should_skip_update_fn: Optional[ShouldSkipUpdateFn] = None,
  token_dtype: Optional[jax.typing.DTypeLike] = None,
) -> optax.GradientTransformationExtraArgs:
  r"""Accumulates token-summed gradients; one exact update every k steps.

  Over a window of :math:`K` micro-batches (on all devices of ``axis_name``),
  with :math:`N_k` counted tokens in micro-batch :math:`k`, the wrapped
  optimizer receives the gradient of the full-batch token-mean loss

  .. math::

    g = \frac{\sum_k \sum_{i \le N_k} \nabla \ell_{ki}}{\sum_k N_k},

  not the average of per-micro-batch means that ``optax.MultiSteps`` computes.
  Micro-steps 1..k-1 add the gradients and tokens into the state and return
  zero updates; the wrapped optimizer is not run and no collective is issued.
  The k-th step sums over ``axis_name`` once, divides by the window's tokens,
  runs ``inner`` once and resets the accumulators. A window without counted
  tokens emits zero updates and leaves ``inner``'s state untouched.

  Args:
    inner: the wrapped optimizer, e.g. ``optax.chain(clip, adamw)``. It sees
      the accumulated, token-normalized gradient once per window.
    every_k_schedule: micro-batches per window: an int >= 1, or a function of
      the optimizer step returning one (batch-size warm-up).
    axis_name: the ``pmap`` / ``shard_map`` data axis (or axes) to sum the
      window over. Leave None under ``jax.jit`` with sharded global arrays.
    loss_reduction: ``'sum'`` if the gradients are of the token-summed loss
      (exact, preferred) or ``'mean'`` if they are of the token-mean loss of
      the micro-batch (they are multiplied by ``num_tokens``).
    accumulator_dtype: dtype of the accumulator; None means the gradient's
      dtype promoted to at least float32.
    compensated: Kahan-compensated summation into the accumulator: the
      rounding error of each addition is kept in the state
      (``acc_compensation``, one more accumulator-sized tree) and added back,
      so that a low-precision accumulator (``jnp.bfloat16``) keeps about
      twice its precision over long windows.
    should_skip_update_fn: ``fn(grads, gradient_step, params) -> (skip,
      skip_state)``; a rejected micro-batch adds neither gradients nor tokens
      and does not advance the window, e.g. :func:`skip_not_finite`. With
      ``axis_name`` the decision is per device: the device's share is dropped
      and the window still closes on schedule everywhere.
    token_dtype: dtype of the token counters; None means int32, which counts
      exactly up to 2**31 - 1 tokens per window. Use a floating dtype for
      fractional token weights. A window whose count is invalid (a negative
      or NaN ``num_tokens`` on any micro-step, or a total over the window and
      devices beyond 2**31 - 1, or not finite) is dropped: zero updates, no
      optimizer step, and ``state.dropped_windows`` counts it. Wrap the
      transform in :func:`with_input_checks` to have
      ``jax.experimental.checkify`` report it instead.

  Returns:
    A ``GradientTransformationExtraArgs`` whose ``update(grads, state,
    params=None, *, num_tokens, loss=None, emit_now=False, **extra_args)``
    forwards ``extra_args`` to ``inner``.

  Example:
    >>> import jax, jax.numpy as jnp, optax
    >>> import optax_tokacc as tokacc
    >>> params = {'w': jnp.zeros(2)}
    >>> tx = tokacc.token_weighted_multistep(optax.sgd(1.0), every_k_schedule=2)
    >>> state = tx.init(params)
    >>> grads = {'w': jnp.array([3.0, 0.0])}  # of a loss summed over 3 tokens
    >>> updates, state = tx.update(grads, state, params, num_tokens=3)
    >>> updates['w']
    Array([0., 0.], dtype=float32)
    >>> grads = {'w': jnp.array([0.0, 1.0])}  # of a loss summed over 1 token
    >>> updates, state = tx.update(grads, state, params, num_tokens=1)
    >>> updates['w']
    Array([-0.75, -0.25], dtype=float32)

  References:
    Hugging Face, `Fixing gradient accumulation
    <https://huggingface.co/blog/gradient_accumulation>`_, 2024.
  """
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
  schedule = _canonical_schedule(every_k_schedule)
  if loss_reduction not in _LOSS_REDUCTIONS:
    raise ValueError(
      f'loss_reduction must be one of {_LOSS_REDUCTIONS}; got '
      f"{loss_reduction!r}. Use 'sum' when the loss is summed over the "
      "micro-batch's counted tokens, 'mean' when it is their mean."
    )
  accumulator_dtype = _check_accumulator_dtype(accumulator_dtype)
  token_dtype = jax.dtypes.canonicalize_dtype(
    jnp.int32 if token_dtype is None else token_dtype
  )
  if not (
    jnp.issubdtype(token_dtype, jnp.integer)
    or jnp.issubdtype(token_dtype, jnp.floating)
  ):
    raise TypeError(
      f'token_dtype must be an integer or floating dtype; got {token_dtype}.'
      ' Use None (int32) for exact token counts.'
    )
  if not isinstance(compensated, (bool, np.bool_)):
    raise TypeError(
      f'compensated must be True or False; got {compensated!r}. With '
      'optax.inject_hyperparams, list it in static_args.'
    )
  inner = optax.with_extra_args_support(inner)

  def init_fn(params: optax.Params) -> TokenWeightedMultiStepState:
    acc_grads = jax.tree.map(
      lambda p: jnp.zeros_like(
        p, dtype=_accumulator_dtype(accumulator_dtype, p)
      ),
      params,
    )
    if should_skip_update_fn is None:
      skip_state = ()
    else:
      _, skip_state = _call_skip_fn(
        should_skip_update_fn,
        optax.tree.zeros_like(params),
        jnp.zeros([], jnp.int32),
        params,
      )
    return TokenWeightedMultiStepState(
      mini_step=jnp.zeros([], jnp.int32),
      gradient_step=jnp.zeros([], jnp.int32),
      acc_grads=acc_grads,
      acc_tokens=jnp.zeros([], token_dtype),
      acc_loss=jnp.zeros([], _loss_dtype()),
      inner_state=inner.init(params),
      last_loss=jnp.zeros([], _loss_dtype()),
      last_tokens=jnp.zeros([], token_dtype),
      skip_state=skip_state,
      emitted=jnp.zeros([], jnp.bool_),
      acc_compensation=optax.tree.zeros_like(acc_grads) if compensated else (),
      dropped_windows=jnp.zeros([], jnp.int32),
    )

  def update_fn(
    updates: optax.Updates,
    state: TokenWeightedMultiStepState,
    params: Optional[optax.Params] = None,
    *,
    num_tokens: Optional[jax.typing.ArrayLike] = None,
    loss: Optional[jax.typing.ArrayLike] = None,
    emit_now: Union[bool, jax.typing.ArrayLike] = False,
    **extra_args: Any,
  ) -> tuple[optax.Updates, TokenWeightedMultiStepState]:
    if not isinstance(state, TokenWeightedMultiStepState):
      raise TypeError(
        'state must be the TokenWeightedMultiStepState returned by tx.init '
        f'of this transform; got {type(state).__name__}. Inside optax.chain, '
        "pass the chain's state to the chain's update."
      )
    tokens = _check_num_tokens(num_tokens, token_dtype)
    if params is not None:
      _check_grads_structure(updates, params, 'the parameters')
    _check_grads_structure(updates, state.acc_grads, 'the accumulator')
    _check_grads_shapes(updates, state.acc_grads)
    grad_axes = None
    if axis_name is not None:
      _check_axis_name(axis_name)
      grad_axes = _axes_to_sum(updates, axis_name)
    if loss is not None and jnp.shape(loss) != ():
      raise ValueError(
        f"loss must be a scalar (this micro-batch's loss); got shape "
        f'{jnp.shape(loss)}.'
      )
    grad_scale = tokens if loss_reduction == 'mean' else None
    loss_sum = jnp.zeros([], _loss_dtype()) if loss is None else loss
    loss_sum = jnp.asarray(loss_sum, _loss_dtype())
    if grad_scale is not None:
      loss_sum = loss_sum * tokens.astype(loss_sum.dtype)

    if should_skip_update_fn is None:
      keep = None
      skip_state = state.skip_state
    else:
      skip, skip_state = _call_skip_fn(
        should_skip_update_fn, updates, state.gradient_step, params
      )
      keep = jnp.logical_not(skip)

    def addend(acc: jax.Array, grad: jax.Array) -> jax.Array:
      """What to add to ``acc``: compensation adds it in >= float32."""
      dtype = acc.dtype
      if compensated:
        dtype = jnp.promote_types(dtype, jnp.float32)
      grad = grad.astype(dtype)
      if grad_scale is not None:
        grad = grad * grad_scale.astype(dtype)
      if keep is not None:
        grad = jnp.where(keep, grad, jnp.zeros_like(grad))
      return grad

    # The accumulators are not zeroed when a window emits (that would write a
    # parameter-sized buffer once more); the first micro-batch of the next
    # window overwrites them instead, with a select, so a NaN of a finished
    # window cannot leak into the next one.
    restart = state.mini_step == 0
    addends = jax.tree.map(addend, state.acc_grads, updates)
    if compensated:
      treedef = jax.tree.structure(state.acc_grads)
      sums = [
        _compensated_add(
          jnp.where(restart, jnp.zeros_like(total), total),
          jnp.where(restart, jnp.zeros_like(error), error),
          value,
        )
        for total, error, value in zip(
          treedef.flatten_up_to(state.acc_grads),
          treedef.flatten_up_to(state.acc_compensation),
          treedef.flatten_up_to(addends),
        )
      ]
      acc_grads = treedef.unflatten([total for total, _ in sums])
      acc_compensation = treedef.unflatten([error for _, error in sums])
    else:
      acc_grads = jax.tree.map(
        lambda total, value: jnp.where(restart, value, total + value),
        state.acc_grads,
        addends,
      )
      acc_compensation = state.acc_compensation
    if keep is None:
      acc_tokens = _add_tokens(state.acc_tokens, tokens)
      acc_loss = state.acc_loss + loss_sum
      mini_step = optax.safe_increment(state.mini_step)
    else:
      acc_tokens = _add_tokens(
        state.acc_tokens, jnp.where(keep, tokens, jnp.zeros_like(tokens))
      )
      acc_loss = state.acc_loss + jnp.where(keep, loss_sum, 0)
      mini_step = jnp.where(
        keep, optax.safe_increment(state.mini_step), state.mini_step
      )

    k = schedule(state.gradient_step)
    if jnp.shape(k) != () or not jnp.issubdtype(
      jnp.result_type(k), jnp.integer
    ):
      raise TypeError(
        'every_k_schedule(gradient_step) must return an integer scalar; got '
        f'shape {jnp.shape(k)} and dtype {jnp.result_type(k)}. Round a '
        'floating schedule, e.g. jnp.round(k).astype(jnp.int32).'
      )
    k = jnp.maximum(jnp.asarray(k, jnp.int32), 1)
    emit = mini_step >= k
    if not (isinstance(emit_now, (bool, np.bool_)) and not emit_now):
      if jnp.shape(emit_now) != ():
        raise ValueError(
          'emit_now must be a boolean scalar (close the window at this '
          f'micro-step); got shape {jnp.shape(emit_now)}.'
        )
      emit_now = jnp.asarray(emit_now, jnp.bool_)
      if axis_name is not None:
        # Any device closing the window closes it everywhere.
        emit_now = lax.pmax(emit_now.astype(jnp.int32), axis_name) > 0
      emit = jnp.logical_or(emit, emit_now)

    # Branch outputs differ in vma under shard_map: match them there.
    cond = lax.cond if axis_name is None else _cond_matching_vma
    # Without axis_name the emitted updates are written into the finished
    # window's accumulator and masked outside the conditional, so that a
    # micro-step writes no parameter-sized zeros (and `apply_if_updated`
    # reads the buffer itself). Under shard_map the accumulator varies over
    # the devices while the updates must not, and an accumulator narrower
    # than the gradients cannot hold the updates exactly: these return zeros
    # from the conditional.
    updates_in_accumulator = axis_name is None and all(
      jnp.promote_types(acc.dtype, jnp.result_type(grad)) == acc.dtype
      for acc, grad in zip(
        jax.tree.leaves(state.acc_grads), jax.tree.leaves(updates)
      )
    )

    def zero_updates():
      # Not zeros_like: under shard_map that inherits the per-device vma of
      # the micro-batch gradients, and would make the parameters varying.
      return jax.tree.map(
        lambda g: jnp.zeros(jnp.shape(g), jnp.result_type(g)), updates
      )

    def emit_window(
      acc_grads,
      acc_compensation,
      acc_tokens,
      acc_loss,
      inner_and_params,
      *,
      run_inner=None,
    ):
      """Closes the window; ``run_inner``: None decides by its tokens."""
      inner_state, params = inner_and_params
      window_grads = acc_grads
      if compensated:
        window_grads = jax.tree.map(
          lambda total, error: (
            total.astype(jnp.promote_types(total.dtype, jnp.float32))
            + error.astype(jnp.promote_types(total.dtype, jnp.float32))
          ),
          acc_grads,
          acc_compensation,
        )
      token_parts, combine_tokens = _token_parts(acc_tokens)
      if axis_name is not None:
        window_grads, token_parts, acc_loss = _psum_window(
          window_grads, token_parts, acc_loss, axis_name, grad_axes
        )
      window_tokens, tokens_valid = combine_tokens(*token_parts)
      # An invalid count (negative, or beyond token_dtype) drops the window.
      has_tokens = jnp.logical_and(tokens_valid, window_tokens > 0)

      def step(window_grads, inner_state, params):
        denominator = window_tokens
        mean_grads = jax.tree.map(
          lambda g: g / denominator.astype(g.dtype), window_grads
        )
        return inner.update(
          optax.tree.cast_like(mean_grads, updates),
          inner_state,
          params,
          **extra_args,
        )

      def no_step(window_grads, inner_state, params):
        del window_grads, params
        return zero_updates(), inner_state

      if run_inner is None:
        new_updates, inner_state = cond(
          has_tokens, step, no_step, window_grads, inner_state, params
        )
      else:
        inner_fn = step if run_inner else no_step
        new_updates, inner_state = inner_fn(window_grads, inner_state, params)
      if updates_in_accumulator:
        new_updates = optax.tree.cast_like(new_updates, acc_grads)
      window_mean_loss = acc_loss / jnp.maximum(window_tokens, 1).astype(
        acc_loss.dtype
      )
      return (
        new_updates,
        inner_state,
        optax.tree.zeros_like(acc_compensation),
        (has_tokens, tokens_valid, window_tokens, window_mean_loss),
      )

    def accumulate(
      acc_grads, acc_compensation, acc_tokens, acc_loss, inner_and_params
    ):
      del acc_tokens, acc_loss
      inner_state, _ = inner_and_params
      return (
        acc_grads if updates_in_accumulator else zero_updates(),
        inner_state,
        acc_compensation,
        (
          jnp.zeros([], jnp.bool_),
          jnp.ones([], jnp.bool_),
          jnp.zeros_like(state.last_tokens),
          jnp.zeros_like(state.last_loss),
        ),
      )

    operands = (
      acc_grads,
      acc_compensation,
      acc_tokens,
      acc_loss,
      (state.inner_state, params),
    )
    if axis_name is None:
      # Without collectives the window's tokens are known before branching:
      # one `cond` on "run the optimizer" (a `cond` nested in the emitting
      # branch would copy the updates out of its own output buffer). An
      # emitting window without tokens takes the accumulating branch.
      token_parts, combine_tokens = _token_parts(acc_tokens)
      window_tokens, tokens_valid = combine_tokens(*token_parts)
      emitted = jnp.logical_and(
        emit, jnp.logical_and(tokens_valid, window_tokens > 0)
      )
      out, inner_state, acc_compensation, _ = cond(
        emitted,
        functools.partial(emit_window, run_inner=True),
        accumulate,
        *operands,
      )
      window_mean_loss = acc_loss / jnp.maximum(window_tokens, 1).astype(
        acc_loss.dtype
      )
    else:
      # The window's tokens are summed over the devices in the emitting
      # branch only (no collective on micro-steps).
      out, inner_state, acc_compensation, window = cond(
        emit, emit_window, accumulate, *operands
      )
      emitted, tokens_valid, window_tokens, window_mean_loss = window
    if updates_in_accumulator:
      acc_grads = out
      new_updates = jax.tree.map(
        lambda held, g: jnp.where(emitted, held, 0).astype(jnp.result_type(g)),
        acc_grads,
        updates,
      )
      _remember_held_updates(new_updates, acc_grads)
    else:
      new_updates = out
    new_state = TokenWeightedMultiStepState(
      mini_step=jnp.where(emit, jnp.zeros_like(mini_step), mini_step),
      gradient_step=jnp.where(
        emitted, optax.safe_increment(state.gradient_step), state.gradient_step
      ),
      acc_grads=acc_grads,
      acc_tokens=jnp.where(emit, jnp.zeros_like(acc_tokens), acc_tokens),
      acc_loss=jnp.where(emit, jnp.zeros_like(acc_loss), acc_loss),
      inner_state=inner_state,
      last_loss=jnp.where(emitted, window_mean_loss, state.last_loss),
      last_tokens=jnp.where(emitted, window_tokens, state.last_tokens),
      skip_state=skip_state,
      emitted=emitted,
      acc_compensation=acc_compensation,
      dropped_windows=jnp.where(
        jnp.logical_and(emit, jnp.logical_not(tokens_valid)),
        optax.safe_increment(state.dropped_windows),
        state.dropped_windows,
      ),
    )
    return new_updates, new_state

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)
