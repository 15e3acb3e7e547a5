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
"""The targets themselves: each compiler present and each device of the
kind it names, never the CPU; bad names, specs and steps refused loudly
(issue 52)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from optax_tokacc import testing
from optax_tokacc.testing import _targets

EXPECTED = {
  'h100': ('gpu', 'NVIDIA H100 80GB HBM3', 1),
  'h100 x8': ('gpu', 'NVIDIA H100 80GB HBM3', 8),
  'h200': ('gpu', 'NVIDIA H200 141GB HBM3e', 1),
  'h200 x8': ('gpu', 'NVIDIA H200 141GB HBM3e', 8),
  'tpu v5e 1x1': ('tpu', 'TPU v5 lite', 1),
  'tpu v5e 2x2': ('tpu', 'TPU v5 lite', 4),
  'tpu v5e 2x4': ('tpu', 'TPU v5 lite', 8),
  'tpu v6e 1x1': ('tpu', 'TPU v6 lite', 1),
  'tpu v6e 2x4': ('tpu', 'TPU v6 lite', 8),
  'tpu v5p 2x2x2': ('tpu', 'TPU v5', 8),
}


def test_every_known_target_is_tested():
  assert set(testing.known_targets()) == set(EXPECTED)


@pytest.mark.parametrize('name', sorted(EXPECTED))
def test_a_target_has_the_devices_it_names(name):
  platform, kind, count = EXPECTED[name]
  target = testing.target(name)
  assert (target.platform, target.device_kind, len(target.devices)) == (
    platform,
    kind,
    count,
  )
  assert {d.platform for d in target.devices} == {platform}
  assert not set(target.devices) & set(jax.devices())  # not this machine's


@pytest.mark.parametrize('name', ['h100', 'tpu v5e 1x1'])
def test_a_program_compiled_for_a_target_is_the_targets(name):
  target = testing.target(name)
  x = jax.ShapeDtypeStruct((128, 128), jnp.float32, sharding=target.sharding())
  report = testing.check(jax.jit(lambda a: a @ a), x)
  assert report.device_kind == EXPECTED[name][1]
  cpu = testing.check(jax.jit(lambda a: a @ a), jnp.ones((128, 128)))
  assert cpu.device_kind != report.device_kind


def test_two_tpu_slices():
  target = testing.target('tpu v5e 2x4', num_slices=2)
  assert len(target.devices) == 16
  assert {d.slice_index for d in target.devices} == {0, 1}
  mesh = target.mesh((2, 8), ('replica', 'data'))
  assert {d.slice_index for d in mesh.devices[0]} == {0}


def test_an_unknown_target_lists_the_known_ones():
  with pytest.raises(ValueError, match=r"'a100'.*h100, h100 x8, h200"):
    testing.target('a100')


def test_slices_of_gpus_are_refused():
  with pytest.raises(ValueError, match='num_slices'):
    testing.target('h100', num_slices=2)


@pytest.fixture
def uncached():
  _targets._target.cache_clear()
  yield
  _targets._target.cache_clear()


def test_a_spec_for_another_jaxlib_is_refused(monkeypatch, uncached):
  monkeypatch.setattr(_targets, 'SPEC_JAXLIB', '0.0.1')
  with pytest.raises(
    RuntimeError, match=r'is for jaxlib 0\.0\.1.*this is jaxlib'
  ):
    testing.target('h200')


def test_a_spec_that_does_not_parse_fails_loudly(monkeypatch, uncached):
  text = _targets.spec_text('h200.txtpb')
  monkeypatch.setattr(
    _targets, 'spec_text', lambda name: text + '\nfield_of_a_newer_xla: 1\n'
  )
  with pytest.raises(RuntimeError, match='could not make NVIDIA H200'):
    testing.target('h200')


def test_a_spec_of_another_device_is_caught_by_its_kind(monkeypatch, uncached):
  """XLA:GPU takes an empty spec silently: the device kind tells."""
  h100 = _targets.spec_text('h100_sxm.txtpb')
  monkeypatch.setattr(_targets, 'spec_text', lambda name: h100)
  with pytest.raises(RuntimeError, match="should have 'NVIDIA H200"):
    testing.target('h200')


def test_an_eager_operation_on_a_target_points_to_eval_shape():
  target = testing.target('h100')
  x = jax.ShapeDtypeStruct((4,), jnp.float32, sharding=target.sharding())

  @jax.jit
  def step(a):
    with jax.ensure_compile_time_eval():  # eager, on the target: cannot run
      table = jax.device_put(np.ones(4, np.float32), target.sharding()) * 2
    return a + table

  with pytest.raises(RuntimeError, match='jax.eval_shape'):
    testing.check(step, x)


def test_check_refuses_what_is_not_a_step():
  with pytest.raises(TypeError, match='jax.jit function'):
    testing.check(lambda x: x, 1.0)
