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
"""The placement where every value is whole: nothing to reduce.

One device, or global arrays under ``jax.jit``, where the compiler reduces
the gradients before they arrive (GSPMD, and explicit meshes whose
parameters are not typed reduced). Values may carry types of sharding;
they are kept as they come.
"""

from collections.abc import Callable
from typing import Optional, final

import jax
import jax.numpy as jnp

from optax_tokacc import _base
from optax_tokacc import _inputs
from optax_tokacc import _layouts
from optax_tokacc import _norms
from optax_tokacc import _placement
from optax_tokacc import _tokens
from optax_tokacc import _typed_sharding
from optax_tokacc import _typing


@final
class Single(_placement.Placement):
  """Every value is whole: nothing to reduce, no device to ask."""

  def share_of(self, x: jax.Array) -> jax.Array:
    return self.summed_now(x)

  def reduce_window(
    self, sums: _typing.Updates, acc_tokens: jax.Array, acc_loss: jax.Array
  ) -> _base.Reduced:
    return _base.Reduced(sums, _tokens.to_parts(acc_tokens), acc_loss)

  def rejected_micro_batch_advances(self) -> bool:
    return False  # one decision: a rejected micro-batch is no micro-step

  @property
  def layout(self) -> _layouts.Layout:
    return _layouts.Typed()

  def scalar_zeros(self, dtype: jax.typing.DTypeLike) -> jax.Array:
    return jnp.zeros([], dtype)

  def gradient_shares(self, grads: _typing.Updates) -> _typing.Updates:
    return grads

  def scale(self, grad: jax.Array, factor: jax.Array) -> jax.Array:
    return grad * factor

  def on_each_device(
    self, fn: Callable, args: tuple, like: _typing.ArrayTree
  ) -> _typing.ArrayTree:
    return jax.tree.map(self.retype_same_values, fn(*args), like)

  def skip_decision(
    self,
    skip_fn: Callable,
    grads: _typing.Updates,
    gradient_step: jax.Array,
    params: Optional[_typing.Params],
  ) -> tuple[jax.Array, _typing.ArrayTree]:
    return _inputs.call_skip_fn(skip_fn, grads, gradient_step, params)

  def sum_over_devices(self, fn: Callable, x: jax.Array) -> jax.Array:
    return fn(x)

  def on_any_device(self, flag: jax.Array) -> jax.Array:
    return flag

  def buffer_holds(self, acc: jax.Array, update: jax.Array) -> bool:
    """Where they are typed alike (split alike)."""
    return _typed_sharding.same_layout(acc, update)

  def buffer_is_the_updates(self) -> bool:
    return True  # the state returned is the trace's

  def cond(
    self,
    pred: jax.Array,
    true_fn: Callable,
    false_fn: Callable,
    *ops: Optional[_typing.ArrayTree],
  ) -> _typing.ArrayTree:
    return jax.lax.cond(pred, true_fn, false_fn, *ops)

  def loop_if(
    self, pred: jax.Array, fn: Callable, values: _typing.ArrayTree
  ) -> _typing.ArrayTree:
    return _placement.flag_loop(pred, fn, values)

  def squares(self, trees: tuple, per_leaf: bool = False) -> tuple[dict, ...]:
    return _norms.typed_squares(trees, per_leaf, False)

  def norms(
    self,
    grads: _typing.Updates,
    updates: _typing.Updates,
    squares: tuple[dict, dict],
    per_leaf: bool = False,
  ) -> _norms.Norms:
    return _norms.typed_norms(
      self.on_each_device, grads, updates, squares, False
    )

  def reduced_types(self, grads: _typing.Updates) -> _typing.Updates:
    return jax.tree.map(self.summed_now, grads)

  def refusal_of(
    self, error: Exception, runs_on: Callable[[_placement.Placement], bool]
  ) -> Optional[Exception]:
    del error, runs_on
    return None

  def typed_like(
    self, tree: _typing.ArrayTree, reference: _typing.ArrayTree
  ) -> _typing.ArrayTree:
    return _typed_sharding.like(tree, reference)
