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
"""One accelerator, compiled for it: the open micro-step against the
ideal's, compiled for the same target (issue 52).

A memory-bound MLP (``on_targets.mlp``: 4 layers of 1024 x 1024, 16.8 MB
of float32 parameters, on a GPU; 4096 x 4096, 268 MB, on a TPU, past its
fast memory) with AdamW, k = 4, on an H100, an H200, a TPU v5e and a TPU
v6e, in float32 and in mixed precision (bfloat16 parameters,
AdamW's first moment in float32). Each close mode of the user's step
(the device decides; the host's open and closing programs) is held to:

- no optimizer work on an open micro-step, and none missing where the
  window closes (the check can fail);
- the device-decided step's conditional kept (XLA:GPU flattens a
  conditional whose branches look cheap into selects, which would run the
  optimizer on every micro-step);
- no collective on one device;
- the rounding compensated accumulation needs, forced: XLA:GPU keeps
  excess precision and removes an ``astype`` round trip;
- against the two-program ideal of the same target, modelled traffic,
  kernels and temporaries no worse than :data:`FLOORS`: today's figures.
"""

import math

import jax
import jax.numpy as jnp
import on_targets
import pytest

from optax_tokacc import testing

TARGETS = on_targets.GPU_TARGETS + on_targets.TPU_TARGETS
DTYPES = ('float32', 'bfloat16')
OURS = (*on_targets.CLOSE_MODES, 'update_and_apply')
K = on_targets.K

# Today's figures (issue 55's closing loop and lazy restart; jax 0.12.0.1,
# libtpu 0.0.51), the floor that must not get worse: per (target,
# parameters' dtype, close mode), the step's modelled traffic over the
# ideal's (an open micro-step: over the ideal micro-step; the host's
# closing program, every loop's trip taken: over the ideal micro-step and
# window update), its kernels, its temporaries beyond the ideal
# micro-step's as a fraction of the parameters' bytes, and the window's
# traffic over the ideal window's (k micro-steps and the window update);
# on a TPU at width 4096 (``on_targets.WIDTHS``). The programs are
# deterministic for pinned compilers; the figures are rounded up at their
# last digit. Printed by ``python tests/accelerators/floors.py``. Against issue 52's (74fa917) the
# device-decided step is cheaper on every target (an H100's open step
# 1.50x against 1.99x; its temporaries 0.00 P against 0.77 P in float32
# and 1.63 P in bfloat16: on a GPU the norms' squares are taken of the
# sums behind an optimization barrier); on the GPUs the host's closing
# step is written out (1.07x against 1.15x in float32, 1.00x against
# 0.94x in bfloat16) and its window 1.03x and 1.00x (1.07x and 0.98x);
# worse: the host-open step's one kernel more (the restart loop's
# predicate), a v5e's bfloat16 host window by 1% and a v6e's host-closing
# temporaries by 0.01-0.02 P. ``update_and_apply``: the device-decided
# step updating and applying in one call, 1.00x on every target (on a
# TPU the closing trip applies the updates, ``_applied._in_trip``). On a
# GPU each leaf's squares of the sums and of the updates are summed in one
# reduction, which XLA:GPU fuses with ``inner``'s step (the window's
# norms, ``_norms.TOGETHER_ON``): the host's closing step 1.00x against
# 1.07x in float32 and 0.92x against 1.00x in bfloat16, its window 1.00x
# and 0.97x (1.03x and 1.00x), ``update_and_apply``'s 1.09x and 1.08x
# (1.12x and 1.12x), the device-decided window 1.37x and 1.28x (1.40x and
# 1.31x). A TPU's host close is written out too, its sums laid out as
# the parameters (``_closing._as_the_parameters``): its closing step 1.09x
# and 1.22x on a v5e, 1.00x and 1.10x on a v6e (1.25x-1.28x), its window
# 1.04x, 1.11x, 1.00x and 1.05x (1.12x-1.14x), its temporaries 0.26, 1.03,
# 0.27 and 0.52 P (1.0 and 1.5 P).
FLOORS = {
  # fmt: off
  # (target, dtype, mode): (traffic, kernels, extra temp / P,
  #                         window traffic)
  ('h100', 'float32', 'device'): (1.497, 56, 0.001, 1.365),
  ('h100', 'float32', 'host_open'): (1.001, 36, 0.001, 1.001),
  ('h100', 'float32', 'host_closing'): (1.001, 67, 0.002, 1.001),
  ('h100', 'float32', 'update_and_apply'): (1.001, 49, 0.001, 1.092),
  ('h100', 'bfloat16', 'device'): (1.336, 61, 0.001, 1.278),
  ('h100', 'bfloat16', 'host_open'): (1.001, 41, 0.001, 0.968),
  ('h100', 'bfloat16', 'host_closing'): (0.922, 70, 0.002, 0.968),
  ('h100', 'bfloat16', 'update_and_apply'): (1.001, 54, 0.001, 1.082),
  ('h200', 'float32', 'device'): (1.497, 56, 0.001, 1.365),
  ('h200', 'float32', 'host_open'): (1.001, 36, 0.001, 1.001),
  ('h200', 'float32', 'host_closing'): (1.001, 67, 0.002, 1.001),
  ('h200', 'float32', 'update_and_apply'): (1.001, 49, 0.001, 1.092),
  ('h200', 'bfloat16', 'device'): (1.336, 61, 0.001, 1.278),
  ('h200', 'bfloat16', 'host_open'): (1.001, 41, 0.001, 0.968),
  ('h200', 'bfloat16', 'host_closing'): (0.922, 70, 0.002, 0.968),
  ('h200', 'bfloat16', 'update_and_apply'): (1.001, 54, 0.001, 1.082),
  ('tpu v5e 1x1', 'float32', 'device'): (2.042, 74, 0.254, 1.685),
  ('tpu v5e 1x1', 'float32', 'host_open'): (1.001, 38, 0.0, 1.043),
  ('tpu v5e 1x1', 'float32', 'host_closing'): (1.085, 129, 0.261, 1.043),
  ('tpu v5e 1x1', 'float32', 'update_and_apply'): (1.001, 66, 0.005, 1.129),
  ('tpu v5e 1x1', 'bfloat16', 'device'): (2.024, 74, 0.511, 1.706),
  ('tpu v5e 1x1', 'bfloat16', 'host_open'): (1.001, 38, 0.0, 1.113),
  ('tpu v5e 1x1', 'bfloat16', 'host_closing'): (1.224, 133, 1.031, 1.113),
  ('tpu v5e 1x1', 'bfloat16', 'update_and_apply'): (1.001, 66, 0.028, 1.142),
  ('tpu v6e 1x1', 'float32', 'device'): (1.827, 72, 0.264, 1.585),
  ('tpu v6e 1x1', 'float32', 'host_open'): (1.001, 40, -0.001, 1.001),
  ('tpu v6e 1x1', 'float32', 'host_closing'): (1.001, 125, 0.272, 1.001),
  ('tpu v6e 1x1', 'float32', 'update_and_apply'): (1.001, 68, 0.017, 1.11),
  ('tpu v6e 1x1', 'bfloat16', 'device'): (1.764, 72, 0.507, 1.576),
  ('tpu v6e 1x1', 'bfloat16', 'host_open'): (1.001, 38, -0.001, 1.047),
  ('tpu v6e 1x1', 'bfloat16', 'host_closing'): (1.101, 127, 0.523, 1.047),
  ('tpu v6e 1x1', 'bfloat16', 'update_and_apply'): (1.001, 66, 0.014, 1.116),
  # fmt: on
}


def figures(target, dtype, mode, window_norms=True):
  """Today's :data:`FLOORS` entry, computed from the compiled programs;
  without ``window_norms``, of ours compiled without the norms (against
  the same ideal)."""
  ideals = on_targets.one_device_reports(target, dtype)
  micro, update = ideals['ideal_micro'], ideals['ideal_update']
  ideal_window = K * micro.open_step.bytes + update.open_step.bytes
  reports = on_targets.one_device_reports(
    target, dtype, window_norms=window_norms
  )
  ours = reports[mode]
  # The host's closing program runs its closing trips (every loop's one
  # trip: the restart's too, a window's first micro-step's, so its
  # figures are high by a parameter-sized write).
  runs = ours.closing_step if mode == 'host_closing' else ours.open_step
  if mode in ('device', 'update_and_apply'):
    window = (K - 1) * ours.open_step.bytes + ours.closing_step.bytes
  else:
    host_open, closing = reports['host_open'], reports['host_closing']
    window = (K - 1) * host_open.open_step.bytes + closing.closing_step.bytes
  extra_temp = ours.temp_bytes - micro.temp_bytes
  ideal = micro.open_step.bytes
  if mode == 'host_closing':
    ideal += update.open_step.bytes
  return (
    runs.bytes / ideal,
    runs.kernels,
    extra_temp / on_targets.param_bytes(target, dtype),
    window / ideal_window,
  )


CASES = on_targets.grid(TARGETS, DTYPES)


@pytest.mark.parametrize(('target', 'dtype'), CASES)
def test_compiled_for_the_target_it_names(target, dtype):
  """Every program is the target's, never the CPU's."""
  reports = on_targets.one_device_reports(target, dtype)
  kind = testing.target(target).device_kind
  assert {r.device_kind for r in reports.values()} == {kind}


@pytest.mark.parametrize(('target', 'dtype'), CASES)
def test_no_optimizer_work_on_an_open_micro_step(target, dtype):
  reports = on_targets.one_device_reports(target, dtype)
  for mode in ('device', 'host_open'):
    assert reports[mode].optimizer_on_open_step == (), reports[mode].summary()
  # Where the window closes, the optimizer runs: the check can fail.
  assert 'sqrt' in reports['device'].optimizer_on_closing_step
  assert 'sqrt' in reports['host_closing'].optimizer_on_closing_step


@pytest.mark.parametrize(('target', 'dtype'), CASES)
def test_the_device_decided_step_keeps_its_conditional(target, dtype):
  """The optimizer runs in a branch (a loop of 0 or 1 trips), not
  flattened into selects; on a GPU the host's open step keeps one flag
  loop, the restart of the sums at a window's first micro-step, and on a
  TPU none (the window restarts where it closes, ``_window.restart_if``)."""
  reports = on_targets.one_device_reports(target, dtype)
  assert reports['device'].conditionals >= 2
  on_tpu = target.startswith('tpu')
  assert reports['host_open'].conditionals == (0 if on_tpu else 1)
  assert (
    reports['device'].open_step.bytes < reports['device'].closing_step.bytes
  )


@pytest.mark.parametrize(('target', 'dtype'), CASES)
def test_no_collective_on_one_device(target, dtype):
  reports = on_targets.one_device_reports(target, dtype)
  assert all(not r.collectives for r in reports.values())


@pytest.mark.parametrize('mode', OURS)
@pytest.mark.parametrize(('target', 'dtype'), CASES)
def test_no_worse_than_today_against_the_ideal(target, dtype, mode):
  found = figures(target, dtype, mode)
  floor = FLOORS[target, dtype, mode]
  names = ('open traffic', 'open kernels', 'extra temp / P', 'window traffic')
  worse = [
    f'{name} {value:.4f} > {bound}'
    for name, value, bound in zip(names, found, floor)
    if value > bound
  ]
  assert not worse, f'{target}, {dtype}, {mode}: {"; ".join(worse)}'


@pytest.mark.parametrize(('target', 'dtype'), CASES)
def test_update_and_apply_open_micro_step_is_the_ideals(target, dtype):
  """Issue 55's targets: where the step updates and applies in one call
  (``tokacc.update_and_apply``, the Flax train states), a device-decided
  open micro-step moves at most 1.05x the ideal's modelled bytes (the
  branch that runs included) and holds temporaries within 5% of the
  parameters' bytes of the ideal's; with ``optax.apply_updates`` after
  ``tx.update``, it adds the returned zeros to every parameter (the
  ``device`` floor: 1.34-2.04x)."""
  traffic, _, extra_temp, _ = figures(target, dtype, 'update_and_apply')
  assert traffic <= 1.05, traffic
  assert extra_temp <= 0.05, extra_temp
  assert figures(target, dtype, 'device')[0] > 1.2  # the check can fail


@pytest.mark.parametrize(('target', 'dtype'), CASES)
def test_update_and_apply_closed_by_the_host_is_apply_updates_program(
  target, dtype
):
  """Where the host closes the window, ``update_and_apply`` is the program
  ``tx.update`` then ``optax.apply_updates`` makes (the same bits
  promised): on a GPU and a TPU the close is written out, and XLA fuses
  the add into ``inner``'s step. Its modelled traffic and temporaries are
  that program's (FLOORS' ``host_closing``); on a GPU its temporaries are
  within 5% of the parameters' bytes of the ideal's (the larger of its
  two programs')."""
  reports = on_targets.one_device_reports(target, dtype)
  ours, theirs = reports['update_and_apply_closing'], reports['host_closing']
  size = on_targets.param_bytes(target, dtype)
  assert ours.closing_step.bytes <= theirs.closing_step.bytes * 1.001
  assert ours.temp_bytes - theirs.temp_bytes <= 0.001 * size
  if not target.startswith('tpu'):
    ideal = max(reports[k].temp_bytes for k in ('ideal_micro', 'ideal_update'))
    assert (ours.temp_bytes - ideal) / size <= 0.05


GPU_CASES = on_targets.grid(on_targets.GPU_TARGETS, DTYPES)


@pytest.mark.parametrize(('target', 'dtype'), GPU_CASES)
def test_a_gpus_window_norms_read_nothing_more(target, dtype):
  """On a GPU the window's norms (``window_norms``, on by default) cost no
  pass of their own: each leaf's squares of the sums and of the updates
  are summed in one reduction (``_norms.local_squares``), which XLA:GPU
  fuses with ``inner``'s step, where the step reads both anyway. The
  closing programs with and without the norms move the same bytes, to
  their scalars (0.01 P: a parameter-sized pass would be 0.25 P or more,
  a leaf's)."""
  bare = on_targets.one_device_reports(target, dtype, window_norms=False)
  normed = on_targets.one_device_reports(target, dtype)
  size = on_targets.param_bytes(target, dtype)
  for mode in ('device', 'host_closing'):
    extra = normed[mode].closing_step.bytes - bare[mode].closing_step.bytes
    assert extra / size <= 0.01, (mode, extra / size)


# Issue 55 leaves these host-closed windows above 1.03x the ideal's
# (FLOORS): a v5e's, and a v6e's in bfloat16. XLA:TPU keeps AdamW's
# writes out of the last gradient's GEMM fusion: the parameters' in
# float32, for the update's norm (the test below), and the moments' in
# bfloat16, for the selects that keep the moments of a window that emits
# nothing (docs/performance.md).
_ABOVE = pytest.mark.xfail(
  reason='issue 55: a host-closed window above 1.03x', strict=True
)
_STILL_ABOVE = {
  ('tpu v5e 1x1', 'float32'),
  ('tpu v5e 1x1', 'bfloat16'),
  ('tpu v6e 1x1', 'bfloat16'),
}
HOST_CASES = [
  on_targets.on_target(t, d, marks=(_ABOVE,) if (t, d) in _STILL_ABOVE else ())
  for t in TARGETS
  for d in DTYPES
]


@pytest.mark.parametrize(('target', 'dtype'), HOST_CASES)
def test_a_host_closed_window_is_the_ideals(target, dtype):
  """Issue 55's targets for the host's close: the open step at most 1.02x
  the ideal micro-step's modelled traffic, the window (k - 1 open steps
  and the closing step) at most 1.03x the ideal's (k micro-steps and the
  window update)."""
  open_step, _, _, _ = figures(target, dtype, 'host_open')
  _, _, _, window = figures(target, dtype, 'host_closing')
  assert open_step <= 1.02, open_step
  assert window <= 1.03, window


@pytest.mark.parametrize(
  'target', [on_targets.on_target(t) for t in on_targets.TPU_TARGETS]
)
def test_a_tpus_float32_host_window_without_norms_is_the_ideals(target):
  """What keeps a v5e's float32 host-closed window above 1.03x is the
  update's norm (``window_norms``, on by default): XLA:TPU fuses the sum
  of the updates' squares into the fusion of the last gradient's GEMM and
  AdamW, and then writes the updates out and adds them to the parameters
  in a pass of its own (a v5e's closing step 1.08x the ideal's). Without
  the norms it fuses the parameters' update there too, and the window is
  below the ideal's, which writes its sums out before AdamW reads them
  (0.91x on a v5e). docs/performance.md tells TPU users so."""
  _, _, _, window = figures(target, 'float32', 'host_closing', False)
  assert window <= 1.0, window


TPU_CASES = on_targets.grid(on_targets.TPU_TARGETS, DTYPES)


@pytest.mark.parametrize(('target', 'dtype'), TPU_CASES)
def test_a_tpus_host_close_lays_out_nothing_again(target, dtype):
  """The host's closing program on a TPU (written out, its sums laid out
  as the parameters, ``_closing._as_the_parameters``) copies no buffer of
  a weight's size: a v6e laid ``inner``'s fusion out transposed, as the
  gradient's GEMM, and copied every parameter, moment and sum into that
  layout and back."""
  report = on_targets.one_device_reports(target, dtype)['host_closing']
  model = on_targets.mlp(testing.target(target), jnp.dtype(dtype))
  weight = min(x.size for x in jax.tree.leaves(model.params) if x.ndim == 2)
  module = testing.hlo.parse_hlo(report.text)
  copies = [
    i.name
    for i in testing.hlo.reachable_instructions(module)
    if i.opcode == 'copy' and math.prod(i.shapes[0][1]) >= weight
  ]
  assert not copies, copies


@pytest.mark.parametrize('mode', ('device', 'host_open'))
@pytest.mark.parametrize('target', [on_targets.on_target(t) for t in TARGETS])
def test_compensated_accumulation_keeps_its_rounding(target, mode):
  """TwoSum's rounding to the bfloat16 accumulator, a ``reduce-precision``
  on the path every micro-step runs, one per leaf at least, after the
  target compiler's passes."""
  report = on_targets.one_device_reports(target, 'bfloat16', True)[mode]
  module = testing.hlo.parse_hlo(report.text)
  info = jnp.finfo(jnp.bfloat16)
  roundings = [
    i
    for i in testing.hlo.reachable_instructions(module, into_branches=False)
    if i.rounds_to == (info.nexp, info.nmant)
  ]
  leaves = 2 * 4  # w and b of 4 layers
  assert len(roundings) >= leaves, report.summary()
