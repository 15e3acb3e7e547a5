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
"""Collectives per micro-step and per window, read from the compiled HLO.

Compiles one training step (gradient, optimizer update, ``apply_updates``)
of a small MLP for each sharding pattern of ``patterns.py``, on fake CPU
devices, with AdamW and windows of k micro-batches, and lists every
collective of the compiled HLO (read by ``optax_tokacc.testing.collectives``,
the tests' reader) with the mesh axes it spans and its payload. A collective on the
unconditional path of the step runs on every micro-step; one in the taken
branch of the transform's ``lax.cond`` only on the step that closes the
window. Each pattern also trains 2 windows against single-device
full-batch AdamW (``ideals.full_batch``), and reports the bytes per device
of the accumulator and of AdamW's state. ``benchmarks/README.md`` has the
patterns and the table's columns::

    python -m benchmarks.collectives [--devices 8] [--k 1,4,8] [--out x.json]
    python -m benchmarks.collectives --patterns explicit_ddp,explicit_hsdp
"""

import argparse

import jax
from jax.sharding import NamedSharding
import optax

from benchmarks import common
from benchmarks import ideals
from benchmarks import models
from benchmarks import patterns
from benchmarks import report
import optax_tokacc as tokacc
from optax_tokacc.testing import collectives


def _train(setup, windows):
  """The parameters after training ``windows`` (already placed)."""
  params, state = setup.params, setup.state
  for window in windows:
    for batch in window:
      params, state = setup.step(params, state, batch)
  return params


def _state_bytes_per_device(state):
  """The bytes of the accumulator and of the inner optimizer's state
  (AdamW's moments and counter) that one device holds."""
  if isinstance(state, optax.MultiStepsState):
    acc, inner = state.acc_grads, state.inner_opt_state
  else:
    found = tokacc.find_state(state)
    acc, inner = found.grad_sums, found.inner_state
  return common.bytes_per_device(acc), common.bytes_per_device(inner)


def measure(name, devices, k, windows, expected):
  """One row: the compiled step's collectives, and 2 windows trained."""
  pattern = patterns.PATTERNS[name]
  setup = pattern.build(devices, k, models.small_params())
  param_bytes = sum(x.nbytes for x in jax.tree.leaves(setup.params))
  acc_bytes, optimizer_bytes = _state_bytes_per_device(setup.state)
  with setup.mesh_context():
    data = NamedSharding(setup.mesh, setup.batch_spec)
    windows = jax.device_put(windows, data)
    lowered = setup.step.lower(setup.params, setup.state, windows[0][0])
    text = lowered.compile().as_text()
    records = collectives.collective_records(text, setup.mesh_axes)
    params = _train(setup, windows)
  return {
    'name': name,
    'pattern': pattern.title,
    'k': k,
    'devices': len(devices),
    'mesh': ' x '.join(f'{n}={s}' for n, s in setup.mesh_axes),
    'param_bytes': param_bytes,
    'collectives': records,
    'summary': collectives.summarize(records, k),
    'accumulator_bytes_per_device': acc_bytes,
    'optimizer_bytes_per_device': optimizer_bytes,
    'exact': pattern.exact,
    'max_abs_diff_to_full_batch': common.max_difference(params, expected),
  }


def run(num_devices=8, ks=(1, 4, 8), names=tuple(patterns.PATTERNS)):
  """Rows of :func:`measure` for each k and pattern, on the first
  ``num_devices`` CPU devices (hybrid patterns need an even number >= 4 of
  devices; they are left out otherwise)."""
  devices = jax.devices('cpu')[:num_devices]
  if len(devices) < 4 or len(devices) % 2:
    names = [name for name in names if not patterns.PATTERNS[name].hybrid]
  rows = []
  for k in ks:
    windows = models.small_windows(len(devices), k)
    with jax.default_device(devices[0]):
      expected = ideals.full_batch(
        models.small_params(), windows, patterns.LEARNING_RATE
      )
    for name in names:
      rows.append(measure(name, devices, k, windows, expected))
  return rows


def parse_args(argv=None):
  parser = argparse.ArgumentParser(
    description=__doc__.splitlines()[0],
    formatter_class=argparse.RawDescriptionHelpFormatter,
  )
  parser.add_argument('--devices', type=int, default=8)
  parser.add_argument('--k', default='1,4,8', help='window sizes, e.g. 1,4,8')
  parser.add_argument(
    '--patterns',
    default=','.join(patterns.PATTERNS),
    help=f'comma-separated, of: {", ".join(patterns.PATTERNS)} (default: all)',
  )
  parser.add_argument('--out', help='write the rows as JSON to this file')
  args = parser.parse_args(argv)
  try:
    args.ks = common.parse_ks(args.k)
    args.names = common.parse_names(args.patterns, patterns.PATTERNS, 'pattern')
  except ValueError as e:
    parser.error(str(e))
  return args


def main(argv=None):
  args = parse_args(argv)
  common.use_cpu_devices(args.devices)
  rows = run(args.devices, args.ks, args.names)
  size = rows[0]['param_bytes'] if rows else '?'
  print(
    f'{args.devices} fake CPU devices, jax {jax.__version__}; payload bytes '
    f'as multiples of the parameter bytes P = {size}'
  )
  report.print_collectives(rows)
  report.print_collective_details(rows)
  if args.out:
    common.write_json(
      args.out,
      {
        'command': common.command('collectives', argv),
        'machine': common.machine(),
        'rows': rows,
      },
    )
  return rows


if __name__ == '__main__':
  main()
