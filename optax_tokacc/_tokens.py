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

A count is held in ``token_dtype``: int32 (the default) or a floating dtype
for fractional weights. Every invalid count
becomes -1, and a window holding -1 is dropped when it closes: nothing is
rounded, wrapped or clipped silently.
"""

import jax
import jax.numpy as jnp

INVALID = -1

# Bits per part of an integer count carried through a float32 ``psum``:
# 3 parts of 11 bits cover int32, and their sums over up to 2**13 devices
# stay below 2**24, the float32 range of exact integers.
_PART_BITS = 11
_MASK = (1 << _PART_BITS) - 1


def as_count(
  num_tokens: jax.typing.ArrayLike, token_dtype: jax.typing.DTypeLike
) -> jax.Array:
  """``num_tokens`` in ``token_dtype``, or -1 if it is not a valid count.

  Under an integer ``token_dtype`` a valid count is a whole number in
  ``[0, max]``, given as an integer or as a float holding a whole number
  (``mask.sum()`` of a float 0/1 mask). Under a floating one it is a finite
  number >= 0.
  """
  value = jnp.asarray(num_tokens)
  valid = value >= 0
  if not jnp.issubdtype(token_dtype, jnp.integer):
    valid = jnp.logical_and(valid, jnp.isfinite(value))
    return jnp.where(valid, value.astype(token_dtype), INVALID)
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
  """A count as float32 parts whose sum over devices is exact.

  The last part counts invalid devices. Integers are split into 11-bit
  parts (exact for up to 2**13 devices); floats are carried as they are.
  """
  parts = [jnp.maximum(count, 0)]
  if jnp.issubdtype(count.dtype, jnp.integer):
    parts = [(parts[0] >> (_PART_BITS * i)) & _MASK for i in range(3)]
  return jnp.stack([p.astype(jnp.float32) for p in [*parts, count < 0]])


def from_parts(
  parts: jax.Array, token_dtype: jax.typing.DTypeLike
) -> tuple[jax.Array, jax.Array]:
  """The total count of summed :func:`to_parts`, and whether it is valid."""
  no_invalid = parts[-1] == 0
  if not jnp.issubdtype(token_dtype, jnp.integer):
    total = parts[0].astype(token_dtype)
    return total, jnp.logical_and(no_invalid, jnp.isfinite(total))
  # Carry each part's excess bits into the next (sums stay below 2**25).
  low, mid, high = (parts[i].astype(jnp.int32) for i in range(3))
  mid = mid + (low >> _PART_BITS)
  high = high + (mid >> _PART_BITS)
  fits = high <= (jnp.iinfo(token_dtype).max >> (2 * _PART_BITS))
  high = jnp.where(fits, high, 0)
  total = (low & _MASK) | (mid & _MASK) << _PART_BITS | high << 2 * _PART_BITS
  return total.astype(token_dtype), jnp.logical_and(no_invalid, fits)
