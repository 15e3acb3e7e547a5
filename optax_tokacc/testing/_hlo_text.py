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
"""HLO text parsed: the instructions of each computation, and what a
reader of them needs (:mod:`optax_tokacc.testing.hlo` re-exports
:class:`Instruction` and :class:`HloModule`, and its ``parse_hlo`` calls
:func:`parse`). What each instruction's text says is read here, once."""

import dataclasses
import math
import re
from typing import Optional

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
_LOOP = re.compile(r'\bcondition=%?([\w.\-]+), body=%?([\w.\-]+)')
_INDEX = re.compile(r'\bindex=(\d+)')
_OP_NAME = re.compile(r'op_name="((?:[^"\\]|\\.)*)"')
_ROUNDS_TO = re.compile(r'exponent_bits=(\d+), mantissa_bits=(\d+)')
_CALL_TARGET = re.compile(r'custom_call_target="([^"]+)"')
# XLA:TPU's transfer between slices: a host-transfer send/recv pair that
# the data-center network's runtime reduces, not a collective opcode.
_TRANSFER = re.compile(r'_xla_megascale_transfer_type="([A-Z_]+)"')
_GROUPS = re.compile(
  r'replica_groups=(\{\{[\d,{}]*\}\}|\{\}|\[[\d,]+\]<=\[[\d,]+\]'
  r'(?:T\([\d,]+\))?|mesh\[[^\]]*\]'
  r'(?:, device_ids=\(\[[\d,]+\](?:T\([\d,]+\))?\))? \{[^}]*\})'
)

Shape = tuple[str, tuple[int, ...]]  # (dtype, dims)


@dataclasses.dataclass(frozen=True)
class Instruction:
  """One HLO instruction: its name, opcode, result shapes and callees.

  ``shapes`` are ``(dtype, dims)`` pairs of the result (a tuple result gives
  several). ``branches`` are a ``conditional``'s branch computations in
  branch-index order (``false`` before ``true`` for a predicate), or a
  flag loop's (:func:`~optax_tokacc.testing.hlo.parse_hlo`): its
  condition alone (no trip), then its body (one trip); ``callees`` the
  other computations it calls. ``groups`` is the text of a collective's
  ``replica_groups`` (``''`` if none).
  """

  name: str
  opcode: str
  shapes: tuple[Shape, ...]
  callees: tuple[str, ...]
  branches: tuple[str, ...]
  groups: str = ''
  operands: tuple[str, ...] = ()  # the names it reads
  root: bool = False  # its computation's result
  # A reduce-precision's format: (exponent_bits, mantissa_bits).
  rounds_to: Optional[tuple[int, ...]] = None
  op_name: str = ''  # its metadata's op_name: a parameter's argument path
  # A send between TPU slices: the collective it carries ('ALL_REDUCE').
  transfer: str = ''
  loop: tuple[str, ...] = ()  # a while's (condition, body)
  index: Optional[int] = None  # a get-tuple-element's
  call_target: str = ''  # a custom-call's custom_call_target

  @property
  def collective(self) -> Optional[str]:
    """The collective's kind (``'all-reduce'`` for its async start too,
    and for the ``send`` that carries it between TPU slices)."""
    if self.transfer:
      return self.transfer.lower().replace('_', '-')
    opcode = self.opcode
    if opcode.endswith(_ASYNC_SUFFIX):
      opcode = opcode[: -len(_ASYNC_SUFFIX)]
    return opcode if opcode in COLLECTIVE_OPCODES else None

  @property
  def num_bytes(self) -> int:
    """Bytes of the result (of its second half for an async start, of the
    buffer a transfer between slices sends)."""
    shapes = self.shapes
    if self.transfer:  # (buffer, context, token)
      shapes = shapes[:1]
    if self.opcode.endswith(_ASYNC_SUFFIX) and len(shapes) > 1:
      shapes = shapes[len(shapes) // 2 :]
    return sum(
      _BYTES_PER_ELEMENT.get(dtype, 4) * math.prod(dims)
      for dtype, dims in shapes
    )


@dataclasses.dataclass(frozen=True)
class HloModule:
  """A compiled program: its computations by name, and the entry's name."""

  computations: dict[str, list[Instruction]]
  entry: str


def _operands(rest: str, match: Optional[re.Match[str]]) -> tuple[str, ...]:
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


def _parse_instruction(
  root: Optional[str], name: str, rest: str
) -> Instruction:
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
  transfer = _TRANSFER.search(rest) if opcode == 'send' else None
  loop = _LOOP.search(rest) if opcode == 'while' else None
  index = _INDEX.search(rest) if opcode == 'get-tuple-element' else None
  target = _CALL_TARGET.search(rest) if opcode == 'custom-call' else None
  return Instruction(
    name, opcode, shapes, callees, branches, groups, operands, bool(root),
    rounds_to, op_name, transfer.group(1) if transfer else '',
    loop.groups() if loop else (), int(index.group(1)) if index else None,
    target.group(1) if target else '',
  )  # fmt: skip


def _as_branches(
  instruction: Instruction, computations: dict[str, list[Instruction]]
) -> Instruction:
  """A flag loop as a conditional of two branches: a ``while`` whose
  condition only reads a ``pred`` of its state runs the trips its values
  decide (``lax.while_loop`` of 0 or 1 trips, this library's closing step:
  XLA keeps it and copies nothing on a trip not taken, where it may copy
  a ``conditional``'s operands); its branches are its condition alone
  (no trip, where the window stays open) and its body (one trip, where it
  closes). Other loops run their computations in line."""
  if not instruction.loop:
    return instruction
  condition_name, body = instruction.loop
  condition = computations.get(condition_name, [])
  roots = [i for i in condition if i.root]
  flag = [i.opcode for i in condition if not i.root] == ['parameter'] and (
    len(roots) == 1
    and roots[0].opcode == 'get-tuple-element'
    and roots[0].shapes == (('pred', ()),)
  )
  if not flag:
    return instruction
  return dataclasses.replace(
    instruction, callees=(), branches=(condition_name, body)
  )


def _check_branches(computations: dict[str, list[Instruction]]) -> None:
  """Every conditional's branches are computations of the module."""
  for instructions in computations.values():
    for instruction in instructions:
      missing = set(instruction.branches) - set(computations)
      if missing:
        raise ValueError(
          f'HLO text not understood: the branches {sorted(missing)} of '
          f'{instruction.name} are not among its computations.'
        )


def parse(hlo_text: str) -> HloModule:
  """:func:`optax_tokacc.testing.hlo.parse_hlo`'s work."""
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
  for instructions in computations.values():
    instructions[:] = [_as_branches(i, computations) for i in instructions]
  return HloModule(computations, entry)
