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
"""Compiled programs, read from their HLO text: the one reader of the
tests (the benchmarks import it too).

``compiled_text`` compiles a jitted function for its arguments and gives
its text; ``parse_hlo`` splits that text into computations (an error names
what it cannot read); ``reachable_opcodes`` counts what a
computation runs, inside the conditionals' branches or outside them;
``returns_its_parameters`` says whether a program computes nothing;
``collective_sites`` finds every collective with the conditional branches
that lead to it (``on_every_call``, ``in_branches``,
``on_micro_step_path``, ``on_closing_step_only`` sort them); ``collective_records`` adds the mesh axes each one spans and
its payload; ``summarize`` counts them per micro-step and per window. A
collective on the unconditional path runs on every micro-step; one in the
taken branch of the transform's ``lax.cond`` (branch 1) only on the step that
closes the window. Payload: the bytes of the unsharded buffer on one device
(all-reduce: its operand; all-gather: its result; reduce-scatter: its
operand).
"""

import collections
import dataclasses
import math
import re

COLLECTIVE_OPCODES = (
  'all-reduce',
  'all-gather',
  'reduce-scatter',
  'all-to-all',
  'ragged-all-to-all',
  'collective-permute',
  'collective-broadcast',
)
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
_INSTRUCTION = re.compile(r'^\s*(ROOT )?%?([\w.\-]+) = (.*)$')
_OPCODE = re.compile(r'(?:^|[\s)}\]])([a-z][a-z0-9\-]*)\(')
_SHAPE = re.compile(r'\b([a-z]+\d*)\[([\d,]*)\]')
_CALLEE = re.compile(
  r'\b(?:calls|to_apply|body|condition|true_computation|false_computation)'
  r'=%?([\w.\-]+)'
)
_BRANCHES = re.compile(r'branch_computations=\{([^}]*)\}')
_TRUE_FALSE = re.compile(r'\b(true|false)_computation=%?([\w.\-]+)')
_OP_NAME = re.compile(r'op_name="((?:[^"\\]|\\.)*)"')
_ROUNDS_TO = re.compile(r'exponent_bits=(\d+), mantissa_bits=(\d+)')
_GROUPS = re.compile(
  r'replica_groups=(\{\{[\d,{}]*\}\}|\{\}|\[[\d,]+\]<=\[[\d,]+\]'
  r'(?:T\([\d,]+\))?|mesh\[[^\]]*\]'
  r'(?:, device_ids=\(\[[\d,]+\](?:T\([\d,]+\))?\))? \{[^}]*\})'
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
  operands: tuple[str, ...] = ()  # the names it reads
  root: bool = False  # its computation's result
  # A reduce-precision's format: (exponent_bits, mantissa_bits).
  rounds_to: tuple[int, int] | None = None
  op_name: str = ''  # its metadata's op_name: a parameter's argument path

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


def _operands(rest, match):
  """The instruction names inside the opcode's parentheses (comments such
  as ``/*index=5*/`` and operand types aside)."""
  if match is None:
    return ()
  depth, start = 0, match.end()
  for end in range(start, len(rest)):
    depth += {'(': 1, ')': -1}.get(rest[end], 0)
    if depth < 0:
      break
  inside = re.sub(r'/\*.*?\*/', '', rest[start:end])
  return tuple(re.findall(r'%?([\w.\-]+)(?=\s*(?:,|$))', inside))


def _parse_instruction(root, name, rest):
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
  groups = groups.group(1) if groups else ''
  operands = _operands(rest, match)
  rounds_to = None
  if opcode == 'reduce-precision':
    found = _ROUNDS_TO.search(rest)
    if found is None:
      raise ValueError(f'HLO text not understood: no format in {name}: {rest}')
    rounds_to = tuple(int(bits) for bits in found.groups())
  op_name = _OP_NAME.search(rest)
  op_name = op_name.group(1).replace('\\', '') if op_name else ''
  return Instruction(
    name, opcode, shapes, callees, branches, groups, operands, bool(root),
    rounds_to, op_name,
  )  # fmt: skip


def compiled_text(jitted, *args, **kwargs):
  """The HLO text of ``jitted`` (a ``jax.jit`` function) compiled for
  ``args`` and ``kwargs``: what the readers below take."""
  return jitted.lower(*args, **kwargs).compile().as_text()


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
  _check_branches(computations)
  return HloModule(computations, entry)


def _check_branches(computations):
  """Every conditional's branches are computations of the module."""
  for instructions in computations.values():
    for instruction in instructions:
      missing = set(instruction.branches) - set(computations)
      if missing:
        raise ValueError(
          f'HLO text not understood: the branches {sorted(missing)} of '
          f'{instruction.name} are not among its computations.'
        )


def find_instruction(module, name):
  """The instruction called ``name`` (an error naming it if none is)."""
  for instructions in module.computations.values():
    for instruction in instructions:
      if instruction.name == name:
        return instruction
  raise ValueError(f'No instruction {name!r} in the HLO module.')


def reachable_opcodes(module, computation=None, into_branches=True):
  """Opcodes of every instruction ``computation`` (the entry: None) runs,
  its callees included, with their counts; the conditionals' branches too,
  unless ``into_branches`` is False (then: what runs on every call)."""
  opcodes = collections.Counter()
  for instruction in reachable_instructions(module, computation, into_branches):
    opcodes[instruction.opcode] += 1
  return opcodes


def compiled_opcodes(hlo_text, into_branches=True):
  """:func:`reachable_opcodes` of compiled HLO text's entry computation."""
  return reachable_opcodes(parse_hlo(hlo_text), into_branches=into_branches)


def instructions_of(module, opcode):
  """Every ``opcode`` instruction of every computation of ``module``."""
  return [
    instruction
    for instructions in module.computations.values()
    for instruction in instructions
    if instruction.opcode == opcode
  ]


def reachable_instructions(module, computation=None, into_branches=True):
  """Every instruction ``computation`` (the entry: None) runs, as
  :func:`reachable_opcodes` counts them."""
  found, stack, seen = [], [computation or module.entry], set()
  while stack:
    name = stack.pop()
    if name in seen or name not in module.computations:
      continue
    seen.add(name)
    for instruction in module.computations[name]:
      found.append(instruction)
      stack.extend(instruction.callees)
      if into_branches:
        stack.extend(instruction.branches)
  return found


def returns_its_parameters(module):
  """Whether the entry computation holds nothing but its parameters and
  the tuple of exactly them that it returns (a program that computes and
  writes nothing), with what it holds otherwise, for a message."""
  entry = module.computations[module.entry]
  parameters = {i.name for i in entry if i.opcode == 'parameter'}
  others = [i for i in entry if i.opcode != 'parameter']
  root = next((i for i in entry if i.root), None)
  holds_only_the_tuple = others == [root] and root.opcode == 'tuple'
  returned = set(root.operands) if root else set()
  found = [(i.name, i.opcode, i.operands) for i in others]
  return holds_only_the_tuple and returned == parameters, found


# What hands a value on, changed at most in precision, on the way to what
# computes with it.
_PASSES_ON = ('copy', 'bitcast', 'convert')


def first_uses(module, argument_prefix):
  """What first computes with each entry parameter whose argument path
  (its ``op_name``, e.g. ``state.grad_sums['w']``) starts with
  ``argument_prefix``: ``{path: sorted opcodes}``, looking into the
  fusions and calls that read it and past copies, bitcasts and converts. A
  ``tuple`` among them is the operand of a conditional or a loop, or the
  program's result."""
  entry = module.computations[module.entry]
  found = {}
  for parameter in entry:
    if parameter.opcode == 'parameter' and parameter.op_name.startswith(
      argument_prefix
    ):
      found[parameter.op_name] = sorted(
        _uses(module, module.entry, parameter.name)
      )
  if not found:
    raise ValueError(f'No entry parameter whose path starts {argument_prefix}')
  return found


def _uses(module, computation, name):
  """The opcodes that first compute with ``name`` in ``computation``."""
  uses = set()
  for instruction in module.computations[computation]:
    if name not in instruction.operands:
      continue
    if instruction.opcode in _PASSES_ON:
      uses |= _uses(module, computation, instruction.name)
    elif instruction.opcode in ('fusion', 'call') and instruction.callees:
      callee = instruction.callees[0]
      for number, operand in enumerate(instruction.operands):
        if operand == name:
          uses |= _uses(module, callee, _parameter(module, callee, number))
    else:
      uses.add(instruction.opcode)
  return uses


def _parameter(module, computation, number):
  """The name of ``computation``'s parameter ``number``."""
  for instruction in module.computations[computation]:
    if instruction.opcode == 'parameter' and instruction.operands == (
      str(number),
    ):
      return instruction.name
  raise ValueError(f'HLO text not understood: no parameter({number}) in '
                   f'{computation}')  # fmt: skip


def group_sets(instruction, num_devices):
  """The device groups of a collective as a frozenset of frozensets of
  device ids; an error naming the instruction and its ``replica_groups``
  text where the form is unknown (see :func:`device_groups`)."""
  groups = device_groups(instruction.groups, num_devices)
  if groups is None:
    raise ValueError(
      f'HLO text not understood: the replica_groups of {instruction.name} '
      f'({instruction.groups!r}) are of a form device_groups() does not know.'
    )
  return frozenset(frozenset(g) for g in groups)


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


def compiled_collectives(hlo_text):
  """:func:`collective_sites` of compiled HLO text."""
  return collective_sites(parse_hlo(hlo_text))


def on_every_call(sites):
  """The collectives of ``sites`` outside every conditional's branches."""
  return [site for site, path in sites if not path]


def in_branches(sites):
  """The collectives of ``sites`` inside a conditional's branch."""
  return [site for site, path in sites if path]


def on_micro_step_path(sites):
  """The collectives of ``sites`` a micro-step runs: on every call, or in
  a branch other than the closing one (:func:`closing_only`)."""
  return [site for site, path in sites if not closing_only(path)]


def on_closing_step_only(sites):
  """The collectives of ``sites`` that only the closing step runs."""
  return [site for site, path in sites if closing_only(path)]


def device_groups(text, num_devices):
  """The device groups of a ``replica_groups`` text, as lists of ids.

  Handles the explicit (``{{0,1},{2,3}}``), iota (``[2,4]<=[4,2]T(1,0)``)
  and mesh (``mesh['axis_0'=2,'axis_1'=4] {'axis_1'}``, optionally with
  ``device_ids=([2,2]T(1,0))`` placing the devices) forms; ``{}`` or no
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
  mesh = re.fullmatch(
    r'mesh\[([^\]]*)\](?:, device_ids=\(\[([\d,]+)\](?:T\(([\d,]+)\))?\))?'
    r' \{([^}]*)\}',
    text,
  )
  if mesh:
    axes = re.findall(r"'(\w+)'=(\d+)", mesh.group(1))
    grouped = set(re.findall(r"'(\w+)'", mesh.group(4)))
    names = [name for name, _ in axes]
    ids = np.arange(math.prod(int(s) for _, s in axes))
    if mesh.group(2):  # device_ids=([dims]T(perm)): devices in mesh order
      ids = ids.reshape([int(d) for d in mesh.group(2).split(',')])
      if mesh.group(3):
        ids = ids.transpose([int(p) for p in mesh.group(3).split(',')])
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


def where(path):
  """When a collective at ``path`` runs: on every micro-step, on the
  closing step only (branch 1 of every conditional on its path: the taken
  branch of ``lax.cond(emit, ...)``), or in another branch (counted as on
  every micro-step, an upper bound, and flagged)."""
  if not path:
    return 'every micro-step'
  if all(index == 1 for _, index in path):
    return 'closing step'
  return 'other branch'


def closing_only(path):
  """Whether a collective at ``path`` runs on the closing step only: in
  branch 1 (``lax.cond``'s true branch) of every conditional leading to
  it."""
  return where(path) == 'closing step'


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
        'where': where(path),
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
