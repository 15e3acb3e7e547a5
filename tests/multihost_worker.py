"""The multi-host test's worker: one process per host.

Started by ``test_multihost.py`` as the ``multihost`` entry point of
``children.py``: it joins a ``jax.distributed`` job on loopback, trains with
``placements.train`` over the global mesh of all processes' CPU
devices and writes the final parameters. ``test_multihost.py`` reads its
run's settings (``MULTIHOST_*``) to build the reference.

    python -m children multihost --process_id=0 --num_processes=2 \
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
from collections.abc import Sequence
import functools

from helpers import adamw
from helpers import fetch
from helpers import init_params
from helpers import make_windows
from helpers import put
import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
import numpy as np
import placements

import optax_tokacc as tokacc

# The multi-host run: windows of k = 3 micro-steps, the last one closed early.
MULTIHOST_WINDOW_SIZES = (3, 3, 2)
MULTIHOST_K = 3
MULTIHOST_AXIS = 'data'
MULTIHOST_BUDGET = 30  # tokens per update over all devices (tokens_per_update)


# HSDP layouts of the multi-host run (of ``placements.HSDP_LAYOUTS``): name
# -> (axis_name, param specs, partial-manual). Each process is one replica;
# `fsdp` stays within it.
MULTIHOST_HSDP_LAYOUTS = {
  'partial_manual': placements.HSDP_LAYOUTS['hsdp_partial_manual'],
  'fully_manual': placements.HSDP_LAYOUTS['hsdp_manual_mixed'],
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


def _reduced_params(params, mesh):
  """``params`` placed on ``mesh`` typed reduced over its first axis: a
  replicated global array from each process's full copy, resharded."""
  axis = mesh.axis_names[0]
  return {
    name: jax.jit(
      lambda x: jax.reshard(x, P(*(None,) * x.ndim, reduced={axis}))
    )(put(value, NamedSharding(mesh, P())))
    for name, value in params.items()
  }


def _explicit_run(tx, mesh, shard_optimizer_over=None):
  """Explicit sharding under plain ``jax.jit`` over ``mesh``'s first axis
  (``placements.global_step``): parameters typed reduced over it, the batch
  split over it; ``shard_optimizer_over``: ZeRO-1's axes
  (``init_sharded``)."""
  with jax.set_mesh(mesh):
    params = _reduced_params(init_params(), mesh)
    if shard_optimizer_over is None:
      state = tx.init(params)
    else:
      state = tokacc.init_sharded(
        tx, params, mesh, shard_optimizer_over=shard_optimizer_over
      )
  data = NamedSharding(mesh, P(mesh.axis_names[0]))
  return placements.Run(
    params,
    state,
    placements.global_step(tx),
    lambda batch: jax.tree.map(lambda x: put(x, data), batch),
    jnp.asarray,
    fetch,
    mesh,
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
  shard_map_params, shard_map_state_ = placements.train_windows(
    placements.shard_map_run(
      make_tx(axis_name=MULTIHOST_AXIS), params, mesh, MULTIHOST_AXIS
    ),
    windows,
  )
  jit_params, jit_state = placements.train_windows(
    placements.gspmd_run(make_tx(), params, mesh, MULTIHOST_AXIS), windows
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
  mesh = placements.hsdp_mesh()
  for replica, devices in enumerate(mesh.devices):
    processes = {d.process_index for d in devices}
    assert processes == {replica}, (replica, processes)
  windows = make_windows(MULTIHOST_WINDOW_SIZES, mesh.size)
  results = {}
  for layout, (axis_name, specs, partial) in MULTIHOST_HSDP_LAYOUTS.items():
    tx = tokacc.token_weighted_multistep(
      adamw(), MULTIHOST_K, axis_name=axis_name
    )
    params, state = placements.train_windows(
      placements.hsdp_run(
        tx, init_params(), mesh, specs, axis_name, partial_manual=partial
      ),
      windows,
    )
    results[f'{layout}_loss'] = fetch(tokacc.window_loss(state))
    for name, value in fetch(params).items():
      results[f'{layout}_{name}'] = value
  return results


def _explicit_results():
  """Explicit data parallelism over all devices of all processes."""
  mesh = jax.make_mesh((jax.device_count(),), (MULTIHOST_AXIS,))
  windows = make_windows(MULTIHOST_WINDOW_SIZES, jax.device_count())
  tx = tokacc.token_weighted_multistep(adamw(), MULTIHOST_K)
  params, state = placements.train_windows(_explicit_run(tx, mesh), windows)
  with jax.set_mesh(mesh):
    results = {'explicit_loss': fetch(tokacc.window_loss(state))}
    for name, value in fetch(tokacc.to_checkpoint(params)).items():
      results[f'explicit_{name}'] = value
  return results


def _zero1_results():
  """Explicit data parallelism with AdamW's moments sharded over the data
  axis of both processes' devices (the distributed-optimizer layout); also
  the shape of each local shard of ``mu``."""
  mesh = jax.make_mesh((jax.device_count(),), (MULTIHOST_AXIS,))
  windows = make_windows(MULTIHOST_WINDOW_SIZES, jax.device_count())
  tx = tokacc.token_weighted_multistep(adamw(), MULTIHOST_K)
  run = _explicit_run(tx, mesh, (MULTIHOST_AXIS,))
  params, state = placements.train_windows(run, windows)
  with jax.set_mesh(mesh):
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
  tx = tokacc.token_weighted_multistep(
    adamw(),
    MULTIHOST_K,
    axis_name=MULTIHOST_AXIS,
    tokens_per_update=MULTIHOST_BUDGET,
  )
  params, state = placements.train_windows(
    placements.shard_map_run(tx, init_params(), mesh, MULTIHOST_AXIS),
    windows,
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


def main(argv: Sequence[str]) -> None:
  """One worker process, configured by the command line ``argv``."""
  parser = argparse.ArgumentParser(prog='multihost', description=__doc__)
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
  _run_worker(parser.parse_args(argv))
