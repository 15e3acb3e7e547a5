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
"""The Flax methods of ``run.py``: the linen ``TrainState`` and the nnx
``Optimizer`` of ``optax_tokacc.flax``, each in a user's jitted step."""

import functools

from flax import nnx
import jax

from benchmarks import trainers
import optax_tokacc as tokacc
from optax_tokacc.flax import Optimizer
from optax_tokacc.flax import TrainState


def tokacc_flax(case):
  """``optax_tokacc.flax.TrainState.apply_gradients`` (Flax linen)."""
  model = case.model

  @functools.partial(jax.jit, donate_argnums=(0,))
  def step(state, batch):
    grads, num_tokens = jax.grad(model.loss_sum, has_aux=True)(
      state.params, batch
    )
    return state.apply_gradients(grads=grads, num_tokens=num_tokens)

  state = TrainState.create(
    apply_fn=None,
    params=trainers.copy(model.params),
    tx=tokacc.token_weighted_multistep(case.adamw, case.k),
  )
  compiled = {'step': step.lower(state, model.windows[0][0]).compile()}
  return trainers.per_micro_batch(
    step, state, compiled, trainers.windows_of(model), lambda s: s.params
  )


class _Weights(nnx.Module):
  """The model's parameters as ``nnx.Param`` s, in its own tree."""

  def __init__(self, params):
    self.params = nnx.data(jax.tree.map(nnx.Param, params))

  def values(self):
    """The parameters' arrays, in the model's tree."""
    return jax.tree.map(
      lambda v: v[...],
      self.params,
      is_leaf=lambda x: isinstance(x, nnx.Variable),
    )


def tokacc_nnx(case):
  """``optax_tokacc.flax.Optimizer.update`` (Flax nnx), in the functional
  form Flax recommends for speed: ``nnx.split`` once, ``jax.jit`` a step
  that merges, updates and returns the state (donated)."""
  model = case.model
  weights = _Weights(trainers.copy(model.params))
  tx = tokacc.token_weighted_multistep(case.adamw, case.k)
  optimizer = Optimizer(weights, tx, wrt=nnx.Param)
  graphdef, state = nnx.split((weights, optimizer))

  @functools.partial(jax.jit, donate_argnums=(0,))
  def step(state, batch):
    weights, optimizer = nnx.merge(graphdef, state)

    def loss_sum(weights):
      return model.loss_sum(weights.values(), batch)

    grads, num_tokens = nnx.grad(loss_sum, has_aux=True)(weights)
    optimizer.update(weights, grads, num_tokens=num_tokens)
    return nnx.state((weights, optimizer))

  compiled = {'step': step.lower(state, model.windows[0][0]).compile()}
  return trainers.per_micro_batch(
    step,
    state,
    compiled,
    trainers.windows_of(model),
    lambda state: nnx.merge(graphdef, state)[0].values(),
  )
