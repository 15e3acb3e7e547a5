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
"""Where a run's values live: meshes, layouts, training steps and loops.

Each placement is written once, as a user writes it, over the model and the
data of ``helpers``:

- ``jax.pmap`` with ``axis_name`` (:func:`pmap_step`);
- ``jax.shard_map`` with ``axis_name``, the parameters ``pcast`` to varying
  (:func:`shard_map_step`);
- GSPMD: ``jax.jit`` over global arrays on an Auto mesh, no ``axis_name``
  (:func:`global_step`);
- explicit sharding: plain ``jax.jit`` on an Explicit mesh, parameters typed
  reduced over the data axes (DDP, HSDP), sharded (FSDP) or replicated
  (:data:`EXPLICIT_LAYOUTS`, :func:`explicit_step`), and ZeRO-1, the
  optimizer's state sharded over the data axes (:data:`ZERO1_LAYOUTS`);
- HSDP with ``shard_map`` on a ``('replica', 'fsdp')`` mesh, partial-manual
  (:func:`partial_manual_step`) and fully manual (:func:`fully_manual_step`).

:data:`PLACEMENTS` holds them as one registry: ``PLACEMENTS[name](n,
make_tx)`` is a :class:`Run` on ``n`` devices, so that a test parametrizes
over placements as chex variants parametrize over ``jit`` and ``pmap``;
:func:`train` runs one (:func:`train_windows` from its start, over
windows). A test that needs a placement on its own mesh, layout or
parameters builds its :class:`Run` with the registry's builders
(:func:`pmap_run`, :func:`shard_map_run`, :func:`jit_run` and
:func:`gspmd_run`, :func:`explicit_run`, :func:`hsdp_run`) and trains it
the same way; ZeRO-1 on its own model, closed by the host or checkpointed
mid-run, has :func:`train_zero1`.
"""

from collections.abc import Callable
import contextlib
import functools
from typing import Any, NamedTuple

import helpers
import jax
from jax import lax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
import numpy as np
import optax
import pytest

import optax_tokacc as tokacc
from optax_tokacc import _compat
from optax_tokacc import _typed_sharding
from optax_tokacc.testing import hlo

AUTO = jax.sharding.AxisType.Auto
EXPLICIT_AXES = jax.sharding.AxisType.Explicit
NEEDS_TYPED_SHARDING = 'reduced/unreduced types need jax >= 0.10'
# A test that runs only where this JAX has reduced and unreduced types.
needs_typed_sharding = pytest.mark.skipif(
  not _typed_sharding.SUPPORTED, reason=NEEDS_TYPED_SHARDING
)


def type_strings(tree):
  """Each leaf's type as JAX prints it (shape, dtype, sharding)."""
  return jax.tree.map(lambda x: str(jax.typeof(x)), tree)


def data_mesh(n=4, names=('data',), shape=None, axis_type=AUTO):
  """A mesh of the first ``n`` devices (one axis ``'data'`` by default)."""
  return jax.make_mesh(
    shape or (n,),
    names,
    axis_types=(axis_type,) * len(names),
    devices=jax.devices()[:n],
  )


def mesh_context(mesh):
  """``jax.set_mesh(mesh)``, or nothing for ``None``."""
  return jax.set_mesh(mesh) if mesh is not None else contextlib.nullcontext()


def micro_batches(windows):
  """``(batch, emit_now)`` in training order: the last micro-batch of the
  last window closes it early (``emit_now``)."""
  for w, window in enumerate(windows):
    for m, batch in enumerate(window):
      yield batch, w == len(windows) - 1 and m == len(window) - 1


def with_nan(batch, device, num_devices=4):
  """``batch`` with a NaN in the rows of ``device`` (of ``num_devices``)."""
  x = np.array(batch['x'])
  x[device * (len(x) // num_devices), 0, 0] = np.nan
  return dict(batch, x=x)


def _apply(tx, params, state, grads, loss, num_tokens, emit_now, close):
  """``tx.update`` with the micro-batch's count and loss, the updates
  applied in the same program (as users write it): ``(params, state,
  updates)``; ``emit_now`` is not passed where the host closes
  (``close``)."""
  emit = {} if close is not None else {'emit_now': emit_now}
  updates, state = tx.update(
    grads, state, params, num_tokens=num_tokens, loss=loss, close=close, **emit
  )
  return optax.apply_updates(params, updates), state, updates


def _outputs(with_updates):
  """What a step returns: ``(params, state)``, or with the updates."""
  return (lambda out: out) if with_updates else (lambda out: out[:2])


# pmap: a leading device axis.


def per_device(x, n=None):
  """A global micro-batch with a leading device axis, for ``pmap``."""
  n = n or jax.device_count()
  return np.reshape(x, (n, -1) + np.shape(x)[1:])


def replicate(x, n=None):
  n = n or jax.device_count()
  return np.broadcast_to(x, (n,) + np.shape(x))


def pmap_step(tx, with_emit_now=True, devices=None, host_closes=False):
  """A ``jax.pmap`` training step over ``devices`` (all by default):
  ``(params, state, batch[, emit_now])``, or with ``host_closes``
  ``(params, state, batch, close)``, ``close`` static."""

  def step(params, state, batch, *flags, close=None):
    loss, grads = jax.value_and_grad(helpers.loss_sum)(params, batch)
    count = helpers.token_count(batch)
    emit_now = flags[0] if flags else False
    out = _apply(tx, params, state, grads, loss, count, emit_now, close)
    return out[:2]

  if host_closes:
    return jax.pmap(
      lambda params, state, batch, close: step(
        params, state, batch, close=close
      ),
      axis_name='data',
      devices=devices,
      static_broadcasted_argnums=3,
    )
  if not with_emit_now:
    return jax.pmap(
      lambda params, state, batch: step(params, state, batch),
      axis_name='data',
      devices=devices,
    )
  return jax.pmap(step, axis_name='data', devices=devices)


# shard_map with axis_name: parameters replicated, shares of the window per
# device.


def state_specs(tx, axes):
  """``shard_map`` specs of the state, from the library's layout helper."""
  return tokacc.state_partition_specs(tx, helpers.init_params(), axis_name=axes)


def shard_map_state(tx, params, mesh, axes):
  """``tx.init`` laid out for :func:`shard_map_step` on ``mesh``."""
  params = jax.tree.map(
    lambda x: helpers.put(x, NamedSharding(mesh, P())), params
  )
  return tokacc.init_sharded(tx, params, mesh, axis_name=axes)


def shard_map_step(
  tx,
  mesh,
  axes,
  with_emit_now=True,
  mark_varying=True,
  loss_fn=helpers.loss_sum,
  check_vma=True,
  with_updates=False,
):
  """One jitted micro-step of per-device code under ``jax.shard_map``.

  Parameters are replicated; each device holds its own accumulator share.
  The gradient is taken with respect to the parameters marked varying over
  ``axes``, so that autodiff does not ``psum`` it on every micro-step. The
  step takes ``(params, state, batch, emit_now)`` (one flag per device), or
  ``(params, state, batch)`` without ``with_emit_now``, and ``close=``
  (static). With ``mark_varying=False`` the gradient is taken with respect
  to the replicated parameters themselves, as a user who does not know the
  pattern would. ``with_updates``: the step returns the updates too.
  """
  specs = state_specs(tx, axes)
  outputs = _outputs(with_updates)

  def local_step(params, state, batch, *emit_now, close):
    local = params
    if mark_varying:
      local = jax.tree.map(lambda p: lax.pcast(p, axes, to='varying'), params)
    loss, grads = jax.value_and_grad(loss_fn)(local, batch)
    count = helpers.token_count(batch)
    flag = emit_now[0][0] if emit_now else False
    return outputs(_apply(tx, params, state, grads, loss, count, flag, close))

  data_specs = (P(axes), P(axes)) if with_emit_now else (P(axes),)

  def step(params, state, *data, close=None):
    return jax.shard_map(
      functools.partial(local_step, close=close),
      mesh=mesh,
      in_specs=(P(), specs) + data_specs,
      out_specs=outputs((P(), specs, P())),
      check_vma=check_vma,
    )(params, state, *data)

  return jax.jit(step, static_argnames='close')


# GSPMD: jax.jit over global arrays, no axis_name.


def fsdp_shardings(mesh, axes):
  """Shards each parameter's first dimension over ``axes`` (FSDP-style)."""
  return {
    'w': NamedSharding(mesh, P(axes, None)),
    'v': NamedSharding(mesh, P(axes)),
  }


def global_step(tx, loss_fn=helpers.loss_sum, with_updates=False):
  """A jitted step over global arrays (or on one device): ``(params, state,
  batch, emit_now=False, close=None) -> (params, state)`` (and the updates,
  with ``with_updates``), as a user writes it under ``jax.jit``; ``close``
  is static."""
  outputs = _outputs(with_updates)

  @functools.partial(jax.jit, static_argnames='close')
  def step(params, state, batch, emit_now=False, close=None):
    loss, grads = jax.value_and_grad(loss_fn)(params, batch)
    count = helpers.token_count(batch)
    return outputs(
      _apply(tx, params, state, grads, loss, count, emit_now, close)
    )

  return step


# Explicit sharding: plain jax.jit on an Explicit mesh.

DDP = P(None, None, reduced={'data'})
U_DATA = P(unreduced={'data'})


def explicit_ddp_mesh():
  return jax.make_mesh((4,), ('data',), devices=jax.devices()[:4])


def explicit_hsdp_mesh():
  return jax.make_mesh((2, 2), ('replica', 'fsdp'), devices=jax.devices()[:4])


class Layout(NamedTuple):
  """A mesh, the parameters' specs on it, and the data axes the optimizer's
  state is sharded over under ZeRO-1 (none otherwise)."""

  mesh: Callable[[], jax.sharding.Mesh]
  specs: dict
  shard_over: tuple = ()


def _reduced(*axes):
  return {'w': P(reduced=set(axes)), 'v': P(reduced=set(axes))}


EXPLICIT_LAYOUTS = {
  'ddp': Layout(explicit_ddp_mesh, _reduced('data')),
  'fsdp': Layout(
    lambda: jax.make_mesh((4,), ('fsdp',), devices=jax.devices()[:4]),
    {'w': P('fsdp'), 'v': P('fsdp')},
  ),
  'hsdp': Layout(
    explicit_hsdp_mesh,
    {
      'w': P('fsdp', reduced={'replica'}),
      'v': P('fsdp', reduced={'replica'}),
    },
  ),
  'replicated': Layout(explicit_ddp_mesh, {'w': P(), 'v': P()}),
}


def full_spec(spec, ndim):
  """``spec`` padded to ``ndim`` entries (what ``jit`` returns)."""
  parts = _compat.partitions(spec)  # jax 0.8.2: no spec.partitions
  parts += (None,) * (ndim - len(parts))
  return P(*parts, reduced=spec.reduced, unreduced=spec.unreduced)


def batch_axes(mesh):
  return tuple(mesh.axis_names)


def place_params(params, mesh, specs):
  return {
    name: jax.device_put(
      value, NamedSharding(mesh, full_spec(specs[name], np.ndim(value)))
    )
    for name, value in params.items()
  }


def forward_params(params):
  """The parameters as the loss uses them: HSDP shards are gathered into a
  copy reduced over every axis (JAX needs the contracting axes reduced)."""

  def gather(p):
    spec = jax.typeof(p).sharding.spec
    if spec.reduced and any(entry is not None for entry in spec.partitions):
      axes = set(spec.reduced)
      for entry in spec.partitions:
        if entry is not None:
          axes.update((entry,) if isinstance(entry, str) else entry)
      return jax.reshard(p, P(reduced=axes))
    return p

  return jax.tree.map(gather, params)


def unreduced_count(batch):
  """The micro-batch's count as partial sums over the mesh's axes: no
  collective."""
  axes = set(batch_axes(jax.sharding.get_abstract_mesh()))
  return jnp.einsum('bt->', batch['mask'], out_sharding=P(unreduced=axes))


def explicit_loss(spelling):
  """The loss sum ``replicated`` (a plain sum: a scalar all-reduce in the
  forward pass) or ``unreduced`` (per-device partial sums: none)."""
  if spelling == 'replicated':
    return helpers.loss_sum

  def unreduced_loss_sum(params, batch):
    axes = set(batch_axes(jax.sharding.get_abstract_mesh()))
    error = helpers.token_losses(params, batch)
    return jnp.einsum(
      'bt,bt->', error, batch['mask'], out_sharding=P(unreduced=axes)
    )

  return unreduced_loss_sum


def explicit_step(tx, spelling='replicated', with_updates=False):
  """A jitted step on an explicit mesh: ``(params, state, batch,
  emit_now=False, close=None) -> (params, state)`` (and the updates, with
  ``with_updates``), ``close`` static; the count and loss spelled
  ``replicated`` or ``unreduced`` (:func:`explicit_loss`)."""
  loss_sum = explicit_loss(spelling)
  outputs = _outputs(with_updates)
  count = helpers.token_count if spelling == 'replicated' else unreduced_count

  @functools.partial(jax.jit, static_argnames='close')
  def step(params, state, batch, emit_now=False, close=None):
    loss, grads = jax.value_and_grad(
      lambda p: loss_sum(forward_params(p), batch)
    )(params)
    num_tokens = count(batch)
    return outputs(
      _apply(tx, params, state, grads, loss, num_tokens, emit_now, close)
    )

  return step


def plain(tree):
  """Host copies (arrays typed reduced read like replicated ones)."""
  return jax.tree.map(
    lambda x: np.asarray(
      jax.reshard(x, P(*jax.typeof(x).sharding.spec.partitions))
    ),
    tree,
  )


def explicit_compiled_text(layout, spelling, inner=None, **options):
  """The compiled HLO of one micro-step (``emit_now`` traced, from
  ``tx.init``) on an explicit layout: ``tx`` accumulates 3 micro-steps of
  ``inner`` (``helpers.adamw()`` by default); ``options`` go to it."""
  tx = tokacc.token_weighted_multistep(inner or helpers.adamw(), 3, **options)
  make_mesh, specs, _ = EXPLICIT_LAYOUTS[layout]
  mesh = make_mesh()
  with jax.set_mesh(mesh):
    params = place_params(helpers.init_params(), mesh, specs)
    state = tx.init(params)
    batch = helpers.make_windows((1,), 4)[0][0]
    data = NamedSharding(mesh, P(batch_axes(mesh)))
    batch = jax.tree.map(lambda x: jax.device_put(x, data), batch)
    return hlo.compiled_text(
      explicit_step(tx, spelling), params, state, batch, jnp.asarray(False)
    )


# ZeRO-1 (the distributed optimizer): explicit sharding with inner's state
# sharded over the data axes, on the model of helpers.zero1_loss_sum.

ZERO1_LAYOUTS = {
  'ddp': Layout(
    explicit_ddp_mesh,
    {'w': P(None, None, reduced={'data'}), 'b': P(None, reduced={'data'})},
    ('data',),
  ),
  # w is split over fsdp and reduced over replica; b (3,), which fsdp does
  # not divide, is whole on every device, typed reduced over replica.
  'hsdp': Layout(
    explicit_hsdp_mesh,
    {
      'w': P('fsdp', None, reduced={'replica'}),
      'b': P(None, reduced={'replica'}),
    },
    ('replica',),
  ),
}


def zero1_inner():
  """Momentum SGD after a global-norm clip that binds (a clip by a shard's
  norm would differ)."""
  return optax.chain(
    optax.clip_by_global_norm(helpers.ZERO1_MAX_NORM),
    optax.sgd(0.5, momentum=0.9),
  )


def zero1_forward_params(params, axes):
  """The parameters as the loss uses them: under HSDP, whole and typed
  reduced over both axes (JAX needs the contracting axes reduced), so that
  the gradients come back reduce-scattered within ``fsdp`` and partial sums
  over ``replica``; under DDP already so (no-op)."""

  def gather(p):
    if jax.typeof(p).sharding.spec == P(*(None,) * p.ndim, reduced=axes):
      return p
    return jax.reshard(p, P(reduced=axes))

  return jax.tree.map(gather, params)


def zero1_loss_sum(params, batch):
  """``helpers.zero1_loss_sum`` as per-device partial sums over every axis
  of the mesh (the batch is split over all of them)."""
  axes = tuple(jax.sharding.get_abstract_mesh().axis_names)
  params = zero1_forward_params(params, set(axes))
  ones = jnp.ones(batch['mask'].shape, out_sharding=P(axes))
  bias = jnp.einsum('bt,i->bt', ones, params['b'], out_sharding=P(axes))
  pred = batch['x'] @ params['w'] + bias[..., None]
  per_token = jnp.sum((pred - batch['y']) ** 2, axis=-1)
  return jnp.einsum(
    'bt,bt->', per_token, batch['mask'], out_sharding=P(unreduced=set(axes))
  )


def zero1_run(layout='ddp', inner=None, k=3, with_updates=False, **options):
  """``(mesh, tx, step)``: ``tx`` accumulates ``k`` micro-steps of
  ``inner`` (:func:`zero1_inner` by default), ``options`` go to it;
  ``step(params, state, batch, close=None) -> (params, state)`` (and the
  updates, with ``with_updates``), ``close`` static."""
  mesh = ZERO1_LAYOUTS[layout].mesh()
  tx = tokacc.token_weighted_multistep(inner or zero1_inner(), k, **options)
  outputs = _outputs(with_updates)

  @functools.partial(jax.jit, static_argnames='close')
  def step(params, state, batch, close=None):
    loss, grads = jax.value_and_grad(zero1_loss_sum)(params, batch)
    num_tokens = unreduced_count(batch)
    return outputs(
      _apply(tx, params, state, grads, loss, num_tokens, False, close)
    )

  return mesh, tx, step


def zero1_placed(mesh, layout='ddp'):
  """The parameters typed as ``layout`` says, a placer of batches (split
  over every axis of the mesh)."""
  data = NamedSharding(mesh, P(tuple(mesh.axis_names)))
  specs = ZERO1_LAYOUTS[layout].specs
  params = {
    k: jax.device_put(v, specs[k]) for k, v in helpers.zero1_params().items()
  }
  return params, lambda batch: jax.device_put(batch, data)


def zero1_init(tx, params, mesh, layout='ddp'):
  return tokacc.init_sharded(
    tx, params, mesh, shard_optimizer_over=ZERO1_LAYOUTS[layout].shard_over
  )


def train_zero1(
  windows,
  interrupt_at=None,
  layout='ddp',
  host_closes=False,
  init=zero1_init,
  on_step=None,
  **options,
):
  """ZeRO-1 training of ``helpers.zero1_params`` on ``windows``;
  ``interrupt_at``: the micro-step after which the state goes through
  ``to_checkpoint`` / ``from_checkpoint``; ``host_closes``: ``close=False``
  / ``True`` from the host; ``init``: ``(tx, params, mesh, layout)`` to the
  initial state; ``on_step(params, state)`` after ``init`` and every
  micro-step; ``options`` go to the transform."""
  mesh, tx, step = zero1_run(layout, **options)
  with jax.set_mesh(mesh):
    params, place = zero1_placed(mesh, layout)
    state = init(tx, params, mesh, layout)
    if on_step is not None:
      on_step(params, state)
    calls = 0
    for window in windows:
      for i, batch in enumerate(window):
        close = i + 1 == len(window) if host_closes else None
        params, state = step(params, state, place(batch), close=close)
        calls += 1
        if on_step is not None:
          on_step(params, state)
        if calls == interrupt_at:
          like = (params, state)
          saved = jax.device_get(tokacc.to_checkpoint(like))
          shardings = jax.tree.map(
            lambda x: x.sharding, tokacc.to_checkpoint(like)
          )
          params, state = tokacc.from_checkpoint(
            jax.device_put(saved, shardings), like
          )
    return params, state


# HSDP with shard_map: shards within a replica, replicas across hosts.

HSDP_AXES = ('replica', 'fsdp')


def hsdp_mesh():
  """A ``('replica', 'fsdp') = (2, 2)`` mesh of the first 4 devices.

  Replica ``r`` holds devices ``2r`` and ``2r + 1`` in (process, id) order:
  with 2 processes of 2 devices each, each process is one replica.
  """
  devices = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
  return jax.sharding.Mesh(
    np.asarray(devices[:4]).reshape(2, 2), HSDP_AXES, axis_types=(AUTO,) * 2
  )


def is_spec(x):
  return isinstance(x, P)


def spec_axes(spec):
  """The mesh axes a ``PartitionSpec`` shards over."""
  axes = set()
  for entry in spec:
    if entry is not None:
      axes.update((entry,) if isinstance(entry, str) else entry)
  return axes


def manual_specs(specs, manual_axes):
  """``specs`` with the mesh axes outside ``manual_axes`` dropped.

  In partial-manual ``shard_map(..., axis_names=manual_axes)`` the in and
  out specs may mention the manual axes only; the other axes' sharding comes
  from the arrays (``NamedSharding`` of the full specs) through GSPMD.
  """

  def keep(entry):
    if entry is None:
      return None
    axes = (entry,) if isinstance(entry, str) else entry
    axes = tuple(a for a in axes if a in manual_axes)
    return None if not axes else axes[0] if len(axes) == 1 else axes

  return jax.tree.map(
    lambda spec: P(*(keep(e) for e in spec)), specs, is_leaf=is_spec
  )


def put_tree(tree, mesh, specs):
  """Global arrays of ``tree`` laid out by ``specs`` on ``mesh``."""
  return jax.tree.map(
    lambda x, spec: helpers.put(x, NamedSharding(mesh, spec)), tree, specs
  )


def _hsdp_update(tx, grads, state, params, loss, batch, flags):
  """``tx.update`` with the batch's token count and loss; ``flags`` holds
  this device's ``emit_now`` (an array of one) or nothing."""
  return tx.update(
    grads,
    state,
    params,
    num_tokens=helpers.token_count(batch),
    loss=loss,
    emit_now=flags[0][0] if flags else False,
  )


def partial_manual_step(tx, mesh, param_specs, state_specs, with_emit_now=True):
  """HSDP step: ``shard_map`` manual over ``replica``, ``fsdp`` by GSPMD.

  ``(params, state, batch[, emit_now])`` with one flag per replica. The
  parameters are marked varying over ``replica``, so that autodiff does not
  reduce over replicas on every micro-step; GSPMD reduces over ``fsdp``.
  The specs are the full ones (``fsdp`` included): the step gives
  ``shard_map`` their ``replica`` part, and ``jit`` their shardings.
  """

  def local_step(params, state, batch, *flags):
    local = jax.tree.map(
      lambda p: lax.pcast(p, 'replica', to='varying'), params
    )
    loss, grads = jax.value_and_grad(helpers.loss_sum)(local, batch)
    updates, state = _hsdp_update(tx, grads, state, params, loss, batch, flags)
    return optax.apply_updates(params, updates), state

  manual = {'replica'}
  param_in = manual_specs(param_specs, manual)
  state_in = manual_specs(state_specs, manual)
  data_specs = (P('replica'),) * (2 if with_emit_now else 1)
  step = jax.shard_map(
    local_step,
    mesh=mesh,
    in_specs=(param_in, state_in) + data_specs,
    out_specs=(param_in, state_in),
    axis_names=manual,
  )
  shardings = jax.tree.map(
    lambda s: NamedSharding(mesh, s),
    (param_specs, state_specs),
    is_leaf=is_spec,
  )
  return jax.jit(step, out_shardings=shardings)


def mark_local(params, param_specs):
  """``params`` marked varying over the data axes they are not sharded
  over, so that autodiff does not reduce their gradients over those axes on
  every micro-step (the transform does, once per window)."""

  def mark(p, spec):
    free = tuple(a for a in HSDP_AXES if a not in spec_axes(spec))
    return lax.pcast(p, free, to='varying') if free else p

  return jax.tree.map(mark, params, param_specs)


def gather_params(local_params, param_specs):
  """Full parameters from their ``fsdp`` shards (autodiff reduce-scatters
  their gradients)."""

  def gather(p, spec):
    for dim, entry in enumerate(spec):
      if entry == 'fsdp':
        p = lax.all_gather(p, 'fsdp', tiled=True, axis=dim)
    return p

  return jax.tree.map(gather, local_params, param_specs)


def fully_manual_step(
  tx, mesh, param_specs, state_specs, with_emit_now=True, check_vma=True
):
  """HSDP step: ``shard_map`` manual over both axes.

  ``(params, state, batch[, emit_now])`` with one flag per device. The
  forward pass all-gathers the ``fsdp`` shards, so that autodiff
  reduce-scatters their gradients. With ``check_vma=False``, JAX does not
  track which values vary over which axes.
  """

  def local_step(params, state, batch, *flags):
    def local_loss(local):
      return helpers.loss_sum(gather_params(local, param_specs), batch)

    local = mark_local(params, param_specs)
    loss, grads = jax.value_and_grad(local_loss)(local)
    updates, state = _hsdp_update(tx, grads, state, params, loss, batch, flags)
    return optax.apply_updates(params, updates), state

  data_specs = (P(HSDP_AXES),) * (2 if with_emit_now else 1)
  return jax.jit(
    jax.shard_map(
      local_step,
      mesh=mesh,
      in_specs=(param_specs, state_specs) + data_specs,
      out_specs=(param_specs, state_specs),
      check_vma=check_vma,
    )
  )


def hsdp_setup(tx, params, mesh, param_specs, axis_name):
  """Global parameters, the state from ``init_sharded`` and its specs."""
  params = put_tree(params, mesh, param_specs)
  state = tokacc.init_sharded(
    tx, params, mesh, param_specs=param_specs, axis_name=axis_name
  )
  state_specs = tokacc.state_partition_specs(
    tx, params, param_specs=param_specs, axis_name=axis_name
  )
  return params, state, state_specs


# HSDP layouts of shard_map: name -> (axis_name, param specs,
# partial-manual). Every sharded dimension has 8 entries: 2 per device on a
# 4-way `fsdp` axis, 4 on a 2-way one.
HSDP_SHARDED = {'w': P('fsdp', None), 'v': P('fsdp')}
HSDP_MIXED = {'w': P(None, 'fsdp'), 'v': P()}  # v replicated
HSDP_LAYOUTS = {
  'hsdp_partial_manual': ('replica', HSDP_SHARDED, True),
  'hsdp_manual_sharded': (HSDP_AXES, HSDP_SHARDED, False),
  'hsdp_manual_mixed': (HSDP_AXES, HSDP_MIXED, False),
}


# The registry: one Run per placement, on n devices.


class Run(NamedTuple):
  """A placement on ``n`` devices: the parameters and state it starts
  from, its jitted step ``(params, state, batch, emit_now) -> (params,
  state)``, how it places a global micro-batch and spells ``emit_now`` (a
  Python bool: the last device raises it), and host copies of its
  parameters."""

  params: Any
  state: Any
  step: Callable
  place: Callable
  emit: Callable
  host: Callable
  mesh: Any = None  # set with jax.set_mesh around the run (explicit types)
  # pmap holds the parameters stacked per device: the checkpoint has one
  # copy (as flax's unreplicate), stacked again on restore
  unstack: Callable = lambda params: params
  stack: Callable = lambda params: params
  # ``lower(mesh, close, params, state, batch, emit_now)``: the step built
  # on ``mesh`` (of the run's shape, on other devices: an accelerator
  # target's) and lowered there for abstract arguments; ``close`` None: the
  # device decides (``emit_now``), a bool: the host's program. None: the
  # step itself, a ``jax.jit`` of placed arguments (lower_jit).
  lower: Any = None


def lower_jit(step):
  """``Run.lower`` of a ``jax.jit`` step that takes its devices from its
  arguments: lowered under the target's mesh."""

  def lower(mesh, close, params, state, batch, emit_now):
    with jax.set_mesh(mesh):
      if close is None:
        return step.lower(params, state, batch, emit_now)
      return step.lower(params, state, batch, close=close)

  return lower


def last_device(flag, n):
  """``emit_now`` of each of ``n`` devices: raised on the last only."""
  return np.arange(n) == (n - 1 if flag else n)


def pmap_run(tx, params, n=None):
  """``jax.pmap`` over the first ``n`` devices (all by default), each
  holding a copy of ``params``."""
  n = n or jax.device_count()
  devices = jax.devices()[:n]
  params = jax.tree.map(lambda x: replicate(x, n), params)
  state = jax.pmap(tx.init, devices=devices)(params)
  step = pmap_step(tx, devices=devices)

  def first(params):
    """Device 0's copy; every device holds the same bits."""
    copies = helpers.fetch(params)
    for leaf in jax.tree.leaves(copies):
      np.testing.assert_array_equal(leaf, np.broadcast_to(leaf[0], leaf.shape))
    return jax.tree.map(lambda x: x[0], copies)

  return Run(
    params,
    state,
    step,
    lambda batch: jax.tree.map(lambda x: per_device(x, n), batch),
    lambda flag: last_device(flag, n),
    first,
    unstack=lambda params: jax.tree.map(lambda x: x[0], params),
    stack=lambda params: jax.tree.map(
      lambda x: replicate(np.asarray(x), n), params
    ),
    lower=functools.partial(_lower_pmap, tx),
  )


def _lower_pmap(tx, mesh, close, params, state, batch, emit_now):
  devices = list(mesh.devices.flat)
  if close is None:
    return pmap_step(tx, devices=devices).lower(params, state, batch, emit_now)
  step = pmap_step(tx, devices=devices, host_closes=True)
  return step.lower(params, state, batch, close)


def shard_map_run(tx, params, mesh, axes, mark_varying=True):
  """``shard_map`` over ``axes`` of ``mesh`` (:func:`shard_map_step`):
  ``params`` replicated, each device's share of the window its own."""
  n = mesh.devices.size
  replicated = NamedSharding(mesh, P())
  data = NamedSharding(mesh, P(axes))
  state = shard_map_state(tx, params, mesh, axes)

  def lower(mesh, close, params, state, batch, emit_now):
    step = shard_map_step(tx, mesh, axes, True, mark_varying)
    return step.lower(params, state, batch, emit_now, close=close)

  return Run(
    jax.tree.map(lambda x: helpers.put(x, replicated), params),
    state,
    shard_map_step(tx, mesh, axes, True, mark_varying),
    lambda batch: jax.tree.map(lambda x: helpers.put(x, data), batch),
    lambda flag: helpers.put(last_device(flag, n), data),
    helpers.fetch,
    mesh,
    lower=lower,
  )


def jit_run(tx, params, mesh, param_specs, data_axes, init=None, step=None):
  """``jax.jit`` over global arrays on ``mesh`` (GSPMD or explicit types):
  ``params`` laid out by ``param_specs``, the batch split over
  ``data_axes``; ``init(tx, params, mesh)`` gives the initial state
  (``tx.init`` by default), ``step`` is :func:`explicit_step` by
  default."""
  with jax.set_mesh(mesh):
    params = place_params(params, mesh, param_specs)
    state = tx.init(params) if init is None else init(tx, params, mesh)
  data = NamedSharding(mesh, P(data_axes))

  def host(params):
    return helpers.fetch(tokacc.to_checkpoint(params))

  return Run(
    params,
    state,
    step or explicit_step(tx),
    lambda batch: jax.tree.map(lambda x: jax.device_put(x, data), batch),
    jnp.asarray,
    host,
    mesh,
  )


def gspmd_run(tx, params, mesh, axes):
  """GSPMD FSDP: ``jax.jit`` with each parameter's first dimension sharded
  over ``axes`` (:func:`fsdp_shardings`), no ``axis_name``."""
  return jit_run(tx, params, mesh, {'w': P(axes), 'v': P(axes)}, axes)


def explicit_run(layout, tx, spelling='replicated', init=None):
  """Explicit sharding on ``EXPLICIT_LAYOUTS[layout]``, the count and loss
  spelled ``spelling`` (:func:`explicit_step`), the state from
  ``init(tx, params, mesh)`` (``tx.init`` by default)."""
  mesh = EXPLICIT_LAYOUTS[layout].mesh()
  specs = EXPLICIT_LAYOUTS[layout].specs
  step = explicit_step(tx, spelling)
  return jit_run(
    tx, helpers.init_params(), mesh, specs, batch_axes(mesh), init, step
  )


def sharded_optimizer(axes):
  """A state builder for :func:`jit_run`: ZeRO-1, ``inner``'s state
  sharded over ``axes`` (``init_sharded``)."""
  return lambda tx, params, mesh: tokacc.init_sharded(
    tx, params, mesh, shard_optimizer_over=axes
  )


def hsdp_run(
  tx, params, mesh, param_specs, axis_name, partial_manual=False, check_vma=True
):
  """HSDP with ``shard_map`` on ``mesh``, partial-manual
  (:func:`partial_manual_step`, one ``emit_now`` per replica) or fully
  manual (:func:`fully_manual_step`, one per device); the batch split over
  both axes."""
  params, state, state_specs = hsdp_setup(
    tx, params, mesh, param_specs, axis_name
  )
  if partial_manual:
    step = partial_manual_step(tx, mesh, param_specs, state_specs)
    flags = NamedSharding(mesh, P('replica'))
    num_flags = mesh.shape['replica']
  else:
    step = fully_manual_step(
      tx, mesh, param_specs, state_specs, check_vma=check_vma
    )
    flags = NamedSharding(mesh, P(HSDP_AXES))
    num_flags = mesh.size
  data = NamedSharding(mesh, P(HSDP_AXES))
  return Run(
    params,
    state,
    step,
    lambda batch: jax.tree.map(lambda x: helpers.put(x, data), batch),
    lambda flag: helpers.put(last_device(flag, num_flags), flags),
    helpers.fetch,
  )


def _hsdp_shape(n):
  return {8: (2, 4), 4: (2, 2), 2: (2, 1), 1: (1, 1)}[n]


def _typed_run(n, make_tx, mesh, param_specs, data_axes, init=None):
  """:func:`jit_run` of ``make_tx(None)`` from ``helpers.init_params``."""
  return jit_run(
    make_tx(None), helpers.init_params(), mesh, param_specs, data_axes, init
  )


PLACEMENTS = {
  'pmap': lambda n, make_tx: pmap_run(
    make_tx('data'), helpers.init_params(), n
  ),
  'shard_map': lambda n, make_tx: shard_map_run(
    make_tx('data'), helpers.init_params(), data_mesh(n), 'data'
  ),
  # gradients of replicated parameters, summed by autodiff (Manual.share_of)
  'shard_map_summed': lambda n, make_tx: shard_map_run(
    make_tx('data'), helpers.init_params(), data_mesh(n), 'data', False
  ),
  'gspmd': lambda n, make_tx: gspmd_run(
    make_tx(None), helpers.init_params(), data_mesh(n), 'data'
  ),
  'explicit_ddp': lambda n, make_tx: _typed_run(
    n,
    make_tx,
    data_mesh(n, axis_type=EXPLICIT_AXES),
    EXPLICIT_LAYOUTS['ddp'].specs,
    'data',
  ),
  'explicit_fsdp': lambda n, make_tx: _typed_run(
    n,
    make_tx,
    data_mesh(n, axis_type=EXPLICIT_AXES),
    {'w': P('data'), 'v': P('data')},
    'data',
  ),
  'explicit_hsdp': lambda n, make_tx: _typed_run(
    n,
    make_tx,
    data_mesh(n, HSDP_AXES, _hsdp_shape(n), axis_type=EXPLICIT_AXES),
    EXPLICIT_LAYOUTS['hsdp'].specs,
    HSDP_AXES,
  ),
  'zero1': lambda n, make_tx: _typed_run(
    n,
    make_tx,
    data_mesh(n, axis_type=EXPLICIT_AXES),
    EXPLICIT_LAYOUTS['ddp'].specs,
    'data',
    sharded_optimizer(('data',)),
  ),
}
# The placements of explicit sharding: reduced and unreduced types, jax >=
# 0.10 (optax_tokacc._typed_sharding.SUPPORTED).
EXPLICIT = ('explicit_ddp', 'explicit_fsdp', 'explicit_hsdp', 'zero1')


def supported(name):
  """Whether this JAX runs placement ``name``."""
  return name not in EXPLICIT or _typed_sharding.SUPPORTED


def train(run, params, state, batches, emit_last=False, on_step=None):
  """``run``'s step over ``batches``, under its mesh; with ``emit_last``
  the last micro-batch closes its window (``emit_now``, raised on the last
  device only); ``on_step(params, state)`` after every micro-step."""
  with mesh_context(run.mesh):
    for i, batch in enumerate(batches):
      emit_now = run.emit(emit_last and i == len(batches) - 1)
      params, state = run.step(params, state, run.place(batch), emit_now)
      if on_step is not None:
        on_step(params, state)
  return params, state


def train_windows(run, windows, on_step=None):
  """:func:`train` from ``run``'s start over the micro-batches of
  ``windows`` in order, the last closing its window (``emit_now``)."""
  batches = [batch for window in windows for batch in window]
  return train(run, run.params, run.state, batches, True, on_step)
