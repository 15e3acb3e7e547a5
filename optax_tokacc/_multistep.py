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
"""Exact, token-weighted gradient accumulation over several optimizer steps.

One code path. A micro-step adds the micro-batch's token-summed gradients,
tokens and loss into the state; the step that closes the window (in one
``lax.cond``) sums the window over the data axes once, divides by its token
count, runs the wrapped optimizer once, and keeps its state's dtypes.
"""

import functools
from typing import Any, Optional, Union

import jax
import jax.numpy as jnp
import optax

from optax_tokacc import _applied
from optax_tokacc import _base
from optax_tokacc import _closing
from optax_tokacc import _config
from optax_tokacc import _inner_step
from optax_tokacc import _inputs
from optax_tokacc import _manual
from optax_tokacc import _norms
from optax_tokacc import _partial_sums
from optax_tokacc import _placement
from optax_tokacc import _single
from optax_tokacc import _state_checks
from optax_tokacc import _typed_sharding
from optax_tokacc import _typing
from optax_tokacc import _window


def token_weighted_multistep(
  inner: optax.GradientTransformation,
  every_k_schedule: Union[int, optax.Schedule],
  *,
  axis_name: Optional[_base.AxisName] = None,
  loss_reduction: str = 'sum',
  accumulator_dtype: Optional[jax.typing.DTypeLike] = None,
  compensated: bool = False,
  should_skip_update_fn: Optional[optax.ShouldSkipUpdateFunction] = None,
  token_dtype: Optional[jax.typing.DTypeLike] = None,
  tokens_per_update: Optional[Union[int, float]] = None,
  window_norms: Union[bool, str] = True,
) -> optax.GradientTransformationExtraArgs:
  r"""Accumulates token-summed gradients; one exact update every k steps.

  Over a window of :math:`K` micro-batches (on all devices of ``axis_name``),
  with :math:`N_k` counted tokens in micro-batch :math:`k`, the wrapped
  optimizer receives the gradient of the full-batch token-mean loss

  .. math::

    g = \frac{\sum_k \sum_{i \le N_k} \nabla \ell_{ki}}{\sum_k N_k},

  not the average of per-micro-batch means that ``optax.MultiSteps`` computes.
  Micro-steps add the gradients, tokens and loss into the state and return
  zero updates; the wrapped optimizer is not run and no collective is issued.
  The k-th step sums the window over ``axis_name`` once, divides by its
  tokens, runs ``inner`` once (its state keeps its dtypes) and starts a new
  window. A window without counted tokens, or with an invalid count, emits
  zero updates and leaves ``inner``'s state untouched.

  The window is the unit ``inner`` sees: when ``loss`` is passed, ``inner``
  receives ``value=`` the window's token-mean loss over all devices (what
  :func:`window_loss` reports), so ``optax.contrib.reduce_on_plateau`` takes
  the decisions of full-batch training. A ``value`` extra arg is refused
  (pass ``loss``), and so are functions that would re-evaluate the
  objective (``value_fn``, ``grad_fn``, ``obj_fn``, any callable: a window
  has no objective to evaluate at new parameters). Other extra args reach
  ``inner`` from the call that closes the window.

  Under ``jax.jit`` on an explicit mesh (``jax.make_mesh``), parameters typed
  reduced over the data axes (``jax.P(reduced={'data'})``) give unreduced
  gradients; the accumulator stays unreduced (per-device partial sums) and
  the window is reduced once, when it closes, in one all-reduce with its
  token count and loss. Leave ``axis_name`` None there.

  Args:
    inner: the wrapped optimizer, e.g. ``optax.chain(clip, adamw)``; it sees
      the accumulated, token-normalized gradient once per window.
    every_k_schedule: micro-batches per window: an int >= 1, or a function of
      the optimizer step returning one (batch-size warm-up).
    axis_name: the ``pmap`` / ``shard_map`` data axis (or axes) to sum the
      window over. Gradients are never summed over an axis along which their
      parameter is sharded. Leave None under ``jax.jit`` with global arrays.
    loss_reduction: ``'sum'`` if the gradients are of the loss summed over the
      micro-batch's counted tokens (exact, preferred), ``'mean'`` if of their
      mean (the gradients and loss are multiplied by ``num_tokens``; a
      micro-batch without tokens adds nothing).
    accumulator_dtype: dtype of the accumulator; None means the gradient's
      dtype promoted to at least float32.
    compensated: Kahan-compensated summation: the rounding error of each
      addition is kept (``acc_compensation``) and added back, so a bfloat16
      accumulator keeps about twice its precision over long windows.
    should_skip_update_fn: ``fn(grads, gradient_step, params) -> (skip,
      skip_state)``, e.g. :func:`skip_not_finite`. A rejected micro-batch adds
      neither gradients, tokens nor loss. Without ``axis_name`` it does not
      advance the window (as in ``optax.MultiSteps``); with ``axis_name`` the
      window still closes on schedule on every device, without a collective.
    token_dtype: int32 (None, the default: exact counts up to 2**31 - 1 per
      window over all devices), or float32 or float64 (under
      ``jax_enable_x64``) for fractional token weights: each window is
      divided by its own total, in that dtype, from its smallest normal
      number to that number's reciprocal (2**-126 to 2**126 in float32).
      float16 and bfloat16 are refused (their sums keep too few bits). An
      invalid count (negative, NaN, fractional under int32, a weight that
      is infinite or below that range, or a total beyond the counter or
      the range) drops its window: zero updates, no optimizer step,
      ``state.dropped_windows`` + 1; :func:`with_input_checks` reports it.
    tokens_per_update: close a window at the first micro-step at which its
      counted tokens, over its micro-steps and all devices, reach this
      number (a Python int >= 1; with a floating ``token_dtype``, a weight
      in its units: any finite number > 0), or after ``every_k_schedule``
      micro-steps, whichever comes first; the micro-batch that reaches it
      belongs to the window. With data parallelism this costs a scalar all-reduce per
      micro-step. None (the default): windows of ``every_k_schedule``.
    window_norms: whether the closing step computes the window's gradient
      and update norms (:func:`window_metrics`). False leaves them NaN and
      saves, on a CPU or TPU, up to two passes over the parameters' size
      at each close (most where the host closes, ``close=True``; on a GPU
      the norms are summed in ``inner``'s step and cost no pass), and the
      norms' scalar collectives where the gradient is split (the cost per
      target is in ``docs/performance.md``).
      ``'per_leaf'``: each leaf's norms too
      (``window_metrics(state).grad_norms``, ``.update_norms``: trees like
      the parameters), from the same squares and in the same collective
      (a vector of one entry per leaf where the gradient is split).

  Returns:
    A ``GradientTransformationExtraArgs`` whose ``update(grads, state,
    params=None, *, num_tokens, loss=None, emit_now=False, close=None,
    **extra_args)`` forwards ``extra_args`` to ``inner``. ``close=None``
    lets the device decide (the schedule, ``tokens_per_update``,
    ``emit_now``); a Python bool is the host's decision: ``False`` adds the
    micro-batch, ``True`` closes the window with it, each traced without a
    conditional (jit with ``static_argnames='close'``: two programs).

  Example:
    >>> import jax, jax.numpy as jnp, optax
    >>> import optax_tokacc as tokacc
    >>> params = {'w': jnp.zeros(2)}
    >>> tx = tokacc.token_weighted_multistep(optax.sgd(1.0), every_k_schedule=2)
    >>> state = tx.init(params)
    >>> grads = {'w': jnp.array([3.0, 0.0])}  # of a loss summed over 3 tokens
    >>> updates, state = tx.update(grads, state, params, num_tokens=3)
    >>> updates['w']  # -0.0: adding it leaves every parameter's bits as is
    Array([-0., -0.], dtype=float32)
    >>> grads = {'w': jnp.array([0.0, 1.0])}  # of a loss summed over 1 token
    >>> updates, state = tx.update(grads, state, params, num_tokens=1)
    >>> updates['w']
    Array([-0.75, -0.25], dtype=float32)

  References:
    Hugging Face, `Fixing gradient accumulation
    <https://huggingface.co/blog/gradient_accumulation>`_, 2024.
  """
  config = _config.make(
    inner=inner,
    every_k_schedule=every_k_schedule,
    axis_name=axis_name,
    loss_reduction=loss_reduction,
    accumulator_dtype=accumulator_dtype,
    compensated=compensated,
    should_skip_update_fn=should_skip_update_fn,
    token_dtype=token_dtype,
    tokens_per_update=tokens_per_update,
    window_norms=window_norms,
  )
  return optax.GradientTransformationExtraArgs(
    functools.partial(_init, config), functools.partial(update, config)
  )


def placement(
  config: _base.Config,
  params: Optional[_typing.Params],
  state: Optional[_base.TokenWeightedMultiStepState] = None,
  grads: Optional[_typing.Updates] = None,
  num_tokens: Optional[jax.typing.ArrayLike] = None,
) -> _placement.Placement:
  """The placement of this trace (``_placement``): from ``axis_name``, and
  the types of the parameters (``init``, without ``state``) or of the
  state's window."""
  if config.axis_name is not None:
    return _manual.Manual.of(config, params, grads, num_tokens)
  if state is None:  # init
    axes = _typed_sharding.data_axes(params)
  else:
    axes = _typed_sharding.unreduced(state.acc_tokens)
  if not axes:
    return _single.Single()
  return _partial_sums.PartialSums.of(config, axes, params, state, grads)


def _init(
  config: _base.Config, /, params: _typing.Params
) -> _base.TokenWeightedMultiStepState:
  _typed_sharding.check_supported(params, 'Parameters')
  place = placement(config, params)

  def zeros(dtype_of):
    return jax.tree.map(lambda p: place.gradient_zeros(p, dtype_of(p)), params)

  nan_norms = _norms.nan(config, params)  # no window yet
  grad_norm, update_norm = _norms.stored(config, nan_norms)
  state = _base.TokenWeightedMultiStepState(
    mini_step=jnp.zeros([], jnp.int32),
    gradient_step=jnp.zeros([], jnp.int32),
    grad_sums=zeros(config.acc_dtype),
    acc_tokens=place.scalar_zeros(config.token_dtype),
    acc_loss=place.scalar_zeros(config.loss_dtype),
    inner_state=config.inner.init(params),
    last_loss=jnp.full([], jnp.nan, config.loss_dtype),
    last_tokens=jnp.zeros([], config.token_dtype),
    emitted=jnp.zeros([], jnp.bool_),
    acc_compensation=zeros(config.acc_dtype) if config.compensated else (),
    dropped_windows=jnp.zeros([], jnp.int32),
    last_grad_norm=grad_norm,
    last_update_norm=update_norm,
  )
  if config.should_skip_update_fn is not None:
    grads = zeros(jnp.result_type)
    _, skip_state = _judge(config, place, grads, state.gradient_step, params)
    state = state._replace(skip_state=skip_state)
  return place.global_state(state)


def _judge(
  config: _base.Config,
  place: _placement.Placement,
  grads: _typing.Updates,
  gradient_step: jax.Array,
  params: Optional[_typing.Params],
) -> tuple[Optional[jax.Array], _typing.ArrayTree]:
  """Whether to keep the micro-batch (None: always), and the skip state."""
  skip_fn = config.should_skip_update_fn
  if skip_fn is None:
    return None, ()
  skip, skip_state = place.skip_decision(skip_fn, grads, gradient_step, params)
  return jnp.logical_not(skip), skip_state


def update(
  config: _base.Config,
  /,
  updates: _typing.Updates,
  state: _base.TokenWeightedMultiStepState,
  params: Optional[_typing.Params] = None,
  **kwargs: Any,
) -> tuple[_typing.Updates, _base.TokenWeightedMultiStepState]:
  """One micro-step; closes the window on the k-th (see the factory and
  :func:`call`)."""
  return call(config, updates, state, params, **kwargs)[:2]


def call(
  config: _base.Config,
  /,
  updates: _typing.Updates,
  state: _base.TokenWeightedMultiStepState,
  params: Optional[_typing.Params] = None,
  *,
  num_tokens: Optional[jax.typing.ArrayLike] = None,
  loss: Optional[jax.typing.ArrayLike] = None,
  emit_now: Union[bool, jax.typing.ArrayLike] = False,
  close: Optional[bool] = None,
  _apply: bool = False,
  **extra_args: Any,
) -> tuple[
  _typing.Updates, _base.TokenWeightedMultiStepState, Optional[_typing.Params]
]:
  """:func:`update`, and where ``_apply`` (``update_and_apply``) the
  parameters with the updates applied (by ``_applied.closed`` where the
  buffer returned is the updates), else None."""
  # The inputs, checked once; then the placement; then the state.
  _inputs.state_type(state)
  _inputs.tree(updates, params, 'the parameters')
  _typed_sharding.check_supported(updates, 'Gradients')
  grads, num_tokens, loss = _typed_sharding.reduce_trivial(
    updates, num_tokens, loss
  )
  _inputs.num_tokens(num_tokens, config.token_dtype)
  _inputs.loss(loss)
  emit_now = _inputs.emit_now(emit_now)
  _inputs.close(close, emit_now, config.tokens_per_update)
  _inputs.extra_args(extra_args)
  place = placement(config, params, state, grads, num_tokens)
  state = place.local_state(state)
  _state_checks.state_matches(config, grads, state, params)

  keep, skip_state = _judge(config, place, grads, state.gradient_step, params)
  micro = _window.micro_batch(config, place, grads, num_tokens, loss, keep)
  window = _base.Window(*(getattr(state, f) for f in _base.Window._fields))
  window = _window.restart_if(place, state.mini_step == 0, window)
  window = _window.add(config, place, window, micro)
  mini_step = _mini_step(place, state.mini_step, keep)
  extra = _inner_step.Extra(extra_args, with_loss=loss is not None)
  ctx = _inner_step.Context(config, place, grads, params, extra)
  device_decides = close is None
  if device_decides:  # in one loop of 0 or 1 trips
    close = _window.should_close(
      config, place, state.gradient_step, mini_step, window.acc_tokens, emit_now
    )
  applied = None
  if _apply and place.buffer_is_the_updates():  # closed and applied here
    result, applied = _applied.closed(
      ctx, close, window, state.inner_state, params
    )
  elif device_decides:
    result = _closing.close_if(ctx, close, window, state.inner_state)
  elif close:  # the host's decision: no conditional
    result = _closing.close_now(ctx, window, state.inner_state)
  else:
    result = _closing.keep_open(ctx, window, state.inner_state)
  new_state = _next_state(config, state, mini_step, close, result, skip_state)
  if _apply and applied is None:
    applied = optax.apply_updates(params, result.updates)
  return result.updates, place.global_state(new_state), applied


def _mini_step(
  place: _placement.Placement,
  mini_step: jax.Array,
  keep: Optional[jax.Array],
) -> jax.Array:
  """The micro-steps of the window after this one: a rejected micro-batch
  is not one, but where the placement advances it anyway (devices that may
  decide differently close their windows together)."""
  advanced = optax.safe_increment(mini_step)
  if keep is None or place.rejected_micro_batch_advances():
    return advanced
  return jnp.where(keep, advanced, mini_step)


def _next_state(
  config: _base.Config,
  state: _base.TokenWeightedMultiStepState,
  mini_step: jax.Array,
  close: Union[bool, jax.Array],
  result: _closing.CallResult,
  skip_state: _typing.ArrayTree,
) -> _base.TokenWeightedMultiStepState:
  """The state after this call: a closed window starts afresh (its
  count and loss zeroed where it closed, its sums before the next
  window's first micro-step, ``_window.restart_if``)."""
  closed, emitted = result.closed, result.closed.emitted
  dropped = jnp.logical_and(close, jnp.logical_not(closed.valid))
  grad_norm, update_norm = _norms.stored(config, closed.norms)
  return _base.TokenWeightedMultiStepState(
    # grad_sums, acc_compensation, acc_tokens, acc_loss
    **result.window._asdict(),
    mini_step=jnp.where(close, jnp.zeros_like(mini_step), mini_step),
    gradient_step=_increment_if(emitted, state.gradient_step),
    inner_state=result.inner_state,
    last_loss=jnp.where(emitted, closed.mean_loss, state.last_loss),
    last_tokens=jnp.where(emitted, closed.tokens, state.last_tokens),
    last_grad_norm=optax.tree.where(emitted, grad_norm, state.last_grad_norm),
    last_update_norm=optax.tree.where(
      emitted, update_norm, state.last_update_norm
    ),
    skip_state=skip_state,
    emitted=emitted,
    dropped_windows=_increment_if(dropped, state.dropped_windows),
  )


def _increment_if(condition: jax.Array, counter: jax.Array) -> jax.Array:
  return jnp.where(condition, optax.safe_increment(counter), counter)
