"""The distributed-optimizer (ZeRO-1) layout under explicit sharding.

Parameters typed reduced over 'data' (4 fake devices), ``inner``'s state
sharded over 'data' by ``init_sharded(..., shard_optimizer_over=('data',))``:
the window stays partial sums, and closes with one reduce-scatter into the
optimizer's shards, ``inner`` on the shards, and an all-gather of the
updates. HSDP too: on a ``('replica', 'fsdp') = (2, 2)`` mesh, ``w`` typed
``P('fsdp', None, reduced={'replica'})`` and its state sharded over
``replica`` as well (``shard_optimizer_over=('replica',)``). The model is
``helpers.zero1_loss_sum``, the layouts ``placements.ZERO1_LAYOUTS``.
Checked against full-batch training in float64 (``helpers.full_batch``),
with unequal counts per device and micro-step and devices without tokens,
and on the compiled HLO (issue 23).
"""

import helpers
import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
import numpy as np
import optax
import placements
import pytest

import optax_tokacc as tokacc
from optax_tokacc import _typed_sharding
from optax_tokacc.testing import collectives
from optax_tokacc.testing import hlo

pytestmark = pytest.mark.skipif(
  not _typed_sharding.SUPPORTED, reason='explicit sharding needs jax >= 0.10'
)

K = 3
NUM_DEVICES = 4
UNIT_ROUNDOFF = np.finfo(np.float32).eps / 2


@pytest.mark.parametrize('host_closes', [False, True])
@pytest.mark.parametrize('layout', sorted(placements.ZERO1_LAYOUTS))
def test_equals_full_batch_training(layout, host_closes):
  """Momentum SGD after a global-norm clip that binds, on the shards (DDP:
  sharded over 'data'; HSDP: ``w``'s fsdp shard sharded over 'replica'),
  the windows closed by the device or by the host.

  The bound: each window's gradient is a sum of ``m`` rounded float32
  terms (its tokens, the features and outputs of a prediction, the
  divisions), within ``gamma(m)`` of exact relative to its size (Higham);
  the clip's norm and scale add ``gamma`` of the update; momentum carries
  every earlier window's error forward, at most the windows' count times.
  So each parameter is within ``windows * 4 * gamma(m)`` of the largest
  update, plus one rounding of the parameter per window.
  """
  windows = helpers.zero1_windows()
  params, state = placements.train_zero1(
    windows, layout=layout, host_closes=host_closes
  )
  assert_equals_full_batch(windows, params)
  assert int(state.gradient_step) == len(windows)


def _shardings(tx, params, mesh, layout):
  return tokacc.state_shardings(
    tx,
    params,
    mesh,
    shard_optimizer_over=placements.ZERO1_LAYOUTS[layout].shard_over,
  )


STATE_BUILDERS = {
  'init_sharded': placements.zero1_init,
  # what init_sharded does, written by hand as sharded trainers do
  'jit_out_shardings': lambda tx, params, mesh, layout: jax.jit(
    tx.init, out_shardings=_shardings(tx, params, mesh, layout)
  )(params),
  'device_put': lambda tx, params, mesh, layout: jax.device_put(
    tx.init(params), _shardings(tx, params, mesh, layout)
  ),
}


@pytest.mark.parametrize('host_closes', [False, True])
@pytest.mark.parametrize('way', sorted(STATE_BUILDERS))
@pytest.mark.parametrize('layout', sorted(placements.ZERO1_LAYOUTS))
def test_every_way_to_build_the_state_trains_exactly(layout, way, host_closes):
  """On jax 0.12, init_sharded failed to compile (an unreduced zero merged
  with the replicated ones); each way users build a ZeRO-1 state now trains
  as full batch does, with the optimizer's moments sharded."""
  windows = helpers.zero1_windows()
  params, state = placements.train_zero1(
    windows, layout=layout, host_closes=host_closes, init=STATE_BUILDERS[way]
  )
  assert_equals_full_batch(windows, params)
  assert int(state.gradient_step) == len(windows)
  trace = state.inner_state[1][0].trace['w']
  assert trace.addressable_shards[0].data.nbytes == (
    helpers.zero1_params()['w'].nbytes // NUM_DEVICES
  )


def assert_equals_full_batch(windows, params):
  """Within the bound derived in ``test_equals_full_batch_training`` of
  full-batch training in float64 (``helpers.full_batch``), whose largest
  update is ``largest``."""
  with jax.enable_x64(True):
    reference = helpers.full_batch(
      placements.zero1_inner(),
      helpers.float64(helpers.zero1_params()),
      helpers.float64(windows),
      helpers.zero1_loss_sum,
    )
  expected = jax.tree.map(np.asarray, reference.params)
  largest = max(window.largest_update for window in reference.windows)
  n = max(int(sum(b['mask'].sum() for b in w)) for w in windows)
  m = n + helpers.FEATURES + helpers.ZERO1_OUTPUTS + 20
  gamma = m * UNIT_ROUNDOFF / (1 - m * UNIT_ROUNDOFF)
  for name in ('w', 'b'):
    got = np.asarray(params[name])
    bound = len(windows) * (
      4 * gamma * largest + UNIT_ROUNDOFF * np.abs(expected[name])
    )
    assert np.all(np.abs(got - expected[name]) <= bound), (got, expected)


@pytest.mark.parametrize(
  'layout, w_shard, acc_type',
  [
    ('ddp', (2, helpers.ZERO1_OUTPUTS), 'float32[8,4]{U:data}'),
    ('hsdp', (4, helpers.ZERO1_OUTPUTS // 2), 'float32[8@fsdp,4]{U:replica}'),
  ],
)
def test_state_is_sharded_and_a_fixed_point_of_the_step(
  layout, w_shard, acc_type
):
  """The moments of ``w`` hold 1/4 of it per device (DDP: split over
  'data'; HSDP: its fsdp half split again over 'replica'), those of ``b``
  (no dimension divides the axis) stay whole; the accumulator stays partial
  sums; the step gives back the types it was given."""
  windows = helpers.zero1_windows()[:1]
  mesh, tx, _ = placements.zero1_run(layout)
  with jax.set_mesh(mesh):
    params, _ = placements.zero1_placed(mesh, layout)
    state = placements.zero1_init(tx, params, mesh, layout)
  trace = state.inner_state[1][0].trace
  shards = trace['w'].addressable_shards
  assert {s.data.shape for s in shards} == {w_shard}
  assert {s.data.nbytes for s in shards} == {
    helpers.zero1_params()['w'].nbytes // NUM_DEVICES
  }
  assert trace['b'].addressable_shards[0].data.shape == (3,)
  assert str(jax.typeof(state.grad_sums['w'])) == acc_type
  _, trained = placements.train_zero1(windows, layout=layout)
  types = placements.type_strings(state)
  assert placements.type_strings(trained) == types


@pytest.mark.slow
@pytest.mark.parametrize('layout', sorted(placements.ZERO1_LAYOUTS))
def test_checkpoint_mid_window_resumes_bit_identically(layout):
  windows = helpers.zero1_windows()
  straight = placements.train_zero1(windows, layout=layout)
  resumed = placements.train_zero1(windows, interrupt_at=K + 1, layout=layout)
  with jax.set_mesh(placements.ZERO1_LAYOUTS[layout].mesh()):
    jax.tree.map(
      np.testing.assert_array_equal,
      jax.device_get(tokacc.to_checkpoint(straight)),
      jax.device_get(tokacc.to_checkpoint(resumed)),
    )


def test_window_closes_with_one_reduce_scatter_and_an_all_gather():
  """Micro-steps: no collective. The closing branch: ``w``'s window
  reduce-scattered, its updates all-gathered; no all-reduce of its size
  (the scalars, ``b`` and the clip's norm are reduced whole)."""
  mesh, tx, step = placements.zero1_run()
  with jax.set_mesh(mesh):
    params, place = placements.zero1_placed(mesh)
    state = placements.zero1_init(tx, params, mesh)
    batch = place(helpers.zero1_windows()[0][0])
    text = hlo.compiled_text(step, params, state, batch)
  sites = collectives.compiled_collectives(text)
  assert collectives.on_micro_step_path(sites) == []
  closing = collectives.on_closing_step_only(sites)
  w_shape = ('f32', (helpers.FEATURES, helpers.ZERO1_OUTPUTS))
  w_shard = ('f32', (helpers.FEATURES // NUM_DEVICES, helpers.ZERO1_OUTPUTS))
  kinds = {s.collective for s in closing}
  assert {'reduce-scatter', 'all-gather'} <= kinds, closing
  for site in closing:
    if site.collective == 'all-reduce':
      assert w_shape not in site.shapes and w_shard not in site.shapes, site


def on_last_dimension(tx, params, mesh, layout):
  """DDP's state, its moments of ``w`` resharded by hand over 'data' on
  their last dimension (``helpers.ZERO1_OUTPUTS`` = 4 = the devices), not the first that
  ``shard_optimizer_over`` would choose."""
  state = tokacc.init_sharded(tx, params, mesh)

  def move(x):
    return jax.reshard(x, P(None, 'data')) if x.ndim == 2 else x

  return state._replace(inner_state=jax.tree.map(move, state.inner_state))


def test_moments_resharded_by_hand_are_followed():
  """The layout is read from the state's types, leaf by leaf: the window
  is reduce-scattered into the last dimension's shards, the step keeps the
  moments where the user put them, and training is exact."""
  windows = helpers.zero1_windows()
  params, state = placements.train_zero1(windows, init=on_last_dimension)
  assert_equals_full_batch(windows, params)
  trace = state.inner_state[1][0].trace['w']
  assert trace.sharding.spec == P(None, 'data')
  assert {s.data.shape for s in trace.addressable_shards} == {
    (helpers.FEATURES, helpers.ZERO1_OUTPUTS // NUM_DEVICES)
  }
  mesh, tx, step = placements.zero1_run()
  with jax.set_mesh(mesh):
    params, place = placements.zero1_placed(mesh)
    state = on_last_dimension(tx, params, mesh, 'ddp')
    batch = place(helpers.zero1_windows()[0][0])
    text = hlo.compiled_text(step, params, state, batch)
  sites = collectives.compiled_collectives(text)
  closing = collectives.on_closing_step_only(sites)
  shard = ('f32', (helpers.FEATURES, helpers.ZERO1_OUTPUTS // NUM_DEVICES))
  scatters = [s for s in closing if s.collective == 'reduce-scatter']
  assert [s.shapes for s in scatters] == [(shard,)], closing


def adamw_on_w():
  return optax.masked(optax.adamw(0.1), {'w': True, 'b': False})


def adamw_and_sgd():
  labels = {'w': 'adamw', 'b': 'sgd'}
  inners = {'adamw': optax.adamw(0.1), 'sgd': optax.sgd(0.1, momentum=0.9)}
  return optax.multi_transform(inners, labels)


COMPOSITIONS = {
  'adamw': lambda: optax.adamw(0.1),
  'lion': lambda: optax.lion(0.01),
  'lamb': lambda: optax.lamb(0.1),  # trust ratios: norms of leaves
  'adafactor': lambda: optax.adafactor(0.1),  # clips by a leaf's RMS
  'masked': adamw_on_w,
  'multi_transform': adamw_and_sgd,
  'inject_hyperparams': lambda: optax.inject_hyperparams(optax.adamw)(0.1),
  'apply_if_finite': lambda: optax.apply_if_finite(optax.adam(0.1), 3),
  'schedule_free': lambda: optax.contrib.schedule_free_adamw(0.1),
}


def integer_case():
  """Parameters and micro-batches of small integers, the loss of
  ``placements.zero1_loss_sum``: every partial sum and sum of one window's gradient is an
  integer below 2**24, exact in float32 whatever the order of addition."""
  rng = np.random.default_rng(11)
  params = {
    'w': rng.integers(-2, 3, (helpers.FEATURES, helpers.ZERO1_OUTPUTS)).astype(
      np.float32
    ),
    'b': rng.integers(-2, 3, (3,)).astype(np.float32),
  }
  batches = []
  for _ in range(K):
    x = rng.integers(-2, 3, (NUM_DEVICES, 3, helpers.FEATURES))
    y = rng.integers(-2, 3, (NUM_DEVICES, 3, helpers.ZERO1_OUTPUTS))
    mask = rng.integers(0, 2, (NUM_DEVICES, 3))
    batches.append(
      dict(x=x.astype(np.float32), y=y.astype(np.float32), mask=mask)
    )
  return params, batches


def one_window(make_inner, shard_over):
  """Parameters and ``placements.zero1_inner``'s state after one window of explicit DDP,
  with ``placements.zero1_inner``'s state sharded over ``shard_over`` or whole (None)."""
  mesh = placements.explicit_ddp_mesh()
  tx = tokacc.token_weighted_multistep(make_inner(), K)
  values, batches = integer_case()
  data = NamedSharding(mesh, P('data'))

  @jax.jit
  def step(params, state, batch):
    grads = jax.grad(placements.zero1_loss_sum)(params, batch)
    num_tokens = jnp.einsum(
      'bt->', batch['mask'], out_sharding=P(unreduced={'data'})
    )
    updates, state = tx.update(grads, state, params, num_tokens=num_tokens)
    return optax.apply_updates(params, updates), state

  with jax.set_mesh(mesh):
    params = {
      k: jax.device_put(v, placements.ZERO1_LAYOUTS['ddp'].specs[k])
      for k, v in values.items()
    }
    state = tokacc.init_sharded(
      tx, params, mesh, shard_optimizer_over=shard_over
    )
    for batch in batches:
      params, state = step(params, state, jax.device_put(batch, data))
    return jax.device_get((params, state.inner_state)), state.inner_state


NORMS = ('lamb', 'adafactor')


@pytest.mark.parametrize(
  'name',
  [
    pytest.param(
      name, marks=pytest.mark.slow if name == 'apply_if_finite' else ()
    )
    for name in sorted(COMPOSITIONS)
  ],
)
def test_compositions_equal_explicit_ddp(name):
  """Every ``placements.zero1_inner`` of the list runs on the shards and gives explicit
  DDP's parameters and state after a window: bit for bit where ``placements.zero1_inner``
  is elementwise, since the window's gradient is exact
  (``integer_case``). A norm of a leaf (``NORMS``) is summed in another
  order over shards than whole: within ``gamma(n)`` of it relatively (n
  its elements, Higham), and so is the scale it gives, applied once and
  once more through the trust ratio or clip: the parameters agree within
  ``4 gamma(n)`` of the update, plus one rounding of the parameter."""
  values, _ = integer_case()
  expected, _ = one_window(COMPOSITIONS[name], None)
  actual, inner_state = one_window(COMPOSITIONS[name], ('data',))
  if name not in NORMS:
    jax.tree.map(np.testing.assert_array_equal, actual, expected)
  else:
    n = helpers.FEATURES * helpers.ZERO1_OUTPUTS
    gamma = n * UNIT_ROUNDOFF / (1 - n * UNIT_ROUNDOFF)
    for key, value in values.items():
      got, want = actual[0][key], expected[0][key]
      update = np.max(np.abs(want - value))
      bound = 4 * gamma * update + UNIT_ROUNDOFF * np.abs(want)
      assert np.all(np.abs(got - want) <= bound), (key, got - want)
  assert any(
    _typed_sharding.sharded(leaf) == {'data'}
    for leaf in jax.tree.leaves(inner_state)
  )


def test_an_inner_that_needs_whole_gradients_is_refused():
  """``optax.contrib.muon`` orthogonalizes each whole gradient matrix, which
  JAX cannot do on shards typed this way: refused at trace time."""
  with pytest.raises(ValueError, match='shard_optimizer_over') as error:
    one_window(lambda: optax.contrib.muon(0.1), ('data',))
  assert 'needs whole gradients' in str(error.value)


def test_an_inner_failing_on_shards_in_its_own_words_is_refused():
  """Regression (issue 56): an ``inner`` that fails on the shards of its
  state and runs on whole gradients is refused with the error that names
  ``shard_optimizer_over``, whatever its own error says (the refusal comes
  from tracing ``inner`` on whole gradients, not from reading its error)."""

  def needs_whole():
    adam = optax.adam(0.1)  # whose moments shard over 'data'

    def update(updates, state, params=None, **extra):
      del extra
      if any(
        any(jax.typeof(x).sharding.spec) for x in jax.tree.leaves(updates)
      ):
        raise ValueError('these gradients are in pieces')
      return adam.update(updates, state, params)

    return optax.GradientTransformationExtraArgs(adam.init, update)

  with pytest.raises(ValueError, match='shard_optimizer_over') as error:
    one_window(needs_whole, ('data',))
  assert 'needs whole gradients' in str(error.value)
  assert 'in pieces' in str(error.value)  # inner's own words, kept
  one_window(needs_whole, None)  # runs on whole gradients


REFUSED_LAYOUTS = {
  # mu and nu of w over 'data' on different dimensions
  'two_ways': ('ddp', (P('data', None), P(None, 'data'))),
  # w's fsdp-split dimension split over 'replica' as well
  'split_dimension': ('hsdp', (P(('fsdp', 'replica'), None),) * 2),
}


@pytest.mark.parametrize('case', sorted(REFUSED_LAYOUTS))
def test_a_state_the_window_cannot_be_scattered_into_is_refused(case):
  """A layout of the moments that no reduce-scatter of the window gives is
  refused at trace time, pointing to ``shard_optimizer_over``."""
  layout, (mu_spec, nu_spec) = REFUSED_LAYOUTS[case]
  mesh = placements.ZERO1_LAYOUTS[layout].mesh()
  tx = tokacc.token_weighted_multistep(optax.adam(0.1), K)
  with jax.set_mesh(mesh):
    params, place = placements.zero1_placed(mesh, layout)
    state = tokacc.init_sharded(tx, params, mesh)
    adam = state.inner_state[0]
    adam = adam._replace(
      mu=dict(adam.mu, w=jax.reshard(adam.mu['w'], mu_spec)),
      nu=dict(adam.nu, w=jax.reshard(adam.nu['w'], nu_spec)),
    )
    state = state._replace(inner_state=(adam,) + state.inner_state[1:])
    batch = place(helpers.zero1_windows()[0][0])

    @jax.jit
    def step(params, state, batch):
      grads = jax.grad(placements.zero1_loss_sum)(params, batch)
      num_tokens = jnp.einsum(
        'bt->', batch['mask'], out_sharding=P(unreduced=set(mesh.axis_names))
      )
      return tx.update(grads, state, params, num_tokens=num_tokens)

    with pytest.raises(ValueError, match='shard_optimizer_over') as error:
      step(params, state, batch)
  assert 'is sharded as' in str(error.value)


FSDP_GROUPS = [[0, 1], [2, 3]]  # hsdp_mesh: devices (2 r + f) at (r, f)
REPLICA_GROUPS = [[0, 2], [1, 3]]


def groups(site):
  return sorted(map(sorted, collectives.group_sets(site, NUM_DEVICES)))


def test_hsdp_window_reduce_scattered_over_replica_once():
  """HSDP with the state sharded over 'replica': per micro-step only the
  user's forward pass's collectives, all within ``fsdp`` (its gathers of
  ``w`` and its reductions of the gradients to ``w``'s fsdp shard), none
  across replicas. The closing branch reduce-scatters ``w``'s (4, 4)
  accumulator shard over 'replica' into (4, 2), all-gathers the (4, 4)
  updates over 'replica', and all-reduces nothing of ``w``'s size (only
  the count, the loss, ``b`` and the clip's norm are reduced whole)."""
  mesh, tx, step = placements.zero1_run('hsdp')
  with jax.set_mesh(mesh):
    params, place = placements.zero1_placed(mesh, 'hsdp')
    state = placements.zero1_init(tx, params, mesh, 'hsdp')
    batch = place(helpers.zero1_windows()[0][0])
    text = hlo.compiled_text(step, params, state, batch)
  sites = collectives.compiled_collectives(text)
  micro = collectives.on_micro_step_path(sites)
  assert micro, 'the forward pass gathers w within fsdp'
  for site in micro:
    assert groups(site) == FSDP_GROUPS, site
  closing = collectives.on_closing_step_only(sites)
  fsdp_shard = ('f32', (helpers.FEATURES // 2, helpers.ZERO1_OUTPUTS))
  state_shard = ('f32', (helpers.FEATURES // 2, helpers.ZERO1_OUTPUTS // 2))
  whole = ('f32', (helpers.FEATURES, helpers.ZERO1_OUTPUTS))
  scatters = [s for s in closing if s.collective == 'reduce-scatter']
  assert [(s.shapes, groups(s)) for s in scatters] == [
    ((state_shard,), REPLICA_GROUPS)
  ], closing
  gathers = [s for s in closing if s.collective == 'all-gather']
  assert [(s.shapes, groups(s)) for s in gathers] == [
    ((fsdp_shard,), REPLICA_GROUPS)
  ], closing
  for site in closing:
    if site.collective == 'all-reduce':
      assert not {fsdp_shard, state_shard, whole} & set(site.shapes), site


def test_fsdp_only_is_refused_naming_the_argument():
  """FSDP without a data axis: the parameters are split over the mesh's
  only axis, which is no data axis; sharding the optimizer over it is
  refused by every entry point that takes the keyword."""
  mesh = jax.make_mesh(
    (NUM_DEVICES,),
    ('fsdp',),
    axis_types=(jax.sharding.AxisType.Explicit,),
    devices=jax.devices()[:NUM_DEVICES],
  )
  tx = tokacc.token_weighted_multistep(placements.zero1_inner(), K)
  with jax.set_mesh(mesh):
    params = {
      'w': jax.device_put(helpers.zero1_params()['w'], P('fsdp', None)),
      'b': jax.device_put(helpers.zero1_params()['b'], P(None)),
    }
    for helper in (
      tokacc.init_sharded,
      tokacc.state_shardings,
      lambda tx, params, mesh, **kwargs: tokacc.state_partition_specs(
        tx, params, **kwargs
      ),
    ):
      with pytest.raises(ValueError, match='shard_optimizer_over') as error:
        helper(tx, params, mesh, shard_optimizer_over=('fsdp',))
      assert "the parameters are sharded over 'fsdp'" in str(error.value)


@pytest.mark.parametrize(
  'axes, message',
  [
    (('model',), "'model' is not an axis of the mesh"),
    (('fsdp',), "the parameters are sharded over 'fsdp'"),
    (('replica',), "'replica' is not a data axis"),
  ],
)
def test_bad_axes_are_refused_naming_the_argument(axes, message):
  mesh = jax.make_mesh(
    (2, 2),
    ('fsdp', 'replica'),
    axis_types=(jax.sharding.AxisType.Explicit,) * 2,
    devices=jax.devices()[:4],
  )
  tx = tokacc.token_weighted_multistep(placements.zero1_inner(), K)
  with jax.set_mesh(mesh):
    params = jax.device_put(
      {'w': np.ones((8, 4), np.float32)}, P('fsdp', None, reduced=set())
    )
    if axes == ('fsdp',):  # a data axis too, so that only the split shows
      params = jax.device_put(params, P('fsdp', None, reduced={'replica'}))
    with pytest.raises(ValueError, match='shard_optimizer_over') as error:
      tokacc.init_sharded(tx, params, mesh, shard_optimizer_over=axes)
  assert message in str(error.value)


def test_with_axis_name_is_refused_pointing_to_explicit_sharding():
  mesh = jax.make_mesh((2,), ('data',), devices=jax.devices()[:2])
  tx = tokacc.token_weighted_multistep(
    placements.zero1_inner(), K, axis_name='data'
  )
  with pytest.raises(ValueError, match='shard_optimizer_over') as error:
    tokacc.init_sharded(
      tx,
      {'w': jnp.ones((8, 4))},
      mesh,
      axis_name='data',
      shard_optimizer_over=('data',),
    )
  assert 'explicit sharding' in str(error.value)


def test_without_a_mesh_the_error_asks_for_one():
  """Outside ``jax.set_mesh``, with parameters not placements.zero1_placed on a mesh (plain
  arrays, typed on JAX's empty mesh) and no ``mesh=``, the error asks for
  the mesh; it used to say "'data' is not an axis of the mesh ()"."""
  tx = tokacc.token_weighted_multistep(placements.zero1_inner(), K)
  specs = {'w': P(None, None, reduced={'data'}), 'b': P(reduced={'data'})}
  for param_specs in (None, specs):
    with pytest.raises(ValueError, match='shard_optimizer_over') as error:
      tokacc.state_partition_specs(
        tx,
        jax.tree.map(jnp.asarray, helpers.zero1_params()),
        param_specs=param_specs,
        shard_optimizer_over=('data',),
      )
    assert 'jax.set_mesh' in str(error.value)


def test_an_inner_without_parameter_shaped_state_is_refused():
  """Plain SGD keeps no state: nothing to shard, said rather than ignored."""
  mesh = placements.explicit_ddp_mesh()
  tx = tokacc.token_weighted_multistep(optax.sgd(0.1), K)
  with jax.set_mesh(mesh):
    params = jax.device_put(helpers.zero1_params(), P(reduced={'data'}))
    with pytest.raises(ValueError, match='shard_optimizer_over') as error:
      tokacc.init_sharded(tx, params, mesh, shard_optimizer_over=('data',))
  assert 'nothing to shard' in str(error.value)
