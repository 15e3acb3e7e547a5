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
"""The collectives of a compiled program, with where they run and what
they span: the tests' and the benchmarks' one reader of them.

:func:`collective_sites` finds every collective with the conditional
branches that lead to it (:func:`on_every_call`, :func:`in_branches`,
:func:`on_micro_step_path`, :func:`on_closing_step_only` sort them);
:func:`group_sets` gives a collective's device groups;
:func:`collective_records` adds the mesh axes each one spans and its
payload; :func:`summarize` counts them per micro-step and per window. A
collective on the unconditional path runs on every micro-step; one in the
taken branch of the transform's ``lax.cond`` (branch 1) only on the step
that closes the window. Payload: the bytes of the unsharded buffer on one
device (all-reduce: its operand; all-gather: its result; reduce-scatter: its
operand).

Public, as :mod:`optax_tokacc.testing`'s reader underneath, for checks of
your own; :func:`optax_tokacc.testing.check` is the summary most need.
"""

import collections
import math
import re
from typing import Any, Optional, Union

import numpy as np

from optax_tokacc.testing import hlo

# The conditional branches from the entry computation to a collective:
# (conditional's name, branch index) pairs, empty on the unconditional path.
Path = tuple[tuple[str, int], ...]
Site = tuple[hlo.Instruction, Path]
MeshAxes = tuple[tuple[str, int], ...]  # ((name, size), ...)
Record = dict[str, Any]  # kind, where, axes, group_size, bytes


def collective_sites(module: hlo.HloModule) -> list[Site]:
  """Every collective with the conditional branches that lead to it.

  Returns ``(instruction, path)`` pairs, where ``path`` is a tuple of
  ``(conditional_name, branch_index)`` from the entry computation: empty for
  a collective that runs on every call.
  """
  sites = []

  def visit(computation: str, path: Path, seen: frozenset[str]) -> None:
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


def compiled_collectives(hlo_text: str) -> list[Site]:
  """:func:`collective_sites` of compiled HLO text."""
  return collective_sites(hlo.parse_hlo(hlo_text))


def on_every_call(sites: list[Site]) -> list[hlo.Instruction]:
  """The collectives of ``sites`` outside every conditional's branches."""
  return [site for site, path in sites if not path]


def in_branches(sites: list[Site]) -> list[hlo.Instruction]:
  """The collectives of ``sites`` inside a conditional's branch."""
  return [site for site, path in sites if path]


def on_micro_step_path(sites: list[Site]) -> list[hlo.Instruction]:
  """The collectives of ``sites`` a micro-step runs: on every call, or in
  a branch other than the closing one (:func:`closing_only`)."""
  return [site for site, path in sites if not closing_only(path)]


def on_closing_step_only(sites: list[Site]) -> list[hlo.Instruction]:
  """The collectives of ``sites`` that only the closing step runs."""
  return [site for site, path in sites if closing_only(path)]


def where(path: Path) -> str:
  """When a collective at ``path`` runs: on every micro-step, on the
  closing step only (branch 1 of every conditional on its path: the taken
  branch of ``lax.cond(emit, ...)``), or in another branch (counted as on
  every micro-step, an upper bound, and flagged)."""
  if not path:
    return 'every micro-step'
  if all(index == 1 for _, index in path):
    return 'closing step'
  return 'other branch'


def closing_only(path: Path) -> bool:
  """Whether a collective at ``path`` runs on the closing step only: in
  branch 1 (``lax.cond``'s true branch) of every conditional leading to
  it."""
  return where(path) == 'closing step'


def group_sets(
  instruction: hlo.Instruction, num_devices: int
) -> frozenset[frozenset[int]]:
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


def device_groups(text: str, num_devices: int) -> Optional[list[list[int]]]:
  """The device groups of a ``replica_groups`` text, as lists of ids.

  Handles the explicit (``{{0,1},{2,3}}``), iota (``[2,4]<=[4,2]T(1,0)``)
  and mesh (``mesh['axis_0'=2,'axis_1'=4] {'axis_1'}``, optionally with
  ``device_ids=([2,2]T(1,0))`` placing the devices) forms; ``{}`` or no
  groups means all devices. Returns None for a form it does not know.
  """
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
    return _mesh_groups(*mesh.groups())
  return None


def _mesh_groups(
  axes_text: str,
  device_dims: Optional[str],
  device_perm: Optional[str],
  grouped_text: str,
) -> list[list[int]]:
  """The groups of ``mesh[axes_text], device_ids=([device_dims]
  T(device_perm)) {grouped_text}``: the devices that differ only along the
  grouped axes."""
  axes = re.findall(r"'(\w+)'=(\d+)", axes_text)
  grouped = set(re.findall(r"'(\w+)'", grouped_text))
  names = [name for name, _ in axes]
  ids = np.arange(math.prod(int(s) for _, s in axes))
  if device_dims:  # device_ids=([dims]T(perm)): devices in mesh order
    ids = ids.reshape([int(d) for d in device_dims.split(',')])
    if device_perm:
      ids = ids.transpose([int(p) for p in device_perm.split(',')])
  ids = ids.reshape([int(s) for _, s in axes])
  order = [i for i, n in enumerate(names) if n not in grouped]
  order += [i for i, n in enumerate(names) if n in grouped]
  size = math.prod(int(s) for n, s in axes if n in grouped)
  return ids.transpose(order).reshape(-1, size).tolist()


def group_axes(groups: Optional[list[list[int]]], mesh_axes: MeshAxes) -> str:
  """The mesh axes along which the devices of a group differ.

  ``mesh_axes`` is ``((name, size), ...)``; device ``i`` of the HLO is the
  ``i``-th device of the mesh in row-major order. Returns ``'?'`` for
  unknown groups and ``'-'`` for groups of one device.
  """
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


def collective_records(hlo_text: str, mesh_axes: MeshAxes) -> list[Record]:
  """Every collective of a compiled step: kind, where, axes, group, bytes."""
  num_devices = math.prod(size for _, size in mesh_axes)
  records = []
  for instruction, path in compiled_collectives(hlo_text):
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


def summarize(records: list[Record], k: int) -> dict[str, Union[dict, int]]:
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
