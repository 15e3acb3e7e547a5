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
from typing import Any, Optional

import jax
import jax.numpy as jnp
import numpy as np
import optax

from optax_tokacc import _base
from optax_tokacc import _explicit

_REDUCTIONS = ('sum', 'mean')
_REAL = (jnp.integer, jnp.floating)  # The dtypes of a real scalar.
# The fix for a static argument that optax.inject_hyperparams made an array.
_STATIC = ' With optax.inject_hyperparams, list it in static_args.'


def _refuse(
  name: str, kinds: str, got: Any, fix: str = '', error: type = TypeError
) -> Exception:
  """The error for a bad ``name``: "``name`` must be ``kinds``; got ``got``."
  and, where it is not obvious, the ``fix``."""
  return error(f'{name} must be {kinds}; got {got}.{fix}')


def _typed(value: Any) -> str:
  """``value`` and its type, as an error echoes it."""
  return f'{value!r} of type {type(value).__name__}'


def check_options(
  inner: Any, should_skip_update_fn: Any, loss_reduction: Any
) -> None:
  """Checks the constructor's non-dtype arguments (bools: :func:`flag`)."""
  if not isinstance(inner, optax.GradientTransformation):
    kinds = 'an optax.GradientTransformation such as optax.adam(1e-3)'
    raise _refuse('inner', kinds, repr(inner))
  if should_skip_update_fn is not None and not callable(should_skip_update_fn):
    kinds = 'None or a function such as tokacc.skip_not_finite'
    raise _refuse('should_skip_update_fn', kinds, repr(should_skip_update_fn))
  if loss_reduction not in _REDUCTIONS:
    kinds = f'one of {_REDUCTIONS}'
    raise _refuse('loss_reduction', kinds, repr(loss_reduction), '', ValueError)


def flag(value: Any, name: str) -> bool:
  """``name``'s ``value``, a Python or NumPy bool, as a Python bool."""
  if not isinstance(value, (bool, np.bool_)):
    raise _refuse(name, 'True or False', repr(value), _STATIC)
  return bool(value)


def positive_int(value: Any, name: str, kinds: str) -> int:
  """``value``, a Python or NumPy int >= 1 (not a bool), as an int.

  ``kinds`` says what ``name`` must be, for the error.
  """
  if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
    raise _refuse(name, kinds, _typed(value))
  if value < 1:
    raise _refuse(name, '>= 1', f'{name}={value}', error=ValueError)
  return int(value)


def schedule(every_k_schedule: Any) -> Callable[[jax.Array], Any]:
  """``every_k_schedule`` checked and made a function of the step."""
  if callable(every_k_schedule):
    return every_k_schedule
  if isinstance(every_k_schedule, jax.Array):  # From inject_hyperparams.
    _base.check_k(every_k_schedule)
    if isinstance(every_k_schedule, jax.core.Tracer):
      return lambda step: every_k_schedule
    every_k_schedule = int(every_k_schedule)
  kinds = 'an int >= 1 or a function of the step, e.g. every_k_schedule=4'
  k = positive_int(every_k_schedule, 'every_k_schedule', kinds)
  return lambda step: k


def dtype(value: Any, name: str) -> Optional[jnp.dtype]:
  """``accumulator_dtype`` (a floating dtype; None stays None: the
  gradient's, at least float32) or ``token_dtype`` (int32, the default for
  exact counts, or a floating dtype), checked and canonicalized."""
  counts = name == 'token_dtype'
  if value is None:
    return jnp.dtype(jnp.int32) if counts else None
  kinds = 'a floating dtype, or None for the gradient dtype (at least float32)'
  kinds = 'int32 or a floating dtype' if counts else kinds
  try:
    found = jnp.dtype(value)
  except TypeError as e:
    raise _refuse(name, kinds, repr(value), _STATIC) from e
  if not (jnp.issubdtype(found, jnp.floating) or counts and found == jnp.int32):
    raise _refuse(name, kinds, found)
  return jax.dtypes.canonicalize_dtype(found)


def _scalar(
  value: Any, name: str, kinds: str, dtypes: tuple, fix='', error=ValueError
) -> None:
  """Checks that ``value`` (what ``name`` holds) is a scalar of one of
  ``dtypes``; ``kinds`` says so in words, and ``error`` is raised for a
  wrong shape."""
  number = (int, float, np.number, np.bool_, np.ndarray, jax.Array)  # No str.
  dtype = jnp.result_type(value) if isinstance(value, number) else None
  if dtype is None or not any(jnp.issubdtype(dtype, d) for d in dtypes):
    raise _refuse(name, kinds, _typed(value), fix)
  if jnp.shape(value) != ():
    raise _refuse(name, kinds, f'shape {jnp.shape(value)}', fix, error)


def num_tokens(value: Any, dtype: jnp.dtype) -> None:
  """Checks ``num_tokens`` at trace time (kind, shape, concrete range)."""
  if value is None:
    raise TypeError(
      'num_tokens is required: tx.update(grads, state, params, num_tokens=n).'
    )
  kinds = "a real scalar (this device's counted tokens of this micro-batch)"
  fix = ' Sum a mask: num_tokens=mask.sum().'
  _scalar(value, 'num_tokens', kinds, _REAL, fix)
  if isinstance(value, jax.core.Tracer):
    return
  count = np.asarray(value).item()
  got = f'num_tokens={count}'
  if not 0 <= count < np.inf:  # Also NaN.
    raise _refuse('num_tokens', 'a finite count >= 0', got, error=ValueError)
  integer = jnp.issubdtype(dtype, jnp.integer)
  if integer and (count != int(count) or count > jnp.iinfo(dtype).max):
    kinds = f'a whole number that fits the {dtype} token counter'
    fix = ' For fractional counts, set token_dtype=jnp.float32.'
    raise _refuse('num_tokens', kinds, got, fix, ValueError)


def emit_now(value: Any) -> Optional[jax.Array]:
  """``emit_now`` as a boolean scalar, or None when statically False."""
  if isinstance(value, (bool, np.bool_)) and not value:
    return None
  _scalar(value, 'emit_now', 'a boolean scalar', (jnp.bool_,))
  return jnp.asarray(value, jnp.bool_)


def close(value: Any, emit_now: Any, tokens_per_update: Any) -> None:
  """``close``: None (the device decides), or a Python bool (the host)."""
  if value is None:
    return
  if not isinstance(value, bool):  # Also a traced value.
    kinds = 'None or a Python bool, not traced (on the device, pass emit_now)'
    raise _refuse('close', kinds, f'close={value!r}')
  if tokens_per_update is not None or emit_now is not None:
    other = f'tokens_per_update={tokens_per_update}'
    other = 'emit_now' if tokens_per_update is None else other
    raise ValueError(f'close={value} and {other} both decide when: drop one.')


def loss(value: Any) -> None:
  """Checks ``loss``: None, or a real scalar."""
  if value is not None:
    _scalar(value, 'loss', "a real scalar (this micro-batch's loss)", _REAL)


def state_type(state: Any) -> None:
  """``state`` must be the transform's own state."""
  if type(state).__name__ != 'TokenWeightedMultiStepState':
    kinds = 'the TokenWeightedMultiStepState of tx.init'
    fix = " With optax.chain, pass the chain's state."
    raise _refuse('state', kinds, type(state).__name__, fix)


def tree(grads: Any, reference: Any, what: str) -> None:
  """``grads`` must have the tree structure of ``reference`` (None: any)."""
  expected = jax.tree.structure(reference)
  if reference is not None and jax.tree.structure(grads) != expected:
    raise ValueError(
      f'The gradient tree does not match {what}: got '
      f'{jax.tree.structure(grads)}, expected {expected}.'
    )


def state_matches(
  config: _base.Config, grads: Any, state: Any, params: Any
) -> None:
  """Refuses a state made (or restored) for another configuration, or for
  gradients of another tree, shape, dtype or (explicit sharding) type.

  Under explicit sharding the accumulator of each gradient must be
  unreduced over the same axes as the gradient (a state built, or restored,
  for the parameters as they are typed now), and never over an axis along
  which the parameter is split (each device would add a different shard
  into one sum).
  """
  tree(grads, state.grad_sums, 'the accumulator')
  acc_leaves = jax.tree.leaves(state.grad_sums)
  compensated = bool(jax.tree.leaves(state.acc_compensation))
  if acc_leaves and compensated != config.compensated:
    raise TypeError(
      f'state has compensated={compensated}, unlike this transform: restore '
      f'into its tx.init(params), or build it with compensated={compensated}.'
    )
  per_leaf = isinstance(state.last_grad_norm, tuple)
  if acc_leaves and per_leaf != config.leaf_norms:
    saved = "'per_leaf'" if per_leaf else 'True or False'
    raise TypeError(
      f'state has window_norms={saved}, unlike this transform: restore into '
      f'its tx.init(params), or build it with window_norms={saved}.'
    )
  for name in ('acc_tokens', 'last_tokens', 'acc_loss', 'last_loss'):
    dtype = config.loss_dtype if 'loss' in name else config.token_dtype
    _state_dtype(name, getattr(state, name), dtype)
  axes = _explicit.unreduced(state.acc_tokens)
  if _explicit.unreduced(state.acc_loss) != axes:
    raise TypeError(
      f'state.acc_loss is {jax.typeof(state.acc_loss)} but state.acc_tokens '
      f'{jax.typeof(state.acc_tokens)}: restored with another type. Restore '
      'it with tokacc.from_checkpoint into tx.init(params).'
    )
  grad_leaves = jax.tree.leaves(grads)
  param_leaves = jax.tree.leaves(params) or [None] * len(grad_leaves)
  for grad, acc, param in zip(grad_leaves, acc_leaves, param_leaves):
    _state_dtype('grad_sums', acc, config.acc_dtype(grad))
    _leaf_matches(grad, acc, param, axes)


def _state_dtype(field: str, value: Any, expected: Any) -> None:
  """``state.field`` (``value``) must have the dtype this transform keeps."""
  if jnp.result_type(value) != expected:
    raise TypeError(
      f'state.{field} has dtype {jnp.result_type(value)}, not {expected}: '
      'restore into its tx.init(params), or set accumulator_dtype/token_dtype.'
    )


def _leaf_matches(grad: Any, acc: Any, param: Any, axes: frozenset) -> None:
  """A gradient must match its accumulator's shape and type (see above)."""
  if jnp.shape(grad) != jnp.shape(acc):
    raise ValueError(
      f'A gradient has shape {jnp.shape(grad)} where the parameter has shape '
      f'{jnp.shape(acc)}: under pmap or shard_map, use tokacc.init_sharded.'
    )
  split = _explicit.unreduced(grad) & _explicit.sharded(param)  # None: {}
  if split:
    raise ValueError(
      f'A gradient is unreduced over {sorted(split)}, along which its '
      f'parameter {jax.typeof(param)} is split. Type the parameter reduced '
      "only where replicated: P('fsdp', reduced={'replica'})."
    )
  partial = _explicit.unreduced(acc)
  if _explicit.unreduced(grad) != partial or not partial <= axes:
    typed = '' if param is None else f' (the parameter is {jax.typeof(param)})'
    raise TypeError(
      f'A gradient is {jax.typeof(grad)}{typed} but its accumulator is '
      f'{jax.typeof(acc)}: the state was built or restored for other types. '
      'Build it with tx.init(params) or tokacc.init_sharded(tx, params, mesh).'
    )


def call_skip_fn(
  should_skip_update_fn: Callable, grads: Any, gradient_step: Any, params: Any
) -> tuple[jax.Array, Any]:
  """Calls ``should_skip_update_fn`` and checks what it returns."""
  result = should_skip_update_fn(grads, gradient_step, params)
  name = 'should_skip_update_fn(grads, step, params)'
  if not (isinstance(result, tuple) and len(result) == 2):
    kinds = 'a pair (should_skip, skip_state), as optax.skip_not_finite gives'
    raise _refuse(name, kinds, type(result).__name__)
  skip, skip_state = result
  fix = ' Reduce it, e.g. with jnp.any(...).'
  _scalar(skip, f'{name}[0]', 'a boolean scalar', (jnp.bool_, jnp.number), fix)
  return jnp.asarray(skip, jnp.bool_), skip_state


def window_norms(value: Any) -> tuple[bool, bool]:
  """``window_norms`` (True, False or ``'per_leaf'``) as the two flags of
  :class:`~optax_tokacc._base.Config`: the global norms, and each leaf's too."""
  if isinstance(value, str) and value == 'per_leaf':
    return True, True
  if isinstance(value, (bool, np.bool_)):
    return bool(value), False
  kinds = "True, False or 'per_leaf'"
  raise _refuse('window_norms', kinds, repr(value), _STATIC)


def axis_name(value: Any) -> None:
  """``axis_name`` must be None, a str or a tuple of str."""
  names = (value,) if isinstance(value, str) else value
  strs = isinstance(names, tuple) and all(isinstance(n, str) for n in names)
  if value is not None and not (strs and names):
    raise _refuse('axis_name', 'a str or a tuple of str', repr(value))


def tokens_per_update(value: Any) -> Optional[int]:
  """``tokens_per_update``: None, or a Python int >= 1."""
  if value is None:
    return None
  return positive_int(value, 'tokens_per_update', 'None or an int >= 1')


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
    raise TypeError('tx.update got value=...: pass the loss as loss= instead.')
  for name, arg in extra.items():
    if name in _OBJECTIVE_FNS or callable(arg):
      raise TypeError(
        f'tx.update got {name}={arg!r}, a function that re-evaluates the '
        'objective; a window has none. Use e.g. optax.lbfgs('
        'linesearch=None) or optax.contrib.sam(..., opaque_mode=False).'
      )


def needs_value_error(error: TypeError) -> Optional[TypeError]:
  """Our error for ``inner`` asking for ``value`` (or an objective function)
  when ``loss`` was not passed; None for an unrelated ``TypeError``."""
  message = str(error)
  if 'value' not in message and not any(n in message for n in _OBJECTIVE_FNS):
    return None
  return TypeError(
    "inner needs value=: pass the micro-batch's loss as loss= to tx.update "
    f'(inner raised: {message}).'
  )
