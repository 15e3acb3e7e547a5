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
"""The explicit DDP and ZeRO-1 methods of ``run.py``: plain ``jax.jit``
under ``jax.set_mesh`` on an explicit ``data`` mesh (``case.ddp_devices``).

Parameters are placed typed reduced over ``data`` with their full spec
(``P(None, None, reduced={'data'})``), micro-batches sharded over ``data``;
the gradients of such parameters are unreduced.

- ``tokacc_explicit_ddp``: a user's step, ``token_weighted_multistep(adamw,
  k)`` with no ``axis_name``, ``optax.apply_updates``.
- ``tokacc_explicit_ddp_host``: the same closed by the host
  (``close=False`` on the micro-steps, ``close=True`` on the k-th: two
  programs, no conditional).
- ``ideal_explicit_ddp``: the two-program reference, written by hand: the
  micro-step adds the unreduced gradients into an unreduced float32
  accumulator (no collective), the window's update reduces it (one
  all-reduce) and runs AdamW on the token mean. The host-closed method is
  judged against it.
- ``ideal_explicit_ddp_one``: the one-program reference, by hand: the same
  add and, in a ``lax.cond`` on the window's last micro-step, the same
  update, with ``optax.apply_updates`` of the updates (zeros on the other
  micro-steps) on every call, as any step compiled once must.
  ``tokacc_explicit_ddp`` (the device decides) is judged against it; its
  own ratio is to the two-program reference.
- ``tokacc_explicit_zero1``: ``tokacc_explicit_ddp`` with AdamW's state
  sharded over ``data`` (``init_sharded(..., shard_optimizer_over=
  ('data',))``, the distributed-optimizer layout).
- ``ideal_explicit_zero1``: its reference, by hand: the micro-step of
  ``ideal_explicit_ddp``; once per window one ``shard_map`` region
  (``check_vma=False``) reduce-scatters the accumulator into shards
  (``lax.psum_scatter``), runs AdamW on them with moments sharded over
  ``data`` on the leaf's first dimension, and all-gathers the updates.

The ratios of each ``tokacc_explicit_*`` are to its ``ideal_explicit_*``:
``tokacc_explicit_ddp`` to ``ideal_explicit_ddp_one``, the others to a
two-program ideal.
Models whose loss cannot take reduced parameters (``model.explicit`` false:
the transformer) are skipped.
"""

import functools

import jax
from jax import lax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
import optax

from benchmarks import _methods
import optax_tokacc as tokacc

REFERENCE = 'ideal_explicit_ddp'
# The reference of the one program that the device closes.
ONE_PROGRAM_REFERENCE = 'ideal_explicit_ddp_one'
ZERO1_REFERENCE = 'ideal_explicit_zero1'


def _mesh(case):
  devices = case.ddp_devices or jax.devices()[:1]
  return jax.make_mesh(
    (len(devices),),
    ('data',),
    axis_types=(jax.sharding.AxisType.Explicit,),
    devices=devices,
  )


def _place(case, mesh):
  """The parameters typed reduced over ``data``, and the windows."""

  def reduced(x):
    spec = P(*(None,) * x.ndim, reduced={'data'})
    return jax.device_put(x.copy(), NamedSharding(mesh, spec))

  rows = NamedSharding(mesh, P('data'))
  params = jax.tree.map(reduced, case.model.params)
  windows = _methods.windows_of(case.model, lambda b: jax.device_put(b, rows))
  return params, windows


def _under_mesh(mesh, call):
  """``call`` run under ``jax.set_mesh(mesh)``, as it was traced."""

  def on_mesh(*args):
    with jax.set_mesh(mesh):
      return call(*args)

  return on_mesh


def _tokacc_explicit(case, init, reference, close=None, **options):
  """``token_weighted_multistep(..., **options)`` on parameters typed
  reduced over ``data``; ``init(tx, params, mesh)`` lays its state out.
  ``close``: the host's two programs (label -> ``close``, the micro-step's
  first), or None for one program that the device closes."""
  model = case.model
  tx = tokacc.token_weighted_multistep(case.adamw, case.k, **options)

  @functools.partial(jax.jit, donate_argnums=(0, 1), static_argnames='close')
  def step(params, opt_state, batch, close=None):
    grads, num_tokens = jax.grad(model.loss_sum, has_aux=True)(params, batch)
    updates, opt_state = tx.update(
      grads, opt_state, params, num_tokens=num_tokens, close=close
    )
    return optax.apply_updates(params, updates), opt_state

  close = close or {'step': None}
  mesh = _mesh(case)
  with jax.set_mesh(mesh):
    params, windows = _place(case, mesh)
    opt_state = init(tx, params, mesh)
    batch = windows[0].micro_batches[0]
    compiled = {
      label: step.lower(params, opt_state, batch, close=c).compile()
      for label, c in close.items()
    }
  labels = list(close)
  micro, closing = compiled[labels[0]], compiled[labels[-1]]
  trainer = _methods.Trainer(
    _under_mesh(mesh, lambda carry, batch: micro(*carry, batch)),
    _under_mesh(
      mesh, lambda carry, window: closing(*carry, window.micro_batches[-1])
    ),
    (params, opt_state),
    lambda carry: carry[0],
    windows,
    compiled,
    reference=reference,
  )
  trainer.optimizer_state_of = lambda carry: carry[1].inner_state
  return trainer


def tokacc_explicit_ddp(case):
  """``token_weighted_multistep`` on parameters typed reduced over ``data``
  (one program: judged against the one-program ideal)."""
  return _tokacc_explicit(
    case, lambda tx, params, mesh: tx.init(params), ONE_PROGRAM_REFERENCE
  )


def tokacc_explicit_ddp_host(case, **options):
  """``tokacc_explicit_ddp`` closed by the host: ``close=False`` on the
  micro-steps, ``close=True`` on the k-th (two programs, no conditional)."""
  return _tokacc_explicit(
    case,
    lambda tx, params, mesh: tx.init(params),
    REFERENCE,
    {'micro': False, 'close': True},
    **options,
  )


def tokacc_explicit_ddp_host_no_norms(case):
  """``tokacc_explicit_ddp_host`` with ``window_norms=False``."""
  return tokacc_explicit_ddp_host(case, window_norms=False)


def tokacc_explicit_zero1(case):
  """``tokacc_explicit_ddp`` with AdamW's state sharded over ``data``."""

  def init(tx, params, mesh):
    return tokacc.init_sharded(tx, params, mesh, shard_optimizer_over=('data',))

  return _tokacc_explicit(case, init, ZERO1_REFERENCE)


def _spec(x, reduced=True):
  """The partition spec of ``x``'s type (``reduced=False``: without its
  reduced axes)."""
  spec = jax.typeof(x).sharding.spec
  return spec if reduced else P(*spec.partitions)


def _unreduced_zeros(x):
  """Float32 (at least) zeros typed like ``x`` with reduced turned
  unreduced: what unreduced gradients add into."""
  spec = _spec(x)
  dtype = jnp.promote_types(x.dtype, jnp.float32)
  unreduced = P(*spec.partitions, unreduced=spec.reduced)
  return jnp.zeros(x.shape, dtype, out_sharding=unreduced)


def _plain(x):
  """``x`` without its reduced type (free: the values are replicated), what
  AdamW's nonlinear update takes."""
  return jax.reshard(x, _spec(x, reduced=False))


def _plain_tree(params):
  return jax.tree.map(_plain, params)


def _window_mean(acc, acc_tokens, param):
  """The token mean of an unreduced sum (one all-reduce), in ``param``'s
  dtype."""
  total = jax.reshard(acc, _spec(param, reduced=False))
  return (total / acc_tokens.astype(total.dtype)).astype(param.dtype)


def ideal_explicit_ddp(case):
  """The hand-written reference of explicit DDP: AdamW runs on the plain
  (not reduced) mean and parameters; its updates are typed back reduced."""
  model, adamw = case.model, case.adamw
  micro_step = _methods.ideal_micro_step(model)

  @functools.partial(jax.jit, donate_argnums=(0, 1, 2, 3))
  def window_update(params, opt_state, acc, acc_tokens):
    mean = jax.tree.map(
      lambda a, p: _window_mean(a, acc_tokens, p), acc, params
    )
    updates, opt_state = adamw.update(mean, opt_state, _plain_tree(params))
    updates = jax.tree.map(
      lambda u, p: jax.reshard(u, _spec(p)), updates, params
    )
    params = optax.apply_updates(params, updates)
    zeros = jax.tree.map(_unreduced_zeros, params)
    return params, opt_state, zeros, jnp.zeros_like(acc_tokens)

  mesh = _mesh(case)
  with jax.set_mesh(mesh):
    params, windows = _place(case, mesh)
    acc = jax.jit(lambda p: jax.tree.map(_unreduced_zeros, p))(params)
    opt_state = jax.jit(lambda p: adamw.init(_plain_tree(p)))(params)
    tokens = jax.device_put(jnp.zeros([], jnp.int32), NamedSharding(mesh, P()))
    carry = (params, opt_state, acc, tokens)
  return _ideal_trainer(
    mesh, micro_step, window_update, carry, windows, REFERENCE
  )


def _ideal_trainer(mesh, micro_step, window_update, carry, windows, reference):
  """An explicit ideal's trainer, its programs compiled for ``carry``;
  ``carry`` is ``(params, opt_state, acc, acc_tokens)``."""
  params, _, acc, tokens = carry
  with jax.set_mesh(mesh):
    batch = windows[0].micro_batches[0]
    compiled = {
      'micro_step': micro_step.lower(params, acc, tokens, batch).compile(),
      'window_update': window_update.lower(*carry).compile(),
    }
  trainer = _methods.ideal_trainer(
    _under_mesh(mesh, micro_step),
    _under_mesh(mesh, window_update),
    carry,
    compiled,
    windows,
    reference=reference,
  )
  trainer.optimizer_state_of = lambda carry: carry[1]
  return trainer


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


def ideal_explicit_zero1(case):
  """The hand-written reference of explicit ZeRO-1: the micro-step of
  ``ideal_explicit_ddp``; per window one ``shard_map`` region: a
  reduce-scatter of each leaf into AdamW's shards, AdamW on the shards
  (moments sharded over ``data``), an all-gather of the updates."""
  model, adamw = case.model, case.adamw
  mesh = _mesh(case)
  size = mesh.shape['data']
  micro_step = _methods.ideal_micro_step(model)

  def specs(tree):
    return jax.tree.map(_spec, tree)

  @functools.partial(jax.jit, donate_argnums=(0, 1, 2, 3))
  def window_update(params, opt_state, acc, acc_tokens):
    if size == 1:  # a partial sum over one device is the sum (and JAX
      # 0.10.2 cannot lower unreduced specs over a size-1 axis)
      acc = jax.tree.map(lambda a: jax.reshard(a, _spec(a, False)), acc)
    state_specs = (specs(params), specs(opt_state))
    params, opt_state = jax.shard_map(
      _zero1_update(adamw, size),
      mesh=mesh,
      in_specs=(*state_specs, specs(acc), P()),
      out_specs=state_specs,
      check_vma=False,
    )(params, opt_state, acc, acc_tokens)
    zeros = jax.tree.map(_unreduced_zeros, params)
    return params, opt_state, zeros, jnp.zeros_like(acc_tokens)

  with jax.set_mesh(mesh):
    params, windows = _place(case, mesh)
    acc = jax.jit(lambda p: jax.tree.map(_unreduced_zeros, p))(params)
    opt_state = jax.jit(
      lambda p: adamw.init(
        jax.tree.map(lambda x: jax.reshard(x, _shard_spec(x, size)), p)
      )
    )(params)
    tokens = jax.device_put(jnp.zeros([], jnp.int32), NamedSharding(mesh, P()))
    carry = (params, opt_state, acc, tokens)
  return _ideal_trainer(
    mesh, micro_step, window_update, carry, windows, ZERO1_REFERENCE
  )


from benchmarks import _explicit_one  # noqa: E402 - it reads this module's helpers.

METHODS = {
  'ideal_explicit_ddp': ideal_explicit_ddp,
  'ideal_explicit_ddp_one': _explicit_one.ideal_explicit_ddp_one,
  'tokacc_explicit_ddp': tokacc_explicit_ddp,
  'tokacc_explicit_ddp_host': tokacc_explicit_ddp_host,
  'tokacc_explicit_ddp_host_no_norms': tokacc_explicit_ddp_host_no_norms,
  'ideal_explicit_zero1': ideal_explicit_zero1,
  'tokacc_explicit_zero1': tokacc_explicit_zero1,
}
