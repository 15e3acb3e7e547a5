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
of a small MLP for each pattern below, on fake CPU devices, with AdamW and
windows of k micro-batches, and lists every collective of the compiled HLO
with the mesh axes it spans and its payload (``--patterns`` selects, by the
names in brackets):

- ``DDP`` (``ddp``): ``jax.shard_map`` over ``data``, replicated parameters
  marked varying, ``token_weighted_multistep(..., axis_name='data')``.
- ``FSDP (GSPMD)`` (``fsdp_gspmd``): ``jax.jit`` over global arrays,
  parameters sharded over ``fsdp`` (first dimension), activations
  constrained to the batch sharding, no ``axis_name``.
- ``HSDP partial-manual`` (``hsdp_partial_manual``): mesh ``replica x
  fsdp``; ``jax.shard_map`` manual over ``replica`` only, ``fsdp`` left to
  GSPMD as in FSDP, ``axis_name='replica'``.
- ``HSDP fully manual`` (``hsdp_fully_manual``): ``jax.shard_map`` over both
  axes, parameter shards ``all_gather``-ed over ``fsdp`` in the forward pass
  (so autodiff reduce-scatters the gradients), ``axis_name=('replica',
  'fsdp')``.
- ``pmean + MultiSteps`` (``pmean_multisteps``): ``lax.pmean`` of the
  gradients on every micro-step, then ``optax.MultiSteps(adamw, k)``.
- ``sharded jit`` (``sharded_jit``): ``jax.jit`` over global arrays,
  replicated parameters, batch sharded over ``data``, no ``axis_name``.
- Explicit sharding (``EXPLICIT_PATTERNS``; plain ``jax.jit`` under
  ``jax.set_mesh``, no ``axis_name``; see ``_explicit_steps.py``):
  ``explicit replicated`` (``explicit_replicated``, parameters ``P()``),
  ``explicit DDP`` (``explicit_ddp``, parameters ``P(None, None,
  reduced={'data'})``), ``explicit ZeRO-1`` (``explicit_zero1``, explicit
  DDP with AdamW's moments sharded over ``data``: ``init_sharded(...,
  shard_optimizer_over=('data',))``), ``explicit FSDP`` (``explicit_fsdp``,
  parameters sharded over ``fsdp``) and ``explicit HSDP``
  (``explicit_hsdp``, parameters ``P('fsdp', None, reduced={'replica'})``).

The state layouts come from ``tokacc.state_partition_specs`` and
``tokacc.init_sharded`` (explicit sharding: ``tx.init``). A collective on
the unconditional path of the step runs on every micro-step; one in the
taken branch of the transform's ``lax.cond`` (branch 1) only on the step
that closes the window. Per window: ``k * (every micro-step) + (closing
step only)``. Payload: the bytes of the unsharded buffer on one device
(all-reduce: its operand; all-gather: its result; reduce-scatter: its
operand). Each pattern also trains 2 windows and reports the largest
parameter difference to single-device full-batch AdamW on the token-mean
loss, and the bytes per device of the accumulator and of the inner
optimizer's state (AdamW's moments and counter).

A pattern of ``MAY_FAIL`` that raises in a run that did not name it is
reported in its row (``error``) instead of stopping the run: explicit
sharding, while the library's support for it is being written. Name it with
``--patterns`` to see the traceback::

    python -m benchmarks.collectives [--devices 8] [--k 1,4,8] [--out x.json]
    python -m benchmarks.collectives --patterns explicit_ddp,explicit_hsdp

Adding a pattern: a builder ``(devices, k, params) -> Setup`` (in
``_sharded_steps.py`` or ``_explicit_steps.py``) and one entry of
``PATTERNS``. The compiled HLO is read by ``tests/hlo.py``, the one reader
that tests and benchmarks share.
"""

import argparse
from collections.abc import Callable
import sys
from typing import NamedTuple

import jax
from jax.sharding import NamedSharding

from benchmarks import _common
from benchmarks import _explicit_steps as explicit
from benchmarks import _sharded_steps as steps
from tests import hlo


class Pattern(NamedTuple):
  """A sharding pattern: its title in tables and JSON, and its step.

  Attributes:
    title: the row's name (the JSON's ``pattern``).
    build: ``(devices, k, params) -> _sharded_steps.Setup``.
    exact: whether it should equal full-batch training.
    hybrid: whether it needs a ``replica x fsdp`` mesh (an even number >= 4
      of devices; left out otherwise).
  """

  title: str
  build: Callable[..., steps.Setup]
  exact: bool = True
  hybrid: bool = False


PATTERNS = {
  'ddp': Pattern('DDP', steps.ddp),
  'fsdp_gspmd': Pattern('FSDP (GSPMD)', steps.fsdp_gspmd),
  'hsdp_partial_manual': Pattern(
    'HSDP partial-manual', steps.hsdp_partial_manual, hybrid=True
  ),
  'hsdp_fully_manual': Pattern(
    'HSDP fully manual', steps.hsdp_fully_manual, hybrid=True
  ),
  'pmean_multisteps': Pattern(
    'pmean + MultiSteps', steps.pmean_multisteps, exact=False
  ),
  'sharded_jit': Pattern('sharded jit', steps.sharded_jit),
  'explicit_replicated': Pattern('explicit replicated', explicit.replicated),
  'explicit_ddp': Pattern('explicit DDP', explicit.ddp),
  'explicit_zero1': Pattern('explicit ZeRO-1', explicit.zero1),
  'explicit_fsdp': Pattern('explicit FSDP', explicit.fsdp),
  'explicit_hsdp': Pattern('explicit HSDP', explicit.hsdp, hybrid=True),
}
EXPLICIT_PATTERNS = (
  'explicit_replicated',
  'explicit_ddp',
  'explicit_zero1',
  'explicit_fsdp',
  'explicit_hsdp',
)
# Patterns whose failure a run that did not name them reports in the row
# instead of raising. Empty it once the library supports explicit sharding.
MAY_FAIL = ()


def _train(setup, windows):
  """The parameters after training ``windows`` (already placed)."""
  params, state = setup.params, setup.state
  for window in windows:
    for batch in window:
      params, state = setup.step(params, state, batch)
  return params


def measure(name, devices, k, windows, expected):
  """One row: the compiled step's collectives, and 2 windows trained."""
  pattern = PATTERNS[name]
  setup = pattern.build(devices, k, steps.init_params())
  param_bytes = sum(x.nbytes for x in jax.tree.leaves(setup.params))
  acc_bytes = steps.accumulator_bytes_per_device(setup.state)
  optimizer_bytes = steps.optimizer_bytes_per_device(setup.state)
  with setup.mesh_context():
    data = NamedSharding(setup.mesh, setup.batch_spec)
    windows = jax.device_put(windows, data)
    lowered = setup.step.lower(setup.params, setup.state, windows[0][0])
    records = hlo.collective_records(
      lowered.compile().as_text(), setup.mesh_axes
    )
    params = _train(setup, windows)
  return {
    'name': name,
    'pattern': pattern.title,
    'k': k,
    'devices': len(devices),
    'mesh': ' x '.join(f'{n}={s}' for n, s in setup.mesh_axes),
    'param_bytes': param_bytes,
    'collectives': records,
    'summary': hlo.summarize(records, k),
    'accumulator_bytes_per_device': acc_bytes,
    'optimizer_bytes_per_device': optimizer_bytes,
    'exact': pattern.exact,
    'max_abs_diff_to_full_batch': _common.max_difference(params, expected),
  }


def _measure_or_report(name, devices, k, windows, expected, may_fail):
  """:func:`measure`, or for a pattern of ``may_fail`` that raises, a row
  holding the error."""
  try:
    return measure(name, devices, k, windows, expected)
  except Exception as e:  # noqa: BLE001 - reported in the row and stderr.
    if name not in may_fail:
      raise
    error = _common.describe_error(e)
    print(f'  {name} (k={k}) not measured: {error}', file=sys.stderr)
    return {
      'name': name,
      'pattern': PATTERNS[name].title,
      'k': k,
      'devices': len(devices),
      'error': error,
    }


def run(num_devices=8, ks=(1, 4, 8), names=tuple(PATTERNS), may_fail=MAY_FAIL):
  """Rows of :func:`measure` for each k and pattern, on the first
  ``num_devices`` CPU devices (hybrid patterns need an even number >= 4 of
  devices; they are left out otherwise)."""
  devices = jax.devices('cpu')[:num_devices]
  if len(devices) < 4 or len(devices) % 2:
    names = [name for name in names if not PATTERNS[name].hybrid]
  rows = []
  for k in ks:
    windows = steps.make_windows(len(devices), k)
    with jax.default_device(devices[0]):
      expected = steps.reference(steps.init_params(), windows)
    for name in names:
      rows.append(
        _measure_or_report(name, devices, k, windows, expected, may_fail)
      )
  return rows


def _count(entry, param_bytes):
  return f'{entry["collectives"]} ({entry["bytes"] / param_bytes:.2f}P)'


def _row_line(row):
  """A measured row of the table."""
  summary, size = row['summary'], row['param_bytes']
  axes = ', '.join(
    f'{name}: {_count(entry, size)}'
    for name, entry in summary['window_by_axes'].items()
  )
  flag = ' (other branch!)' if summary['other_branch'] else ''
  return (
    f'{row["pattern"]:<20} {row["mesh"]:<18} {row["k"]:>2} '
    f'{_count(summary["micro_step"], size):>12} '
    f'{_count(summary["closing_step_extra"], size):>11} '
    f'{_count(summary["window"], size):>13} '
    f'{row["accumulator_bytes_per_device"] / size:>6.3f}P '
    f'{row["optimizer_bytes_per_device"] / size:>6.3f}P '
    f'{row["max_abs_diff_to_full_batch"]:>8.1e}  {axes or "-"}{flag}'
  )


def print_table(rows, file=None):
  """Per pattern and k: collectives (payload in parameter bytes P)."""
  print(
    f'{"pattern":<20} {"mesh":<18} {"k":>2} {"micro-step":>12} '
    f'{"closing +":>11} {"window":>13} {"acc/dev":>7} {"opt/dev":>7} '
    f'{"max|dp|":>8}  '
    'window by mesh axes',
    file=file,
  )
  for row in rows:
    if 'error' in row:
      line = f'{row["pattern"]:<20} {"":<18} {row["k"]:>2} not measured: '
      print(line + row['error'], file=file)
    else:
      print(_row_line(row), file=file)


def print_details(rows, file=None):
  """Every collective of each pattern's compiled step (of the last k)."""
  last = [row for row in rows if row['k'] == rows[-1]['k']]
  print(
    f'\n{"pattern":<20} {"runs on":<17} {"collective":<15} {"axes":<13} '
    f'{"group":>5} {"bytes":>8}',
    file=file,
  )
  for row in last:
    for record in row.get('collectives', ()):
      print(
        f'{row["pattern"]:<20} {record["where"]:<17} {record["kind"]:<15} '
        f'{record["axes"]:<13} {record["group_size"] or "?":>5} '
        f'{record["bytes"]:>8}',
        file=file,
      )


def parse_args(argv=None):
  parser = argparse.ArgumentParser(
    description=__doc__.splitlines()[0],
    formatter_class=argparse.RawDescriptionHelpFormatter,
  )
  parser.add_argument('--devices', type=int, default=8)
  parser.add_argument('--k', default='1,4,8', help='window sizes, e.g. 1,4,8')
  parser.add_argument(
    '--patterns',
    default=None,
    help=f'comma-separated, of: {", ".join(PATTERNS)} (default: all)',
  )
  parser.add_argument('--out', help='write the rows as JSON to this file')
  args = parser.parse_args(argv)
  try:
    args.ks = _common.parse_ks(args.k)
    args.names = tuple(PATTERNS)
    if args.patterns is not None:
      args.names = _common.parse_names(args.patterns, PATTERNS, 'pattern')
  except ValueError as e:
    parser.error(str(e))
  return args


def main(argv=None):
  args = parse_args(argv)
  _common.use_cpu_devices(args.devices)
  # Patterns named on the command line raise; the default run reports.
  may_fail = MAY_FAIL if args.patterns is None else ()
  rows = run(args.devices, args.ks, args.names, may_fail)
  measured = [row for row in rows if 'error' not in row]
  size = measured[0]['param_bytes'] if measured else '?'
  print(
    f'{args.devices} fake CPU devices, jax {jax.__version__}; payload bytes '
    f'as multiples of the parameter bytes P = {size}'
  )
  print_table(rows)
  print_details(rows)
  if args.out:
    _common.write_json(
      args.out,
      {
        'command': _common.command('collectives', argv),
        'machine': _common.machine(),
        'rows': rows,
      },
    )
  return rows


if __name__ == '__main__':
  main()
