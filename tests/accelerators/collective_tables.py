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
"""The collectives of each layout, explicit sharding's and ``shard_map``'s,
per target, as ``docs/sharded_training.md`` tabulates them (issue 54, item
3).

``python tests/accelerators/collective_tables.py`` (from the repository's
root, with the ``accelerators`` extra and ``JAX_PLATFORMS=cpu``) compiles
the MLP of :func:`on_targets.mlp_report` and
:func:`on_targets.shard_map_mlp_report` (P = 557,056 bytes, AdamW, k = 4)
in each layout for 8 x H100, a TPU v5e 2x4 slice and 8 CPU devices, with the
device deciding and with the host closing, and prints one Markdown row per
layout and target: what an open micro-step sends, what the closing step
adds, and what the host's closing program sends, in multiples of P.
``test_placements.test_the_docs_tables_are_the_compiled_programs`` checks
that the page's rows are these. ``... collective_tables.py zero1`` prints how
each target reduces ZeRO-1's window for leaves of several shapes
(``docs/sharded_training.md``, ZeRO-1 on a TPU).
"""

import collections
import os
import pathlib
import sys

import jax
from jax.sharding import PartitionSpec as P
import numpy as np

EXPLICIT = jax.sharding.AxisType.Explicit
REDUCED = P(None, None, reduced={'data'})
LAYOUTS = {  # mesh shape and axes, the parameters' spec, init_sharded's
  'DDP': ((8,), ('data',), REDUCED, {}),
  'ZeRO-1': ((8,), ('data',), REDUCED, {'shard_optimizer_over': ('data',)}),
  'FSDP': ((8,), ('fsdp',), P('fsdp', None), {}),
  'HSDP': (
    (2, 4),
    ('replica', 'fsdp'),
    P('fsdp', None, reduced={'replica'}),
    {},
  ),
  'replicated `P()`': ((8,), ('data',), P(), {}),
}
# shard_map's layouts (Auto axes): mesh shape and axes, the layout in
# on_targets.SHARD_MAP_LAYOUTS.
SHARD_MAP = {
  'DDP, `shard_map`': ((8,), ('data',), 'ddp'),
  'HSDP fully manual': ((2, 4), ('replica', 'fsdp'), 'hsdp'),
  'HSDP partial-manual': ((2, 4), ('replica', 'fsdp'), 'hsdp_partial'),
}
TARGETS = ('h100 x8', 'tpu v5e 2x4', 'cpu')
SCALAR = 1024  # bytes: at most the count, the loss and the norms


def _mesh(target, shape, axes, kind=EXPLICIT):
  types = (kind,) * len(axes)
  if target == 'cpu':
    devices = np.asarray(jax.devices()[:8]).reshape(shape)
    return jax.sharding.Mesh(devices, axes, axis_types=types)
  from optax_tokacc import testing  # noqa: PLC0415

  return testing.target(target).mesh(shape, axes, types)


def described(collectives, p_bytes):
  """``collectives`` grouped by kind and axes: '2 all-gather fsdp
  (1.00P)', a scalar one as 'scalar all-reduce data'."""
  groups = collections.Counter()
  sizes = collections.defaultdict(int)
  for c in collectives:
    scalar = c.bytes <= SCALAR
    key = ('scalar ' if scalar else '') + f'{c.kind} {c.axes}'
    groups[key] += 1
    sizes[key] += 0 if scalar else c.bytes
  if not groups:
    return 'none'
  parts = []
  for key, count in sorted(groups.items()):
    size = f' ({sizes[key] / p_bytes:.2f}P)' if sizes[key] else ''
    parts.append(f'{count} {key}{size}')
  return ', '.join(parts)


def row(layout, target):
  """One Markdown row: the layout, the target, the open micro-step, what
  the closing step adds, the host's closing program."""
  import on_targets  # noqa: PLC0415 - beside this file, on the tests' path

  if layout in SHARD_MAP:
    shape, axes, name = SHARD_MAP[layout]
    mesh = _mesh(target, shape, axes, jax.sharding.AxisType.Auto)
    device, host = (
      on_targets.shard_map_mlp_report(close, mesh, name)
      for close in (None, True)
    )
  else:
    shape, axes, spec, options = LAYOUTS[layout]
    mesh = _mesh(target, shape, axes)
    device, host = (
      on_targets.mlp_report(close, mesh, spec, **options)
      for close in (None, True)
    )
  p_bytes = on_targets.MLP_BYTES
  cells = (
    described(device.on_open_step(), p_bytes),
    described(device.on_closing_step_only(), p_bytes),
    described(host.collectives, p_bytes),
  )
  return f'| {layout} | {target} | ' + ' | '.join(cells) + ' |'


def rows():
  layouts = (*LAYOUTS, *SHARD_MAP)
  return [row(layout, target) for layout in layouts for target in TARGETS]


def zero1_leaf(target, shape):
  """ZeRO-1 of one float32 leaf of ``shape`` (sharded on its first
  dimension) on ``target``'s 8 devices, closed by the host: the kinds of
  the window's reduction, and the program's temporaries."""
  import on_targets  # noqa: PLC0415

  mesh = _mesh(target, (8,), ('data',))
  found = on_targets.one_leaf_zero1_report(mesh, shape)
  kinds = [c.kind for c in found.collectives if c.bytes > SCALAR]
  return [k for k in kinds if k != 'all-gather'], found.temp_bytes


ZERO1_SHAPES = (
  (128, 128), (160, 128), (192, 128), (256, 128), (8000, 128), (8192, 128),
  (96, 768), (128, 768), (512, 16), (1024, 16),
)  # fmt: skip


if __name__ == '__main__':
  here = pathlib.Path(__file__).resolve().parent
  sys.path[:0] = [str(here.parent), str(here)]
  os.environ.setdefault('JAX_PLATFORMS', 'cpu')
  import conftest  # noqa: F401, PLC0415 - 8 CPU devices, before any backend

  if sys.argv[1:] == ['zero1']:
    for target in ('tpu v5e 2x4', 'tpu v6e 2x4', 'h100 x8'):
      for shape in ZERO1_SHAPES:
        kinds, temp = zero1_leaf(target, shape)
        rows_per_chip = shape[0] // 8
        print(f'{target} {shape} {rows_per_chip} rows/chip: {kinds}, '
              f'temporaries {temp:,} B')  # fmt: skip
  else:
    print('\n'.join(rows()))
