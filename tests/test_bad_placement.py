"""Bad input under a placement: error type and message.

An ``axis_name`` bound nowhere, missing from the mesh or leaving out an
axis the data is split over; ``shard_map`` without ``params``, and where
its warning about gradients summed by autodiff points. Under explicit
sharding (jax >= 0.10): gradients and states of the wrong type, a
checkpoint of other shapes and ``manual_axes`` with reduced parameters,
refused at trace time; below jax 0.10, the version gate.
"""

import helpers
import jax
from jax import lax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
import numpy as np
import optax
import placements
import pytest

import optax_tokacc as tokacc
from optax_tokacc import _typed_sharding

K = 3
AUTO = jax.sharding.AxisType.Auto


# axis_name under pmap and shard_map.


def bound_nowhere_update(axis_name):
  tx = tokacc.token_weighted_multistep(optax.sgd(0.1), K, axis_name=axis_name)
  params = {'w': jnp.ones(3)}
  state = tx.init(params)
  return lambda: tx.update(params, state, params, num_tokens=2)


@pytest.mark.parametrize('axis_name', ['data', ('data', 'model')])
@pytest.mark.parametrize('use_jit', [False, True])
def test_axis_name_outside_pmap_or_shard_map(axis_name, use_jit):
  update = bound_nowhere_update(axis_name)
  if use_jit:
    update = jax.jit(update)
  with pytest.raises(ValueError, match=r'axis_name=.* is not bound') as error:
    update()
  message = str(error.value)
  assert 'jax.pmap' in message and 'jax.shard_map' in message
  assert 'axis_name=None' in message


def test_axis_name_missing_from_the_mesh():
  mesh = placements.data_mesh(jax.device_count())
  update = bound_nowhere_update('model')
  with pytest.raises(ValueError, match=r"axis_name='model' is not bound"):
    jax.jit(
      jax.shard_map(
        lambda x: update()[0]['w'] + x,
        mesh=mesh,
        in_specs=P('data'),
        out_specs=P('data'),
      )
    )(jnp.ones((jax.device_count(), 3)))


def test_hybrid_mesh_with_an_axis_left_out_is_refused():
  """Data split over ('replica', 'fsdp') but axis_name='replica': the window
  would be summed over half the devices (0.1: half the tokens, silently)."""
  mesh = jax.make_mesh(
    (2, 2), ('replica', 'fsdp'), (AUTO, AUTO), devices=jax.devices()[:4]
  )
  tx = tokacc.token_weighted_multistep(optax.sgd(0.1), 2, axis_name='replica')
  params = {'w': np.zeros(4, np.float32)}
  specs = tokacc.state_partition_specs(tx, params, axis_name='replica')
  state = tokacc.init_sharded(
    tx,
    jax.device_put(params, NamedSharding(mesh, P())),
    mesh,
    axis_name='replica',
  )

  def local_step(params, state, x):
    local = jax.tree.map(
      lambda p: lax.pcast(p, ('replica', 'fsdp'), to='varying'), params
    )
    grads = jax.grad(lambda p: jnp.sum(p['w'] * x))(local)
    return tx.update(grads, state, params, num_tokens=x.size)

  step = jax.jit(
    jax.shard_map(
      local_step,
      mesh=mesh,
      in_specs=(P(), specs, P(('replica', 'fsdp'))),
      out_specs=(P(), specs),
    )
  )
  x = jax.device_put(
    np.ones(16, np.float32), NamedSharding(mesh, P(('replica', 'fsdp')))
  )
  with pytest.raises(ValueError, match=r"axis_name=\('replica', 'fsdp'\)"):
    step(jax.device_put(params, NamedSharding(mesh, P())), state, x)


def _shard_map_update(tx, mesh, axes, vary, pass_params=True):
  """One ``tx.update`` inside ``shard_map`` over ``mesh``, written here so
  that a warning's location can be compared with this file."""
  params = {'w': np.zeros((4, 4), np.float32)}
  rows = mesh.devices.size  # one row of data per device

  def local(params, x):
    state = tx.init(params)
    varying = lax.pcast(params, vary, to='varying') if vary else params
    grads = jax.grad(lambda p: jnp.sum(p['w'] * x))(varying)
    given = params if pass_params else None
    tx.update(grads, state, given, num_tokens=16)  # the caller's line
    return x

  data = P(tuple(mesh.axis_names))
  step = jax.shard_map(local, mesh=mesh, in_specs=(P(), data), out_specs=data)
  jax.jit(step)(params, np.ones((rows, 4), np.float32))


def test_shard_map_warning_points_at_the_callers_line():
  """The warning about gradients summed by autodiff names the line that
  calls ``tx.update``, not a line of the library."""
  mesh, axes = placements.data_mesh(jax.device_count()), 'data'
  tx = tokacc.token_weighted_multistep(optax.sgd(0.1), K, axis_name=axes)
  with pytest.warns(UserWarning, match='already summed') as record:
    _shard_map_update(tx, mesh, axes, vary=None)
  assert [w.filename for w in record] == [__file__]


def test_shard_map_without_params_cannot_tell_sharded_from_replicated():
  """A gradient varying over a manual axis that ``axis_name`` leaves out
  is summed there only if its parameter is replicated there, which only
  ``params`` says: without them the update is refused, naming ``params``,
  where it would otherwise leave the sum over ``fsdp`` out."""
  mesh = jax.make_mesh((2, 2), ('replica', 'fsdp'), (AUTO, AUTO))
  tx = tokacc.token_weighted_multistep(optax.sgd(0.1), K, axis_name='replica')
  vary = ('replica', 'fsdp')
  with pytest.raises(ValueError, match='params'):
    _shard_map_update(tx, mesh, 'replica', vary, pass_params=False)
  with pytest.raises(ValueError, match=r"axis_name=\('replica', 'fsdp'\)"):
    _shard_map_update(tx, mesh, 'replica', vary)


# Explicit sharding: refused at trace time, naming what is wrong and the fix.


def _one_update(tx, params, state, grads, **kwargs):
  return jax.jit(
    lambda g, s, p: tx.update(g, s, p, num_tokens=4, **kwargs)
  ).trace(grads, state, params)


def _placed_params(mesh, layout):
  """``helpers.init_params()`` on ``mesh`` as ``EXPLICIT_LAYOUTS[layout]``
  places them."""
  specs = placements.EXPLICIT_LAYOUTS[layout].specs
  return placements.place_params(helpers.init_params(), mesh, specs)


def _ddp_grads(params):
  x = jax.device_put(jnp.ones((8, 8)), P('data'))

  @jax.jit
  def grads(params):
    return jax.grad(lambda p: jnp.sum(x @ p['w'] @ p['v']))(params)

  return grads(params)


@placements.needs_typed_sharding
def test_unreduced_gradients_with_a_state_of_replicated_params():
  """A state built for replicated parameters, fed unreduced gradients (the
  parameters were typed reduced afterwards): the error names both types
  and how to build the state, not JAX's internal ShardingTypeError."""
  tx = tokacc.token_weighted_multistep(helpers.sgd(), K)
  mesh = placements.explicit_ddp_mesh()
  with jax.set_mesh(mesh):
    replicated = _placed_params(mesh, 'replicated')
    reduced = _placed_params(mesh, 'ddp')
    state = tx.init(replicated)
    with pytest.raises(TypeError, match=r'U:data.*accumulator.*tx\.init'):
      _one_update(tx, reduced, state, _ddp_grads(reduced))
    state = tx.init(reduced)  # the reverse: reduced state, replicated grads
    with pytest.raises(TypeError, match='accumulator is float32.*U:data'):
      _one_update(tx, replicated, state, _ddp_grads(replicated))


@placements.needs_typed_sharding
def test_state_restored_with_another_type():
  """A state whose window count lost its unreduced type (restored without
  ``from_checkpoint``) is refused: it would be summed wrongly."""
  tx = tokacc.token_weighted_multistep(helpers.sgd(), K)
  mesh = placements.explicit_ddp_mesh()
  with jax.set_mesh(mesh):
    params = _placed_params(mesh, 'ddp')
    state = tx.init(params)
    broken = state._replace(acc_tokens=jnp.zeros([], jnp.int32))
    with pytest.raises(TypeError, match='restored with another type'):
      _one_update(tx, params, broken, _ddp_grads(params))
    broken = state._replace(
      grad_sums=dict(state.grad_sums, w=jnp.zeros((8, 8)))
    )
    with pytest.raises(TypeError, match='built or restored'):
      _one_update(tx, params, broken, _ddp_grads(params))


@placements.needs_typed_sharding
def test_gradients_unreduced_over_an_axis_the_parameter_is_split_on():
  """Gradients whose partial sums run over the axis their parameter is
  sharded on would add different shards into one sum: refused."""
  tx = tokacc.token_weighted_multistep(helpers.sgd(), K)
  mesh = placements.explicit_ddp_mesh()
  with jax.set_mesh(mesh):
    params = placements.place_params(
      helpers.init_params(), mesh, {'w': P('data'), 'v': P('data')}
    )
    state = tx.init(params)
    grads = jax.jit(
      lambda: {
        'w': jnp.zeros((8, 8), out_sharding=P(None, None, unreduced={'data'})),
        'v': jnp.zeros((8,), out_sharding=P(None, unreduced={'data'})),
      }
    )()
    with pytest.raises(ValueError, match=r"unreduced over \['data'\].*split"):
      _one_update(tx, params, state, grads)


@placements.needs_typed_sharding
def test_from_checkpoint_refuses_a_tree_of_other_shapes():
  tx = tokacc.token_weighted_multistep(helpers.sgd(), K)
  mesh = placements.explicit_ddp_mesh()
  with jax.set_mesh(mesh):
    params = _placed_params(mesh, 'ddp')
    state = tx.init(params)
    saved = tokacc.to_checkpoint(state).state
    assert saved.grad_sums['w'].shape == (4, 8, 8)
    with pytest.raises(ValueError, match='from_checkpoint.*partial sums'):
      tokacc.from_checkpoint(state._replace(grad_sums=saved.grad_sums), state)


@placements.needs_typed_sharding
def test_manual_axes_with_reduced_parameters_names_the_argument():
  """``manual_axes`` describes a partial-manual ``shard_map``; parameters
  typed reduced are explicit sharding under ``jax.jit``, whose state specs
  keep their reduced and unreduced axes: the mix is refused naming
  ``manual_axes`` (JAX's own error about unpacking a spec came first)."""
  mesh = placements.explicit_ddp_mesh()
  tx = tokacc.token_weighted_multistep(optax.adam(0.1), 3)
  with jax.set_mesh(mesh):
    params = {
      'w': jax.device_put(np.zeros((8, 4), np.float32), P(reduced={'data'}))
    }
    with pytest.raises(ValueError, match='manual_axes') as error:
      tokacc.state_partition_specs(tx, params, manual_axes=('data',))
  assert 'explicit sharding' in str(error.value)


@pytest.mark.skipif(
  _typed_sharding.SUPPORTED, reason='the gate applies to jax < 0.10'
)
def test_reduced_parameters_on_an_old_jax_name_the_version_needed():
  """Explicit sharding with reduced types is gated at jax 0.10 (device_put
  of unreduced arrays, and so checkpoint restores, are missing before); the
  error names the version. Everything else works at the floor."""
  mesh = jax.make_mesh(
    (4,),
    ('data',),
    axis_types=(jax.sharding.AxisType.Explicit,),
    devices=jax.devices()[:4],
  )
  tx = tokacc.token_weighted_multistep(optax.sgd(0.1), 2)
  with jax.set_mesh(mesh):
    init = jax.jit(
      lambda: tx.init(
        jax.reshard(jnp.zeros((8, 2)), P(None, None, reduced={'data'}))
      )
    )
    with pytest.raises(NotImplementedError, match=r'jax >= 0\.10\.0'):
      init.trace()
