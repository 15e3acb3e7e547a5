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
with the mesh axes it spans and its payload:

- ``DDP``: ``jax.shard_map`` over ``data``, replicated parameters marked
  varying, ``token_weighted_multistep(..., axis_name='data')``.
- ``FSDP (GSPMD)``: ``jax.jit`` over global arrays, parameters sharded over
  ``fsdp`` (first dimension), activations constrained to the batch
  sharding, no ``axis_name``.
- ``HSDP partial-manual``: mesh ``replica x fsdp``; ``jax.shard_map`` manual
  over ``replica`` only (``axis_names={'replica'}``), ``fsdp`` left to
  GSPMD as in FSDP, ``axis_name='replica'``.
- ``HSDP fully manual``: ``jax.shard_map`` over both axes, parameter shards
  ``all_gather``-ed over ``fsdp`` in the forward pass (so autodiff
  reduce-scatters the gradients), ``axis_name=('replica', 'fsdp')``.
- ``pmean + MultiSteps``: ``lax.pmean`` of the gradients on every micro-step,
  then ``optax.MultiSteps(adamw, k)`` (mean loss per device).
- ``sharded jit``: ``jax.jit`` over global arrays, replicated parameters,
  batch sharded over ``data``, no ``axis_name``.

The state layouts come from ``tokacc.state_partition_specs`` and
``tokacc.init_sharded``. A collective on the unconditional path of the step
runs on every micro-step; one in the taken branch of the transform's
``lax.cond`` (branch 1) only on the step that closes the window. Per window:
``k * (every micro-step) + (closing step only)``. Payload: the bytes of the
unsharded buffer on one device (all-reduce: its operand; all-gather: its
result; reduce-scatter: its operand). Each pattern also trains 2 windows and
reports the largest parameter difference to single-device full-batch AdamW
on the token-mean loss, and the accumulator's bytes per device.

    python benchmarks/collectives.py [--devices 8] [--k 1,4,8] [--out x.json]

``parse_hlo``, ``collective_records`` and ``summarize`` can be imported.
"""

import argparse
import collections
import dataclasses
import json
import math
import os
import re
import sys

COLLECTIVE_OPCODES = (
  'all-reduce',
  'all-gather',
  'reduce-scatter',
  'all-to-all',
  'ragged-all-to-all',
  'collective-permute',
  'collective-broadcast',
)
PATTERNS = (
  'DDP',
  'FSDP (GSPMD)',
  'HSDP partial-manual',
  'HSDP fully manual',
  'pmean + MultiSteps',
  'sharded jit',
)
EXACT_PATTERNS = PATTERNS[:4] + PATTERNS[5:]
_ASYNC_SUFFIX = '-start'
_BYTES_PER_ELEMENT = {
  'pred': 1,
  's8': 1,
  'u8': 1,
  'bf16': 2,
  'f16': 2,
  's16': 2,
  'u16': 2,
  'f32': 4,
  's32': 4,
  'u32': 4,
  'f64': 8,
  's64': 8,
  'u64': 8,
}

_HEADER = re.compile(r'^(ENTRY )?%?([\w.\-]+) \(.*\) -> .*\{\s*$')
_INSTRUCTION = re.compile(r'^\s*(?:ROOT )?%?([\w.\-]+) = (.*)$')
_OPCODE = re.compile(r'(?:^|[\s)}\]])([a-z][a-z0-9\-]*)\(')
_SHAPE = re.compile(r'\b([a-z]+\d*)\[([\d,]*)\]')
_CALLEE = re.compile(
  r'\b(?:calls|to_apply|body|condition|true_computation|false_computation)'
  r'=%?([\w.\-]+)'
)
_BRANCHES = re.compile(r'branch_computations=\{([^}]*)\}')
_TRUE_FALSE = re.compile(r'\b(true|false)_computation=%?([\w.\-]+)')
_GROUPS = re.compile(
  r'replica_groups=(\{\{[\d,{}]*\}\}|\{\}|\[[\d,]+\]<=\[[\d,]+\]'
  r'(?:T\([\d,]+\))?|mesh\[[^\]]*\] \{[^}]*\})'
)


@dataclasses.dataclass(frozen=True)
class Instruction:
  """One HLO instruction: its name, opcode, result shapes and callees.

  ``shapes`` are ``(dtype, dims)`` pairs of the result (a tuple result gives
  several). ``branches`` are a ``conditional``'s branch computations in
  branch-index order (``false`` before ``true`` for a predicate);
  ``callees`` the other computations it calls. ``groups`` is the text of a
  collective's ``replica_groups`` (``''`` if none).
  """

  name: str
  opcode: str
  shapes: tuple[tuple[str, tuple[int, ...]], ...]
  callees: tuple[str, ...]
  branches: tuple[str, ...]
  groups: str = ''

  @property
  def collective(self):
    """The collective's kind (``'all-reduce'`` for its async start too)."""
    opcode = self.opcode
    if opcode.endswith(_ASYNC_SUFFIX):
      opcode = opcode[: -len(_ASYNC_SUFFIX)]
    return opcode if opcode in COLLECTIVE_OPCODES else None

  @property
  def num_bytes(self):
    """Bytes of the result (of its second half for an async start)."""
    shapes = self.shapes
    if self.opcode.endswith(_ASYNC_SUFFIX) and len(shapes) > 1:
      shapes = shapes[len(shapes) // 2 :]
    return sum(
      _BYTES_PER_ELEMENT.get(dtype, 4) * math.prod(dims)
      for dtype, dims in shapes
    )


@dataclasses.dataclass(frozen=True)
class HloModule:
  computations: dict[str, list[Instruction]]
  entry: str


def _parse_instruction(name, rest):
  match = _OPCODE.search(rest)
  opcode = match.group(1) if match else ''
  type_text = rest[: match.start(1)] if match else rest
  shapes = tuple(
    (dtype, tuple(int(d) for d in dims.split(',') if d))
    for dtype, dims in _SHAPE.findall(type_text)
  )
  branches = ()
  found = _BRANCHES.search(rest)
  if found:
    branches = tuple(b.strip().lstrip('%') for b in found.group(1).split(','))
  else:
    true_false = dict(_TRUE_FALSE.findall(rest))
    if true_false:
      branches = (true_false['false'], true_false['true'])
  callees = tuple(c for c in _CALLEE.findall(rest) if c not in branches)
  groups = _GROUPS.search(rest)
  return Instruction(
    name, opcode, shapes, callees, branches, groups.group(1) if groups else ''
  )


def parse_hlo(hlo_text):
  """Splits compiled HLO text (``compiled.as_text()``) into computations."""
  computations = {}
  entry = None
  current = None
  for line in hlo_text.splitlines():
    header = _HEADER.match(line)
    if header:
      current = header.group(2)
      computations[current] = []
      if header.group(1):
        entry = current
      continue
    if current is None:
      continue
    if line.startswith('}'):
      current = None
      continue
    instruction = _INSTRUCTION.match(line)
    if instruction:
      computations[current].append(_parse_instruction(*instruction.groups()))
  if entry is None:
    raise ValueError('No ENTRY computation found in the HLO text.')
  return HloModule(computations, entry)


def collective_sites(module):
  """Every collective with the conditional branches that lead to it.

  Returns ``(instruction, path)`` pairs, where ``path`` is a tuple of
  ``(conditional_name, branch_index)`` from the entry computation: empty for
  a collective that runs on every call.
  """
  sites = []

  def visit(computation, path, seen):
    if computation in seen or computation not in module.computations:
      return
    seen = seen | {computation}
    for instruction in module.computations[computation]:
      if instruction.collective:
        sites.append((instruction, path))
      for callee in instruction.callees:
        visit(callee, path, seen)
      for index, branch in enumerate(instruction.branches):
        visit(branch, path + ((instruction.name, index),), seen)

  visit(module.entry, (), frozenset())
  return sites


def device_groups(text, num_devices):
  """The device groups of a ``replica_groups`` text, as lists of ids.

  Handles the explicit (``{{0,1},{2,3}}``), iota (``[2,4]<=[4,2]T(1,0)``)
  and mesh (``mesh['axis_0'=2,'axis_1'=4] {'axis_1'}``) forms; ``{}`` or no
  groups means all devices. Returns None for a form it does not know.
  """
  import numpy as np  # noqa: PLC0415

  if text in ('', '{}'):
    return [list(range(num_devices))]
  if text.startswith('{{'):
    return [
      [int(i) for i in group.split(',') if i]
      for group in re.findall(r'\{([\d,]*)\}', text[1:-1])
    ]
  iota = re.fullmatch(r'\[([\d,]+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?', text)
  if iota:
    shape, dims, perm = (
      [int(i) for i in g.split(',')] if g else None for g in iota.groups()
    )
    ids = np.arange(math.prod(dims)).reshape(dims)
    ids = ids.transpose(perm) if perm else ids
    return ids.reshape(shape[0], -1).tolist()
  mesh = re.fullmatch(r'mesh\[([^\]]*)\] \{([^}]*)\}', text)
  if mesh:
    axes = re.findall(r"'(\w+)'=(\d+)", mesh.group(1))
    grouped = set(re.findall(r"'(\w+)'", mesh.group(2)))
    names = [name for name, _ in axes]
    ids = np.arange(math.prod(int(s) for _, s in axes))
    ids = ids.reshape([int(s) for _, s in axes])
    order = [i for i, n in enumerate(names) if n not in grouped]
    order += [i for i, n in enumerate(names) if n in grouped]
    size = math.prod(int(s) for n, s in axes if n in grouped)
    return ids.transpose(order).reshape(-1, size).tolist()
  return None


def group_axes(groups, mesh_axes):
  """The mesh axes along which the devices of a group differ.

  ``mesh_axes`` is ``((name, size), ...)``; device ``i`` of the HLO is the
  ``i``-th device of the mesh in row-major order. Returns ``'?'`` for
  unknown groups and ``'-'`` for groups of one device.
  """
  import numpy as np  # noqa: PLC0415

  if groups is None:
    return '?'
  sizes = [size for _, size in mesh_axes]
  coordinates = np.array(np.unravel_index(groups[0], sizes))
  names = [
    name
    for (name, _), row in zip(mesh_axes, coordinates)
    if len(set(row.tolist())) > 1
  ]
  return ','.join(names) or '-'


def _where(path):
  """When a collective at ``path`` runs: on every micro-step, on the
  closing step only (branch 1 of every conditional on its path: the taken
  branch of ``lax.cond(emit, ...)``), or in another branch (counted as on
  every micro-step, an upper bound, and flagged)."""
  if not path:
    return 'every micro-step'
  if all(index == 1 for _, index in path):
    return 'closing step'
  return 'other branch'


def collective_records(hlo_text, mesh_axes):
  """Every collective of a compiled step: kind, where, axes, group, bytes."""
  num_devices = math.prod(size for _, size in mesh_axes)
  records = []
  for instruction, path in collective_sites(parse_hlo(hlo_text)):
    groups = device_groups(instruction.groups, num_devices)
    group_size = len(groups[0]) if groups else None
    payload = instruction.num_bytes
    if instruction.collective == 'reduce-scatter' and group_size:
      payload *= group_size  # Its operand: the result times the group.
    records.append(
      {
        'kind': instruction.collective,
        'where': _where(path),
        'axes': group_axes(groups, mesh_axes),
        'group_size': group_size,
        'bytes': payload,
      }
    )
  return records


def summarize(records, k):
  """Collectives and payload bytes per micro-step and per window of ``k``.

  A micro-step that does not close the window runs the ``every micro-step``
  (and ``other branch``) collectives; the window adds those of the closing
  step once. ``window_by_axes`` splits the window's totals by mesh axes.
  """
  per_step = [r for r in records if r['where'] != 'closing step']
  closing = [r for r in records if r['where'] == 'closing step']
  by_axes = collections.defaultdict(lambda: {'collectives': 0, 'bytes': 0})
  for records_of, times in ((per_step, k), (closing, 1)):
    for record in records_of:
      by_axes[record['axes']]['collectives'] += times
      by_axes[record['axes']]['bytes'] += times * record['bytes']
  return {
    'micro_step': {
      'collectives': len(per_step),
      'bytes': sum(r['bytes'] for r in per_step),
    },
    'closing_step_extra': {
      'collectives': len(closing),
      'bytes': sum(r['bytes'] for r in closing),
    },
    'window': {
      'collectives': k * len(per_step) + len(closing),
      'bytes': k * sum(r['bytes'] for r in per_step)
      + sum(r['bytes'] for r in closing),
    },
    'window_by_axes': dict(sorted(by_axes.items())),
    'other_branch': sum(r['where'] == 'other branch' for r in records),
  }


def _max_difference(params, expected):
  import jax  # noqa: PLC0415
  import numpy as np  # noqa: PLC0415

  differences = jax.tree.map(
    lambda a, b: float(np.max(np.abs(np.asarray(a) - np.asarray(b)))),
    params,
    expected,
  )
  return max(jax.tree.leaves(differences))


def measure(pattern, num_devices, k, windows, expected):
  """One row: the compiled step's collectives, and 2 windows trained."""
  import _sharded_steps as steps  # noqa: PLC0415
  import jax  # noqa: PLC0415
  from jax.sharding import NamedSharding  # noqa: PLC0415

  setup = steps.BUILDERS[pattern](num_devices, k, steps.init_params())
  data = NamedSharding(setup.mesh, setup.batch_spec)
  first = jax.device_put(windows[0][0], data)
  compiled = setup.step.lower(setup.params, setup.state, first).compile()
  records = collective_records(compiled.as_text(), setup.mesh_axes)
  param_bytes = sum(x.nbytes for x in jax.tree.leaves(setup.params))
  acc_bytes = steps.accumulator_bytes_per_device(setup.state)
  params, state = setup.params, setup.state
  for window in windows:
    for batch in window:
      params, state = setup.step(params, state, jax.device_put(batch, data))
  return {
    'pattern': pattern,
    'k': k,
    'devices': num_devices,
    'mesh': ' x '.join(f'{n}={s}' for n, s in setup.mesh_axes),
    'param_bytes': param_bytes,
    'collectives': records,
    'summary': summarize(records, k),
    'accumulator_bytes_per_device': acc_bytes,
    'exact': pattern in EXACT_PATTERNS,
    'max_abs_diff_to_full_batch': _max_difference(params, expected),
  }


def run(num_devices=8, ks=(1, 4, 8), patterns=PATTERNS):
  """Rows of :func:`measure` for each k and pattern (HSDP needs an even
  number >= 4 of devices; it is left out otherwise)."""
  import _sharded_steps as steps  # noqa: PLC0415

  if num_devices < 4 or num_devices % 2:
    patterns = [p for p in patterns if not p.startswith('HSDP')]
  rows = []
  for k in ks:
    windows = steps.make_windows(num_devices, k)
    expected = steps.reference(steps.init_params(), windows)
    for pattern in patterns:
      rows.append(measure(pattern, num_devices, k, windows, expected))
  return rows


def _count(entry, param_bytes):
  return f'{entry["collectives"]} ({entry["bytes"] / param_bytes:.2f}P)'


def print_table(rows, file=None):
  """Per pattern and k: collectives (payload in parameter bytes P)."""
  print(
    f'{"pattern":<20} {"mesh":<18} {"k":>2} {"micro-step":>12} '
    f'{"closing +":>11} {"window":>13} {"acc/dev":>7} {"max|dp|":>8}  '
    'window by mesh axes',
    file=file,
  )
  for row in rows:
    summary, size = row['summary'], row['param_bytes']
    axes = ', '.join(
      f'{name}: {_count(entry, size)}'
      for name, entry in summary['window_by_axes'].items()
    )
    flag = ' (other branch!)' if summary['other_branch'] else ''
    print(
      f'{row["pattern"]:<20} {row["mesh"]:<18} {row["k"]:>2} '
      f'{_count(summary["micro_step"], size):>12} '
      f'{_count(summary["closing_step_extra"], size):>11} '
      f'{_count(summary["window"], size):>13} '
      f'{row["accumulator_bytes_per_device"] / size:>6.3f}P '
      f'{row["max_abs_diff_to_full_batch"]:>8.1e}  {axes or "-"}{flag}',
      file=file,
    )


def print_details(rows, file=None):
  """Every collective of each pattern's compiled step (of the last k)."""
  last = [row for row in rows if row['k'] == rows[-1]['k']]
  print(
    f'\n{"pattern":<20} {"runs on":<17} {"collective":<15} {"axes":<13} '
    f'{"group":>5} {"bytes":>8}',
    file=file,
  )
  for row in last:
    for record in row['collectives']:
      print(
        f'{row["pattern"]:<20} {record["where"]:<17} {record["kind"]:<15} '
        f'{record["axes"]:<13} {record["group_size"] or "?":>5} '
        f'{record["bytes"]:>8}',
        file=file,
      )


def main(argv=None):
  parser = argparse.ArgumentParser(
    description=__doc__.splitlines()[0],
    formatter_class=argparse.RawDescriptionHelpFormatter,
  )
  parser.add_argument('--devices', type=int, default=8)
  parser.add_argument('--k', default='1,4,8', help='window sizes, e.g. 1,4,8')
  parser.add_argument('--out', help='write the rows as JSON to this file')
  args = parser.parse_args(argv)
  ks = tuple(int(k) for k in args.k.split(','))
  if 'jax' not in sys.modules:
    os.environ.setdefault('JAX_PLATFORMS', 'cpu')
  import jax  # noqa: PLC0415

  jax.config.update('jax_num_cpu_devices', args.devices)
  rows = run(args.devices, ks)
  print(
    f'{args.devices} fake CPU devices, jax {jax.__version__}; payload bytes '
    f'as multiples of the parameter bytes P = {rows[0]["param_bytes"]}'
  )
  print_table(rows)
  print_details(rows)
  if args.out:
    import run as benchmarks_run  # noqa: PLC0415

    with open(args.out, 'w') as f:
      json.dump(
        {'machine': benchmarks_run.machine(), 'rows': rows}, f, indent=2
      )


if __name__ == '__main__':
  sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
  main()
