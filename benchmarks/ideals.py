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
"""The hand-written references: what each method is judged against.

- ``ideal`` and ``ideal_explicit_ddp``: two programs. A jitted micro-step
  adds the gradients into a float32 accumulator (donated; unreduced under
  explicit DDP, so no collective); once per window a jitted update takes
  the token mean (one all-reduce under explicit DDP), handed to AdamW in
  the gradients' dtype, as ``token_weighted_multistep`` does.
- ``ideal_explicit_ddp_one``: one program, what a hand-written step that
  the device closes must run: the same add and, in a ``lax.cond`` on the
  window's last micro-step, the same update, with ``optax.apply_updates``
  of its updates (zeros on the other micro-steps) on every call.
- ``ideal_explicit_zero1``: the micro-step of ``ideal_explicit_ddp``; once
  per window one ``shard_map`` region (``check_vma=False``):
  ``lax.psum_scatter`` of the accumulator into shards, AdamW on the shards
  with moments sharded over ``data`` (first dimension), ``lax.all_gather``
  of the updates.
- :func:`full_batch`: ``collectives.py``'s check, single-device full-batch
  AdamW on each window's token-mean loss.
"""

import functools

import jax
from jax import lax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P
import numpy as np
import optax

from benchmarks import models
from benchmarks import trainers


def micro_step(model: models.Model):
  """The ideal's jitted micro-step: ``acc + grad`` (accumulator donated)."""

  @functools.partial(jax.jit, donate_argnums=(1, 2))
  def step(params, acc, acc_tokens, batch):
    grads, num_tokens = jax.grad(model.loss_sum, has_aux=True)(params, batch)
    acc = jax.tree.map(lambda a, g: a + g.astype(a.dtype), acc, grads)
    return acc, acc_tokens + num_tokens

  return step


def _mean(layout, acc, acc_tokens, param):
  """The token mean of a window's sum, in ``param``'s dtype."""
  total = layout.whole(acc)
  return (total / acc_tokens.astype(total.dtype)).astype(param.dtype)


def _sum_zeros(layout, params):
  return jax.tree.map(layout.sum_zeros, params)


def _start(case, layout, init_state):
  """``(carry, windows)`` placed on ``layout``: ``carry`` is ``(params,
  opt_state, acc, acc_tokens)``, ``init_state`` lays AdamW's state out."""
  params, windows = layout.place(case.model)
  acc = jax.jit(functools.partial(_sum_zeros, layout))(params)
  opt_state = jax.jit(init_state)(params)
  return (params, opt_state, acc, layout.scalar_zero()), windows


def _trainer(case, layout, window_update, init_state, reference):
  """A two-program ideal: :func:`micro_step` on every micro-batch, then
  ``window_update(params, opt_state, acc, acc_tokens)`` once per window."""
  add = micro_step(case.model)
  with layout.context():
    carry, windows = _start(case, layout, init_state)
    params, _, acc, acc_tokens = carry
    batch = windows[0].micro_batches[0]
    compiled = {
      'micro_step': add.lower(params, acc, acc_tokens, batch).compile(),
      'window_update': window_update.lower(*carry).compile(),
    }
  add, window_update = layout.on_mesh(add), layout.on_mesh(window_update)

  def step(carry, batch):
    params, opt_state, acc, acc_tokens = carry
    return (params, opt_state, *add(params, acc, acc_tokens, batch))

  def closing_step(carry, window):
    return window_update(*step(carry, window.micro_batches[-1]))

  state_of = None if layout.mesh is None else (lambda carry: carry[1])
  return trainers.Trainer(
    step,
    closing_step,
    carry,
    lambda carry: carry[0],
    windows,
    compiled,
    reference=reference,
    optimizer_state_of=state_of,
  )


def window_update(adamw: optax.GradientTransformation, layout):
  """The ideal's jitted window update on ``layout``: ``(params,
  opt_state, acc, acc_tokens) -> the same``, AdamW on the token mean,
  the sums restarted (all donated)."""

  @functools.partial(jax.jit, donate_argnums=(0, 1, 2, 3))
  def update(params, opt_state, acc, acc_tokens):
    mean = jax.tree.map(
      lambda a, p: _mean(layout, a, acc_tokens, p), acc, params
    )
    whole = jax.tree.map(layout.whole, params)
    updates, opt_state = adamw.update(mean, opt_state, whole)
    updates = jax.tree.map(layout.typed_like, updates, params)
    params = optax.apply_updates(params, updates)
    zeros = _sum_zeros(layout, params)
    return params, opt_state, zeros, jnp.zeros_like(acc_tokens)

  return update


def _two_programs(case, layout, reference):
  def init_state(params):
    return case.adamw.init(jax.tree.map(layout.whole, params))

  update = window_update(case.adamw, layout)
  return _trainer(case, layout, update, init_state, reference)


def ideal(case: trainers.Case) -> trainers.Trainer:
  """The reference of the one-device methods (two programs)."""
  return _two_programs(case, trainers.OneDevice(), 'ideal')


def ideal_explicit_ddp(case: trainers.Case) -> trainers.Trainer:
  """The two-program reference of explicit DDP: AdamW runs on the whole
  (not reduced) mean and parameters; its updates are typed back reduced."""
  layout = trainers.explicit_data(case)
  return _two_programs(case, layout, 'ideal_explicit_ddp')


def _one_program_step(case, layout):
  """``(params, opt_state, acc, acc_tokens, mini_step, batch) -> the
  same``: the ideal's add on every call and, in a ``lax.cond`` on the
  window's last micro-step, its window update; the updates (zeros on the
  other micro-steps) applied on every call."""
  model, adamw, k = case.model, case.adamw, case.k

  def close(params, opt_state, acc, acc_tokens):
    mean = jax.tree.map(
      lambda a, p: _mean(layout, a, acc_tokens, p), acc, params
    )
    whole = jax.tree.map(layout.whole, params)
    updates, opt_state = adamw.update(mean, opt_state, whole)
    zeros = _sum_zeros(layout, params)
    return updates, opt_state, zeros, jnp.zeros_like(acc_tokens)

  def keep(params, opt_state, acc, acc_tokens):
    # Zeros in the dtypes of AdamW's updates (float32 with mu_dtype).
    shapes = jax.eval_shape(close, params, opt_state, acc, acc_tokens)[0]
    zeros = jax.tree.map(
      lambda u, p: jnp.zeros(
        p.shape, u.dtype, out_sharding=trainers.spec(p, False)
      ),
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
    updates = jax.tree.map(layout.typed_like, updates, params)
    params = optax.apply_updates(params, updates)
    return params, opt_state, acc, acc_tokens, (mini_step + 1) % k

  return step


def ideal_explicit_ddp_one(case: trainers.Case) -> trainers.Trainer:
  """The one-program reference of explicit DDP (judged against the
  two-program one; ``tokacc_explicit_ddp`` is judged against it)."""
  layout = trainers.explicit_data(case)
  step = _one_program_step(case, layout)

  def init_state(params):
    return case.adamw.init(jax.tree.map(layout.whole, params))

  with layout.context():
    carry, windows = _start(case, layout, init_state)
    carry = (*carry, carry[3].copy())  # and the micro-step's index
    compiled = step.lower(*carry, windows[0].micro_batches[0]).compile()

  def call(carry, batch):
    return compiled(*carry, batch)

  return trainers.Trainer(
    layout.on_mesh(call),
    layout.on_mesh(lambda c, window: call(c, window.micro_batches[-1])),
    carry,
    lambda carry: carry[0],
    windows,
    {'step': compiled},
    reference='ideal_explicit_ddp',
    optimizer_state_of=lambda carry: carry[1],
  )


def _shard_dim(x, size):
  """The dimension of ``x`` its optimizer state is split on over ``size``
  devices: the first, if ``size`` divides it (else None: whole)."""
  return 0 if x.ndim and x.shape[0] % size == 0 else None


def _shard_spec(x, size):
  dim = _shard_dim(x, size)
  return P(*(None,) * x.ndim) if dim is None else P('data', *(None,) * dim)


def _zero1_update(adamw, size):
  """``(params, opt_state, acc, acc_tokens) -> (params, opt_state)`` on
  each device's share (a ``shard_map`` body): the window reduce-scattered
  into shards, AdamW on the shards, its updates all-gathered and applied."""

  def scatter(acc, param):
    dim = _shard_dim(param, size)
    if dim is None:
      return lax.psum(acc, 'data')
    return lax.psum_scatter(acc, 'data', scatter_dimension=dim, tiled=True)

  def shard(param):  # this device's slice of a whole (replicated) value
    dim = _shard_dim(param, size)
    if dim is None:
      return param
    length = param.shape[dim] // size
    start = lax.axis_index('data') * length
    return lax.dynamic_slice_in_dim(param, start, length, dim)

  def gather(update, param):
    dim = _shard_dim(param, size)
    if dim is None:
      return update
    return lax.all_gather(update, 'data', axis=dim, tiled=True)

  def update(params, opt_state, acc, acc_tokens):
    summed = jax.tree.map(scatter, acc, params)
    mean = jax.tree.map(
      lambda g, p: (g / acc_tokens.astype(g.dtype)).astype(p.dtype),
      summed,
      params,
    )
    shards = jax.tree.map(shard, params)
    updates, opt_state = adamw.update(mean, opt_state, shards)
    updates = jax.tree.map(gather, updates, params)
    return optax.apply_updates(params, updates), opt_state

  return update


def ideal_explicit_zero1(case: trainers.Case) -> trainers.Trainer:
  """The reference of explicit ZeRO-1 (two programs)."""
  layout = trainers.explicit_data(case)
  mesh = layout.mesh
  size = mesh.shape['data']

  def specs(tree):
    return jax.tree.map(trainers.spec, tree)

  @functools.partial(jax.jit, donate_argnums=(0, 1, 2, 3))
  def window_update(params, opt_state, acc, acc_tokens):
    if size == 1:  # a partial sum over one device is the sum (and JAX
      # 0.10.2 cannot lower unreduced specs over a size-1 axis)
      acc = jax.tree.map(layout.whole, acc)
    state_specs = (specs(params), specs(opt_state))
    params, opt_state = jax.shard_map(
      _zero1_update(case.adamw, size),
      mesh=mesh,
      in_specs=(*state_specs, specs(acc), P()),
      out_specs=state_specs,
      check_vma=False,
    )(params, opt_state, acc, acc_tokens)
    zeros = _sum_zeros(layout, params)
    return params, opt_state, zeros, jnp.zeros_like(acc_tokens)

  def init_state(params):
    shards = jax.tree.map(
      lambda x: jax.reshard(x, _shard_spec(x, size)), params
    )
    return case.adamw.init(shards)

  return _trainer(
    case, layout, window_update, init_state, 'ideal_explicit_zero1'
  )


def full_batch(params, windows, learning_rate):
  """``models.small_params`` after single-device full-batch AdamW on each
  window's token-mean loss (``collectives.py``'s check)."""
  optimizer = optax.adamw(learning_rate)

  @jax.jit
  def step(params, opt_state, batch):
    grads, num_tokens = jax.grad(models.small_loss_sum, has_aux=True)(
      params, batch
    )
    grads = jax.tree.map(lambda g: g / num_tokens, grads)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state

  params = jax.tree.map(jnp.asarray, params)
  opt_state = optimizer.init(params)
  for window in windows:
    batch = jax.tree.map(lambda *xs: np.concatenate(xs), *window)
    params, opt_state = step(params, opt_state, batch)
  return params
