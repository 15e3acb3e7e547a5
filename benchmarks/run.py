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

Every method trains the same model from the same parameters on the same
micro-batches with AdamW, as a user's jitted train step would (parameters and
optimizer state donated). One window is ``k`` micro-batches. Windows of all
methods are interleaved (round robin) so that load from other processes
spreads over all of them (``_timing.py``). Printed: the median time per
micro-step (a call that does not close the window) and per window after
warm-up, their ratios to the method's hand-written ideal (per window also
to ``optax.MultiSteps``), the compiled memory of each jitted function, and
the collectives of ``collectives.py`` on fake CPU devices::

  python -m benchmarks.run --short            # the full models, 4 windows
  python -m benchmarks.run --out results.json # the full run
  python -m benchmarks.run --models mlp_bf16 --methods ideal,multisteps,tokacc
  python -m benchmarks.run --quick            # smoke-test sizes (CI runs it)

Methods (``--methods``; the train steps are in ``_methods.py``,
``_flax_methods.py`` and ``_explicit_methods.py``):

- ``plain``: one AdamW step per micro-batch (no accumulation).
- ``ideal``: the reference: a jitted micro-step ``acc + grad`` (accumulator
  donated) and, once per window, a jitted AdamW update of the token mean.
- ``multisteps``: ``optax.MultiSteps(adamw, k)`` on the mean loss, with
  ``optax.apply_updates``.
- ``tokacc``: ``token_weighted_multistep(adamw, k)`` with
  ``optax.apply_updates``.
- ``tokacc_chain``: ``optax.chain(token_weighted_multistep(adamw, k),
  optax.clip(1.0))``: a transform chained after the accumulator.
- ``tokacc_device`` / ``tokacc_host``: ``tokacc`` as compiled programs:
  one (the device decides, ``close=None``), or the host's two
  (``close=False`` on the micro-steps, ``close=True`` on the k-th; no
  conditional). Their compile times are printed below the table.
- ``tokacc_no_buffer`` / ``tokacc_select_restart`` (``ABLATIONS``):
  ``tokacc_device`` with one performance trick undone: the updates in fresh
  zeros instead of the accumulator's buffer, and the window's restart as a
  select instead of a ``lax.cond``.
- ``tokacc_flax``: ``optax_tokacc.flax.TrainState.apply_gradients`` (linen).
- ``tokacc_nnx``: ``optax_tokacc.flax.Optimizer.update`` (nnx).
- ``microbatched``: one jitted step per window on the whole window's batch,
  ``tokacc.microbatched_value_and_grad`` then AdamW.
- ``EXPLICIT_METHODS``: ``tokacc_explicit_ddp``, ``token_weighted_multistep``
  under plain ``jax.jit`` on an explicit ``data`` mesh of ``--ddp-devices``
  devices with parameters typed reduced, and its hand-written references
  ``ideal_explicit_ddp`` (two programs) and ``ideal_explicit_ddp_one``
  (one program that applies updates on every call, what
  ``tokacc_explicit_ddp``'s ratios divide by); ``tokacc_explicit_ddp_host``,
  the same closed by the host (two programs); ``tokacc_explicit_zero1``, the same with AdamW's
  state sharded over ``data`` (``init_sharded(...,
  shard_optimizer_over=('data',))``), and its hand-written reference
  ``ideal_explicit_zero1`` (one reduce-scatter, AdamW on the shards, one
  all-gather per window). MLP models only. Their memory per device
  (arguments of each compiled function, optimizer state) is printed below
  the table.

Models (``--models``): ``mlp`` and ``transformer`` in float32, and
``mlp_bf16``, the mixed-precision configuration: bfloat16 parameters and
activations, float32 accumulators, AdamW with ``mu_dtype=jnp.float32``
(``multisteps`` accumulates in bfloat16, as optax does); ``gpt2`` and
``gpt2_bf16``, GPT-2 small (124M parameters) in float32 and in mixed
precision, when named (``--short``: micro-batches of 2 x 64 tokens for a
CPU; full: 8 x 1024).

Exact methods (all but ``plain`` and ``multisteps``) hold the same
parameters after the first window; the largest difference to their ideal
(``max|dp|``) is reported as a check. A method of ``MAY_FAIL`` that raises
while a run that did not name it sets it up is reported in its row
(``error``) instead of stopping the run.
"""

import argparse
import sys

import jax
import optax

from benchmarks import _common
from benchmarks import _explicit_methods
from benchmarks import _methods
from benchmarks import _models
from benchmarks import _report
from benchmarks import _timing
from benchmarks import collectives

FLAX_METHODS = ('tokacc_flax', 'tokacc_nnx')
EXPLICIT_METHODS = tuple(_explicit_methods.METHODS)
METHODS = (
  'plain',
  'ideal',
  'multisteps',
  'tokacc',
  'tokacc_chain',
  'tokacc_device',
  'tokacc_host',
  'tokacc_host_no_norms',
  *FLAX_METHODS,
  'microbatched',
  *EXPLICIT_METHODS,
  *_methods.ABLATIONS,
)
# Methods whose failure a run that did not name them reports in the row
# instead of raising. Empty it once the library supports explicit sharding.
MAY_FAIL = ()
MODEL_NAMES = tuple(_models.MODELS)
# GPT-2 small runs when named (--models gpt2,gpt2_bf16; device_check.py).
DEFAULT_MODELS = ('mlp', 'transformer', 'mlp_bf16')
SETTINGS = {
  # windows timed, warm-up windows, k values, models
  'full': dict(windows=10, warmup=2, ks=(4, 8), models=DEFAULT_MODELS),
  'short': dict(windows=4, warmup=1, ks=(4,), models=DEFAULT_MODELS),
  'quick': dict(windows=1, warmup=1, ks=(2,), models=DEFAULT_MODELS),
}


def build(name, case):
  """The trainer of method ``name`` on ``case``."""
  if name in FLAX_METHODS:
    from benchmarks import _flax_methods  # noqa: PLC0415 - Flax is optional.

    return _flax_methods.METHODS[name](case)
  if name in EXPLICIT_METHODS:
    return _explicit_methods.METHODS[name](case)
  return _methods.METHODS[name](case)


def _build_all(case, names, may_fail):
  """``(trainers, errors)``: name -> trainer, and name -> why not."""
  trainers, errors = {}, {}
  for name in names:
    if name in EXPLICIT_METHODS and not case.model.explicit:
      continue  # Its loss does not take reduced parameters.
    try:
      trainers[name] = build(name, case)
    except ImportError as e:
      print(f'  skipped {name}: {e}', file=sys.stderr)
    except Exception as e:  # noqa: BLE001 - reported in the row and stderr.
      if name not in may_fail:
        raise
      errors[name] = _common.describe_error(e)
      print(f'  {name} not measured: {errors[name]}', file=sys.stderr)
  return trainers, errors


def _differences(trainers):
  """Largest parameter difference of each exact method to its reference.

  After one window all exact methods hold the same parameters up to
  rounding. (Later, AdamW's normalization of near-zero gradient entries
  lets rounding differences grow to ~lr.)
  """
  return {
    name: _common.max_difference(
      trainer.params(), trainers[trainer.reference].params()
    )
    for name, trainer in trainers.items()
    if name not in _methods.INEXACT and trainer.reference in trainers
  }


def bench_model(model_name, k, args, may_fail=MAY_FAIL):
  """Rows of one model and k: times, ratios, memory, check."""
  model = _models.build(model_name, args.setting, k)
  case = _methods.Case(
    model,
    k,
    optax.adamw(1e-4, mu_dtype=model.mu_dtype),
    tuple(jax.devices()[: args.ddp_devices]),
  )
  trainers, errors = _build_all(case, args.methods, may_fail)
  differences = {}

  def check():
    differences.update(_differences(trainers))

  times = _timing.interleave(trainers, k, args.windows, args.warmup, check)
  return _report.rows(case, trainers, times, differences, errors)


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
  parser.add_argument('--models', default=None, help=','.join(MODEL_NAMES))
  parser.add_argument('--methods', default=None, help=','.join(METHODS))
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
    args.named_methods = args.methods is not None
    args.methods = _common.parse_names(
      args.methods or ','.join(METHODS), METHODS, 'method'
    )
    args.models = _common.parse_names(
      args.models or ','.join(defaults['models']), MODEL_NAMES, 'model'
    )
    args.ks = _common.parse_ks(args.k) if args.k else defaults['ks']
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
  collectives.print_table(rows)
  return rows


def main(argv=None):
  args = parse_args(argv)
  if args.devices or args.ddp_devices > 1:  # fake CPU devices for either
    _common.use_cpu_devices(max(args.devices, args.ddp_devices))
  if len(jax.devices()) < args.ddp_devices:
    sys.exit(f'--ddp-devices {args.ddp_devices}: only {len(jax.devices())}.')
  info = _common.machine()
  print(f'{info["device"]}, {info["cpu_count"]} CPUs, jax {info["jax"]}')
  may_fail = () if args.named_methods else MAY_FAIL
  rows = []
  for model_name in args.models:
    for k in args.ks:
      print(f'  {model_name}, k={k}', file=sys.stderr)
      rows += bench_model(model_name, k, args, may_fail)
  _report.print_table(rows)
  collective_rows = _collectives(args)
  if args.out:
    results = {
      'setting': args.setting,
      'command': _common.command('run', argv),
      'machine': info,
      'windows': args.windows,
      'warmup': args.warmup,
      'ddp_devices': args.ddp_devices,
      'rows': rows,
      'collectives': collective_rows,
    }
    _common.write_json(args.out, results)
  return rows


if __name__ == '__main__':
  main()
