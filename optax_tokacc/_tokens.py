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
"""Exact token counting: valid counts, sums that never wrap, and carriers.

A count is held in ``token_dtype``: int32 (the default) or float32 or
float64 for fractional weights (:func:`honoured_range`). Every invalid
count becomes -1, and a window holding -1 is dropped when it closes:
nothing is rounded, wrapped or clipped silently.
"""

import jax
import jax.numpy as jnp

INVALID = -1

# Bits per part of an integer count carried through a float32 ``psum``:
# 3 parts of 11 bits cover int32, and their sums over up to 2**13 devices
# stay below 2**24, the float32 range of exact integers.
_PART_BITS = 11
_MASK = (1 << _PART_BITS) - 1


def honoured_range(token_dtype: jax.typing.DTypeLike) -> tuple[float, float]:
  """The weights and window totals a floating ``token_dtype`` honours,
  besides 0: from its smallest normal number to that number's reciprocal
  (2**-126 to 2**126 in float32, 2**-1022 to 2**1022 in float64), where a
  total and the reciprocal the window's sums are multiplied by are both
  normal: XLA flushes subnormal numbers to zero on a CPU (a TPU has
  none), and the reciprocal of a total above the range is subnormal."""
  smallest = float(jnp.finfo(token_dtype).tiny)
  return smallest, 1 / smallest  # powers of two: both exact


def as_count(
  num_tokens: jax.typing.ArrayLike, token_dtype: jax.typing.DTypeLike
) -> jax.Array:
  """``num_tokens`` in ``token_dtype``, or -1 if it is not a valid count.

  Under an integer ``token_dtype`` a valid count is a whole number in
  ``[0, max]``, given as an integer or as a float holding a whole number
  (``mask.sum()`` of a float 0/1 mask). Under a floating one it is 0 or,
  once in ``token_dtype``, at least the start of :func:`honoured_range`:
  not negative, NaN, nor a weight that underflows in ``token_dtype`` (one
  above the range drops its window when it closes, and an infinite one
  when it is added). A subnormal ``num_tokens`` is below the range, or 0
  where a comparison reads it so: XLA on a CPU flushes subnormal numbers
  to zero, and whether a comparison sees one as 0 is its compiler's
  choice (it rewrites tests of a float's bits into comparisons, and back).
  """
  value = jnp.asarray(num_tokens)
  if not jnp.issubdtype(token_dtype, jnp.integer):
    count = value.astype(token_dtype)
    valid = (count >= honoured_range(token_dtype)[0]) | (value == 0)
    return jnp.where(valid, count, INVALID)
  valid = value >= 0
  top = jnp.iinfo(token_dtype).max
  if not jnp.issubdtype(value.dtype, jnp.integer):
    # 2**31 is exact in float32, 2**31 - 1 is not.
    valid = valid & (value < float(top) + 1.0) & (value == jnp.floor(value))
  elif jnp.iinfo(value.dtype).max > top:
    valid = jnp.logical_and(valid, value <= top)
  safe = jnp.where(valid, value, 0).astype(token_dtype)
  return jnp.where(valid, safe, jnp.asarray(INVALID, token_dtype))


def add(total: jax.Array, count: jax.Array) -> jax.Array:
  """``total + count``, or -1 if either is invalid or the sum overflows."""
  new_total = total + count
  # Two int32 counts >= 0 overflow (wrap) to a negative sum.
  integer = jnp.issubdtype(total.dtype, jnp.integer)
  fits = new_total >= 0 if integer else jnp.isfinite(new_total)
  valid = (total >= 0) & (count >= 0) & fits
  return jnp.where(valid, new_total, jnp.asarray(INVALID, total.dtype))


def to_parts(count: jax.Array) -> jax.Array:
  """A count as parts whose sum over devices is exact.

  The last part counts invalid devices. Integers are split into 11-bit
  float32 parts (exact for up to 2**13 devices); floats are carried as
  they are, in their own dtype (float64 stays float64).
  """
  parts, dtype = [jnp.maximum(count, 0)], count.dtype
  if jnp.issubdtype(count.dtype, jnp.integer):
    parts = [(parts[0] >> (_PART_BITS * i)) & _MASK for i in range(3)]
    dtype = jnp.float32
  return jnp.stack([p.astype(dtype) for p in [*parts, count < 0]])


def from_parts(
  parts: jax.Array, token_dtype: jax.typing.DTypeLike
) -> tuple[jax.Array, jax.Array]:
  """The total count of summed :func:`to_parts`, and whether it is valid."""
  no_invalid = parts[-1] == 0
  if not jnp.issubdtype(token_dtype, jnp.integer):
    total = parts[0].astype(token_dtype)
    # A sum of valid weights is 0 or at least the range's start; above its
    # end (an overflow to inf included) it is not honoured.
    honoured = total <= honoured_range(token_dtype)[1]
    return total, jnp.logical_and(no_invalid, honoured)
  # Carry each part's excess bits into the next (sums stay below 2**25).
  low, mid, high = (parts[i].astype(jnp.int32) for i in range(3))
  mid = mid + (low >> _PART_BITS)
  high = high + (mid >> _PART_BITS)
  fits = high <= (jnp.iinfo(token_dtype).max >> (2 * _PART_BITS))
  high = jnp.where(fits, high, 0)
  total = (low & _MASK) | (mid & _MASK) << _PART_BITS | high << 2 * _PART_BITS
  return total.astype(token_dtype), jnp.logical_and(no_invalid, fits)


def divisor(total: jax.Array) -> jax.Array:
  """What a window's sums are divided by: its total count, or 1 where it
  has none (and emits nothing)."""
  if jnp.issubdtype(total.dtype, jnp.integer):
    return jnp.maximum(total, 1)  # an integer total > 0 is at least 1
  return jnp.where(total > 0, total, jnp.ones_like(total))
