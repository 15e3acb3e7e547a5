"""The multi-host test's worker: one process per host.

Started by ``test_multihost.py`` as the ``multihost`` entry point of
``children.py``: it joins a ``jax.distributed`` job on loopback, trains with
the loops of ``placements`` over the global mesh of all processes' CPU
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
import jax
from jax.sharding import PartitionSpec as P
import numpy as np
import placements

import optax_tokacc as tokacc

# The multi-host run: windows of k = 3 micro-steps, the last one closed early.
MULTIHOST_WINDOW_SIZES = (3, 3, 2)
MULTIHOST_K = 3
MULTIHOST_AXIS = 'data'
MULTIHOST_BUDGET = 30  # tokens per update over all devices (tokens_per_update)


# HSDP layouts of the multi-host run: name -> (axis_name, param specs,
# partial-manual). Each process is one replica; `fsdp` stays within it.
MULTIHOST_HSDP_LAYOUTS = {
  'partial_manual': ('replica', {'w': P('fsdp', None), 'v': P('fsdp')}, True),
  'fully_manual': (
    placements.HSDP_AXES,
    {'w': P(None, 'fsdp'), 'v': P()},
    False,
  ),
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
  shard_map_params, shard_map_state_ = placements.train_shard_map(
    make_tx(axis_name=MULTIHOST_AXIS), params, windows, mesh, MULTIHOST_AXIS
  )
  jit_params, jit_state = placements.train_sharded_jit(
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
    params, state = placements.train_hsdp(
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


def _explicit_results():
  """Explicit data parallelism over all devices of all processes."""
  mesh = jax.make_mesh((jax.device_count(),), (MULTIHOST_AXIS,))
  windows = make_windows(MULTIHOST_WINDOW_SIZES, jax.device_count())
  tx = tokacc.token_weighted_multistep(adamw(), MULTIHOST_K)
  params, loss = placements.train_explicit(tx, init_params(), windows, mesh)
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
    params, state = placements.train_explicit_state(
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
  params, state = placements.train_shard_map(
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
