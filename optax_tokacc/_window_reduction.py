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
"""The window's one reduction in a manual region: its sums with its count
and loss, in as few collectives as their axes allow.

Both placements that sum over named axes use it: ``shard_map``'s
(``_manual``) and explicit sharding's, which reduces each device's share in
a ``shard_map`` of its own (``_partial_sums``).
"""

from collections.abc import Callable

import jax
from jax import lax
import jax.numpy as jnp

from optax_tokacc import _tokens

# The largest leaf (bytes on one device) that carries the window's count and
# loss in its reduction (:func:`_summed_with`): the temporary it costs.
CARRIER_BYTES = 2**20


def sum_with_scalars(
  leaves: list,
  over: list[tuple],
  acc_tokens: jax.Array,
  acc_loss: jax.Array,
  axes: tuple,
  can_carry: Callable[[jax.Array], bool] = lambda leaf: True,
) -> tuple[list, jax.Array, jax.Array]:
  """Each of ``leaves`` summed over its axes in ``over``, and the count's
  exact parts (``_tokens.to_parts``) and the loss summed over ``axes``.

  The scalars are summed in the same ``psum`` as the leaves summed over
  the axes :func:`_shared_axes` chooses (HSDP's ``replica``), carried
  inside one of them where ``can_carry`` allows (:func:`_summed_with`),
  then over the rest of ``axes`` (HSDP's ``fsdp``, within each replica):
  what crosses the chosen axes is one all-reduce, which XLA:TPU left as
  two (the sums with the count, and the loss alone) when the scalars were
  summed over every axis at once.
  """
  over = [tuple(sorted(o)) for o in over]
  axes = tuple(sorted(axes))
  shared = _shared_axes(over, axes)
  chosen = [i for i, o in enumerate(over) if o == shared]
  sums, packed = _summed_with(
    [leaves[i] for i in chosen], _packed(acc_tokens, acc_loss), shared,
    can_carry,
  )  # fmt: skip
  out = list(leaves)
  for i, leaf in zip(chosen, sums):
    out[i] = leaf
  for i, o in enumerate(over):
    if o and o != shared:
      out[i] = lax.psum(out[i], o)
  rest = tuple(a for a in axes if a not in shared)
  if rest:
    # After every reduction of the window: XLA:TPU (v6e) otherwise combined
    # this psum with the micro-step's gradient reduction over the same axes,
    # which then ran between, and split, the all-reduces across `shared`.
    out, packed = lax.optimization_barrier((out, packed))
    packed = lax.psum(packed, rest)
  parts, loss = _unpacked(packed)
  return out, parts, loss


def _shared_axes(over: list[tuple], axes: tuple) -> tuple:
  """The axes the scalars are summed over last, with the leaves summed
  over them: ``axes`` themselves where some leaf is summed over all of
  them (nothing to sum first), else those over which the most leaves are
  summed; ``axes`` where no leaf is summed over a subset of them (FSDP:
  the scalars alone)."""
  counts = {o: over.count(o) for o in over if o and set(o) <= set(axes)}
  if not counts:
    return axes
  return max(counts, key=lambda o: (o == axes, counts[o], o))


def _summed_with(
  sums: list, packed: tuple, axes: tuple, can_carry: Callable
) -> tuple[list, tuple]:
  """``sums`` and the ``packed`` scalars (:func:`_packed`) summed over
  ``axes`` in one ``psum``.

  JAX lowers each operand of a ``psum`` to an all-reduce of its own, which
  XLA may or may not combine (XLA:TPU did not, across two slices, for a
  1024 x 1024 leaf and the scalars). Where the scalars are one vector of a
  leaf's dtype they travel inside the smallest such leaf, flattened: what
  crosses ``axes`` is then the leaves' reduction alone. The copy that
  flattening makes is a temporary of that leaf's size, so only a leaf of
  at most :data:`CARRIER_BYTES` carries them (a bias, a norm's scale, a
  shard); beside larger leaves only, the scalars rely on XLA's combining
  (which XLA:GPU, and XLA:TPU within a slice, do in every program of the
  accelerator tier: ``tests/accelerators``)."""
  fits = [
    i
    for i, x in enumerate(sums)
    if len(packed) == 1
    and x.dtype == packed[0].dtype
    and x.size * x.dtype.itemsize <= CARRIER_BYTES
    and can_carry(x)
  ]
  if not fits:
    return lax.psum((sums, packed), axes)
  carrier = min(fits, key=lambda i: sums[i].size)
  leaf = sums[carrier]
  flat = jnp.concatenate([jnp.ravel(leaf), packed[0]])
  sums = [*sums[:carrier], flat, *sums[carrier + 1 :]]
  sums = lax.psum(sums, axes)
  flat = sums[carrier]
  sums[carrier] = jnp.reshape(flat[: leaf.size], leaf.shape)
  return sums, (flat[leaf.size :],)


def _packed(acc_tokens: jax.Array, acc_loss: jax.Array) -> tuple:
  """The window's count parts and loss as the reduction's operands: one
  vector where their dtypes agree (the count's parts are float32 for an
  int32 counter, as the loss), else the two."""
  parts = _tokens.to_parts(acc_tokens)
  if parts.dtype == acc_loss.dtype:
    return (jnp.concatenate([parts, acc_loss[None]]),)
  return (parts, acc_loss)


def _unpacked(packed: tuple) -> tuple[jax.Array, jax.Array]:
  """The count parts and the loss of :func:`_packed`'s operands."""
  if len(packed) == 1:
    return packed[0][:-1], packed[0][-1]
  return packed
