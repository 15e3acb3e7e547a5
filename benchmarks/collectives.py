"""Collectives per accumulation window, read from the compiled HLO.

Compares, on fake CPU devices under ``jax.shard_map``, for k = 1, 4, 8:

- ``tokacc``: ``token_weighted_multistep(adamw, k, axis_name='data')``, local
  gradients (parameters marked varying, so autodiff does not reduce them);
  the transform ``psum``s the window once, inside the emitting branch.
- ``pmean + MultiSteps``: the usual pattern, ``lax.pmean`` of the gradients
  on every micro-step, then ``optax.MultiSteps(adamw, k)``.
- ``sharded jit`` (GSPMD, no ``axis_name``), for reference: the gradient of
  the global batch is reduced by the partitioner on every micro-step.

A collective on the unconditional path of the compiled step runs on every
micro-step; one inside a ``conditional`` branch runs when that branch is
taken, here once per window (the emitting step). Per window:
``k * unconditional + in_branches``.

    python benchmarks/collectives.py [--devices 8] [--out results.json]

``count_collectives(hlo_text)`` and ``parse_hlo(hlo_text)`` can be imported.
"""

import argparse
import collections
import dataclasses
import json
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


@dataclasses.dataclass(frozen=True)
class Instruction:
  """One HLO instruction: its name, opcode, result shapes and callees.

  ``shapes`` are ``(dtype, dims)`` pairs of the result (a tuple result gives
  several; for an all-reduce they are also its operands). ``branches`` are a
  ``conditional``'s branch computations in branch-index order (``false``
  before ``true`` for a predicate); ``callees`` the other computations it
  calls (fusions, reductions, loop bodies).
  """

  name: str
  opcode: str
  shapes: tuple[tuple[str, tuple[int, ...]], ...]
  callees: tuple[str, ...]
  branches: tuple[str, ...]

  @property
  def collective(self):
    """The collective's kind (``'all-reduce'`` for its async start too)."""
    opcode = self.opcode
    if opcode.endswith(_ASYNC_SUFFIX):
      opcode = opcode[: -len(_ASYNC_SUFFIX)]
    return opcode if opcode in COLLECTIVE_OPCODES else None

  @property
  def num_bytes(self):
    total = 0
    for dtype, dims in self.shapes:
      size = _BYTES_PER_ELEMENT.get(dtype, 4)
      for dim in dims:
        size *= dim
      total += size
    return total


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
  return Instruction(name, opcode, shapes, callees, branches)


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


def reachable_opcodes(module, computation):
  """Opcodes of all instructions ``computation`` runs, callees included."""
  opcodes = collections.Counter()
  stack, seen = [computation], set()
  while stack:
    name = stack.pop()
    if name in seen or name not in module.computations:
      continue
    seen.add(name)
    for instruction in module.computations[name]:
      opcodes[instruction.opcode] += 1
      stack.extend(instruction.callees)
      stack.extend(instruction.branches)
  return opcodes


def count_collectives(hlo_text):
  """Collectives of a compiled step, split by where they run.

  Counts collective instructions (an all-reduce of a tuple is one; XLA's
  combiner may merge per-leaf reductions into one).

  Returns:
    ``{'unconditional': {kind: n}, 'in_branches': {kind: n},
    'unconditional_bytes': b, 'in_branches_bytes': b}``: ``unconditional``
    run on every call of the step, ``in_branches`` only when the
    conditional branch holding them is taken.
  """
  counts = {
    'unconditional': collections.Counter(),
    'in_branches': collections.Counter(),
  }
  num_bytes = {'unconditional': 0, 'in_branches': 0}
  for instruction, path in collective_sites(parse_hlo(hlo_text)):
    where = 'in_branches' if path else 'unconditional'
    counts[where][instruction.collective] += 1
    num_bytes[where] += instruction.num_bytes
  return {
    'unconditional': dict(counts['unconditional']),
    'in_branches': dict(counts['in_branches']),
    'unconditional_bytes': num_bytes['unconditional'],
    'in_branches_bytes': num_bytes['in_branches'],
  }


def per_window(counts, k):
  """Collectives and bytes per window of ``k`` micro-steps.

  Assumes, as for the steps below, that branch collectives run once per
  window (the emitting step) and unconditional ones on every micro-step.
  """
  return {
    'collectives': k * sum(counts['unconditional'].values())
    + sum(counts['in_branches'].values()),
    'bytes': k * counts['unconditional_bytes'] + counts['in_branches_bytes'],
  }


def _steps(num_devices, k):
  """The compiled-HLO texts of one micro-step of each pattern."""
  import jax  # noqa: PLC0415
  from jax import lax  # noqa: PLC0415
  import jax.numpy as jnp  # noqa: PLC0415
  from jax.sharding import NamedSharding  # noqa: PLC0415
  from jax.sharding import PartitionSpec as P  # noqa: PLC0415
  import optax  # noqa: PLC0415

  import optax_tokacc as tokacc  # noqa: PLC0415

  width = 64
  mesh = jax.make_mesh(
    (num_devices,), ('data',), axis_types=(jax.sharding.AxisType.Auto,)
  )
  params = {
    'w1': jnp.zeros((width, width)),
    'b1': jnp.zeros((width,)),
    'w2': jnp.zeros((width, 1)),
  }
  batch = {
    'x': jnp.zeros((4 * num_devices, width)),
    'y': jnp.zeros((4 * num_devices,)),
    'mask': jnp.ones((4 * num_devices,)),
  }

  def loss_sum(params, batch):
    hidden = jnp.tanh(batch['x'] @ params['w1'] + params['b1'])
    error = (hidden @ params['w2'])[:, 0] - batch['y']
    return jnp.sum(error**2 * batch['mask'])

  def num_tokens(batch):
    return jnp.sum(batch['mask']).astype(jnp.int32)

  def local(params):
    return jax.tree.map(lambda p: lax.pcast(p, 'data', to='varying'), params)

  def shard_mapped(step, state_specs):
    return jax.jit(
      jax.shard_map(
        step,
        mesh=mesh,
        in_specs=(P(), state_specs, P('data')),
        out_specs=(P(), state_specs),
      )
    )

  adamw = optax.adamw(1e-3)
  texts = {}

  tx = tokacc.token_weighted_multistep(adamw, k, axis_name='data')
  state = tx.init(params)
  local_fields = {
    name: jax.tree.map(lambda x: x[None], getattr(state, name))
    for name in state._fields
    if name.startswith('acc_')
  }
  state = state._replace(**local_fields)
  specs = jax.tree.map(lambda _: P(), state)._replace(
    **{
      name: jax.tree.map(lambda _: P('data'), value)
      for name, value in local_fields.items()
    }
  )

  def tokacc_step(params, state, batch):
    state = state._replace(
      **{
        name: jax.tree.map(lambda x: x[0], getattr(state, name))
        for name in local_fields
      }
    )
    grads = jax.grad(loss_sum)(local(params), batch)
    updates, state = tx.update(
      grads, state, params, num_tokens=num_tokens(batch)
    )
    state = state._replace(
      **{
        name: jax.tree.map(lambda x: x[None], getattr(state, name))
        for name in local_fields
      }
    )
    return optax.apply_updates(params, updates), state

  stacked = jax.tree.map(
    lambda x, spec: (
      jnp.broadcast_to(x, (num_devices,) + x.shape[1:]) if spec != P() else x
    ),
    state,
    specs,
  )
  texts['tokacc'] = (
    shard_mapped(tokacc_step, specs)
    .lower(params, stacked, batch)
    .compile()
    .as_text()
  )

  multi = optax.MultiSteps(adamw, k)

  def multisteps_step(params, state, batch):
    grads = jax.grad(loss_sum)(local(params), batch)
    grads = lax.pmean(grads, 'data')
    updates, state = multi.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  multi_state = multi.init(params)
  texts['pmean + MultiSteps'] = (
    shard_mapped(multisteps_step, jax.tree.map(lambda _: P(), multi_state))
    .lower(params, multi_state, batch)
    .compile()
    .as_text()
  )

  gspmd = tokacc.token_weighted_multistep(adamw, k)

  def gspmd_step(params, state, batch):
    grads = jax.grad(loss_sum)(params, batch)
    updates, state = gspmd.update(
      grads, state, params, num_tokens=num_tokens(batch)
    )
    return optax.apply_updates(params, updates), state

  sharded_batch = jax.device_put(batch, NamedSharding(mesh, P('data')))
  replicated = jax.device_put(params, NamedSharding(mesh, P()))
  texts['sharded jit (GSPMD)'] = (
    jax.jit(gspmd_step)
    .lower(replicated, gspmd.init(replicated), sharded_batch)
    .compile()
    .as_text()
  )
  return texts


def run(num_devices=8, ks=(1, 4, 8)):
  """Rows ``{pattern, k, per_step, per_window}`` for each pattern and k."""
  rows = []
  for k in ks:
    for pattern, text in _steps(num_devices, k).items():
      counts = count_collectives(text)
      rows.append(
        {
          'pattern': pattern,
          'k': k,
          'devices': num_devices,
          'per_step': counts,
          'per_window': per_window(counts, k),
        }
      )
  return rows


def _print_table(rows):
  print(
    f'{"pattern":<22} {"k":>2} {"every step":>10} {"in branch":>9} '
    f'{"per window":>10} {"bytes/window":>12}'
  )
  for row in rows:
    counts = row['per_step']
    print(
      f'{row["pattern"]:<22} {row["k"]:>2} '
      f'{sum(counts["unconditional"].values()):>10} '
      f'{sum(counts["in_branches"].values()):>9} '
      f'{row["per_window"]["collectives"]:>10} '
      f'{row["per_window"]["bytes"]:>12}'
    )


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--devices', type=int, default=8)
  parser.add_argument('--out', help='write the rows as JSON to this file')
  args = parser.parse_args(argv)
  if 'jax' not in sys.modules:
    os.environ.setdefault('JAX_PLATFORMS', 'cpu')
  import jax  # noqa: PLC0415

  jax.config.update('jax_num_cpu_devices', args.devices)
  rows = run(args.devices)
  _print_table(rows)
  if args.out:
    with open(args.out, 'w') as f:
      json.dump(rows, f, indent=2)


if __name__ == '__main__':
  main()
