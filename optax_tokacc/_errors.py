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
"""The house style of an error: one sentence that names the argument and
echoes the bad value, then the fix where it is not obvious (as optax's
``reduce_on_plateau``: "Factor must be in the range (0, 1), got factor =
..."); and of a warning (:func:`warn`), raised at the user's line."""

import sys
from typing import Any
import warnings

import jax
import jax.numpy as jnp
import numpy as np

# The fix for a static argument that optax.inject_hyperparams made an array.
STATIC_ARG_FIX = ' With optax.inject_hyperparams, list it in static_args.'
_LIBRARIES = ('optax_tokacc', 'optax', 'flax')  # frames warn() skips


def refuse(
  name: str, kinds: str, got: Any, fix: str = '', error: type = TypeError
) -> Exception:
  """The error for a bad ``name``: "``name`` must be ``kinds``; got
  ``got``." and, where it is not obvious, the ``fix``."""
  return error(f'{name} must be {kinds}; got {got}.{fix}')


def typed(value: Any) -> str:
  """``value`` and its type, as an error echoes it."""
  return f'{value!r} of type {type(value).__name__}'


def check_scalar(
  value: Any,
  name: str,
  kinds: str,
  dtypes: tuple,
  fix: str = '',
  error: type = ValueError,
) -> None:
  """Checks that ``value`` (what ``name`` holds) is a scalar of one of
  ``dtypes``; ``kinds`` says so in words, and ``error`` is raised for a
  wrong shape (a wrong kind is a ``TypeError``)."""
  number = (int, float, np.number, np.bool_, np.ndarray, jax.Array)  # No str.
  dtype = jnp.result_type(value) if isinstance(value, number) else None
  if dtype is None or not any(jnp.issubdtype(dtype, d) for d in dtypes):
    raise refuse(name, kinds, typed(value), fix)
  if jnp.shape(value) != ():
    raise refuse(name, kinds, f'shape {jnp.shape(value)}', fix, error)


def warn(message: str) -> None:
  """Warns at the line that calls into the libraries (``tx.update`` in the
  user's step), however deep in optax or Flax the transform is nested."""
  frame, level = sys._getframe(1), 2
  while frame.f_globals.get('__name__', '').split('.')[0] in _LIBRARIES:
    frame, level = frame.f_back, level + 1
  warnings.warn(f'token_weighted_multistep: {message}', stacklevel=level)
