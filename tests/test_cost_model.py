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
"""``testing.step_cost``'s model on programs written by hand: a kernel
is charged the bytes it reads and writes, and moving a buffer into a
TPU's fast memory ahead of the kernel that reads it (a prefetch, whole
or in slices) charges that kernel's read once, as if it read the buffer
where it lies. The programs are XLA:TPU's own forms (libtpu 0.0.51),
cut down to one kernel."""

import pytest

from optax_tokacc import testing

_HEADER = 'HloModule step, is_scheduled=true\n\n'
_FUSED = """\
%fused (p: f32[1024,256]) -> f32[1024,256] {
  %p = f32[1024,256]{1,0} parameter(0)
  ROOT %negate = f32[1024,256]{1,0} negate(%p)
}

"""

# The kernel reads the parameter where it lies.
DIRECT = f"""{_HEADER}{_FUSED}\
ENTRY %main (x: f32[1024,256]) -> f32[1024,256] {{
  %x = f32[1024,256]{{1,0}} parameter(0)
  ROOT %fusion = f32[1024,256]{{1,0}} fusion(%x), kind=kLoop, calls=%fused
}}
"""

# XLA:TPU's whole prefetch into its fast memory (S(1)), then the kernel.
PREFETCHED = f"""{_HEADER}{_FUSED}\
ENTRY %main (x: f32[1024,256]) -> f32[1024,256] {{
  %x = f32[1024,256]{{1,0}} parameter(0)
  %copy-start = (f32[1024,256]{{1,0:S(1)}}, f32[1024,256]{{1,0}}, u32[]{{:S(2)}}) copy-start(%x)
  %copy-done = f32[1024,256]{{1,0:S(1)}} copy-done(%copy-start)
  ROOT %fusion = f32[1024,256]{{1,0}} fusion(%copy-done), kind=kLoop, calls=%fused
}}
"""  # noqa: E501

# XLA:TPU's sliced prefetch: four asynchronous slices into its fast
# memory, joined again by a bitcast (``ConcatBitcast``), then the kernel.
_SLICES = ''.join(
  f'  %slice-start.{i} = ((f32[1024,256]{{1,0}}), f32[256,256]{{1,0:S(1)}}, '
  f's32[]{{:S(2)}}) slice-start(%x), slice={{[{256 * i}:{256 * (i + 1)}], '
  f'[0:256]}}\n'
  f'  %slice-done.{i} = f32[256,256]{{1,0:S(1)}} slice-done(%slice-start.{i})\n'
  for i in range(4)
)
SLICED = f"""{_HEADER}{_FUSED}\
ENTRY %main (x: f32[1024,256]) -> f32[1024,256] {{
  %x = f32[1024,256]{{1,0}} parameter(0)
{_SLICES}\
  %custom-call = f32[1024,256]{{1,0:S(1)}} custom-call(%slice-done.0, %slice-done.1, %slice-done.2, %slice-done.3), custom_call_target="ConcatBitcast"
  ROOT %fusion = f32[1024,256]{{1,0}} fusion(%custom-call), kind=kLoop, calls=%fused
}}
"""  # noqa: E501

# Any other custom call is a kernel of its own.
CUSTOM = DIRECT.replace(
  'fusion(%x), kind=kLoop, calls=%fused',
  'custom-call(%x), custom_call_target="Sharding"',
)

BUFFER = 1024 * 256 * 4  # the parameter's bytes, and the result's


def cost(text):
  return testing.step_cost(testing.hlo.parse_hlo(text), 0)


def test_a_kernel_is_charged_what_it_reads_and_writes():
  assert cost(DIRECT) == testing.Cost(kernels=1, bytes=2 * BUFFER)


@pytest.mark.parametrize('text', [PREFETCHED, SLICED], ids=['whole', 'sliced'])
def test_a_prefetch_costs_what_reading_the_buffer_in_place_costs(text):
  assert cost(text) == cost(DIRECT)


def test_a_custom_call_other_than_the_slices_bitcast_is_a_kernel():
  assert cost(CUSTOM) == testing.Cost(kernels=1, bytes=2 * BUFFER)
