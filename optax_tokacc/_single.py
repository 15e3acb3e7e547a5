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

from typing import final

import jax

from optax_tokacc import _base
from optax_tokacc import _placement
from optax_tokacc import _tokens
from optax_tokacc import _typing


@final
class Single(_placement.Placement):
  """Every value is whole: nothing to reduce, no device to ask (the
  interface's defaults)."""

  def share_of(self, x: jax.Array) -> jax.Array:
    return self.summed_now(x)

  def reduce_window(
    self, sums: _typing.Updates, acc_tokens: jax.Array, acc_loss: jax.Array
  ) -> _base.Reduced:
    return _base.Reduced(sums, _tokens.to_parts(acc_tokens), acc_loss)
