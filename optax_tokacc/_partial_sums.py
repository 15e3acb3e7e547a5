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
device's share in a fully manual ``shard_map`` (``_explicit.local``), which
moves no data.
"""

import dataclasses
from typing import Any

import jax
from jax import lax
import jax.numpy as jnp
import optax

from optax_tokacc import _base
from optax_tokacc import _explicit
from optax_tokacc import _placement
from optax_tokacc import _tokens


@dataclasses.dataclass(frozen=True)
class PartialSums(_placement.Single):
  """Shares typed unreduced over ``axes``; one reduction per window.

  ``targets``: per gradient leaf, where the window's reduction scatters it
  (the distributed optimizer's ``_zero1.Target``), or None where it is
  summed whole; empty: every leaf summed whole.
  """

  axes: frozenset
  mesh: Any
  targets: tuple = ()
  on_shares = True

  @classmethod
  def of(cls, axes, params, state) -> 'PartialSums':
    reduced = filter(_explicit.reduced, jax.tree.leaves(params))
    like = next(reduced) if state is None else state.acc_tokens
    return cls(axes, _explicit.mesh_of(like))

  def scalar_zeros(self, dtype):
    spec = jax.P(unreduced=self.axes)
    return _explicit.unreduced_zeros([], dtype, self.mesh, spec)

  def share(self, x):
    """A replicated value is put on one device; one unreduced over other
    axes is summed there."""
    if _explicit.unreduced(x):
      return _explicit.to_type(x, jax.P(unreduced=self.axes))
    return _explicit.on_one_device(x, self.axes, self.mesh)

  def scale(self, grad, factor):
    """An unreduced gradient takes ``factor`` typed reduced (the product is
    then linear in it)."""
    axes = _explicit.unreduced(grad)
    factor = _explicit.to_type(factor, jax.P(reduced=axes)) if axes else factor
    return grad * factor

  def per_device(self, fn, args, like):
    return _explicit.local(fn, args, _explicit.specs(like))

  def judge(self, skip_fn, grads, step, params):
    """Gradients kept as partial sums are judged on every device's share
    and rejected everywhere if any device rejects them: a scalar
    all-reduce per micro-step. That is exact for ``skip_not_finite`` (a sum
    is not finite when a partial sum is not); any other function sees the
    reduced gradients, at the cost of their all-reduce per micro-step."""
    if not any(map(_explicit.unreduced, jax.tree.leaves(grads))):
      return super().judge(skip_fn, grads, step, params)
    params = _explicit.without_reduced(params)
    if skip_fn is not optax.skip_not_finite:
      _placement.warn(
        'should_skip_update_fn sees the gradients reduced, an all-reduce of '
        'the gradients per micro-step under explicit sharding; '
        'tokacc.skip_not_finite decides on partial sums.'
      )
      grads = jax.tree.map(_explicit.reduce_now, grads)
      return super().judge(skip_fn, grads, step, params)
    axes = tuple(sorted(self.axes))

    def decide(*args):  # summed in one psum, bools as any device's
      decision = _placement.call_skip_fn(skip_fn, *args)
      summed = lax.psum(decision, axes)  # bools summed as int32
      return jax.tree.map(
        lambda s, x: s > 0 if x.dtype == jnp.bool_ else s, summed, decision
      )

    return _explicit.local(decide, (grads, step, params), jax.P())

  def total(self, fn, x):
    axes = tuple(sorted(self.axes))
    return _explicit.local(lambda v: lax.psum(fn(v), axes), (x,), jax.P())

  def reduce(self, sums, acc_tokens, acc_loss):
    """On each device's share, each leaf summed over the axes it is
    unreduced over (reduce-scattered into its target, if any: the rest of
    its axes summed after), and the scalars in one ``psum``: one
    all-reduce in data parallelism."""
    leaves, treedef = jax.tree.flatten(sums)
    targets = self.targets or (None,) * len(leaves)
    # the axes to sum over, known from the types here only
    sum_over = [tuple(sorted(_explicit.unreduced(x))) for x in leaves]
    axes = tuple(sorted(self.axes))

    def reduce(leaves, acc_tokens, acc_loss):
      out = []
      for leaf, target, over in zip(leaves, targets, sum_over):
        if target is not None:
          leaf = lax.psum_scatter(
            leaf, target.axes, scatter_dimension=target.dim, tiled=True
          )
          over = tuple(a for a in over if a not in jax.tree.leaves(target.axes))
        out.append(lax.psum(leaf, over) if over else leaf)
      parts, loss = lax.psum((_tokens.to_parts(acc_tokens), acc_loss), axes)
      return _base.Reduced(treedef.unflatten(out), parts, loss)

    specs = [
      _explicit.spec(x, unreduced=False) or jax.P() if t is None else t.spec
      for x, t in zip(leaves, targets)
    ]
    out_specs = _base.Reduced(treedef.unflatten(specs), jax.P(), jax.P())
    return _explicit.local(reduce, (leaves, acc_tokens, acc_loss), out_specs)
