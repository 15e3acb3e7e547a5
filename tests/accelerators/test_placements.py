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
"""Every placement on 8 accelerators, compiled for them: the collectives
each one promises (issue 52).

Each entry of ``placements.PLACEMENTS`` is built on 8 fake CPU devices and
compiled for 8 x H100, 8 x H200, and 8-chip TPU v5e and v6e slices, in
each close mode (the device decides; the host's open and closing
programs). The model is the tests' (``helpers.init_params``: :data:`P`
bytes of parameters), AdamW, k = 4. A scalar collective (at most :data:`SCALAR` bytes) is the step's
own (the user's token count and loss summed over the batch) or the
library's agreement on ``emit_now`` over devices; the window's gradients
are what the promises are about:

- deferred (pmap, shard_map, explicit DDP, ZeRO-1): no gradient
  collective on an open micro-step, one gradient reduction per window
  where it closes, carrying the sums with the count and the loss;
- gradients summed by autodiff (shard_map without ``pcast``, warned):
  one all-reduce of the gradients on every micro-step, as documented;
- FSDP (GSPMD, explicit): the gradients reduced over ``data`` on every
  micro-step (FSDP keeps 1/G of the memory), nothing of gradient size
  where the window closes;
- HSDP (explicit): only ``fsdp`` collectives of gradient size on a
  micro-step, one all-reduce across ``replica`` per window;
- no optimizer work on an open micro-step; the device's conditional kept.

Two TPU v5e slices of 8 chips (16 in all): HSDP with ``replica`` across
the slices sends nothing between them on a micro-step and one reduction
per window. XLA:TPU writes it as a ``send`` to the data-center network's
runtime, not as a collective op; the check reads it as one.
"""

import functools

import collective_tables
import helpers
import jax
import jax.numpy as jnp
import on_targets
import placements
import pytest

from optax_tokacc import testing

P = sum(x.nbytes for x in jax.tree.leaves(helpers.init_params()))
SCALAR = 8  # bytes: a float32 loss and an int32 count, at most
# What the window's one reduction carries beyond the sums: the count's
# parts (4 float32) and the loss.
WITH_COUNT_AND_LOSS = 32

DEFERRED = ('pmap', 'shard_map', 'explicit_ddp', 'zero1')
SUMMED_BY_AUTODIFF = ('shard_map_summed',)
FSDP = ('gspmd', 'explicit_fsdp')
HSDP = ('explicit_hsdp',)
assert set(DEFERRED + SUMMED_BY_AUTODIFF + FSDP + HSDP) == set(
  placements.PLACEMENTS
), 'a placement without its promise here'


@functools.cache
def report(name, target, mode):
  close = on_targets.CLOSE_MODES[mode]
  return on_targets.placement_report(name, testing.target(target), close)


def _cases(names, modes=tuple(on_targets.CLOSE_MODES)):
  supported = tuple(n for n in names if placements.supported(n))
  return on_targets.grid(on_targets.EIGHT_DEVICES, supported, modes)


def gradient_sized(collectives, at_least=P):
  return [c for c in collectives if c.bytes >= at_least]


def _listed(report_):
  return report_.summary()


@pytest.mark.parametrize(('target', 'name', 'mode'), _cases(DEFERRED))
def test_deferred_placements_reduce_once_per_window(name, target, mode):
  found = report(name, target, mode)
  if mode == 'host_closing':  # every call closes a window
    reductions = gradient_sized(found.collectives)
  else:
    assert all(c.bytes <= SCALAR for c in found.on_open_step()), _listed(found)
    reductions = gradient_sized(found.on_closing_step_only())
  reductions = [c for c in reductions if c.kind != 'all-gather']
  assert len(reductions) == (0 if mode == 'host_open' else 1), _listed(found)
  for reduction in reductions:
    assert reduction.axes == 'data', _listed(found)
    assert P <= reduction.bytes <= P + WITH_COUNT_AND_LOSS, _listed(found)


@pytest.mark.parametrize(
  ('target', 'name', 'mode'),
  on_targets.grid(
    on_targets.EIGHT_DEVICES, ('zero1',), ('device', 'host_closing')
  ),
)
def test_zero1_reduce_scatters_the_window_into_the_optimizer_shards(
  name, target, mode
):
  """On a GPU, one reduce-scatter of the window (XLA:GPU combines the
  leaves'). On a TPU the tests' leaves (8 x 8 and 8: one row per chip)
  are all-reduced whole, the window's gradients with the count and the
  loss: XLA:TPU keeps a reduce-scatter only where each chip's shard falls
  on its tiles (docs/sharded_training.md, ZeRO-1 on a TPU; issue 54)."""
  found = report(name, target, mode)
  reductions = gradient_sized(
    [c for c in found.collectives if c.kind != 'all-gather']
  )
  kind = 'all-reduce' if target.startswith('tpu') else 'reduce-scatter'
  assert [c.kind for c in reductions] == [kind], _listed(found)


# One float32 leaf sharded on its first dimension over 8 chips, and how
# XLA:TPU reduces its window (measured: `collective_tables.py zero1`):
# it keeps a reduce-scatter only for some shapes, by the shard's rows, not
# by size. XLA:GPU reduce-scatters every leaf.
ZERO1_ON_TPU = {
  (128, 128): {'tpu v5e 2x4': 'reduce-scatter', 'tpu v6e 2x4': 'all-reduce'},
  (160, 128): {'tpu v5e 2x4': 'all-reduce', 'tpu v6e 2x4': 'all-reduce'},
  (8192, 128): {
    'tpu v5e 2x4': 'reduce-scatter',
    'tpu v6e 2x4': 'reduce-scatter',
  },
}


@pytest.mark.parametrize(
  ('target', 'shape'),
  on_targets.grid(on_targets.EIGHT_DEVICES, tuple(ZERO1_ON_TPU)),
)
def test_zero1_window_reduction_per_target(target, shape):
  """Issue 54, item 3: what ZeRO-1's window costs per target, stated.
  XLA:GPU reduce-scatters every leaf. XLA:TPU reduce-scatters a float32
  leaf of 128 columns only where its shard's rows suit it: on a v5e 16
  rows per chip (128 x 128) but not 20 (160 x 128), on a v6e neither;
  1,024 rows per chip (8192 x 128) on both. Where it does not, it
  all-reduces the whole leaf (docs/sharded_training.md, ZeRO-1 on a
  TPU)."""
  mesh = testing.target(target).mesh(
    (8,), ('data',), (jax.sharding.AxisType.Explicit,)
  )
  found = on_targets.one_leaf_zero1_report(mesh, shape)
  leaf = 4 * shape[0] * shape[1]
  reductions = [
    c.kind
    for c in found.collectives
    if c.kind != 'all-gather' and c.bytes >= leaf // 8
  ]
  expected = ZERO1_ON_TPU[shape].get(target, 'reduce-scatter')
  assert reductions == [expected], found.summary()


@pytest.mark.parametrize(('target', 'name', 'mode'), _cases(SUMMED_BY_AUTODIFF))
def test_gradients_summed_by_autodiff_are_reduced_every_micro_step(
  name, target, mode
):
  """The gradients, all-reduced whole on every micro-step (P bytes); in the
  host's closing program XLA:GPU may combine the window's count parts and
  loss (5 float32) into that all-reduce."""
  found = report(name, target, mode)
  every_call = gradient_sized(
    [c for c in found.collectives if c.where == 'every call']
  )
  assert [c.kind for c in every_call][:1] == ['all-reduce'], _listed(found)
  assert P <= every_call[0].bytes <= P + 5 * 4, _listed(found)


@pytest.mark.parametrize(('target', 'name', 'mode'), _cases(FSDP))
def test_fsdp_reduces_every_micro_step_and_adds_nothing_of_gradient_size(
  name, target, mode
):
  found = report(name, target, mode)
  assert all(c.bytes <= SCALAR for c in found.on_closing_step_only())
  if not target.startswith('tpu'):  # XLA:GPU: one reduce-scatter of the grads
    kinds = [c.kind for c in gradient_sized(found.on_open_step())]
    assert 'reduce-scatter' in kinds, _listed(found)
  assert found.on_open_step(), _listed(found)


@pytest.mark.parametrize(('target', 'name', 'mode'), _cases(HSDP))
def test_hsdp_reduces_across_replicas_once_per_window(name, target, mode):
  found = report(name, target, mode)
  shard = P // 4  # the parameters over fsdp (2 x 4 devices: fsdp = 4)
  across = [c for c in found.collectives if 'replica' in c.axes]
  if mode == 'host_closing':
    window = gradient_sized(across, shard)
  else:
    assert not gradient_sized(
      [c for c in across if c.where != 'closing step'], SCALAR + 1
    ), _listed(found)
    window = gradient_sized(
      [c for c in across if c.where == 'closing step'], shard
    )
  assert len(window) == (0 if mode == 'host_open' else 1), _listed(found)
  for reduction in window:
    assert reduction.kind == 'all-reduce' and reduction.axes == 'replica'


@functools.cache
def hsdp_mlp_report(target, mode, num_slices=1):
  found = testing.target(target, num_slices=num_slices)
  shape = (2, 8) if num_slices > 1 else (2, 4)
  types = (jax.sharding.AxisType.Explicit,) * 2
  mesh = found.mesh(shape, ('replica', 'fsdp'), types)
  close = on_targets.CLOSE_MODES[mode]
  spec = jax.P('fsdp', None, reduced={'replica'})
  return on_targets.mlp_report(close, mesh, spec)


HSDP_MLP_CASES = [
  *on_targets.grid(on_targets.EIGHT_DEVICES, ('device', 'host_closing'), (1,)),
  *(
    on_targets.on_target('tpu v5e 2x4', mode, 2)
    for mode in ('device', 'host_closing')
  ),
]


@pytest.mark.skipif(
  not placements.supported('explicit_hsdp'),
  reason=placements.NEEDS_TYPED_SHARDING,
)
@pytest.mark.parametrize(('target', 'mode', 'num_slices'), HSDP_MLP_CASES)
def test_hsdp_sends_one_all_reduce_across_replicas_per_window(
  target, mode, num_slices
):
  """Regression (issue 54, item 3): explicit HSDP of a 2-layer MLP (P =
  557,056 bytes): whoever closes, exactly one all-reduce crosses
  ``replica`` (or the slices) per window, carrying the window's sums (P /
  4 over 2 x 4 devices, P / 8 over two slices of 8), the count and the
  loss; the step's own count and loss are partial sums, so nothing else
  crosses. Closed by the host on a TPU v5e or v6e slice it sent two: the
  sums with the count, and the loss alone."""
  assert_one_all_reduce_across_replicas(
    hsdp_mlp_report(target, mode, num_slices), mode, num_slices
  )


def assert_one_all_reduce_across_replicas(found, mode, num_slices):
  """Exactly one collective crosses ``replica`` (or the slices) per window,
  on the closing step where the device closes: an all-reduce of the MLP's
  sums (P / 4 over 2 x 4 devices, P / 8 over two slices of 8) with the
  count's parts and the loss."""
  across = [
    c
    for c in found.collectives
    if c.across_slices or 'replica' in c.axes.split(',')
  ]
  if mode == 'device':
    assert all(c.where == 'closing step' for c in across), found.summary()
  assert len(across) == 1, found.summary()
  (reduction,) = across
  assert reduction.kind == 'all-reduce', found.summary()
  shard = on_targets.MLP_BYTES // (4 * num_slices)
  count_parts_and_loss = 5 * 4  # float32
  assert shard + count_parts_and_loss <= reduction.bytes, found.summary()


@pytest.mark.parametrize('layout', ['hsdp', 'hsdp_partial'])
@pytest.mark.parametrize(('target', 'mode', 'num_slices'), HSDP_MLP_CASES)
def test_manual_hsdp_sends_one_all_reduce_across_replicas_per_window(
  target, mode, num_slices, layout
):
  """Regression (issue 54): the same MLP in ``shard_map`` HSDP, fully
  manual (``axis_name=('replica', 'fsdp')``) and partial-manual
  (``axis_name='replica'``, ``fsdp`` left to the partitioner): one
  all-reduce crosses ``replica`` (or the slices) per window. Fully manual,
  the count and the loss are carried in a gradient shard, then summed
  within each replica; they went as a second all-reduce, over every
  device. Partial-manual, they travel beside the leaves as one vector."""
  found = on_targets.shard_map_mlp_report(
    on_targets.CLOSE_MODES[mode],
    testing.target(target, num_slices=num_slices).mesh(
      (2, 8) if num_slices > 1 else (2, 4), ('replica', 'fsdp')
    ),
    layout,
  )
  assert_one_all_reduce_across_replicas(found, mode, num_slices)


@pytest.mark.parametrize(
  ('target', 'name', 'mode'), _cases(tuple(placements.PLACEMENTS), ('device',))
)
def test_no_optimizer_work_on_an_open_micro_step(name, target, mode):
  found = report(name, target, mode)
  assert found.optimizer_on_open_step == (), _listed(found)
  assert 'sqrt' in found.optimizer_on_closing_step, _listed(found)
  assert found.conditionals >= 1


@pytest.mark.parametrize(
  ('target', 'name', 'mode'), _cases(tuple(placements.PLACEMENTS), ('device',))
)
def test_compensated_accumulation_keeps_its_rounding_on_every_device(
  name, target, mode
):
  """A bfloat16 accumulator with compensation, in every placement: TwoSum's
  rounding forced on the path every micro-step runs (one per leaf at
  least), no optimizer work there, and the deferral as in float32."""
  found = on_targets.placement_report(
    name, testing.target(target), None, on_targets.compensated_tx
  )
  module = testing.hlo.parse_hlo(found.text)
  info = jnp.finfo(jnp.bfloat16)
  roundings = [
    i
    for i in testing.hlo.reachable_instructions(module, into_branches=False)
    if i.rounds_to == (info.nexp, info.nmant)
  ]
  assert len(roundings) >= len(helpers.init_params()), found.summary()
  assert found.optimizer_on_open_step == (), found.summary()
  if name in DEFERRED:
    assert not gradient_sized(found.on_open_step(), P // 2), found.summary()


@pytest.mark.parametrize(
  ('target', 'mode'),
  on_targets.grid(on_targets.EIGHT_DEVICES, tuple(on_targets.CLOSE_MODES)),
)
def test_gspmd_with_replicated_parameters_reduces_every_micro_step(
  target, mode
):
  """``jax.jit`` over global arrays, parameters replicated on an Auto mesh
  (no ``axis_name``): the partitioner all-reduces each micro-step's
  gradients over ``data`` (docs/sharded_training.md says so: exact, one
  reduction per micro-step; DDP deferred is shard_map's or explicit
  sharding's), and the window adds nothing of gradient size."""

  def build(n, make_tx):
    mesh = placements.data_mesh(n)
    specs = {'w': jax.P(), 'v': jax.P()}
    return placements.jit_run(
      make_tx(None), helpers.init_params(), mesh, specs, 'data',
      step=placements.global_step(make_tx(None)),
    )  # fmt: skip

  run = build(8, on_targets.adamw_tx)
  close = on_targets.CLOSE_MODES[mode]
  found = on_targets.run_report(run, testing.target(target), close)
  every_call = gradient_sized(
    [c for c in found.collectives if c.where == 'every call']
  )
  assert every_call and {c.axes for c in every_call} == {'data'}, (
    found.summary()
  )
  assert not gradient_sized(found.on_closing_step_only()), found.summary()


@pytest.mark.parametrize(
  ('target', 'name', 'mode'), _cases(DEFERRED + HSDP, ('device', 'host_open'))
)
def test_mixed_precision_keeps_the_window_on_the_devices(target, name, mode):
  """bfloat16 parameters (float32 accumulator and moments): no optimizer
  work and nothing of the gradients' size (P / 2 in bfloat16) crosses
  devices on an open micro-step, other than FSDP's own reduction within
  ``fsdp`` (HSDP)."""
  run = placements.PLACEMENTS[name](8, on_targets.adamw_tx)
  close = on_targets.CLOSE_MODES[mode]
  found = on_targets.run_report(
    run, testing.target(target), close, jnp.bfloat16
  )
  assert found.optimizer_on_open_step == (), found.summary()
  crossing = [c for c in found.on_open_step() if c.axes != 'fsdp']
  assert not gradient_sized(crossing, P // 2), found.summary()
  if mode == 'device':
    assert gradient_sized(found.on_closing_step_only(), P // 4), found.summary()


@functools.cache
def two_slices_report(mode):
  """Explicit HSDP on 2 x 8 TPU v5e chips: ``replica`` across the slices,
  ``fsdp`` within each; the count and the loss spelled unreduced, so that
  the step sends nothing of its own between the slices (replicated, they
  are summed over the batch on every call: a scalar, which XLA:TPU pads to
  a 512-byte tile)."""
  run = placements.PLACEMENTS['explicit_hsdp'](8, on_targets.adamw_tx)
  step = placements.explicit_step(on_targets.adamw_tx(None), 'unreduced')
  batch = run.place(helpers.make_windows([on_targets.K], 8)[0][0])
  target = testing.target('tpu v5e 2x4', num_slices=2)
  mesh = target.mesh((2, 8), ('replica', 'fsdp'), run.mesh.axis_types)
  args = on_targets.abstract_on(
    (run.params, run.state, batch, run.emit(False)), mesh
  )
  lower = placements.lower_jit(step)
  return testing.check(
    lower(mesh, on_targets.CLOSE_MODES[mode], *args), mesh=mesh
  )


@pytest.mark.skipif(
  not placements.supported('explicit_hsdp'),
  reason=placements.NEEDS_TYPED_SHARDING,
)
@pytest.mark.parametrize('mode', tuple(on_targets.CLOSE_MODES))
def test_hsdp_across_tpu_slices_sends_one_reduction_per_window(mode):
  found = two_slices_report(mode)
  between = [c for c in found.collectives if c.across_slices]
  if mode == 'host_closing':
    assert len(between) == 1, found.summary()
  else:
    assert not [c for c in between if c.where != 'closing step'], (
      found.summary()
    )
    closing = [c for c in between if c.where == 'closing step']
    assert len(closing) == (0 if mode == 'host_open' else 1), found.summary()
  for transfer in between:
    assert transfer.kind == 'all-reduce' and transfer.bytes >= P // 8


@pytest.mark.skipif(
  not placements.supported('explicit_hsdp'),
  reason=placements.NEEDS_TYPED_SHARDING,
)
@pytest.mark.xdist_group('collective tables')
def test_the_docs_tables_are_the_compiled_programs():
  """Issue 54, item 3: the per-target table of docs/sharded_training.md
  is what ``collective_tables.py`` reads from the programs compiled for
  8 x H100, a TPU v5e 2x4 slice and 8 CPU devices (about 48 compiles:
  explicit sharding's layouts and shard_map's)."""
  page = (helpers.REPO / 'docs' / 'sharded_training.md').read_text()
  begin, end = (
    '<!-- collective-tables: begin -->',
    '<!-- collective-tables: end -->',
  )
  table = page[page.index(begin) : page.index(end)].splitlines()
  documented = [line for line in table[3:] if line.startswith('|')]
  assert documented == collective_tables.rows()


# A model whose leaves fill a TPU's tiles (the tests' tiny one is padded
# many times over): 8 MiB of float32 parameters in two matrices.
WIDE = {'w1': (512, 2048), 'w2': (2048, 512)}


def _wide_step_temporaries(target, layout):
  """The compiled temporaries of the explicit-sharding MLP step
  (``on_targets.mlp_report``, with :data:`WIDE`) on ``target``'s 8
  devices, the device deciding, as a fraction of the parameters' bytes."""
  mesh = testing.target(target).mesh(
    (8,), ('data',), (jax.sharding.AxisType.Explicit,)
  )
  spec = jax.sharding.PartitionSpec(None, None, reduced={'data'})
  found = on_targets.mlp_report(None, mesh, spec, shapes=WIDE, **layout)
  return found.temp_bytes / sum(4 * a * b for a, b in WIDE.values())


@pytest.mark.skipif(
  not placements.supported('explicit_ddp'),
  reason=placements.NEEDS_TYPED_SHARDING,
)
@pytest.mark.parametrize(
  ('target', 'name'),
  on_targets.grid(on_targets.EIGHT_DEVICES, ('explicit_ddp', 'zero1')),
)
def test_the_device_decided_close_holds_one_reduced_window_at_most(
  target, name
):
  """The device-decided step's temporaries, per device: the window
  reduced whole (DDP: one buffer of the parameters' size, the all-reduce's
  result) or its shard and the shard's updates (ZeRO-1: 2/8 of it), and
  an eighth more for the rest. A second copy of the reduced window (the
  closing loop carrying it beside the accumulator's buffer, which
  XLA:TPU keeps alive: 2.04x on a v5e 2x4 slice, DDP) fails."""
  layout = {'shard_optimizer_over': ('data',)} if name == 'zero1' else {}
  found = _wide_step_temporaries(target, layout)
  assert found <= (2 / 8 if layout else 1) + 1 / 8, found
