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
"""Time and memory of gradient accumulation methods, on the same data.

Every method of ``methods.METHODS`` trains the same model from the same
parameters on the same micro-batches with AdamW, as a user's jitted train
step would (parameters and optimizer state donated), windows of all
methods interleaved (``timing.py``). Printed: the median time per
micro-step and per window after warm-up, their ratios to the method's
hand-written ideal (per window also to ``optax.MultiSteps``), the compiled
memory of each jitted function, the largest parameter difference to the
ideal after one window, and the collectives of ``collectives.py`` on fake
CPU devices. ``benchmarks/README.md`` lists the methods and models::

  python -m benchmarks.run --short            # the full models, 4 windows
  python -m benchmarks.run --out results.json # the full run
  python -m benchmarks.run --models mlp_bf16 --methods ideal,multisteps,tokacc
  python -m benchmarks.run --quick            # smoke-test sizes (CI runs it)
"""

import argparse
import sys

import jax

from benchmarks import collectives
from benchmarks import common
from benchmarks import methods
from benchmarks import models
from benchmarks import report
from benchmarks import timing
from benchmarks import trainers

# GPT-2 small runs when named (--models gpt2,gpt2_bf16; device_check.py).
DEFAULT_MODELS = ('mlp', 'transformer', 'mlp_bf16')
SETTINGS = {
  # windows timed, warm-up windows, k values
  'full': dict(windows=10, warmup=2, ks=(4, 8)),
  'short': dict(windows=4, warmup=1, ks=(4,)),
  'quick': dict(windows=1, warmup=1, ks=(2,)),
}


def parse_args(argv=None):
  """The command line, with the setting's defaults filled in."""
  parser = argparse.ArgumentParser(
    description=__doc__.splitlines()[0],
    formatter_class=argparse.RawDescriptionHelpFormatter,
  )
  parser.add_argument(
    '--quick', action='store_true', help='smoke-test sizes (what CI runs)'
  )
  parser.add_argument(
    '--short', action='store_true', help='the full models, fewer windows'
  )
  parser.add_argument(
    '--models', default=','.join(DEFAULT_MODELS), help=','.join(models.MODELS)
  )
  parser.add_argument(
    '--methods',
    default=','.join(methods.METHODS),
    help=','.join(methods.METHODS),
  )
  parser.add_argument('--k', default=None, help='e.g. 4,8')
  parser.add_argument('--windows', type=int, default=None)
  parser.add_argument('--warmup', type=int, default=None)
  parser.add_argument(
    '--devices',
    type=int,
    default=8,
    help='fake CPU devices for the collective counts (0: skip them)',
  )
  parser.add_argument(
    '--ddp-devices',
    type=int,
    default=1,
    help="devices of the explicit DDP methods' mesh (default 1)",
  )
  parser.add_argument('--out', help='write the results as JSON to this file')
  args = parser.parse_args(argv)
  args.setting = 'quick' if args.quick else 'short' if args.short else 'full'
  defaults = SETTINGS[args.setting]
  try:
    args.methods = common.parse_names(args.methods, methods.METHODS, 'method')
    args.models = common.parse_names(args.models, models.MODELS, 'model')
    args.ks = common.parse_ks(args.k) if args.k else defaults['ks']
  except ValueError as e:
    parser.error(str(e))
  for name in ('windows', 'warmup'):
    if getattr(args, name) is None:
      setattr(args, name, defaults[name])
  if args.windows < 1 or args.warmup < 0 or args.ddp_devices < 1:
    parser.error('--windows and --ddp-devices must be >= 1, --warmup >= 0.')
  return args


def _collectives(args):
  """The rows of ``collectives.py`` (None with ``--devices 0`` or fewer
  CPU devices than asked)."""
  if not args.devices or len(jax.devices('cpu')) < args.devices:
    return None
  rows = collectives.run(args.devices, args.ks)
  print(f'\ncollectives on {args.devices} fake CPU devices:')
  report.print_collectives(rows)
  return rows


def main(argv=None):
  args = parse_args(argv)
  if args.devices or args.ddp_devices > 1:  # fake CPU devices for either
    common.use_cpu_devices(max(args.devices, args.ddp_devices))
  if len(jax.devices()) < args.ddp_devices:
    sys.exit(f'--ddp-devices {args.ddp_devices}: only {len(jax.devices())}.')
  info = common.machine()
  print(f'{info["device"]}, {info["cpu_count"]} CPUs, jax {info["jax"]}')
  ddp_devices = jax.devices()[: args.ddp_devices]
  rows = []
  for model_name in args.models:
    for k in args.ks:
      print(f'  {model_name}, k={k}', file=sys.stderr)
      model = models.build(model_name, args.setting, k)
      case = trainers.make_case(model, k, ddp_devices)
      rows += timing.measure(case, args.methods, args.windows, args.warmup)[0]
  report.print_table(rows)
  collective_rows = _collectives(args)
  if args.out:
    results = {
      'setting': args.setting,
      'command': common.command('run', argv),
      'machine': info,
      'windows': args.windows,
      'warmup': args.warmup,
      'ddp_devices': args.ddp_devices,
      'rows': rows,
      'collectives': collective_rows,
    }
    common.write_json(args.out, results)
  return rows


if __name__ == '__main__':
  main()
