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
"""The one-program reference of explicit DDP (``ideal_explicit_ddp_one``
of ``run.py``), by hand, on the layout of ``_explicit_methods.py``.

A step compiled once, with the window's close decided on the device, must
apply updates on every call (zeros on the micro-steps that do not close),
a pass over the parameters that the two-program ideal's micro-step does not
run. ``tokacc_explicit_ddp`` is judged against this step.
"""

import functools

import jax
from jax import lax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
import optax

from benchmarks import _explicit_methods as em
from benchmarks import _methods


def _one_program_step(model, adamw, k):
  """The one-program ideal's step: ``(params, opt_state, acc, acc_tokens,
  mini_step, batch) -> the same``, the ideal's add on every call and, in
  a ``lax.cond`` on the window's last micro-step, its window update; the
  updates (zeros on the other micro-steps) applied on every call."""

  def close(params, opt_state, acc, acc_tokens):
    mean = jax.tree.map(
      lambda a, p: em._window_mean(a, acc_tokens, p), acc, params
    )
    updates, opt_state = adamw.update(mean, opt_state, em._plain_tree(params))
    zeros = jax.tree.map(em._unreduced_zeros, params)
    return updates, opt_state, zeros, jnp.zeros_like(acc_tokens)

  def keep(params, opt_state, acc, acc_tokens):
    # Zeros in the dtypes of AdamW's updates (float32 with mu_dtype).
    shapes = jax.eval_shape(close, params, opt_state, acc, acc_tokens)[0]
    zeros = jax.tree.map(
      lambda u, p: jnp.zeros(p.shape, u.dtype, out_sharding=em._spec(p, False)),
      shapes,
      params,
    )
    return zeros, opt_state, acc, acc_tokens

  @functools.partial(jax.jit, donate_argnums=(0, 1, 2, 3))
  def step(params, opt_state, acc, acc_tokens, mini_step, batch):
    grads, num_tokens = jax.grad(model.loss_sum, has_aux=True)(params, batch)
    acc = jax.tree.map(lambda a, g: a + g.astype(a.dtype), acc, grads)
    state = (params, opt_state, acc, acc_tokens + num_tokens)
    updates, opt_state, acc, acc_tokens = lax.cond(
      mini_step == k - 1, close, keep, *state
    )
    updates = jax.tree.map(
      lambda u, p: jax.reshard(u, em._spec(p)), updates, params
    )
    params = optax.apply_updates(params, updates)
    return params, opt_state, acc, acc_tokens, (mini_step + 1) % k

  return step


def ideal_explicit_ddp_one(case):
  """The one-program reference of explicit DDP: what a hand-written step
  that the device closes must run. The ideal's add into the unreduced
  accumulator on every call; on the window's last micro-step, in a
  ``lax.cond``, its update; ``optax.apply_updates`` of the updates (zeros
  on the other micro-steps) on every call, as a one-program step must."""
  model, adamw = case.model, case.adamw
  step = _one_program_step(model, adamw, case.k)
  mesh = em._mesh(case)
  with jax.set_mesh(mesh):
    params, windows = em._place(case, mesh)
    acc = jax.jit(lambda p: jax.tree.map(em._unreduced_zeros, p))(params)
    opt_state = jax.jit(lambda p: adamw.init(em._plain_tree(p)))(params)
    scalar = NamedSharding(mesh, P())
    tokens = jax.device_put(jnp.zeros([], jnp.int32), scalar)
    carry = (params, opt_state, acc, tokens, tokens.copy())
    batch = windows[0].micro_batches[0]
    compiled = step.lower(*carry, batch).compile()

  def call(carry, batch):
    return compiled(*carry, batch)

  trainer = _methods.Trainer(
    em._under_mesh(mesh, call),
    em._under_mesh(mesh, lambda c, window: call(c, window.micro_batches[-1])),
    carry,
    lambda carry: carry[0],
    windows,
    {'step': compiled},
    reference=em.REFERENCE,
  )
  trainer.optimizer_state_of = lambda carry: carry[1]
  return trainer
