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
"""What a compiled training step does on an open micro-step and where a
window closes: collectives, conditionals, optimizer work, modelled cost.

An open micro-step runs the entry computation with branch 0 of every
conditional (``lax.cond``'s false branch: where the transform keeps a
window open); the closing step runs branch 1. A step closed by the host
compiles to two programs, each checked on its own (the open one has no
conditional of ours; the closing one runs every call as a closing step).
"""

import dataclasses
from typing import Any, NamedTuple, Optional

import jax

from optax_tokacc import _base
from optax_tokacc.testing import collectives
from optax_tokacc.testing import hlo

OPEN, CLOSING = 0, 1  # the branch each step takes

# What launches no kernel of its own, or moves no bytes through one: the
# program's plumbing, the ends of asynchronous pairs (their start is
# counted), and XLA:TPU's prefetches into its fast memory, whole
# (copy-start, copy-done) or in slices (slice-start, slice-done, joined by
# a ``ConcatBitcast``): the kernel that reads the buffer is charged its
# read, once, as if it read the buffer where it lies.
_PLUMBING = frozenset({
  'parameter', 'constant', 'tuple', 'get-tuple-element', 'bitcast',
  'after-all', 'partition-id', 'replica-id', 'copy-start', 'copy-done',
  'slice-start', 'slice-done',
  'opt-barrier', 'add-dependency', 'send-done', 'recv-done', 'async-done',
  'all-reduce-done', 'all-gather-done', 'collective-permute-done',
  'domain', 'iota',
})  # fmt: skip
_PLUMBING_CALLS = frozenset({'ConcatBitcast'})  # custom calls' targets
_INLINE = frozenset({'call', 'while'})  # their computations run in line


class Cost(NamedTuple):
  """Modelled cost of a step: its kernels, and the bytes they read and
  write (each kernel's operands and result, summed). It tells a cheap
  step from a costly one; only a device times them."""

  kernels: int
  bytes: int


@dataclasses.dataclass(frozen=True)
class Collective:
  """One collective of a compiled step.

  Attributes:
    kind: ``'all-reduce'``, ``'reduce-scatter'``, ``'all-gather'``, ...
    where: ``'every call'``, ``'closing step'`` (only where a window
      closes), or ``'other branch'`` (counted as every call).
    axes: the mesh axes its device groups span (``'-'``: none, ``'?'``:
      unknown, ``'slices'``: the network between TPU slices).
    group_size: devices per group (None where unknown, as between TPU
      slices: XLA:TPU's transfer names no replica groups).
    bytes: the payload: the buffer reduced or gathered, on one device.
  """

  kind: str
  where: str
  axes: str
  group_size: Optional[int]
  bytes: int

  @property
  def across_slices(self) -> bool:
    """Whether it crosses the data-center network between TPU slices."""
    return self.axes == 'slices'


@dataclasses.dataclass(frozen=True)
class StepReport:
  """What :func:`check` read from one compiled step.

  Attributes:
    device_kind: the device it was compiled for.
    collectives: every collective, with where it runs.
    conditionals: the conditionals kept in the program, with the loops of
      0 or 1 trips decided on the device (``lax.while_loop`` on a flag),
      which are read as conditionals: no trip on an open micro-step, one
      on the closing step.
    optimizer_on_open_step: opcodes of the inner optimizer's work
      (``token_weighted_multistep``'s ``inner.update``) that an open
      micro-step runs: empty in every form the library promises.
    optimizer_on_closing_step: the same for the closing step (where the
      optimizer runs: empty only where ``inner`` does nothing).
    open_step: modelled cost of an open micro-step.
    closing_step: modelled cost of the step that closes a window.
    temp_bytes: the compiled temporaries (``memory_analysis()``).
    text: the compiled program's HLO text.
  """

  device_kind: str
  collectives: tuple[Collective, ...]
  conditionals: int
  optimizer_on_open_step: tuple[str, ...]
  optimizer_on_closing_step: tuple[str, ...]
  open_step: Cost
  closing_step: Cost
  temp_bytes: int
  text: str = dataclasses.field(repr=False)

  def on_open_step(self) -> tuple[Collective, ...]:
    """The collectives an open micro-step runs."""
    return tuple(c for c in self.collectives if c.where != 'closing step')

  def on_closing_step_only(self) -> tuple[Collective, ...]:
    """The collectives only the closing step runs."""
    return tuple(c for c in self.collectives if c.where == 'closing step')

  def summary(self) -> str:
    """A few lines for a log or an assertion message."""

    def listed(found):
      return ', '.join(f'{c.kind} over {c.axes} ({c.bytes:,} B)' for c in found)

    return '\n'.join([
      f'compiled for {self.device_kind}',
      f'open micro-step: {self.open_step.kernels} kernels, '
      f'{self.open_step.bytes:,} bytes; collectives: '
      f'{listed(self.on_open_step()) or "none"}; optimizer work: '
      f'{", ".join(self.optimizer_on_open_step) or "none"}',
      f'closing step: {self.closing_step.kernels} kernels, '
      f'{self.closing_step.bytes:,} bytes; collectives only there: '
      f'{listed(self.on_closing_step_only()) or "none"}',
      f'conditionals kept: {self.conditionals}; temporaries: '
      f'{self.temp_bytes:,} bytes',
    ])  # fmt: skip


def step_cost(module: hlo.HloModule, branch: int) -> Cost:
  """:class:`Cost` of the entry computation with ``branch`` of every
  conditional (the last branch where it has fewer)."""
  kernels, moved = 0, 0
  stack = [module.entry]
  while stack:
    computation = module.computations[stack.pop()]
    shapes = {i.name: i.num_bytes for i in computation}
    for instruction in computation:
      if instruction.branches:
        taken = instruction.branches[min(branch, len(instruction.branches) - 1)]
        stack.append(taken)
      elif instruction.opcode in _INLINE:
        stack.extend(instruction.callees)
      elif not _plumbing(instruction):
        kernels += 1
        moved += instruction.num_bytes
        moved += sum(shapes.get(name, 0) for name in instruction.operands)
  return Cost(kernels, moved)


def _plumbing(instruction: hlo.Instruction) -> bool:
  """Whether ``instruction`` launches no kernel (:data:`_PLUMBING`)."""
  return (
    instruction.opcode in _PLUMBING
    or instruction.call_target in _PLUMBING_CALLS
  )


def optimizer_work(module: hlo.HloModule, branch: int) -> tuple[str, ...]:
  """Opcodes, sorted, of the instructions named by ``inner.update``'s
  scope that run with ``branch`` of every conditional taken."""
  found, stack, seen = set(), [module.entry], set()
  while stack:
    name = stack.pop()
    if name in seen:
      continue
    seen.add(name)
    for instruction in module.computations[name]:
      if _base.INNER_UPDATE_SCOPE in instruction.op_name:
        found.add(instruction.opcode)
      stack.extend(instruction.callees)
      if instruction.branches:
        index = min(branch, len(instruction.branches) - 1)
        stack.append(instruction.branches[index])
  return tuple(sorted(found))


def _mesh_axes(mesh: Any) -> collectives.MeshAxes:
  if mesh is None:
    return ()
  return tuple((str(name), int(size)) for name, size in mesh.shape.items())


def _collectives(module: hlo.HloModule, mesh: Any, num_devices: int):
  axes_of = _mesh_axes(mesh)
  found = []
  for instruction, path in collectives.collective_sites(module):
    groups = collectives.device_groups(instruction.groups, num_devices)
    size = len(groups[0]) if groups else None
    payload = instruction.num_bytes
    if instruction.collective == 'reduce-scatter' and size:
      payload *= size  # its operand: the result times the group
    if instruction.transfer:
      axes, size = 'slices', None
    elif axes_of:
      axes = collectives.group_axes(groups, axes_of)
    else:
      axes = '?' if groups is None else ('-' if size == 1 else 'all')
    where = collectives.where(path)
    where = 'every call' if where == 'every micro-step' else where
    found.append(Collective(instruction.collective, where, axes, size, payload))
  return tuple(found)


def _compiled(step: Any, args: tuple, kwargs: dict) -> Any:
  """``step`` compiled: a ``Compiled``, a ``Lowered``, or a ``jax.jit``
  function with its arguments."""
  if hasattr(step, 'as_text') and hasattr(step, 'memory_analysis'):
    return step
  if hasattr(step, 'compile') and not hasattr(step, 'lower'):
    return step.compile()
  if not hasattr(step, 'lower'):
    raise TypeError(
      'step must be a jax.jit function (with its arguments), a Lowered or '
      f'a Compiled, got {type(step).__name__}.'
    )
  try:
    return step.lower(*args, **kwargs).compile()
  except Exception as error:
    if not (_compile_only(args, kwargs) and _ran_eagerly(error)):
      raise
    raise RuntimeError(
      f'The step could not be compiled for devices that only compile '
      f'({type(error).__name__}: {error}). If an operation ran eagerly on '
      'them (tx.init, jax.device_put, an array made outside the step), '
      'give the step abstract arguments instead: jax.ShapeDtypeStruct with '
      'a sharding on the target, e.g. from jax.eval_shape.'
    ) from error


def _ran_eagerly(error: Exception) -> bool:
  """Whether ``error`` is of the kinds a compile-only client gives an
  operation that would run: XLA's (no host buffers there) or a missing
  attribute (its executables have no local devices)."""
  return isinstance(error, (jax.errors.JaxRuntimeError, AttributeError))


def _compile_only(args: tuple, kwargs: dict) -> bool:
  """Whether an argument is placed on devices this process cannot run."""
  here = set(jax.devices())
  for leaf in jax.tree.leaves((args, kwargs)):
    sharding = getattr(leaf, 'sharding', None)
    if sharding is not None and not set(sharding.device_set) <= here:
      return True
  return False


def check(step: Any, *args: Any, mesh: Any = None, **kwargs: Any) -> StepReport:
  """Reads what a training step does, from its compiled program.

  Args:
    step: a ``jax.jit`` function, called as ``step.lower(*args,
      **kwargs)``; or its ``Lowered`` or ``Compiled``.
    *args: its arguments: arrays or ``jax.ShapeDtypeStruct`` (with a
      sharding on a :func:`target`'s devices, to compile for an
      accelerator that is not here).
    mesh: the mesh whose axes name the collectives' device groups (its
      axes are read in the devices' order of the program).
    **kwargs: its keyword arguments (static ones included).

  Returns:
    A :class:`StepReport`.
  """
  compiled = _compiled(step, args, kwargs)
  text = compiled.as_text()
  module = hlo.parse_hlo(text)
  devices = _num_devices(compiled, mesh)
  memory = compiled.memory_analysis()
  kinds = {d.device_kind for d in _devices(compiled)}
  return StepReport(
    device_kind=', '.join(sorted(kinds)) or '?',
    collectives=_collectives(module, mesh, devices),
    conditionals=sum(
      bool(i.branches) for i in hlo.reachable_instructions(module)
    ),
    optimizer_on_open_step=optimizer_work(module, OPEN),
    optimizer_on_closing_step=optimizer_work(module, CLOSING),
    open_step=step_cost(module, OPEN),
    closing_step=step_cost(module, CLOSING),
    temp_bytes=int(getattr(memory, 'temp_size_in_bytes', 0) or 0),
    text=text,
  )


def _devices(compiled: Any) -> list[jax.Device]:
  shardings = jax.tree.leaves(compiled.input_shardings)
  devices = []
  for sharding in shardings:
    devices.extend(d for d in sharding.device_set if d not in devices)
  return devices


def _num_devices(compiled: Any, mesh: Any) -> int:
  if mesh is not None:
    return int(mesh.devices.size)
  return max(len(_devices(compiled)), 1)
