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
"""The placement under explicit sharding: the window as partial sums.

Under ``jax.jit`` on an explicit mesh, parameters typed reduced over the
data axes (``jax.P(reduced={'data'})``) get *unreduced* gradients: each
device's partial sum, which no collective has summed yet. The window keeps
them so: its sums, count and loss are typed unreduced across micro-steps and
reduced once, when it closes. JAX defines only linear operations on
unreduced values, so what is not linear (validating a count, Kahan
summation, a skip decision, splitting a count into exact parts) runs on each
device's share in a fully manual ``shard_map`` (``_typed_sharding.local``), which
moves no data.
"""

from collections.abc import Callable
import dataclasses
from typing import Optional, final

import jax
from jax import lax
import jax.numpy as jnp
import optax

from optax_tokacc import _base
from optax_tokacc import _errors
from optax_tokacc import _inputs
from optax_tokacc import _layouts
from optax_tokacc import _norms
from optax_tokacc import _optimizer_shards
from optax_tokacc import _placement
from optax_tokacc import _typed_sharding
from optax_tokacc import _typing
from optax_tokacc import _window_reduction


@final
@dataclasses.dataclass(frozen=True)
class PartialSums(_placement.Placement):
  """Shares typed unreduced over ``axes``; one reduction per window.

  ``targets``: per gradient leaf, the shards of ``inner``'s state its
  window is reduce-scattered into (``_optimizer_shards.ShardTarget``), or
  None where it is summed whole; empty: every leaf summed whole.

  It does as whole values do where ``jax.jit``'s one program makes a value
  the same everywhere: the state is the shares (its types say
  which are partial sums), the gradients arrive as partial sums or whole,
  ``emit_now`` and the skip decision (:meth:`skip_decision`) are every
  device's, so a rejected micro-batch is no micro-step.
  """

  axes: frozenset
  mesh: _typed_sharding.MeshLike
  targets: tuple = ()

  @classmethod
  def of(
    cls,
    config: _base.Config,
    axes: frozenset,
    params: Optional[_typing.Params],
    state: Optional[_base.TokenWeightedMultiStepState] = None,
    grads: Optional[_typing.Updates] = None,
  ) -> 'PartialSums':
    """The placement of ``init`` (from the parameters' types) or of
    ``update`` (from the state's, and the shards of ``inner``'s state)."""
    if state is None:
      mesh = _typed_sharding.mesh_of(
        next(filter(_typed_sharding.reduced, jax.tree.leaves(params)))
      )
      return cls(axes, mesh)
    targets = _optimizer_shards.shard_targets(
      config.inner, state.inner_state, grads, axes
    )
    return cls(axes, _typed_sharding.mesh_of(state.acc_tokens), targets)

  def scalar_zeros(self, dtype: jax.typing.DTypeLike) -> jax.Array:
    spec = jax.P(unreduced=self.axes)
    return _typed_sharding.unreduced_zeros([], dtype, self.mesh, spec)

  def share_of(self, x: jax.Array) -> jax.Array:
    """A replicated value is put on one device; one unreduced over other
    axes is summed there."""
    if _typed_sharding.unreduced(x):
      return _typed_sharding.to_type(x, jax.P(unreduced=self.axes))
    return _typed_sharding.on_one_device(x, self.axes, self.mesh)

  def scale(self, grad: jax.Array, factor: jax.Array) -> jax.Array:
    """An unreduced gradient takes ``factor`` typed reduced (the product is
    then linear in it)."""
    axes = _typed_sharding.unreduced(grad)
    if axes:
      factor = _typed_sharding.to_type(factor, jax.P(reduced=axes))
    return grad * factor

  def on_each_device(
    self, fn: Callable, args: tuple, like: _typing.ArrayTree
  ) -> _typing.ArrayTree:
    return _typed_sharding.local(fn, args, _typed_sharding.type_specs(like))

  def skip_decision(
    self,
    skip_fn: Callable,
    grads: _typing.Updates,
    gradient_step: jax.Array,
    params: Optional[_typing.Params],
  ) -> tuple[jax.Array, _typing.ArrayTree]:
    """Gradients kept as partial sums are judged on every device's share
    and rejected everywhere if any device rejects them: a scalar
    all-reduce per micro-step. That is exact for ``skip_not_finite`` (a sum
    is not finite when a partial sum is not); any other function sees the
    reduced gradients, at the cost of their all-reduce per micro-step."""
    call = _inputs.call_skip_fn
    if not any(map(_typed_sharding.unreduced, jax.tree.leaves(grads))):
      return call(skip_fn, grads, gradient_step, params)
    params = _typed_sharding.without_reduced(params)
    if skip_fn is not optax.skip_not_finite:
      _errors.warn(
        'should_skip_update_fn sees the gradients reduced, an all-reduce of '
        'the gradients per micro-step under explicit sharding; '
        'tokacc.skip_not_finite decides on partial sums.'
      )
      grads = jax.tree.map(_typed_sharding.reduce_now, grads)
      return call(skip_fn, grads, gradient_step, params)
    axes = tuple(sorted(self.axes))

    def decide(*args):  # summed in one psum, bools as any device's
      decision = call(skip_fn, *args)
      summed = lax.psum(decision, axes)  # bools summed as int32
      return jax.tree.map(
        lambda s, x: s > 0 if x.dtype == jnp.bool_ else s, summed, decision
      )

    return _typed_sharding.local(
      decide, (grads, gradient_step, params), jax.P()
    )

  def sum_over_devices(self, fn: Callable, x: jax.Array) -> jax.Array:
    axes = tuple(sorted(self.axes))
    return _typed_sharding.local(lambda v: lax.psum(fn(v), axes), (x,), jax.P())

  def reduce_window(
    self, sums: _typing.Updates, acc_tokens: jax.Array, acc_loss: jax.Array
  ) -> _base.Reduced:
    """On each device's share, each leaf summed over the axes it is
    unreduced over (reduce-scattered into its target, if any: the rest of
    its axes summed after), the scalars with them
    (``_window_reduction.sum_with_scalars``)."""
    leaves, treedef = jax.tree.flatten(sums)
    targets = self.targets or (None,) * len(leaves)
    # the axes to sum over, known from the types here only
    sum_over = [_typed_sharding.unreduced(x) for x in leaves]

    def reduce(leaves, acc_tokens, acc_loss):
      out, rest = [], []
      for leaf, target, over in zip(leaves, targets, sum_over):
        if target is not None:
          leaf = lax.psum_scatter(
            leaf, target.axes, scatter_dimension=target.dim, tiled=True
          )
          over = tuple(a for a in over if a not in jax.tree.leaves(target.axes))
        out.append(leaf)
        rest.append(over)
      out, parts, loss = _window_reduction.sum_with_scalars(
        out, rest, acc_tokens, acc_loss, self.axes
      )
      return _base.Reduced(treedef.unflatten(out), parts, loss)

    specs = [_reduced_spec(x, t) for x, t in zip(leaves, targets)]
    out_specs = _base.Reduced(treedef.unflatten(specs), jax.P(), jax.P())
    return _typed_sharding.local(
      reduce, (leaves, acc_tokens, acc_loss), out_specs
    )

  def reduced_types(self, grads: _typing.Updates) -> _typing.Updates:
    """Whole where summed whole, else the shards of the target."""
    leaves, treedef = jax.tree.flatten(grads)
    targets = self.targets or (None,) * len(leaves)
    return treedef.unflatten(
      self.summed_now(x)
      if t is None
      else jax.reshard(self.summed_now(x), t.spec)
      for x, t in zip(leaves, targets)
    )

  def refusal_of(
    self, error: Exception, runs_on: Callable[[_placement.Placement], bool]
  ) -> Optional[Exception]:
    """``inner`` failing on the shards of its state, where it runs on the
    whole gradients (tried, not read from ``error``)."""
    if not self.targets or not runs_on(dataclasses.replace(self, targets=())):
      return None
    return ValueError(
      'inner cannot run on the shards of its state (shard_optimizer_over): it'
      ' needs whole gradients, as the orthogonalization of optax.contrib.muon'
      f' does. Leave shard_optimizer_over out. (inner raised: {error})'
    )

  def typed_like(
    self, tree: _typing.ArrayTree, reference: _typing.ArrayTree
  ) -> _typing.ArrayTree:
    """Shards all-gathered where ``reference`` is whole (the updates of
    ``inner``'s shards), then typed like it."""

    def gather(x, ref):
      is_shard = bool(_typed_sharding.sharded(x) & self.axes)
      ref_is_shard = bool(_typed_sharding.sharded(ref) & self.axes)
      if not is_shard or ref_is_shard:
        return x
      return jax.reshard(
        x, jax.P(*_typed_sharding.partitions(_typed_sharding.spec(ref)))
      )

    return _typed_sharding.like(
      jax.tree.map(gather, tree, reference), reference
    )

  def rejected_micro_batch_advances(self) -> bool:
    return False  # every device's decision: a rejected one is no micro-step

  @property
  def layout(self) -> _layouts.Layout:
    return _layouts.Typed()

  def gradient_shares(self, grads: _typing.Updates) -> _typing.Updates:
    return grads  # partial sums, or whole

  def on_any_device(self, flag: jax.Array) -> jax.Array:
    return flag  # one program: the same everywhere

  def buffer_holds(self, acc: jax.Array, update: jax.Array) -> bool:
    """Where they are typed alike (split alike)."""
    return _typed_sharding.same_layout(acc, update)

  def buffer_is_the_updates(self) -> bool:
    return False  # the buffer is typed unreduced: each device's share

  def cond(
    self,
    pred: jax.Array,
    true_fn: Callable,
    false_fn: Callable,
    *ops: Optional[_typing.ArrayTree],
  ) -> _typing.ArrayTree:
    return lax.cond(pred, true_fn, false_fn, *ops)

  def loop_if(
    self, pred: jax.Array, fn: Callable, values: _typing.ArrayTree
  ) -> _typing.ArrayTree:
    return _placement.flag_loop(pred, fn, values)

  def squares(self, trees: tuple, per_leaf: bool = False) -> tuple[dict, ...]:
    """Summed in a manual region whatever JAX defers: the shares are
    typed as partial sums (``_norms.typed_split_axes``)."""
    return _norms.typed_squares(trees, per_leaf, True)

  def norms(
    self,
    grads: _typing.Updates,
    updates: _typing.Updates,
    squares: tuple[dict, dict],
    per_leaf: bool = False,
  ) -> _norms.Norms:
    return _norms.typed_norms(
      self.on_each_device, grads, updates, squares, True
    )


def _reduced_spec(
  leaf: jax.Array, target: Optional[_optimizer_shards.ShardTarget]
) -> jax.P:
  """The spec of a window's sums once reduced: the target's shards, else
  the leaf's own spec without its unreduced axes."""
  if target is not None:
    return target.spec
  return _typed_sharding.spec(leaf, unreduced=False) or jax.P()
