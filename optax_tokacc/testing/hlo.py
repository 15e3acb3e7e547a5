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
"""Compiled programs, read from their HLO text: the one reader of the tests
and the benchmarks (neither reaches into the other for it).

The performance contract is a statement about compiled programs (a
micro-step runs no inner-optimizer work and no collective), so the tests
guard it by reading them, and the benchmarks count them the same way.
:func:`compiled_text` compiles a jitted function for its arguments and
gives its text; :func:`parse_hlo` splits that text into computations (an
error names what it cannot read); :func:`reachable_opcodes` counts what a
computation runs, inside the conditionals' branches or outside them;
:func:`returns_its_parameters` says whether a program computes nothing;
:func:`first_uses` what first computes with an argument. The collectives
and the branches that lead to them are :mod:`.collectives`'.

Public, as :mod:`optax_tokacc.testing`'s reader underneath, for checks of
your own; :func:`optax_tokacc.testing.check` is the summary most need.
"""

import collections
from collections.abc import Callable
from typing import Any, Optional

from optax_tokacc.testing import _hlo_text
from optax_tokacc.testing._hlo_text import COLLECTIVE_OPCODES
from optax_tokacc.testing._hlo_text import HloModule
from optax_tokacc.testing._hlo_text import Instruction
from optax_tokacc.testing._hlo_text import Shape

__all__ = (
  'COLLECTIVE_OPCODES',
  'HloModule',
  'Instruction',
  'Shape',
  'compiled_opcodes',
  'compiled_text',
  'find_instruction',
  'first_uses',
  'instructions_of',
  'parse_hlo',
  'reachable_instructions',
  'reachable_opcodes',
  'returns_its_parameters',
)


def compiled_text(jitted: Callable[..., Any], *args: Any, **kwargs: Any) -> str:
  """The HLO text of ``jitted`` (a ``jax.jit`` function) compiled for
  ``args`` and ``kwargs`` (whatever it takes): what the readers below
  take."""
  return jitted.lower(*args, **kwargs).compile().as_text()


def parse_hlo(hlo_text: str) -> HloModule:
  """Splits compiled HLO text (``compiled.as_text()``) into computations.

  A ``while`` whose condition only reads a ``pred`` of its state (a flag
  loop of 0 or 1 trips, this library's closing step) is read as a
  conditional: its branches are its condition alone, then its body. An
  error names what it cannot read."""
  return _hlo_text.parse(hlo_text)


def find_instruction(module: HloModule, name: str) -> Instruction:
  """The instruction called ``name`` (an error naming it if none is)."""
  for instructions in module.computations.values():
    for instruction in instructions:
      if instruction.name == name:
        return instruction
  raise ValueError(f'No instruction {name!r} in the HLO module.')


def reachable_opcodes(
  module: HloModule,
  computation: Optional[str] = None,
  into_branches: bool = True,
) -> collections.Counter[str]:
  """Opcodes of every instruction ``computation`` (the entry: None) runs,
  its callees included, with their counts; the conditionals' branches too,
  unless ``into_branches`` is False (then: what runs on every call)."""
  opcodes = collections.Counter()
  for instruction in reachable_instructions(module, computation, into_branches):
    opcodes[instruction.opcode] += 1
  return opcodes


def compiled_opcodes(
  hlo_text: str, into_branches: bool = True
) -> collections.Counter[str]:
  """:func:`reachable_opcodes` of compiled HLO text's entry computation."""
  return reachable_opcodes(parse_hlo(hlo_text), into_branches=into_branches)


def instructions_of(module: HloModule, opcode: str) -> list[Instruction]:
  """Every ``opcode`` instruction of every computation of ``module``."""
  return [
    instruction
    for instructions in module.computations.values()
    for instruction in instructions
    if instruction.opcode == opcode
  ]


def reachable_instructions(
  module: HloModule,
  computation: Optional[str] = None,
  into_branches: bool = True,
) -> list[Instruction]:
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


def returns_its_parameters(
  module: HloModule,
) -> tuple[bool, list[tuple[str, str, tuple[str, ...]]]]:
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


def first_uses(module: HloModule, argument_prefix: str) -> dict[str, list[str]]:
  """What first computes with each entry parameter whose argument path
  (its ``op_name``, e.g. ``state.grad_sums['w']``) starts with
  ``argument_prefix``: ``{path: sorted opcodes}``, looking into the
  fusions and calls that read it, past copies, bitcasts and converts, and
  past a flag loop that hands it on (0 or 1 trips: one not taken reads
  nothing). A ``tuple`` among them is the operand of a conditional or of
  another loop, or the program's result."""
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


def _uses(module: HloModule, computation: str, name: str) -> set[str]:
  """The opcodes that first compute with ``name`` in ``computation``."""
  uses = set()
  instructions = module.computations[computation]
  for instruction in instructions:
    if name not in instruction.operands:
      continue
    handed_on = _handed_on(module, instructions, instruction, name)
    if handed_on is not None:
      for value in handed_on:
        uses |= _uses(module, computation, value)
    elif instruction.opcode in _PASSES_ON:
      uses |= _uses(module, computation, instruction.name)
    elif instruction.opcode in ('fusion', 'call') and instruction.callees:
      callee = instruction.callees[0]
      for number, operand in enumerate(instruction.operands):
        if operand == name:
          uses |= _uses(module, callee, _parameter(module, callee, number))
    else:
      uses.add(instruction.opcode)
  return uses


def _handed_on(
  module: HloModule,
  instructions: list[Instruction],
  tuple_: Instruction,
  name: str,
) -> Optional[list[str]]:
  """Where a flag loop (:func:`parse_hlo`) hands on ``name``, an element
  of ``tuple_``, its operand: the elements of its result at the same
  place (a trip not taken reads nothing). The CPU wraps the loop in a
  ``call`` of its own. None where ``tuple_`` is not a flag loop's
  operand."""
  if tuple_.opcode != 'tuple':
    return None
  loops = [
    i
    for i in instructions
    if i.operands == (tuple_.name,) and _flag_loop(module, i)
  ]
  if len(loops) != 1:
    return None
  places = [n for n, operand in enumerate(tuple_.operands) if operand == name]
  return [
    i.name
    for i in instructions
    if i.opcode == 'get-tuple-element'
    and i.operands == (loops[0].name,)
    and i.index in places
  ]


def _flag_loop(module: HloModule, instruction: Instruction) -> bool:
  """Whether ``instruction`` is a flag loop, or a call of one alone."""
  if instruction.opcode == 'while':
    return bool(instruction.branches)
  if instruction.opcode != 'call' or len(instruction.callees) != 1:
    return False
  body = module.computations.get(instruction.callees[0], [])
  parameters = [i.name for i in body if i.opcode == 'parameter']
  return len(body) == 2 and any(
    i.root and i.opcode == 'while' and i.branches and i.operands == (p,)
    for i in body
    for p in parameters
  )


def _parameter(module: HloModule, computation: str, number: int) -> str:
  """The name of ``computation``'s parameter ``number``."""
  for instruction in module.computations[computation]:
    if instruction.opcode == 'parameter' and instruction.operands == (
      str(number),
    ):
      return instruction.name
  raise ValueError(f'HLO text not understood: no parameter({number}) in '
                   f'{computation}')  # fmt: skip
