"""Data-parallel and HSDP training harness, and the multi-host test's worker.

Imported by ``test_data_parallel.py``, ``test_sharded.py`` and
``test_multihost.py`` for the model, the data, the single-device full-batch
reference and the ``shard_map`` / sharded-``jit`` training loops (HSDP:
partial-manual and fully manual ``shard_map`` on a ``('replica', 'fsdp')``
mesh). Run as a script by ``test_multihost.py``, one
process per host: it joins a ``jax.distributed`` job on loopback, trains over
the global mesh of all processes' CPU devices and writes the final parameters.

    python multihost_worker.py --process_id=0 --num_processes=2 \
      --port=12345 --out=/tmp/result.npz [--mode=hsdp]

``--mode=ddp`` (the default) trains data-parallel over all devices;
``--mode=hsdp`` trains on a ``('replica', 'fsdp') = (2, 2)`` mesh, each
process one replica, partial-manual and fully manual; ``--mode=explicit``
trains data-parallel under plain ``jax.jit`` with parameters typed reduced
(explicit sharding); ``--mode=zero1`` trains as ``explicit`` with
AdamW's moments sharded over the data axis (``init_sharded(...,
shard_optimizer_over=('data',))``); ``--mode=budget`` trains data-parallel
with ``tokens_per_update``.
"""

import argparse
import functools

from helpers import LEARNING_RATE
from helpers import fetch
from helpers import init_params
from helpers import loss_sum
from helpers import make_windows
from helpers import put
from helpers import token_count
import jax
from jax import lax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
import numpy as np
import optax

import optax_tokacc as tokacc


def state_specs(tx, axes):
  """``shard_map`` specs of the state, from the library's layout helper."""
  return tokacc.state_partition_specs(tx, init_params(), axis_name=axes)


def shard_map_state(tx, params, mesh, axes):
  """``tx.init`` laid out for :func:`shard_map_step` on ``mesh``."""
  params = jax.tree.map(lambda x: put(x, NamedSharding(mesh, P())), params)
  return tokacc.init_sharded(tx, params, mesh, axis_name=axes)


def shard_map_step(
  tx, mesh, axes, state, with_emit_now=True, mark_varying=True
):
  """One jitted micro-step of per-device code under ``jax.shard_map``.

  Parameters are replicated; each device holds its own accumulator share.
  The gradient is taken with respect to the parameters marked varying over
  ``axes``, so that autodiff does not ``psum`` it on every micro-step. The
  step takes ``(params, state, batch, emit_now)`` (one flag per device), or
  ``(params, state, batch)`` without ``with_emit_now``. With
  ``mark_varying=False`` the gradient is taken with respect to the replicated
  parameters themselves, as a user who does not know the pattern would.
  """
  del state  # Its layout comes from `tx`.
  specs = state_specs(tx, axes)

  def local_step(params, state, batch, *emit_now):
    local_params = params
    if mark_varying:
      local_params = jax.tree.map(
        lambda p: lax.pcast(p, axes, to='varying'), params
      )
    loss, grads = jax.value_and_grad(loss_sum)(local_params, batch)
    updates, state = tx.update(
      grads,
      state,
      params,
      num_tokens=token_count(batch),
      loss=loss,
      emit_now=emit_now[0][0] if with_emit_now else False,
    )
    params = optax.apply_updates(params, updates)
    return params, state

  data_specs = (P(axes), P(axes)) if with_emit_now else (P(axes),)
  return jax.jit(
    jax.shard_map(
      local_step,
      mesh=mesh,
      in_specs=(P(), specs) + data_specs,
      out_specs=(P(), specs),
    )
  )


def train_shard_map(tx, params, windows, mesh, axes, mark_varying=True):
  """Trains under ``shard_map``; the last micro-step of the last window is
  closed early by ``emit_now`` raised on the last device only.

  Returns the final parameters and state.
  """
  num_devices = mesh.devices.size
  replicated = NamedSharding(mesh, P())
  data = NamedSharding(mesh, P(axes))
  state = shard_map_state(tx, params, mesh, axes)
  params = jax.tree.map(lambda x: put(x, replicated), params)
  step = shard_map_step(tx, mesh, axes, state, mark_varying=mark_varying)
  for w, window in enumerate(windows):
    for m, batch in enumerate(window):
      emit_now = np.zeros(num_devices, bool)
      emit_now[-1] = w == len(windows) - 1 and m == len(window) - 1
      params, state = step(
        params,
        state,
        jax.tree.map(lambda x: put(x, data), batch),
        put(emit_now, data),
      )
  return params, state


def fsdp_shardings(mesh, axes):
  """Shards each parameter's first dimension over ``axes`` (FSDP-style)."""
  return {
    'w': NamedSharding(mesh, P(axes, None)),
    'v': NamedSharding(mesh, P(axes)),
  }


def global_step(tx):
  """A jitted step over global arrays: ``(params, state, batch, emit_now)
  -> (params, state)``, as a user writes it under ``jax.jit``."""

  @jax.jit
  def step(params, state, batch, emit_now):
    loss, grads = jax.value_and_grad(loss_sum)(params, batch)
    updates, state = tx.update(
      grads,
      state,
      params,
      num_tokens=token_count(batch),
      loss=loss,
      emit_now=emit_now,
    )
    return optax.apply_updates(params, updates), state

  return step


def train_sharded_jit(tx, params, windows, mesh, axes, on_step=None):
  """Trains with ``jax.jit`` over global arrays (GSPMD, no ``axis_name``).

  The last window is closed early with ``emit_now``. ``on_step(params,
  state)`` is called after ``tx.init`` and after every micro-step.
  """
  data = NamedSharding(mesh, P(axes))
  shardings = fsdp_shardings(mesh, axes)
  params = jax.tree.map(put, params, shardings)
  state = tx.init(params)
  step = global_step(tx)
  if on_step is not None:
    on_step(params, state)
  for w, window in enumerate(windows):
    for m, batch in enumerate(window):
      emit_now = w == len(windows) - 1 and m == len(window) - 1
      batch = jax.tree.map(lambda x: put(x, data), batch)
      params, state = step(params, state, batch, jnp.asarray(emit_now))
      if on_step is not None:
        on_step(params, state)
  return params, state


# Hybrid (HSDP) meshes: shards within a replica, replicas across hosts.

HSDP_AXES = ('replica', 'fsdp')


def hsdp_mesh():
  """A ``('replica', 'fsdp') = (2, 2)`` mesh of the first 4 devices.

  Replica ``r`` holds devices ``2r`` and ``2r + 1`` in (process, id) order:
  with 2 processes of 2 devices each, each process is one replica.
  """
  devices = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
  return jax.sharding.Mesh(
    np.asarray(devices[:4]).reshape(2, 2),
    HSDP_AXES,
    axis_types=(jax.sharding.AxisType.Auto,) * 2,
  )


def _is_spec(x):
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
    lambda spec: P(*(keep(e) for e in spec)), specs, is_leaf=_is_spec
  )


def put_tree(tree, mesh, specs):
  """Global arrays of ``tree`` laid out by ``specs`` on ``mesh``."""
  return jax.tree.map(
    lambda x, spec: put(x, NamedSharding(mesh, spec)), tree, specs
  )


def _hsdp_update(tx, grads, state, params, loss, batch, flags):
  """``tx.update`` with the batch's token count and loss; ``flags`` holds
  this device's ``emit_now`` (an array of one) or nothing."""
  return tx.update(
    grads,
    state,
    params,
    num_tokens=token_count(batch),
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
    loss, grads = jax.value_and_grad(loss_sum)(local, batch)
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
    is_leaf=_is_spec,
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
      return loss_sum(gather_params(local, param_specs), batch)

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


def train_hsdp(
  tx,
  params,
  windows,
  mesh,
  param_specs,
  axis_name,
  *,
  partial_manual=False,
  check_vma=True,
):
  """Trains HSDP on ``mesh``, partial-manual or fully manual.

  The batch is split over both axes; the last device raises ``emit_now`` on
  the last micro-step. Returns the final parameters and state.
  """
  params, state, state_specs = hsdp_setup(
    tx, params, mesh, param_specs, axis_name
  )
  if partial_manual:
    step = partial_manual_step(tx, mesh, param_specs, state_specs)
    flags = NamedSharding(mesh, P('replica'))
  else:
    step = fully_manual_step(
      tx, mesh, param_specs, state_specs, check_vma=check_vma
    )
    flags = NamedSharding(mesh, P(HSDP_AXES))
  data = NamedSharding(mesh, P(HSDP_AXES))
  num_flags = mesh.shape['replica'] if partial_manual else mesh.size
  for w, window in enumerate(windows):
    for m, batch in enumerate(window):
      emit_now = np.zeros(num_flags, bool)
      emit_now[-1] = w == len(windows) - 1 and m == len(window) - 1
      params, state = step(
        params,
        state,
        jax.tree.map(lambda x: put(x, data), batch),
        put(emit_now, flags),
      )
  return params, state


# The multi-host run: windows of k = 3 micro-steps, the last one closed early.
MULTIHOST_WINDOW_SIZES = (3, 3, 2)
MULTIHOST_K = 3
MULTIHOST_AXIS = 'data'
MULTIHOST_BUDGET = 30  # tokens per update over all devices (tokens_per_update)


def adamw():
  """AdamW whose update depends on the gradient's scale (large eps).

  With the default eps, Adam is nearly invariant to the gradient's scale and
  would hide a gradient summed over the devices twice.
  """
  return optax.adamw(LEARNING_RATE, eps=0.1, weight_decay=0.1)


# HSDP layouts of the multi-host run: name -> (axis_name, param specs,
# partial-manual). Each process is one replica; `fsdp` stays within it.
MULTIHOST_HSDP_LAYOUTS = {
  'partial_manual': ('replica', {'w': P('fsdp', None), 'v': P('fsdp')}, True),
  'fully_manual': (HSDP_AXES, {'w': P(None, 'fsdp'), 'v': P()}, False),
}


def _join(args):
  jax.config.update('jax_platforms', 'cpu')
  jax.config.update('jax_num_cpu_devices', args.local_devices)
  jax.config.update('jax_cpu_collectives_implementation', 'gloo')
  jax.distributed.initialize(
    coordinator_address=f'127.0.0.1:{args.port}',
    num_processes=args.num_processes,
    process_id=args.process_id,
    initialization_timeout=300,  # both processes start at once; a busy machine
  )


def _data_parallel_results():
  """DDP under ``shard_map`` and sharded ``jit`` over all devices."""
  num_devices = jax.device_count()
  mesh = jax.make_mesh(
    (num_devices,),
    (MULTIHOST_AXIS,),
    axis_types=(jax.sharding.AxisType.Auto,),
  )
  windows = make_windows(MULTIHOST_WINDOW_SIZES, num_devices)
  params = init_params()
  make_tx = functools.partial(
    tokacc.token_weighted_multistep, adamw(), MULTIHOST_K
  )
  shard_map_params, shard_map_state_ = train_shard_map(
    make_tx(axis_name=MULTIHOST_AXIS), params, windows, mesh, MULTIHOST_AXIS
  )
  jit_params, jit_state = train_sharded_jit(
    make_tx(), params, windows, mesh, MULTIHOST_AXIS
  )
  results = {
    'shard_map_loss': fetch(tokacc.window_loss(shard_map_state_)),
    'jit_loss': fetch(tokacc.window_loss(jit_state)),
  }
  for name, value in fetch(shard_map_params).items():
    results[f'shard_map_{name}'] = value
  for name, value in fetch(jit_params).items():
    results[f'jit_{name}'] = value
  return results


def _hsdp_results():
  """HSDP on a (2, 2) mesh whose replica r is process r, in each layout of
  ``MULTIHOST_HSDP_LAYOUTS``."""
  mesh = hsdp_mesh()
  for replica, devices in enumerate(mesh.devices):
    processes = {d.process_index for d in devices}
    assert processes == {replica}, (replica, processes)
  windows = make_windows(MULTIHOST_WINDOW_SIZES, mesh.size)
  results = {}
  for layout, (axis_name, specs, partial) in MULTIHOST_HSDP_LAYOUTS.items():
    tx = tokacc.token_weighted_multistep(
      adamw(), MULTIHOST_K, axis_name=axis_name
    )
    params, state = train_hsdp(
      tx,
      init_params(),
      windows,
      mesh,
      specs,
      axis_name,
      partial_manual=partial,
    )
    results[f'{layout}_loss'] = fetch(tokacc.window_loss(state))
    for name, value in fetch(params).items():
      results[f'{layout}_{name}'] = value
  return results


def train_explicit(tx, params, windows, mesh, shard_optimizer_over=None):
  """Explicit sharding under plain ``jax.jit``: parameters typed reduced
  over the data axis (unreduced gradients), the batch split over it.
  ``shard_optimizer_over``: the axes to shard ``inner``'s state over
  (ZeRO-1, laid out by ``init_sharded``). Returns host copies of the final
  parameters and of the last window's loss."""
  with jax.set_mesh(mesh):
    params, state = train_explicit_state(
      tx, params, windows, mesh, shard_optimizer_over
    )
    return fetch(tokacc.to_checkpoint(params)), fetch(tokacc.window_loss(state))


def train_explicit_state(tx, params, windows, mesh, shard_optimizer_over=None):
  """:func:`train_explicit`'s loop, under ``jax.set_mesh(mesh)``: the final
  parameters and state, global arrays."""
  axis = mesh.axis_names[0]
  params = {
    name: jax.jit(
      lambda x: jax.reshard(x, P(*(None,) * x.ndim, reduced={axis}))
    )(put(value, NamedSharding(mesh, P())))
    for name, value in params.items()
  }
  if shard_optimizer_over is None:
    state = tx.init(params)
  else:
    state = tokacc.init_sharded(
      tx, params, mesh, shard_optimizer_over=shard_optimizer_over
    )
  step = global_step(tx)
  data = NamedSharding(mesh, P(axis))
  for w, window in enumerate(windows):
    for m, batch in enumerate(window):
      emit_now = w == len(windows) - 1 and m == len(window) - 1
      batch = jax.tree.map(lambda x: put(x, data), batch)
      params, state = step(params, state, batch, jnp.asarray(emit_now))
  return params, state


def _explicit_results():
  """Explicit data parallelism over all devices of all processes."""
  mesh = jax.make_mesh((jax.device_count(),), (MULTIHOST_AXIS,))
  windows = make_windows(MULTIHOST_WINDOW_SIZES, jax.device_count())
  tx = tokacc.token_weighted_multistep(adamw(), MULTIHOST_K)
  params, loss = train_explicit(tx, init_params(), windows, mesh)
  results = {'explicit_loss': loss}
  for name, value in params.items():
    results[f'explicit_{name}'] = value
  return results


def _zero1_results():
  """Explicit data parallelism with AdamW's moments sharded over the data
  axis of both processes' devices (the distributed-optimizer layout); also
  the shape of each local shard of ``mu``."""
  mesh = jax.make_mesh((jax.device_count(),), (MULTIHOST_AXIS,))
  windows = make_windows(MULTIHOST_WINDOW_SIZES, jax.device_count())
  tx = tokacc.token_weighted_multistep(adamw(), MULTIHOST_K)
  with jax.set_mesh(mesh):
    params, state = train_explicit_state(
      tx, init_params(), windows, mesh, (MULTIHOST_AXIS,)
    )
    results = {'zero1_loss': fetch(tokacc.window_loss(state))}
    for name, value in fetch(tokacc.to_checkpoint(params)).items():
      results[f'zero1_{name}'] = value
  for name, mu in state.inner_state[0].mu.items():
    shapes = {s.data.shape for s in mu.addressable_shards}
    assert len(shapes) == 1, shapes  # every local device holds one shard
    results[f'zero1_mu_shard_{name}'] = np.asarray(shapes.pop())
  return results


def _budget_results():
  """DDP under ``shard_map`` with ``tokens_per_update``: the transform finds
  the windows in one stream of micro-batches (the last closed by
  ``emit_now``)."""
  mesh = jax.make_mesh(
    (jax.device_count(),),
    (MULTIHOST_AXIS,),
    axis_types=(jax.sharding.AxisType.Auto,),
  )
  windows = make_windows(MULTIHOST_WINDOW_SIZES, jax.device_count())
  stream = [[batch for window in windows for batch in window]]
  tx = tokacc.token_weighted_multistep(
    adamw(),
    MULTIHOST_K,
    axis_name=MULTIHOST_AXIS,
    tokens_per_update=MULTIHOST_BUDGET,
  )
  params, state = train_shard_map(
    tx, init_params(), stream, mesh, MULTIHOST_AXIS
  )
  results = {'budget_updates': fetch(tokacc.find_state(state).gradient_step)}
  for name, value in fetch(params).items():
    results[f'budget_{name}'] = value
  return results


def _run_worker(args):
  _join(args)
  if args.mode == 'hsdp':
    results = _hsdp_results()
  elif args.mode == 'explicit':
    results = _explicit_results()
  elif args.mode == 'zero1':
    results = _zero1_results()
  elif args.mode == 'budget':
    results = _budget_results()
  else:
    results = _data_parallel_results()
  results['num_devices'] = np.asarray(jax.device_count())
  if jax.process_index() == 0:
    np.savez(args.out, **results)
  jax.distributed.shutdown()


def main():
  parser = argparse.ArgumentParser(description=__doc__)
  parser.add_argument('--process_id', type=int, required=True)
  parser.add_argument('--num_processes', type=int, required=True)
  parser.add_argument('--port', type=int, required=True)
  parser.add_argument('--local_devices', type=int, default=2)
  parser.add_argument(
    '--mode',
    choices=('ddp', 'hsdp', 'explicit', 'zero1', 'budget'),
    default='ddp',
  )
  parser.add_argument('--out', required=True)
  _run_worker(parser.parse_args())


if __name__ == '__main__':
  main()
