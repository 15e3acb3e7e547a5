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
"""Accumulation into the window's sums: plain, or Kahan-compensated.

A micro-step only adds; the window's sums are zeroed where it closes
(never multiplied by zero, so nothing of a finished window leaks into the
next). With
``compensated=True`` the rounding error of every addition is kept and added
back (TwoSum in at least float32), so that a low-precision accumulator keeps
about twice its precision over long windows.

**The rule: a rounding the arithmetic relies on is forced, never assumed.**
TwoSum's error term is exact only if the new total it starts from is
really rounded to the accumulator's dtype. A round trip through ``astype``
(float32 -> bfloat16 -> float32) does not force it: a compiler that keeps
excess precision removes the pair (XLA:GPU's ``SimplifyFPConversions``,
on under its default ``xla_allow_excess_precision``), the total stays
unrounded and the error term is 0, silently. :func:`rounded` rounds with
``lax.reduce_precision``, which compilers keep (JAX's own remat relies on
it against excess precision), and gives the bits ``astype`` gives.
``tests/test_compensated.py`` checks the compiled programs hold it.
"""

from typing import Optional

import jax
from jax import lax
import jax.numpy as jnp
import optax

from optax_tokacc import _base
from optax_tokacc import _typing


def rounded(value: jax.Array, dtype: jax.typing.DTypeLike) -> jax.Array:
  """``value`` rounded to ``dtype``, kept in its own (wider) dtype: the
  bits of ``value.astype(dtype).astype(value.dtype)``, in a form no
  compiler removes (see the module's rule).

  ``lax.reduce_precision`` rounds to nearest even, as ``astype`` does, but
  flushes to zero what would be subnormal in ``dtype``: where ``dtype``
  has fewer exponent bits than ``value`` (float16 from float32), that
  range is rounded here to ``dtype``'s subnormal spacing instead, by
  arithmetic (a scaling by a power of two and ``round``), exact.
  """
  info = jnp.finfo(dtype)
  if jnp.dtype(dtype) == value.dtype:
    return value
  normal = lax.reduce_precision(value, info.nexp, info.nmant)
  if info.nexp >= jnp.finfo(value.dtype).nexp:  # bfloat16 from float32
    return normal
  spacing = jnp.asarray(info.smallest_subnormal, value.dtype)
  subnormal = jnp.round(value / spacing) * spacing
  is_subnormal = jnp.abs(value) < jnp.asarray(info.smallest_normal, value.dtype)
  return jnp.where(is_subnormal, subnormal, normal)


# The platforms where TwoSum's new error is computed before its new total
# (:func:`_compensated_add`).
ERROR_FIRST_ON = ('cpu',)


def _compensated_add(
  total: jax.Array, error: jax.Array, value: jax.Array
) -> tuple[jax.Array, jax.Array]:
  """Kahan-compensated ``total + value``: the new total and its error.

  The arithmetic runs in at least float32 (explicitly, not relying on excess
  precision); the new total is rounded to the accumulator dtype, forced
  (:func:`rounded`), and its exact rounding error (TwoSum) is kept, to be
  added back at the next step.

  On the CPU (:data:`ERROR_FIRST_ON`) in order: the widened addend written
  once, the error, then the total. XLA:CPU computes the two in two
  fusions; where each read the total and the compensation, neither could
  be written over the buffer it replaces, and the state's were copied.
  """

  def two_sum(total, value):
    total_wide = total.astype(value.dtype)
    new_wide = rounded(total_wide + value, total.dtype)
    virtual = new_wide - total_wide
    new_error = (total_wide - (new_wide - virtual)) + (value - virtual)
    return new_wide.astype(total.dtype), new_error.astype(total.dtype)  # exact

  def error_first(total, value):
    value = lax.optimization_barrier(value)
    _, new_error = two_sum(total, value)
    new_error, total, value = lax.optimization_barrier(
      (new_error, total, value)
    )
    new_total, _ = two_sum(total, value)
    return new_total, new_error

  value = _wide_sum(value, error)
  branches = dict.fromkeys(ERROR_FIRST_ON, error_first)
  return jax.lax.platform_dependent(total, value, **branches, default=two_sum)


def accumulate(
  sums: tuple[_typing.Updates, _typing.Updates],
  addends: _typing.Updates,
  compensated: bool,
) -> tuple[_typing.Updates, _typing.Updates]:
  """Adds ``addends`` into the window's ``sums``, the pair ``(grad_sums,
  acc_compensation)``, and returns the new pair.

  Only an add: the window restarts before it (``_window.restart_if``),
  not here, so that the add is the ideal's (on a GPU the compiler fuses it
  into the gradient's producers; a restart select on the way would keep it
  out). ``acc_compensation`` is ``()`` when summation is not compensated.
  """
  grad_sums, acc_compensation = sums
  if not compensated:
    addends = optax.tree.cast_like(addends, grad_sums)
    return jax.tree.map(jnp.add, grad_sums, addends), ()
  added = jax.tree.map(_compensated_add, grad_sums, acc_compensation, addends)
  return jax.tree.transpose(jax.tree.structure(grad_sums), None, added)


def window_sums(window: _base.Window, compensated: bool) -> _typing.Updates:
  """The window's sums (``_base.Window``): with compensation, ``total +
  error`` in >= float32."""
  if not compensated:
    return window.grad_sums
  return jax.tree.map(_wide_sum, window.grad_sums, window.acc_compensation)


def _wide_sum(x: jax.Array, error: jax.Array) -> jax.Array:
  """``x + error`` in at least float32 (``error`` has the accumulator's
  dtype, as the total it compensates)."""
  wide = jnp.promote_types(error.dtype, jnp.float32)
  return x.astype(wide) + error.astype(wide)


def merge_rows(
  grad_rows: jax.Array, error_rows: Optional[jax.Array]
) -> tuple[jax.Array, Optional[jax.Array]]:
  """Several windows' sums of one leaf, stacked on the leading axis (the
  shares of a window's devices), merged into one: their total, and with
  compensation its rounding error (``error_rows`` None without).

  With compensation the shares and their errors are added in turn by
  :func:`_compensated_add`, so that no error term is lost; without, they
  are summed in at least float32 and rounded once to the accumulator's
  dtype.
  """
  if error_rows is None:
    wide = jnp.promote_types(grad_rows.dtype, jnp.float32)
    return jnp.sum(grad_rows.astype(wide), axis=0).astype(grad_rows.dtype), None
  total, error = grad_rows[0], error_rows[0]
  for row in range(1, grad_rows.shape[0]):
    total, error = _compensated_add(total, error, grad_rows[row])
    total, error = _compensated_add(total, error, error_rows[row])
  return total, error
