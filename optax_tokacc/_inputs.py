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
"""The arguments of ``tx.update``, checked at trace time.

Each check raises one error that names the argument and echoes the bad
value (``_errors``); what cannot be known at trace time (a traced count)
is handled by the token rules of ``_tokens``.
"""

from collections.abc import Callable
from typing import Any, Optional

import jax
import jax.numpy as jnp
import numpy as np

from optax_tokacc import _base
from optax_tokacc import _errors
from optax_tokacc import _tokens
from optax_tokacc import _typing

_REAL = (jnp.integer, jnp.floating)  # The dtypes of a real scalar.


def num_tokens(value: Any, dtype: jnp.dtype) -> None:
  """Checks ``num_tokens`` at trace time (kind, shape, concrete range)."""
  if value is None:
    raise TypeError(
      'num_tokens is required: tx.update(grads, state, params, num_tokens=n).'
    )
  kinds = "a real scalar (this device's counted tokens of this micro-batch)"
  fix = ' Sum a mask: num_tokens=mask.sum().'
  _errors.check_scalar(value, 'num_tokens', kinds, _REAL, fix)
  if isinstance(value, jax.core.Tracer):
    return
  count = np.asarray(value).item()
  got = f'num_tokens={count}'
  if not 0 <= count < np.inf:  # Also NaN.
    raise _errors.refuse(
      'num_tokens', 'a finite count >= 0', got, error=ValueError
    )
  integer = jnp.issubdtype(dtype, jnp.integer)
  if integer and (count != int(count) or count > jnp.iinfo(dtype).max):
    kinds = f'a whole number that fits the {dtype} token counter'
    fix = ' For fractional counts, set token_dtype=jnp.float32.'
    raise _errors.refuse('num_tokens', kinds, got, fix, ValueError)
  if not integer:
    _honoured_weight(count, got, dtype)


def _honoured_weight(count: float, got: str, dtype: jnp.dtype) -> None:
  """A concrete weight under a floating counter: 0, or in the range it
  honours (``_tokens.honoured_range``; a traced one: ``_tokens.as_count``)."""
  smallest, largest = _tokens.honoured_range(dtype)
  if count != 0 and not smallest <= count <= largest:
    exponent = int(np.log2(largest))
    kinds = f'0 or a {dtype} number from 2**-{exponent} to 2**{exponent}'
    fix = ' Scale every weight by one factor: the weighted mean is the same.'
    raise _errors.refuse('num_tokens', kinds, got, fix, ValueError)


def emit_now(value: Any) -> Optional[jax.Array]:
  """``emit_now`` as a boolean scalar, or None when statically False."""
  if isinstance(value, (bool, np.bool_)) and not value:
    return None
  _errors.check_scalar(value, 'emit_now', 'a boolean scalar', (jnp.bool_,))
  return jnp.asarray(value, jnp.bool_)


def close(
  value: Any, emit_now: Optional[jax.Array], tokens_per_update: Optional[int]
) -> None:
  """``close``: None (the device decides), or a Python bool (the host)."""
  if value is None:
    return
  if not isinstance(value, bool):  # Also a traced value.
    kinds = 'None or a Python bool, not traced (on the device, pass emit_now)'
    raise _errors.refuse('close', kinds, f'close={value!r}')
  if tokens_per_update is not None or emit_now is not None:
    if tokens_per_update is None:
      other = 'emit_now'
    else:
      other = f'tokens_per_update={tokens_per_update}'
    raise ValueError(f'close={value} and {other} both decide when: drop one.')


def loss(value: Any) -> None:
  """Checks ``loss``: None, or a real scalar."""
  if value is not None:
    _errors.check_scalar(
      value, 'loss', "a real scalar (this micro-batch's loss)", _REAL
    )


def state_type(state: Any) -> None:
  """``state`` must be the transform's own state."""
  if not isinstance(state, _base.TokenWeightedMultiStepState):
    kinds = 'the TokenWeightedMultiStepState of tx.init'
    fix = " With optax.chain, pass the chain's state."
    raise _errors.refuse('state', kinds, type(state).__name__, fix)


def tree(
  grads: _typing.Updates, reference: Optional[_typing.ArrayTree], what: str
) -> None:
  """``grads`` must have the tree structure of ``reference`` (None: any)."""
  expected = jax.tree.structure(reference)
  if reference is not None and jax.tree.structure(grads) != expected:
    raise ValueError(
      f'The gradient tree does not match {what}: got '
      f'{jax.tree.structure(grads)}, expected {expected}.'
    )


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


def needs_value_error(error: TypeError) -> TypeError:
  """Our error for ``inner``, which raised ``error`` without ``value`` and
  runs with it, when ``loss`` was not passed."""
  return TypeError(
    "inner needs value=: pass the micro-batch's loss as loss= to tx.update "
    f'(inner raised: {error}).'
  )


def call_skip_fn(
  should_skip_update_fn: Callable,
  grads: _typing.Updates,
  gradient_step: jax.Array,
  params: Optional[_typing.Params],
) -> tuple[jax.Array, _typing.ArrayTree]:
  """Calls ``should_skip_update_fn`` and checks what it returns."""
  result = should_skip_update_fn(grads, gradient_step, params)
  name = 'should_skip_update_fn(grads, step, params)'
  if not (isinstance(result, tuple) and len(result) == 2):
    kinds = 'a pair (should_skip, skip_state), as optax.skip_not_finite gives'
    raise _errors.refuse(name, kinds, type(result).__name__)
  skip, skip_state = result
  fix = ' Reduce it, e.g. with jnp.any(...).'
  _errors.check_scalar(
    skip, f'{name}[0]', 'a boolean scalar', (jnp.bool_, jnp.number), fix
  )
  return jnp.asarray(skip, jnp.bool_), skip_state
