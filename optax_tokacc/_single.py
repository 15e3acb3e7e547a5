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
from typing import Any, final

import jax
import jax.numpy as jnp

from optax_tokacc import _base
from optax_tokacc import _placement
from optax_tokacc import _tokens
from optax_tokacc import _typed_sharding


@final
class Single(_placement.Placement):
  """Every value is whole: nothing to reduce, no device to ask."""

  def rejected_micro_batch_advances(self) -> bool:
    return False  # one decision: a rejected micro-batch is not a micro-step

  def local_state(self, state: _base.TokenWeightedMultiStepState) -> Any:
    return state

  def global_state(self, state: Any) -> _base.TokenWeightedMultiStepState:
    return state

  def scalar_zeros(self, dtype: Any) -> jax.Array:
    return jnp.zeros([], dtype)

  def share_of(self, x: jax.Array) -> jax.Array:
    return self.summed_now(x)

  def gradient_shares(self, grads: Any) -> Any:
    return grads

  def scale(self, grad: jax.Array, factor: jax.Array) -> jax.Array:
    return grad * factor

  def on_each_device(self, fn: Callable, args: tuple, like: Any) -> Any:
    return jax.tree.map(self.retype_same_values, fn(*args), like)

  def skip_decision(
    self, skip_fn: Callable, grads: Any, gradient_step: Any, params: Any
  ) -> tuple[jax.Array, Any]:
    return _placement.call_skip_fn(skip_fn, grads, gradient_step, params)

  def sum_over_devices(self, fn: Callable, x: jax.Array) -> jax.Array:
    return fn(x)

  def on_any_device(self, flag: jax.Array) -> jax.Array:
    return flag

  def reduce_window(
    self, sums: Any, acc_tokens: jax.Array, acc_loss: jax.Array
  ) -> _base.Reduced:
    return _base.Reduced(sums, _tokens.to_parts(acc_tokens), acc_loss)

  def buffer_holds(self, acc: jax.Array, update: jax.Array) -> bool:
    return _typed_sharding.same_layout(acc, update)  # typed: split alike

  def cond(
    self, pred: jax.Array, true_fn: Callable, false_fn: Callable, *ops: Any
  ) -> Any:
    return jax.lax.cond(pred, true_fn, false_fn, *ops)

  def squares(self, tree: Any, per_leaf: bool = False) -> dict:
    return _placement.typed_squares(tree, per_leaf, on_shares=False)

  def norms(
    self, grads: Any, grad_squares: dict, updates: Any, per_leaf: bool = False
  ) -> _base.Norms:
    return _placement.typed_norms(
      self, grads, grad_squares, updates, per_leaf, on_shares=False
    )
