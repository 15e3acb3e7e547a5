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
"""Save and restore time of a mid-window state with orbax (issue 40).

A model's parameters (``models.py``: the MLP, GPT-2 small) and the state
of ``token_weighted_multistep(adamw, 4)``, two micro-steps into a window,
are saved with ``orbax.checkpoint.StandardCheckpointer`` on N fake CPU
devices and restored in a new process on M: ``tx.init`` on one device,
DDP under ``shard_map`` (``tokacc.init_sharded`` with ``axis_name``) on
more. Each save and restore runs in a process of its own (the number of
devices is set before JAX starts), each part timed apart, the package's
and orbax's: the save, ``to_checkpoint((params, state))`` then orbax's
``save`` and ``wait_until_finished``; the restore, the documented flow,
orbax's ``metadata(path)``, ``checkpoint_target(like, metadata)``,
orbax's ``restore(path, target)``, ``from_checkpoint(restored, like)``.
``--baseline DIR`` runs 0.5.0's flow too, with the ``optax_tokacc`` of the
checkout DIR (``git worktree add DIR v0.5.0``): the same save, the target
``jax.tree.map(ocp.utils.to_shape_dtype_struct, tokacc.to_checkpoint(like))``
(the package's part), orbax's restore, ``from_checkpoint``; a restore it
cannot do holds its error. Each restore is checked against the window
saved (micro-step, tokens, the sum of the gradient sums)::

  python -m benchmarks.checkpoint                       # mlp and gpt2
  python -m benchmarks.checkpoint --baseline /tmp/v050  # and 0.5.0's flow
  python -m benchmarks.checkpoint --quick --models mlp  # smoke test (CI)
"""

import argparse
import functools
import itertools
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

from benchmarks import common
from benchmarks import models

REPO = os.path.dirname(common.HERE)
K = 4
MICRO_STEPS = 2  # into the window of K: the middle of a window
DEFAULT_MODELS = ('mlp', 'gpt2')
DEFAULT_PAIRS = '1:1,4:4,4:2,4:1'  # devices saved on : restored on
# The package's and orbax's parts of each, in the order they run.
SAVE_PARTS = ('to_checkpoint', 'orbax_save')
_LAST = ('orbax_restore', 'from_checkpoint')
RESTORE_PARTS = {
  'now': ('orbax_metadata', 'checkpoint_target', *_LAST),
  '0.5.0': ('target', *_LAST),
}
OURS = ('to_checkpoint', 'checkpoint_target', 'target', 'from_checkpoint')
WORKER_LIMIT_S = 1800


def parse_args(argv=None):
  parser = argparse.ArgumentParser(
    description=__doc__.splitlines()[0],
    formatter_class=argparse.RawDescriptionHelpFormatter,
  )
  parser.add_argument(
    '--models', default=','.join(DEFAULT_MODELS), help=','.join(models.MODELS)
  )
  parser.add_argument('--quick', action='store_true', help='smoke-test sizes')
  parser.add_argument(
    '--pairs', default=DEFAULT_PAIRS, help='devices saved on : restored on'
  )
  parser.add_argument('--repeats', type=int, default=None, help='default 3')
  parser.add_argument('--baseline', help='a checkout of 0.5.0 (its flow too)')
  parser.add_argument('--out', help='write the results as JSON to this file')
  # One save or restore, in a process of its own (run by the above).
  parser.add_argument('--worker', choices=('save', 'restore'))
  parser.add_argument('--flow', choices=tuple(RESTORE_PARTS), default='now')
  parser.add_argument('--devices', type=int, default=1)
  parser.add_argument('--path')
  parser.add_argument('--result')
  args = parser.parse_args(argv)
  args.setting = 'quick' if args.quick else 'short'
  if args.repeats is None:
    args.repeats = 1 if args.quick else 3
  try:
    args.models = common.parse_names(args.models, models.MODELS, 'model')
    args.pairs = tuple(
      tuple(int(n) for n in pair.split(':')) for pair in args.pairs.split(',')
    )
  except ValueError as e:
    parser.error(str(e))
  if args.repeats < 1 or min(min(pair) for pair in args.pairs) < 1:
    parser.error('--repeats and the devices of --pairs must be >= 1.')
  return args


# The worker: one save or restore, in a process with --devices devices.


def _state(model_name, setting, devices):
  """``(tx, params, state, fill)`` for ``model_name`` on ``devices``
  devices: ``tx.init`` on one, DDP under ``shard_map`` on more; ``fill``
  adds one micro-step of gradients that differ per device."""
  import jax  # noqa: PLC0415
  import optax  # noqa: PLC0415

  import optax_tokacc as tokacc  # noqa: PLC0415

  model = models.build(model_name, setting, K)
  adamw = optax.adamw(1e-4, mu_dtype=model.mu_dtype)

  def micro_step(tx, params, state, share):
    grads = jax.tree.map(lambda p: p * share.astype(p.dtype), params)
    return tx.update(grads, state, params, num_tokens=10 * share)[1]

  if devices == 1:
    tx = tokacc.token_weighted_multistep(adamw, K)
    params = jax.device_put(model.params)
    fill = functools.partial(micro_step, tx, share=jax.numpy.int32(1))
    return tx, params, tx.init(params), jax.jit(fill, donate_argnums=1)
  tx = tokacc.token_weighted_multistep(adamw, K, axis_name='data')
  mesh = jax.make_mesh((devices,), ('data',), devices=jax.devices()[:devices])
  params = jax.device_put(model.params, jax.NamedSharding(mesh, jax.P()))
  specs = tokacc.state_partition_specs(tx, params, axis_name='data')

  def local(params, state):
    share = jax.lax.axis_index('data') + 1
    return micro_step(tx, params, state, share)

  fill = jax.shard_map(
    local, mesh=mesh, in_specs=(jax.P(), specs), out_specs=specs
  )
  state = tokacc.init_sharded(tx, params, mesh, axis_name='data')
  return tx, params, state, jax.jit(fill, donate_argnums=1)


def _window(tree):
  """What a restore must give back: the window's micro-step, its tokens
  and the sum of its gradient sums (over every device's share)."""
  import jax  # noqa: PLC0415
  import numpy as np  # noqa: PLC0415

  state = tree[1]
  sums = jax.tree.leaves(state.grad_sums)
  return {
    'mini_step': int(np.max(np.asarray(state.mini_step))),
    'tokens': int(np.sum(np.asarray(state.acc_tokens))),
    'grad_sum': sum(
      float(np.sum(np.asarray(x), dtype=np.float64)) for x in sums
    ),
  }


def _abstract(tree):
  """``tree``'s types (shape, dtype, sharding), as ``jax.eval_shape``
  gives them: the ``like`` of a restore on several devices, whose arrays
  are then freed (a GPT-2 state on 4 fake devices of one host holds 8
  GB, which the restore doubles)."""
  import jax  # noqa: PLC0415

  def abstract(x):
    sharding = getattr(x, 'sharding', None)
    return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)

  return jax.tree.map(abstract, tree)


def _timed(parts, name, call, *args):
  """``call(*args)``, ready, its seconds appended to ``parts[name]``."""
  import jax  # noqa: PLC0415

  start = time.perf_counter()
  out = jax.block_until_ready(call(*args))
  parts.setdefault(name, []).append(time.perf_counter() - start)
  return out


def _save(args, checkpointer, tree):
  import optax_tokacc as tokacc  # noqa: PLC0415

  def save(path, saved):
    checkpointer.save(path, saved)
    checkpointer.wait_until_finished()

  parts, path = {}, None
  for repeat in range(args.repeats):
    if path:  # only the last is restored
      shutil.rmtree(path)
    path = os.path.join(args.path, f'repeat_{repeat}')
    saved = _timed(parts, 'to_checkpoint', tokacc.to_checkpoint, tree)
    _timed(parts, 'orbax_save', save, path, saved)
    del saved
  size = sum(
    os.path.getsize(os.path.join(folder, name))
    for folder, _, names in os.walk(path)
    for name in names
  )
  return {'parts_s': parts, 'path': path, 'bytes': size}


def _restore(args, checkpointer, like):
  import jax  # noqa: PLC0415
  import orbax.checkpoint as ocp  # noqa: PLC0415

  import optax_tokacc as tokacc  # noqa: PLC0415

  parts = {}
  for _ in range(args.repeats):
    if args.flow == 'now':
      metadata = _timed(
        parts, 'orbax_metadata', checkpointer.metadata, args.path
      )
      target = _timed(
        parts, 'checkpoint_target', tokacc.checkpoint_target, like, metadata
      )
    else:

      def target_of(like):
        saved = tokacc.to_checkpoint(like)
        return jax.tree.map(ocp.utils.to_shape_dtype_struct, saved)

      target = _timed(parts, 'target', target_of, like)
    restored = _timed(
      parts, 'orbax_restore', checkpointer.restore, args.path, target
    )
    del target
    tree = _timed(
      parts, 'from_checkpoint', tokacc.from_checkpoint, restored, like
    )
    del restored
    window = _window(tree)
    del tree
  return {'parts_s': parts, 'window': window}


def worker(args):
  """One save (after filling the window) or one restore, as JSON in
  ``args.result``; a restore that fails records its error."""
  common.use_cpu_devices(args.devices)
  import orbax.checkpoint as ocp  # noqa: PLC0415

  import optax_tokacc as tokacc  # noqa: PLC0415

  tx, params, state, fill = _state(args.models[0], args.setting, args.devices)
  result = {'package': tokacc.__file__}
  checkpointer = ocp.StandardCheckpointer()
  if args.worker == 'save':
    for _ in range(MICRO_STEPS):
      state = fill(params, state)
    result.update(_save(args, checkpointer, (params, state)))
    result['window'] = _window((params, state))
  else:
    like = (params, state)
    if args.devices > 1:
      like = _abstract(like)  # its arrays freed (checkpoint_target takes
      del params, state  # types on meshes; one device's state it expands)
    try:
      result.update(_restore(args, checkpointer, like))
    except Exception as e:  # noqa: BLE001 - 0.5.0 on other devices
      result['error'] = common.describe_error(e)
  checkpointer.close()
  peak_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
  result['peak_rss_bytes'] = 1024 * peak_kib
  common.write_json(args.result, result)


# The run: a process per save and per restore, the tables.


def _run_worker(flow, package, *args):
  """``python -m benchmarks.checkpoint --worker ...`` with the
  ``optax_tokacc`` of ``package`` (a folder) first on its path (nothing
  else: ``PYTHONSAFEPATH`` keeps the working folder off it)."""
  with tempfile.NamedTemporaryFile(suffix='.json') as result:
    env = dict(
      os.environ,
      JAX_PLATFORMS='cpu',
      PYTHONSAFEPATH='1',
      PYTHONPATH=os.pathsep.join(dict.fromkeys((package, REPO))),
    )
    command = [sys.executable, '-m', 'benchmarks.checkpoint', '--flow', flow]
    command += [*map(str, args), '--result', result.name]
    process = subprocess.run(
      command, capture_output=True, text=True, env=env, timeout=WORKER_LIMIT_S
    )
    if process.returncode:
      raise RuntimeError(f'{" ".join(command)}:\n{process.stderr[-3000:]}')
    with open(result.name) as f:
      out = json.load(f)
  if not out['package'].startswith(os.path.join(package, 'optax_tokacc')):
    raise RuntimeError(f'{flow} ran {out["package"]}, not {package}.')
  return out


def _checked(saved, restored):
  """The restored window against the saved one: the same micro-step and
  tokens, the gradient sums' total within float32 round-off of merging;
  or the restore's error (its first sentence)."""
  if 'error' in restored:
    return restored['error'].split('. ')[0]
  got, want = restored['window'], saved['window']
  same = [got[key] == want[key] for key in ('mini_step', 'tokens')]
  difference = abs(got['grad_sum'] - want['grad_sum'])
  if not all(same) or difference > 1e-5 * abs(want['grad_sum']):
    return f'window differs: saved {want}, restored {got}'
  return 'ok'


def measure(args, model_name, flows, folder):
  """The rows of one model: each pair's save and restore, by each flow
  (name -> its package's folder) in turn, so that load spreads over all."""
  options = ['--models', model_name, '--repeats', args.repeats]
  options += ['--quick'] if args.quick else []
  saves, rows = {}, []
  for (saved_on, restored_on), flow in itertools.product(args.pairs, flows):
    print(
      f'  {model_name} {flow}: {saved_on} -> {restored_on}', file=sys.stderr
    )
    if (flow, saved_on) not in saves:
      path = os.path.join(folder, f'{model_name}_{flow}_{saved_on}')
      worker_args = ['--worker', 'save', '--devices', saved_on, '--path', path]
      saves[flow, saved_on] = _run_worker(
        flow, flows[flow], *worker_args, *options
      )
    saved = saves[flow, saved_on]
    worker_args = ['--worker', 'restore', '--devices', restored_on]
    worker_args += ['--path', saved['path']]
    restored = _run_worker(flow, flows[flow], *worker_args, *options)
    rows.append(
      {
        'model': model_name,
        'flow': flow,
        'saved_on': saved_on,
        'restored_on': restored_on,
        'checkpoint_bytes': saved['bytes'],
        'save_s': saved['parts_s'],
        'restore_s': restored.get('parts_s'),
        'peak_rss_bytes': [saved['peak_rss_bytes'], restored['peak_rss_bytes']],
        'check': _checked(saved, restored),
        'load_average_1min': os.getloadavg()[0],
      }
    )
  for saved in saves.values():
    shutil.rmtree(os.path.dirname(saved['path']))
  return rows


def _seconds(parts, names, pick=statistics.median):
  """``pick`` of each part's seconds: 'total (ours + orbax)', and each
  part's."""
  if parts is None:
    return '', ''
  picked = {name: pick(parts[name]) for name in names}
  ours = sum(s for name, s in picked.items() if name in OURS)
  orbax = sum(s for name, s in picked.items() if name not in OURS)
  each = ', '.join(f'{name} {s:.3f}' for name, s in picked.items())
  return f'{ours + orbax:.3f} ({ours:.3f} + {orbax:.3f})', each


def markdown(rows):
  """The table: per model, devices and flow, the median seconds of the
  save and of the restore (the package's + orbax's), the first restore
  of its process, the check, and the restore's parts."""
  lines = [
    '| model | devices | flow | GB | save s (ours + orbax) | '
    'restore s (ours + orbax) | first restore s | check | restore parts, s |',
    '| --- | --- | --- | ---: | --- | --- | --- | --- | --- |',
  ]
  for row in rows:
    save, _ = _seconds(row['save_s'], SAVE_PARTS)
    names = RESTORE_PARTS[row['flow']]
    restore, each = _seconds(row['restore_s'], names)
    first, _ = _seconds(row['restore_s'], names, lambda seconds: seconds[0])
    lines.append(
      f'| {row["model"]} | {row["saved_on"]} -> {row["restored_on"]} | '
      f'{row["flow"]} | {row["checkpoint_bytes"] / 1e9:.3f} | {save} | '
      f'{restore} | {first} | {row["check"]} | {each} |'
    )
  return '\n'.join(lines)


def main(argv=None):
  args = parse_args(argv)
  if args.worker:
    return worker(args)
  flows = {'now': REPO}
  if args.baseline:
    flows = {'0.5.0': os.path.abspath(args.baseline), **flows}
  load = [os.getloadavg()]
  folder = tempfile.mkdtemp(prefix='checkpoint_bench_')
  rows = []
  try:
    for model_name in args.models:
      rows += measure(args, model_name, flows, folder)
  finally:
    shutil.rmtree(folder, ignore_errors=True)
  load.append(os.getloadavg())
  print(markdown(rows))
  before, after = (' '.join(f'{x:.2f}' for x in each) for each in load)
  print(f'load average (1, 5, 15 min): before {before}, after {after}')
  if args.out:
    results = {
      'command': common.command('checkpoint', argv),
      'machine': common.machine(),
      'load_average': load,
      'repeats': args.repeats,
      'rows': rows,
    }
    common.write_json(args.out, results)
  return rows


if __name__ == '__main__':
  main()
