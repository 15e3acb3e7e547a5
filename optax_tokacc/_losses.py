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
"""Token-summed losses that report how many tokens they count.

:func:`token_cross_entropy` returns ``(loss_sum, num_tokens)``: the
cross-entropy summed over the counted (non-padding) tokens, in at least
float32, and their count, which is exactly what
:func:`optax_tokacc.token_weighted_multistep` takes. Built on
``optax.losses``.
"""

from typing import Any, Optional, Union

import jax
import jax.numpy as jnp
import optax


def token_cross_entropy(
  logits: jax.typing.ArrayLike,
  labels: jax.typing.ArrayLike,
  *,
  where: Optional[jax.typing.ArrayLike] = None,
  ignore_index: Optional[int] = -100,
  out_sharding: Optional[Any] = None,
) -> tuple[jax.Array, jax.Array]:
  r"""Token-summed softmax cross-entropy and the number of counted tokens.

  With the weight :math:`w_i = \text{where}_i \, [y_i \neq
  \text{ignore\_index}]` of position :math:`i` (:math:`\text{where}_i = 1`
  when ``where`` is None, and a bool mask counts as 0/1),

  .. math::

    L = \sum_i w_i \left(\log \sum_v e^{x_{iv}} - x_{i y_i}\right),
    \qquad N = \sum_i w_i,

  so :math:`L / N` is the (weighted) token-mean loss, and ``(L, N)`` is what
  :func:`optax_tokacc.token_weighted_multistep` expects: the gradient of
  ``L`` and ``num_tokens=N``. The per-token loss is
  ``optax.losses.softmax_cross_entropy_with_integer_labels``, computed in at
  least float32 (bfloat16 logits are upcast). Ignored labels are replaced by
  0 before the loss and masked out after, so values like -100 never index
  the vocabulary.

  ``where`` is a mask or T5X/Flax-style token weights, and its dtype decides
  the count's: a bool mask or integer weights give an exact int32 count; a
  floating ``where`` is used as weights, never rounded to a mask, and gives
  a floating count (the sum of the weights). Fractional weights need
  ``token_weighted_multistep(..., token_dtype=jnp.float32)``: its default
  int32 counter counts a floating count exactly when it holds a whole
  number (a 0/1 float mask), and drops a window with a fractional one.

  Args:
    logits: unnormalized log-probabilities of shape ``[..., vocab]``.
    labels: integer class indices of shape ``logits.shape[:-1]``.
    where: optional mask or non-negative weights of shape ``labels.shape``:
      bool (only positions where it is true count), integer or floating
      (each position's loss is multiplied by its weight, and the position
      counts as that many tokens).
    ignore_index: label value of positions that do not count (padding);
      None means every label counts.
    out_sharding: the type of both sums on an explicit mesh, as for
      ``jnp.einsum``: e.g. ``jax.P(unreduced={'data'})`` for a batch split
      over ``data`` keeps them per-device partial sums (no collective; what
      :func:`optax_tokacc.token_weighted_multistep` takes under explicit
      sharding). None: replicated sums (a scalar all-reduce each).

  Returns:
    ``(loss_sum, num_tokens)``: the summed loss (at least float32) and the
    number of counted positions, or the sum of their weights: int32 unless
    ``where`` is floating, then ``where``'s dtype promoted to at least
    float32.

  Example:
    >>> import jax.numpy as jnp
    >>> import optax_tokacc as tokacc
    >>> logits = jnp.zeros((1, 3, 4))  # uniform over a vocabulary of 4
    >>> labels = jnp.array([[2, 1, -100]])  # the last position is padding
    >>> loss_sum, num_tokens = tokacc.token_cross_entropy(logits, labels)
    >>> num_tokens
    Array(2, dtype=int32)
    >>> loss_sum / num_tokens  # log(4)
    Array(1.3862944, dtype=float32)
    >>> weights = jnp.array([[1.0, 0.5, 1.0]])  # the padding still counts 0
    >>> loss_sum, num_tokens = tokacc.token_cross_entropy(
    ...   logits, labels, where=weights
    ... )
    >>> num_tokens
    Array(1.5, dtype=float32)
    >>> loss_sum / num_tokens
    Array(1.3862944, dtype=float32)
  """
  logits, labels = jnp.asarray(logits), jnp.asarray(labels)
  where = jnp.asarray(jnp.ones(labels.shape, bool) if where is None else where)
  # shapes and dtypes, checked at trace time
  if logits.ndim < 1:
    raise ValueError(
      f'logits must have a trailing vocabulary axis; got shape {logits.shape}.'
    )
  if not jnp.issubdtype(logits.dtype, jnp.floating):
    raise TypeError(f'logits must be floating point; got dtype {logits.dtype}.')
  if labels.shape != logits.shape[:-1]:
    raise ValueError(
      f'labels must have the shape {logits.shape[:-1]} of logits without the '
      f'vocabulary axis; got {labels.shape}. For next-token prediction '
      'shift first, e.g. logits[:, :-1] with labels tokens[:, 1:].'
    )
  if not jnp.issubdtype(labels.dtype, jnp.integer):
    raise TypeError(
      f'labels must be integer class indices; got dtype {labels.dtype}. '
      'For one-hot targets use optax.losses.softmax_cross_entropy.'
    )
  if where.shape != labels.shape:
    raise ValueError(
      f'where must have the shape {labels.shape} of labels; got {where.shape}.'
    )
  real = (jnp.bool_, jnp.integer, jnp.floating)
  if not any(jnp.issubdtype(where.dtype, kind) for kind in real):
    raise TypeError(
      f'where must be a bool mask or real token weights; got {where.dtype}.'
    )

  # int32 for a bool mask or integer weights (an exact count); floating
  # weights keep their dtype, promoted to at least float32.
  floating = jnp.issubdtype(where.dtype, jnp.floating)
  dtype = jnp.promote_types(where.dtype, jnp.float32) if floating else jnp.int32
  weights = where.astype(dtype)
  if ignore_index is not None:
    weights = jnp.where(labels != ignore_index, weights, 0)
  counted = weights != 0
  labels = jnp.where(counted, labels, jnp.zeros_like(labels))  # in range
  logits = logits.astype(jnp.promote_types(logits.dtype, jnp.float32))
  nll = optax.losses.softmax_cross_entropy_with_integer_labels(logits, labels)
  weighted = jnp.where(counted, nll * weights.astype(logits.dtype), 0)
  return _sum(weighted, out_sharding), _sum(weights, out_sharding)


def _sum(
  x: jax.Array, out_sharding: Optional[Union[jax.sharding.Sharding, jax.P]]
) -> jax.Array:
  """``jnp.sum(x)``, typed by ``out_sharding`` (None: replicated)."""
  return jax.lax.reduce_sum(x, range(x.ndim), out_sharding=out_sharding)
