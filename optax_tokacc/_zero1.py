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
"""The distributed-optimizer (ZeRO-1) placement: sharded optimizer state.

Under explicit sharding, with parameters typed reduced over the data axes
and ``inner``'s parameter-shaped state sharded over some of them
(:func:`optax_tokacc.init_sharded` with ``shard_optimizer_over``), the
window is kept as partial sums, as in DDP, and closed by one reduce-scatter
straight into the optimizer's shards (``lax.psum_scatter`` on each device's
share). ``inner`` runs on the shards, and its updates are all-gathered to
the parameters' type. A window moves the bytes of one all-reduce, and each
device holds 1/N of the optimizer state.
"""

import dataclasses
from typing import Any, Optional

import jax
from jax import lax
from jax.sharding import PartitionSpec as P

from optax_tokacc import _explicit
from optax_tokacc import _partial_sums
from optax_tokacc import _placement
from optax_tokacc import _tokens


def shard_dim(shape: tuple, partitions: tuple, size: int) -> Optional[int]:
  """The dimension a leaf's optimizer state is sharded on: the first one
  that is not already split and that ``size`` divides (None: replicated)."""
  for dim, (length, entry) in enumerate(zip(shape, partitions)):
    if entry is None and length % size == 0 and length >= size:
      return dim
  return None


def shard_spec(x: Any, axes: tuple, mesh: Any, found: Any = None) -> P:
  """The spec of ``x``'s optimizer state, sharded over ``axes`` (``x``'s
  own spec, or ``found``, gives how it is split otherwise)."""
  found = _explicit.spec(x) if found is None else found
  parts = _explicit.partitions(found) if found is not None else ()
  parts += (None,) * (len(x.shape) - len(parts))
  size = 1
  for axis in axes:
    size *= mesh.shape[axis]
  dim = shard_dim(tuple(x.shape), parts, size)
  if dim is None:
    return P(*parts)
  lead = axes[0] if len(axes) == 1 else tuple(axes)
  return P(*parts[:dim], lead, *parts[dim + 1 :])


def sharded_axes(inner_state: Any, axes: frozenset) -> tuple:
  """The data axes some leaf of ``inner``'s state is sharded over."""
  found = set()
  for leaf in jax.tree.leaves(inner_state):
    found |= _explicit.sharded(leaf) & axes
  return tuple(sorted(found))


@dataclasses.dataclass(frozen=True)
class DistributedOptimizer(_partial_sums.PartialSums):
  """Partial sums, reduce-scattered into ``inner``'s shards over
  ``shard_axes`` when the window closes."""

  shard_axes: tuple = ()

  def _spec(self, x: Any) -> P:
    return shard_spec(x, self.shard_axes, self.mesh)

  def _dim(self, spec: P) -> Optional[int]:
    for dim, entry in enumerate(_explicit.partitions(spec)):
      if entry in (self.shard_axes, self.shard_axes[0]):
        return dim
    return None

  def reduce(self, sums, acc_tokens, acc_loss):
    """One reduce-scatter of each leaf of partial sums into its shards (an
    all-reduce for a leaf that no dimension divides), and the scalars in
    one ``psum``."""
    leaves, treedef = jax.tree.flatten(sums)
    plans = [self._plan(leaf) for leaf in leaves]
    axes = tuple(sorted(self.axes))

    def reduce(leaves, acc_tokens, acc_loss):
      out = []
      for leaf, (over, dim, _) in zip(leaves, plans):
        if dim is not None:
          leaf = lax.psum_scatter(
            leaf, self.shard_axes, scatter_dimension=dim, tiled=True
          )
          over = tuple(a for a in over if a not in self.shard_axes)
        out.append(lax.psum(leaf, over) if over else leaf)
      return out, lax.psum((_tokens.to_parts(acc_tokens), acc_loss), axes)

    out_specs = ([spec for _, _, spec in plans], (P(), P()))
    reduced, (parts, loss) = _explicit.local(
      reduce, (leaves, acc_tokens, acc_loss), out_specs
    )
    return _placement.Reduced(treedef.unflatten(reduced), parts, loss)

  def _plan(self, leaf):
    """How a leaf is reduced: the axes it is summed over, the dimension
    its sum is scattered on (None: not scattered), and its spec after."""
    over = tuple(sorted(_explicit.unreduced(leaf)))
    spec = self._spec(leaf)
    dim = self._dim(spec)
    if dim is None or not set(self.shard_axes) <= set(over):
      return over, None, _explicit.spec(leaf, unreduced=False) or P()
    return over, dim, spec

  def for_inner(self, tree):
    """Reduced types dropped, and parameter-shaped leaves that are whole
    sliced to this device's shard (free): what ``inner`` runs on."""

    def shard(x):
      x = _explicit.without_reduced(x)
      if not hasattr(x, 'shape') or _explicit.sharded(x) & set(self.shard_axes):
        return x
      spec = self._spec(x)
      return x if self._dim(spec) is None else jax.reshard(x, spec)

    return jax.tree.map(shard, tree)

  def like(self, tree, reference):
    """Shards all-gathered where ``reference`` is whole, then typed like it."""

    def gather(x, ref):
      if _explicit.sharded(x) & set(self.shard_axes) and not (
        _explicit.sharded(ref) & set(self.shard_axes)
      ):
        x = jax.reshard(x, P(*_explicit.partitions(_explicit.spec(ref))))
      return x

    return _explicit.like(jax.tree.map(gather, tree, reference), reference)
