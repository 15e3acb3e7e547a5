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
"""The constructor's arguments, checked and made a :class:`~optax_tokacc._base.Config`.

Each check raises one error that names the argument and echoes the bad
value (``_errors``), when ``token_weighted_multistep`` is called.
"""

from collections.abc import Callable
from typing import Any, Optional, Union

import jax
import jax.numpy as jnp
import numpy as np
import optax

from optax_tokacc import _base
from optax_tokacc import _errors
from optax_tokacc import _norms


def make(
  *,
  inner: optax.GradientTransformation,
  every_k_schedule: Union[int, optax.Schedule],
  axis_name: Optional[_base.AxisName],
  loss_reduction: str,
  accumulator_dtype: Optional[jax.typing.DTypeLike],
  compensated: bool,
  should_skip_update_fn: Optional[optax.ShouldSkipUpdateFunction],
  token_dtype: Optional[jax.typing.DTypeLike],
  tokens_per_update: Optional[Union[int, float]],
  window_norms: Union[bool, str],
) -> _base.Config:
  """The configuration of ``token_weighted_multistep``'s arguments, each
  checked and canonicalized (the annotations say what the user means to
  pass; each argument is checked, whatever it is)."""
  check_options(inner, should_skip_update_fn, loss_reduction)
  check_axis_name(axis_name)
  norms, leaf_norms = _norms.parse(window_norms)
  counts = dtype(token_dtype, 'token_dtype')
  return _base.Config(
    inner=optax.with_extra_args_support(inner),
    schedule=schedule(every_k_schedule),
    axis_name=axis_name,
    mean_loss=loss_reduction == 'mean',
    accumulator_dtype=dtype(accumulator_dtype, 'accumulator_dtype'),
    compensated=flag(compensated, 'compensated'),
    should_skip_update_fn=should_skip_update_fn,
    token_dtype=counts,
    tokens_per_update=check_tokens_per_update(tokens_per_update, counts),
    norms=norms,
    leaf_norms=leaf_norms,
  )


_REDUCTIONS = ('sum', 'mean')


def check_options(
  inner: Any, should_skip_update_fn: Any, loss_reduction: Any
) -> None:
  """Checks the constructor's non-dtype arguments (bools: :func:`flag`)."""
  if not isinstance(inner, optax.GradientTransformation):
    kinds = 'an optax.GradientTransformation such as optax.adam(1e-3)'
    raise _errors.refuse('inner', kinds, repr(inner))
  if should_skip_update_fn is not None and not callable(should_skip_update_fn):
    kinds = 'None or a function such as tokacc.skip_not_finite'
    raise _errors.refuse(
      'should_skip_update_fn', kinds, repr(should_skip_update_fn)
    )
  if loss_reduction not in _REDUCTIONS:
    kinds = f'one of {_REDUCTIONS}'
    raise _errors.refuse(
      'loss_reduction', kinds, repr(loss_reduction), '', ValueError
    )


def flag(value: Any, name: str) -> bool:
  """``name``'s ``value``, a Python or NumPy bool, as a Python bool."""
  if not isinstance(value, (bool, np.bool_)):
    raise _errors.refuse(
      name, 'True or False', repr(value), _errors.STATIC_ARG_FIX
    )
  return bool(value)


def positive_int(value: Any, name: str, kinds: str) -> int:
  """``value``, a Python or NumPy int >= 1 (not a bool), as an int.

  ``kinds`` says what ``name`` must be, for the error.
  """
  if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
    raise _errors.refuse(name, kinds, _errors.typed(value))
  if value < 1:
    raise _errors.refuse(name, '>= 1', f'{name}={value}', error=ValueError)
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
  exact counts, or float32 or float64 for fractional weights: float64 is
  float32 without ``jax_enable_x64``, as everywhere in JAX), checked and
  canonicalized."""
  counts = name == 'token_dtype'
  if value is None:
    return jnp.dtype(jnp.int32) if counts else None
  if counts:
    kinds = 'int32, float32 or float64'
  else:
    kinds = (
      'a floating dtype, or None for the gradient dtype (at least float32)'
    )
  try:
    found = jnp.dtype(value)
  except TypeError as e:
    raise _errors.refuse(
      name, kinds, repr(value), _errors.STATIC_ARG_FIX
    ) from e
  if not (jnp.issubdtype(found, jnp.floating) or counts and found == jnp.int32):
    raise _errors.refuse(name, kinds, found)
  if counts and found.itemsize < 4:
    raise _errors.refuse(name, kinds, found, _narrow_count_fix(found))
  return jax.dtypes.canonicalize_dtype(found)


def _narrow_count_fix(found: jnp.dtype) -> str:
  """Why a floating ``token_dtype`` narrower than float32 is refused, and
  what to pass instead."""
  bits = jnp.finfo(found).nmant + 1
  return (
    f' A sum of {found} weights keeps {bits} significant bits (whole counts'
    f' above {2**bits} are rounded): set token_dtype=jnp.float32'
    f' (num_tokens may stay {found}).'
  )


def check_axis_name(value: Any) -> None:
  """``axis_name`` must be None, a str or a tuple of str."""
  names = (value,) if isinstance(value, str) else value
  strs = isinstance(names, tuple) and all(isinstance(n, str) for n in names)
  if value is not None and not (strs and names):
    raise _errors.refuse('axis_name', 'a str or a tuple of str', repr(value))


def check_tokens_per_update(
  value: Any, token_dtype: jnp.dtype
) -> Optional[Union[int, float]]:
  """``tokens_per_update``: None, or a Python int >= 1; with a floating
  ``token_dtype``, a budget in the weights' units: any finite real > 0."""
  name = 'tokens_per_update'
  if value is None:
    return None
  if not jnp.issubdtype(token_dtype, jnp.floating):
    return positive_int(value, name, 'None or an int >= 1')
  real = isinstance(value, (int, float, np.integer, np.floating))
  if isinstance(value, bool) or not real:
    kinds = f'None or a real number > 0 (token_dtype={token_dtype.name})'
    raise _errors.refuse(name, kinds, _errors.typed(value))
  if not 0 < value < float('inf'):
    raise _errors.refuse(
      name, 'a finite number > 0', f'{name}={value}', error=ValueError
    )
  return float(value)
