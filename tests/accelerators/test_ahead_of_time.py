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
"""Every public helper ahead of time (issue 54, items 1 and 4): on
abstract values laid out on devices that only compile, as a trainer that
compiles its step before it rents the accelerators calls them.

Each helper is called under ``jax.set_mesh`` with a mesh of 8 H100s, 8
H200s, or a TPU v5e or v6e 2x4, on ``jax.ShapeDtypeStruct`` parameters, and inside
``jax.eval_shape``; what it gives must be what it gives for the same
layout on 8 fake CPU devices (the tests' ``jax.devices()``), where it
runs: the same specs, and the same shardings up to the mesh's devices.
"""

import functools

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
import numpy as np
import on_targets
import optax
import pytest

import optax_tokacc as tokacc
from optax_tokacc import testing

EXPLICIT = jax.sharding.AxisType.Explicit
SHAPES = {'w': (64, 16), 'b': (16,)}
# Each layout: the transform's options, the parameters' specs and whether
# they are typed (explicit sharding), the helpers' keyword arguments.
LAYOUTS = {
  'ddp_shard_map': ({'axis_name': 'data'}, P(), False, {'axis_name': 'data'}),
  'fsdp_gspmd': ({}, P('data'), False, {}),
  'explicit_ddp': ({}, P(reduced={'data'}), True, {}),
  'zero1': (
    {},
    P(reduced={'data'}),
    True,
    {'shard_optimizer_over': ('data',)},
  ),
}


def _mesh(devices, typed):
  types = (EXPLICIT if typed else jax.sharding.AxisType.Auto,)
  return jax.sharding.Mesh(np.asarray(devices), ('data',), axis_types=types)


def _params(mesh, spec):
  def leaf(shape):
    parts = spec.partitions
    full = P(*parts, *[None] * (len(shape) - len(parts)), reduced=spec.reduced)
    return jax.ShapeDtypeStruct(
      shape, jnp.float32, sharding=NamedSharding(mesh, full)
    )

  return {name: leaf(shape) for name, shape in SHAPES.items()}


def _setup(layout, devices):
  options, spec, typed, kwargs = LAYOUTS[layout]
  tx = tokacc.token_weighted_multistep(optax.adamw(1e-3), 4, **options)
  mesh = _mesh(devices, typed)
  params = _params(mesh, spec)
  if not typed:
    kwargs = dict(
      kwargs, param_specs=jax.tree.map(lambda p: p.sharding.spec, params)
    )
  return tx, mesh, params, kwargs


def _specs(shardings):
  return jax.tree.map(lambda s: s.spec, shardings)


CASES = on_targets.grid(on_targets.EIGHT_DEVICES, tuple(LAYOUTS))


@functools.cache
def _on_cpu(layout, helper):
  """What ``helper`` gives for ``layout`` on 8 CPU devices, where it runs:
  the specs and shardings the helpers state, and the types of the arrays
  that ``init_sharded`` and ``checkpoint_target`` make (the reference)."""
  tx, mesh, params, kwargs = _setup(layout, jax.devices()[:8])
  with jax.set_mesh(mesh):
    if helper == 'specs':
      return tokacc.state_partition_specs(tx, params, **kwargs)
    if helper == 'shardings':
      return _specs(tokacc.state_shardings(tx, params, mesh, **kwargs))
    arrays = jax.tree.map(
      lambda p: jnp.zeros(p.shape, p.dtype, device=p.sharding), params
    )
    state = tokacc.init_sharded(tx, arrays, mesh, **kwargs)
    if helper == 'init':
      return _types(state)
    like = (arrays, state)
    target = tokacc.checkpoint_target(like, tokacc.to_checkpoint(like))
    return jax.tree.map(_shape_dtype_spec, target)


def _types(tree):
  """Each leaf's spec as its type states it (explicit meshes: reduced and
  unreduced axes included), or as it is laid out (Auto meshes)."""
  return _stripped(jax.tree.map(_type_spec, tree))


def _type_spec(x):
  mesh = x.sharding.mesh
  if isinstance(x, jax.Array) and EXPLICIT in mesh.axis_types:
    return jax.typeof(x).sharding.spec
  return x.sharding.spec


def _shape_dtype_spec(x):
  return x.shape, x.dtype, _stripped(x.sharding.spec)


@pytest.mark.parametrize(('target', 'layout'), CASES)
def test_state_partition_specs_ahead_of_time(target, layout):
  tx, mesh, params, kwargs = _setup(layout, testing.target(target).devices)
  with jax.set_mesh(mesh):
    specs = tokacc.state_partition_specs(tx, params, **kwargs)
  assert specs == _on_cpu(layout, 'specs')


@pytest.mark.parametrize(('target', 'layout'), CASES)
def test_state_shardings_ahead_of_time(target, layout):
  tx, mesh, params, kwargs = _setup(layout, testing.target(target).devices)
  with jax.set_mesh(mesh):
    shardings = tokacc.state_shardings(tx, params, mesh, **kwargs)
  assert {s.mesh for s in jax.tree.leaves(shardings)} == {mesh}
  assert _specs(shardings) == _on_cpu(layout, 'shardings')


@pytest.mark.parametrize(('target', 'layout'), CASES)
def test_init_sharded_of_abstract_parameters_keeps_the_layout(target, layout):
  """Regression (issue 54, item 1): ahead of time, ``init_sharded`` of
  ``jax.ShapeDtypeStruct`` parameters gives the abstract state laid out on
  the target's mesh as the arrays it makes on 8 CPU devices are (it
  failed: ``jax.jit`` takes no ``ShapeDtypeStruct``)."""
  tx, mesh, params, kwargs = _setup(layout, testing.target(target).devices)
  with jax.set_mesh(mesh):
    state = tokacc.init_sharded(tx, params, mesh, **kwargs)
    shardings = tokacc.state_shardings(tx, params, mesh, **kwargs)
  assert all(
    isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree.leaves(state)
  )
  assert {x.sharding.mesh for x in jax.tree.leaves(state)} == {mesh}
  assert _types(state) == _on_cpu(layout, 'init')
  assert _stripped(_specs(shardings)) == _stripped(
    _specs(jax.tree.map(lambda x: x.sharding, state))
  )


EXPLICIT_CASES = on_targets.grid(
  on_targets.EIGHT_DEVICES, ('explicit_ddp', 'zero1')
)


@pytest.mark.parametrize(('target', 'layout'), EXPLICIT_CASES)
def test_init_sharded_inside_eval_shape_keeps_the_layout(target, layout):
  """Regression (issue 54, item 1): inside ``jax.eval_shape`` (a trace
  around a step that calls it) on an explicit mesh, the state's types are
  the layout: the distributed optimizer's moments sharded over ``data``
  (they kept the parameters' reduced type), the scalars replicated on the
  mesh (they had no sharding). On an Auto mesh types carry no layout
  (``init_sharded``'s docstring): pass abstract parameters instead."""
  tx, mesh, params, kwargs = _setup(layout, testing.target(target).devices)
  with jax.set_mesh(mesh):
    state = jax.eval_shape(
      lambda p: tokacc.init_sharded(tx, p, mesh, **kwargs), params
    )
    expected = tokacc.state_partition_specs(tx, params, **kwargs)
  assert _types(state) == _on_cpu(layout, 'init')
  assert _stripped(_specs(jax.tree.map(lambda x: x.sharding, state))) == (
    _stripped(expected)
  )


def _stripped(specs):
  """Each spec as (partitions without trailing Nones, reduced, unreduced)."""

  def parts(spec):
    entries = list(spec.partitions)
    while entries and entries[-1] is None:
      entries.pop()
    return str((tuple(entries), spec.reduced, spec.unreduced))

  return jax.tree.leaves(
    jax.tree.map(parts, specs, is_leaf=lambda x: isinstance(x, P))
  )


READERS = (tokacc.window_metrics, tokacc.window_loss, tokacc.has_updated)


@functools.cache
def _read_on_cpu(layout):
  """What the readers give for ``layout``'s state on 8 CPU devices, as
  shapes and dtypes (the reference)."""
  tx, mesh, params, kwargs = _setup(layout, jax.devices()[:8])
  with jax.set_mesh(mesh):
    arrays = jax.tree.map(
      lambda p: jnp.zeros(p.shape, p.dtype, device=p.sharding), params
    )
    state = tokacc.init_sharded(tx, arrays, mesh, **kwargs)
    return [_shapes_dtypes(read(state)) for read in READERS]


def _shapes_dtypes(tree):
  return jax.tree.map(lambda x: (jnp.shape(x), jnp.result_type(x)), tree)


@pytest.mark.parametrize(('target', 'layout'), CASES)
def test_the_readers_of_an_abstract_state(target, layout):
  """Issue 54, item 1: ``window_metrics``, ``window_loss`` and
  ``has_updated`` of the abstract state ``init_sharded`` lays out on the
  target's mesh give abstract values with the shapes and dtypes they give
  on 8 CPU devices, called directly (they raised a ``float()``
  ``TypeError``) and inside ``jax.eval_shape``."""
  tx, mesh, params, kwargs = _setup(layout, testing.target(target).devices)
  with jax.set_mesh(mesh):
    state = tokacc.init_sharded(tx, params, mesh, **kwargs)
    direct = [read(state) for read in READERS]
    traced = [jax.eval_shape(read, state) for read in READERS]
  for found in (direct, traced):
    leaves = jax.tree.leaves(found)
    assert all(isinstance(x, jax.ShapeDtypeStruct) for x in leaves)
    assert [_shapes_dtypes(x) for x in found] == _read_on_cpu(layout)


@pytest.mark.parametrize(('target', 'layout'), CASES)
def test_checkpoint_target_of_an_abstract_state(target, layout):
  """Regression (issue 54, item 1): ``checkpoint_target`` of abstract
  parameters and state on the target's mesh is what it is for the arrays
  of 8 CPU devices, laid out on that mesh (it failed: ``_shares`` retyped
  the leaves eagerly)."""
  tx, mesh, params, kwargs = _setup(layout, testing.target(target).devices)
  with jax.set_mesh(mesh):
    like = (params, tokacc.init_sharded(tx, params, mesh, **kwargs))
    saved = jax.eval_shape(tokacc.to_checkpoint, like)
    target_tree = tokacc.checkpoint_target(like, saved)
  assert jax.tree.structure(target_tree) == jax.tree.structure(saved)
  assert {x.sharding.mesh for x in jax.tree.leaves(target_tree)} == {mesh}
  found = jax.tree.map(_shape_dtype_spec, target_tree)
  assert found == _on_cpu(layout, 'checkpoint_target')


@pytest.mark.parametrize('target', on_targets.EIGHT_DEVICES)
def test_helpers_that_need_values_say_what_to_call_ahead_of_time(target):
  """Issue 54, item 4: ``to_checkpoint`` of abstract values names
  ``jax.eval_shape``; ``from_checkpoint``, which reads the rows recorded
  in the restored arrays, names ``checkpoint_target``, abstract or traced
  (it raised a float() TypeError and a TracerArrayConversionError)."""
  tx, mesh, params, kwargs = _setup(
    'explicit_ddp', testing.target(target).devices
  )
  with jax.set_mesh(mesh):
    like = (params, tokacc.init_sharded(tx, params, mesh, **kwargs))
    with pytest.raises(TypeError, match=r'eval_shape\(tokacc.to_checkpoint'):
      tokacc.to_checkpoint(like)
    saved = jax.eval_shape(tokacc.to_checkpoint, like)
    with pytest.raises(TypeError, match='from_checkpoint.*checkpoint_target'):
      tokacc.from_checkpoint(saved, like)
    with pytest.raises(TypeError, match='traced.*checkpoint_target'):
      jax.eval_shape(tokacc.from_checkpoint, saved, like)
