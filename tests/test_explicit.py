"""Explicit sharding under plain ``jax.jit``: reduced parameters, unreduced
gradients, one reduction per window (``axis_name=None``, no ``shard_map``).

Every run is compared with single-device full-batch training on the
concatenation of all devices' micro-batches (``helpers.full_batch``), with
unequal token counts per device and micro-step and devices without tokens.
The compiled step is inspected for the collectives each path runs: a
micro-step issues none, whatever reductions the user writes in the loss
(issue 22). Flax, and a data axis of one device. Checkpoints mid-window
(orbax, in this process and in new ones): ``test_checkpoint_anywhere``.
Bad input: ``test_bad_placement``.
"""

import chex
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
from optax_tokacc.testing import collectives
from optax_tokacc.testing import hlo

pytestmark = placements.needs_typed_sharding

K = 3
WINDOW_SIZES = (3, 3, 2)  # the last window is closed early by emit_now


def clipped_adamw():
  return optax.chain(optax.clip_by_global_norm(1.0), helpers.adamw())


def reference(optimizer, num_devices=4):
  """The windows, and full-batch training on them with the round-off
  bounds that ``helpers.full_batch`` derives (relative to each
  window's largest update, so that they hold on any CPU)."""
  windows = helpers.make_windows(WINDOW_SIZES, num_devices)
  expected = helpers.full_batch(optimizer, helpers.init_params(), windows)
  return windows, expected


@pytest.mark.parametrize(
  ('layout', 'spelling'),
  [
    pytest.param(
      layout,
      spelling,
      marks=pytest.mark.slow
      if (layout, spelling) == ('ddp', 'replicated')
      else (),
    )
    for spelling in ('replicated', 'unreduced')
    for layout in ('ddp', 'hsdp', 'fsdp', 'replicated')
  ],
)
def test_equals_full_batch(layout, spelling):
  if layout in ('fsdp', 'replicated') and spelling == 'unreduced':
    pytest.skip('one spelling suffices where gradients are not unreduced')
  windows, expected = reference(helpers.sgd())
  tx = tokacc.token_weighted_multistep(helpers.sgd(), K)
  run = placements.explicit_run(layout, tx, spelling)
  params, state = placements.train_windows(run, windows)
  with jax.set_mesh(placements.EXPLICIT_LAYOUTS[layout].mesh()):
    helpers.assert_within_round_off(placements.plain(params), expected)
    np.testing.assert_allclose(
      tokacc.window_loss(state), expected.loss, atol=expected.loss_atol
    )
    assert int(state.gradient_step) == len(WINDOW_SIZES)


def _restored(tx, params, mesh):
  """A state saved to host memory and restored onto the devices
  (``to_checkpoint`` / ``from_checkpoint``, as orbax would)."""
  del mesh
  like = jax.jit(tx.init)(params)
  saved = jax.device_get(tokacc.to_checkpoint(like))
  shardings = jax.tree.map(lambda x: x.sharding, tokacc.to_checkpoint(like))
  return tokacc.from_checkpoint(jax.device_put(saved, shardings), like)


STATE_BUILDERS = {
  'eager': lambda tx, params, mesh: tx.init(params),
  # the idiom of sharded trainers; on jax 0.12 its replicated zeros left
  # jit typed unreduced, and the first step refused them
  'jit': lambda tx, params, mesh: jax.jit(tx.init)(params),
  'init_sharded': lambda tx, params, mesh: tokacc.init_sharded(
    tx, params, mesh
  ),
  'restored': _restored,
}


@pytest.mark.parametrize(
  ('layout', 'way'),
  [
    pytest.param(
      layout,
      way,
      marks=pytest.mark.slow if (layout, way) == ('hsdp', 'restored') else (),
    )
    for way in sorted(STATE_BUILDERS)
    for layout in ('ddp', 'hsdp', 'fsdp', 'replicated')
  ],
)
def test_every_way_to_build_the_state_trains_exactly(layout, way):
  """Each way users build the state trains as full batch does, and the
  step keeps the state's types and shardings (a fixed point)."""
  windows, expected = reference(helpers.sgd())
  tx = tokacc.token_weighted_multistep(helpers.sgd(), K)
  make_mesh, specs, _ = placements.EXPLICIT_LAYOUTS[layout]
  with jax.set_mesh(make_mesh()):
    params = placements.place_params(helpers.init_params(), make_mesh(), specs)
    built = typed(STATE_BUILDERS[way](tx, params, make_mesh()))
  seen = []
  run = placements.explicit_run(layout, tx, init=STATE_BUILDERS[way])
  params, state = placements.train_windows(
    run, windows, on_step=lambda p, s: seen.append(typed(s))
  )
  with jax.set_mesh(make_mesh()):
    helpers.assert_within_round_off(placements.plain(params), expected)
  assert int(state.gradient_step) == len(WINDOW_SIZES)
  assert all(s == built for s in seen)


def typed(tree):
  """Each leaf's type, and the kind of sharding it carries (a
  ``GSPMDSharding`` is what jax 0.12 could not take back)."""
  return jax.tree.map(
    lambda x: (str(jax.typeof(x)), type(x.sharding).__name__), tree
  )


@pytest.mark.slow
def test_clip_by_global_norm_sees_the_global_norm():
  """Clipping inside ``inner`` acts (the norm is above 1) and is exact:
  it sees the norm of the reduced window gradient, not of a partial sum."""
  windows, expected = reference(clipped_adamw())
  tx = tokacc.token_weighted_multistep(clipped_adamw(), K)
  for layout in ('ddp', 'hsdp'):
    params, _ = placements.train_windows(
      placements.explicit_run(layout, tx), windows
    )
    with jax.set_mesh(placements.EXPLICIT_LAYOUTS[layout].mesh()):
      helpers.assert_within_round_off(placements.plain(params), expected)


@pytest.mark.parametrize('layout', ['ddp', 'hsdp', 'fsdp', 'replicated'])
def test_types_are_a_fixed_point(layout):
  """After every call the state and parameters have the types of ``tx.init``
  and of the placed parameters; the step compiles once."""
  windows = helpers.make_windows(WINDOW_SIZES, 4)
  tx = tokacc.token_weighted_multistep(helpers.adamw(), K)
  make_mesh, specs, _ = placements.EXPLICIT_LAYOUTS[layout]
  with jax.set_mesh(make_mesh()):
    params0 = placements.place_params(helpers.init_params(), make_mesh(), specs)
    expected_params = placements.type_strings(params0)
    expected_state = placements.type_strings(tx.init(params0))
    jitted_state = placements.type_strings(jax.jit(tx.init)(params0))
  assert jitted_state == expected_state
  seen = []

  def check(params, state):
    assert placements.type_strings(params) == expected_params
    assert placements.type_strings(state) == expected_state
    seen.append(1)

  run = placements.explicit_run(layout, tx)
  placements.train_windows(run, windows, on_step=check)
  assert len(seen) == sum(WINDOW_SIZES)
  assert run.step._cache_size() == 1


@pytest.mark.parametrize(
  'layout, acc_type, tokens_type',
  [
    ('ddp', 'float32[8,8]{U:data}', 'int32[]{U:data}'),
    ('hsdp', 'float32[8@fsdp,8]{U:replica}', 'int32[]{U:replica}'),
    ('fsdp', 'float32[8@fsdp,8]', 'int32[]'),
    ('replicated', 'float32[8,8]', 'int32[]'),
  ],
)
def test_accumulator_typed_like_the_gradients(layout, acc_type, tokens_type):
  """The accumulator is the parameter's type with reduced turned unreduced;
  the optimizer moments are typed like the parameters."""
  make_mesh, specs, _ = placements.EXPLICIT_LAYOUTS[layout]
  mesh = make_mesh()
  tx = tokacc.token_weighted_multistep(helpers.adamw(), K)
  with jax.set_mesh(mesh):
    params = placements.place_params(helpers.init_params(), mesh, specs)
    for state in (
      tx.init(params),
      jax.jit(tx.init)(params),
      tokacc.init_sharded(tx, params, mesh),
    ):
      assert str(jax.typeof(state.grad_sums['w'])) == acc_type
      assert str(jax.typeof(state.acc_tokens)) == tokens_type
      assert str(jax.typeof(state.acc_loss)) == tokens_type.replace(
        'int32', 'float32'
      )
      mu = state.inner_state[0].mu['w']
      assert jax.typeof(mu) == jax.typeof(params['w'])
    shardings = tokacc.state_shardings(tx, params, mesh)
    acc_spec = jax.typeof(state.grad_sums['w']).sharding.spec
    assert shardings.grad_sums['w'].spec.unreduced == acc_spec.unreduced
    assert shardings.acc_tokens.spec == P(unreduced=acc_spec.unreduced)
    specs_out = tokacc.state_partition_specs(tx, params)
    assert set(specs_out.grad_sums['w'].unreduced) == set(
      jax.typeof(state.grad_sums['w']).sharding.spec.unreduced
    )
    assert set(specs_out.inner_state[0].mu['w'].reduced) == set(
      jax.typeof(params['w']).sharding.spec.reduced
    )


def test_accumulator_bytes_per_device():
  """DDP keeps a whole accumulator per device, HSDP a shard of it."""
  tx = tokacc.token_weighted_multistep(helpers.adamw(), K)
  full = helpers.init_params()['w'].nbytes
  for layout, expected in (('ddp', full), ('hsdp', full // 2)):
    make_mesh, specs, _ = placements.EXPLICIT_LAYOUTS[layout]
    with jax.set_mesh(make_mesh()):
      params = placements.place_params(
        helpers.init_params(), make_mesh(), specs
      )
      acc = tx.init(params).grad_sums['w']
      assert {s.data.nbytes for s in acc.addressable_shards} == {expected}


# Collectives in the compiled step.


def test_ddp_one_all_reduce_per_window():
  """Unreduced counts and loss: no collective at all on a micro-step; the
  closing branch runs one all-reduce carrying every gradient leaf, the
  smallest (v, 8 values) with the count's four float32 parts and the loss
  after it (issue 54: no operand of their own, which XLA may not
  combine)."""
  sites = collectives.compiled_collectives(
    placements.explicit_compiled_text('ddp', 'unreduced')
  )
  every_step, window = (
    collectives.on_every_call(sites),
    collectives.in_branches(sites),
  )
  assert every_step == []
  (reduction,) = window
  assert reduction.opcode.startswith('all-reduce')
  assert sorted(reduction.shapes) == [('f32', (8, 8)), ('f32', (8 + 5,))]


def test_ddp_replicated_count_costs_only_scalars_per_micro_step():
  """A plain ``mask.sum()`` count and loss cost scalar all-reduces in the
  forward pass (the user's code), never a gradient-sized one."""
  sites = collectives.compiled_collectives(
    placements.explicit_compiled_text('ddp', 'replicated')
  )
  every_step, window = (
    collectives.on_every_call(sites),
    collectives.in_branches(sites),
  )
  assert every_step, 'the forward pass sums the count and loss'
  for site in every_step:
    assert all(dims == () for _, dims in site.shapes), site
  assert len(window) == 1


def test_hsdp_reduces_across_replicas_once_per_window():
  """Per micro-step, the reductions stay within ``fsdp`` groups (the
  forward pass's all-gathers of the shards are the user's code; with a
  replicated count and loss, so are its scalar sums); the closing branch
  holds an all-reduce over ``replica`` of the accumulator shard (P / 2 per
  leaf; the count parts and the loss after the smaller one), and one
  scalar all-reduce over ``fsdp`` of the squared norms of the shards
  (``window_metrics``)."""
  fsdp_groups = [[0, 1], [2, 3]]
  replica_groups = [[0, 2], [1, 3]]
  for spelling in ('replicated', 'unreduced'):
    sites = collectives.compiled_collectives(
      placements.explicit_compiled_text('hsdp', spelling)
    )
    every_step, window = (
      collectives.on_every_call(sites),
      collectives.in_branches(sites),
    )
    reductions = [s for s in every_step if s.opcode.startswith('all-reduce')]
    assert reductions
    for site in reductions:
      if spelling == 'replicated' and all(d == () for _, d in site.shapes):
        continue
      assert (
        sorted(map(sorted, collectives.group_sets(site, 4))) == fsdp_groups
      ), site
    (norms,) = [s for s in window if sorted(s.shapes) == [('f32', (2,))]]
    assert sorted(map(sorted, collectives.group_sets(norms, 4))) == fsdp_groups
    (reduction,) = [s for s in window if s is not norms]
    assert (
      sorted(map(sorted, collectives.group_sets(reduction, 4)))
      == replica_groups
    )
    assert sorted(reduction.shapes) == [('f32', (4, 8)), ('f32', (4 + 5,))]


# Compositions, on the DDP layout, against full-batch training.


def run(tx, sequence, layout='ddp', step=None, dtype=None):
  """Trains on ``sequence``; returns final params (host) and state."""
  make_mesh, specs, _ = placements.EXPLICIT_LAYOUTS[layout]
  mesh = make_mesh()
  with jax.set_mesh(mesh):
    data = NamedSharding(mesh, P(placements.batch_axes(mesh)))
    params = helpers.init_params()
    if dtype is not None:
      params = jax.tree.map(lambda x: x.astype(dtype), params)
    params = placements.place_params(params, mesh, specs)
    state = tx.init(params)
    step = step or placements.explicit_step(tx)
    for batch, emit_now in sequence:
      batch = jax.tree.map(lambda x: jax.device_put(x, data), batch)
      params, state = step(params, state, batch, jnp.asarray(emit_now))
    return placements.plain(params), state


@pytest.mark.parametrize('custom', [False, True])
def test_skip_not_finite_rejects_the_micro_batch_on_every_device(custom):
  """A micro-batch with a NaN on one device is rejected on all of them and
  does not advance the window: training equals full-batch training on the
  other micro-batches. ``skip_not_finite`` decides on each device's partial
  sums (a scalar all-reduce); another function sees the reduced gradients
  (an all-reduce of the gradients, with a warning)."""
  windows, expected = reference(helpers.sgd())
  skip = tokacc.skip_not_finite
  if custom:

    def skip(grads, step, params):
      return optax.skip_not_finite(grads, step, params)

  tx = tokacc.token_weighted_multistep(
    helpers.sgd(), K, should_skip_update_fn=skip
  )
  sequence = list(placements.micro_batches(windows))
  sequence.insert(1, (placements.with_nan(sequence[0][0], device=2), False))
  if custom:
    with pytest.warns(UserWarning, match='all-reduce of the gradients') as w:
      params, state = run(tx, sequence)
    # at the lines that call tx.init (run, here) and tx.update
    # (placements._apply)
    assert {x.filename for x in w} == {__file__, placements.__file__}
  else:
    params, state = run(tx, sequence)
  helpers.assert_within_round_off(params, expected)
  assert int(state.gradient_step) == len(WINDOW_SIZES)


def test_compensated_and_chained_after():
  """Kahan-compensated partial sums, and a stage after the accumulator
  (doubling the updates equals SGD with twice the learning rate)."""
  double = optax.sgd(2 * helpers.LEARNING_RATE, momentum=0.9)
  windows, expected = reference(double)
  tx = optax.chain(
    tokacc.token_weighted_multistep(helpers.sgd(), K, compensated=True),
    optax.scale(2.0),
  )
  params, _ = run(tx, placements.micro_batches(windows))
  helpers.assert_within_round_off(params, expected)


def test_linear_stage_before_the_accumulator():
  """A stage before the accumulator sees unreduced partial sums: a linear
  one with a reduced constant is exact; a Python float is refused by JAX
  (the README says to put such stages inside ``inner``)."""
  double = optax.sgd(2 * helpers.LEARNING_RATE, momentum=0.9)
  windows, expected = reference(double)
  with jax.set_mesh(placements.explicit_ddp_mesh()):
    two = jax.reshard(jnp.float32(2.0), P(reduced={'data'}))
  tx = optax.chain(
    optax.scale(two), tokacc.token_weighted_multistep(helpers.sgd(), K)
  )
  params, _ = run(tx, placements.micro_batches(windows))
  helpers.assert_within_round_off(params, expected)
  tx = optax.chain(
    optax.scale(2.0), tokacc.token_weighted_multistep(helpers.sgd(), K)
  )
  with pytest.raises(Exception, match='reduced'):
    run(tx, placements.micro_batches(windows))


def test_mixed_precision_bf16_params():
  """bfloat16 parameters and gradients typed reduced/unreduced, a float32
  accumulator, AdamW with float32 moments: dtypes and types kept, close to
  full-batch training in float32."""
  inner = optax.adamw(helpers.LEARNING_RATE, mu_dtype=jnp.float32)
  windows, expected = reference(inner)
  tx = tokacc.token_weighted_multistep(inner, K)
  params, state = run(tx, placements.micro_batches(windows), dtype=jnp.bfloat16)
  assert {x.dtype for x in jax.tree.leaves(params)} == {jnp.dtype(jnp.bfloat16)}
  assert state.grad_sums['w'].dtype == jnp.float32
  assert str(jax.typeof(state.grad_sums['w'])).endswith('{U:data}')
  assert state.inner_state[0].mu['w'].dtype == jnp.float32
  # bfloat16 keeps 8 significant bits (u = 2**-8): the parameters (|p| <
  # 2.4) are rounded by up to 2.4 u = 0.0094 when cast and after each of
  # the 3 updates, 0.0375 in all; the rest, 0.0125, is a fifth of one
  # update (lr 0.05) for the bfloat16 forward pass's error in the gradients.
  chex.assert_trees_all_close(
    jax.tree.map(lambda x: x.astype(np.float32), params),
    expected.params,
    rtol=0,
    atol=0.05,
  )


def test_flax_train_state():
  """``optax_tokacc.flax.TrainState`` over reduced parameters: its step
  counts optimizer updates; parameters keep their type."""
  from optax_tokacc import flax as tokacc_flax  # noqa: PLC0415

  windows, expected = reference(helpers.sgd())
  tx = tokacc.token_weighted_multistep(helpers.sgd(), K)
  mesh = placements.explicit_ddp_mesh()

  @jax.jit
  def step(ts, batch, emit_now):
    loss, grads = jax.value_and_grad(helpers.loss_sum)(ts.params, batch)
    return ts.apply_gradients(
      grads=grads,
      num_tokens=helpers.token_count(batch),
      loss=loss,
      emit_now=emit_now,
    )

  with jax.set_mesh(mesh):
    data = NamedSharding(mesh, P('data'))
    params = placements.place_params(
      helpers.init_params(), mesh, placements.EXPLICIT_LAYOUTS['ddp'].specs
    )
    ts = tokacc_flax.TrainState.create(apply_fn=None, params=params, tx=tx)
    for batch, emit_now in placements.micro_batches(windows):
      batch = jax.tree.map(lambda x: jax.device_put(x, data), batch)
      ts = step(ts, batch, jnp.asarray(emit_now))
      assert jax.typeof(ts.params['w']) == jax.typeof(params['w'])
    helpers.assert_within_round_off(placements.plain(ts.params), expected)
    assert int(ts.step) == len(WINDOW_SIZES)


@pytest.mark.slow
def test_microbatched_value_and_grad_and_token_cross_entropy():
  """In-step micro-batches of a token cross-entropy, accumulated across
  steps with unreduced gradients, equal full-batch training."""
  classes = 3
  rng = np.random.default_rng(3)
  params = {'w': rng.normal(size=(helpers.FEATURES, classes))}
  params = jax.tree.map(lambda x: x.astype(np.float32), params)
  windows = helpers.make_windows(WINDOW_SIZES, 4)

  def labels(batch):
    y = (np.abs(batch['y']) * 10).astype(np.int32) % classes
    return np.where(batch['mask'] > 0, y, -100)

  def loss_fn(params, batch):
    logits = batch['x'] @ params['w']
    return tokacc.token_cross_entropy(logits, batch['labels'])

  windows = [[dict(b, labels=labels(b)) for b in w] for w in windows]
  # helpers.full_batch's bound, m the roundings of a token's term as the
  # tanh model's (8 features; 3 classes: fewer terms).
  expected = helpers.full_batch(
    helpers.sgd(), params, windows, lambda p, b: loss_fn(p, b)[0]
  )

  tx = tokacc.token_weighted_multistep(helpers.sgd(), K)
  grad_fn = tokacc.microbatched_value_and_grad(loss_fn, 4)  # 2 per step
  mesh = placements.explicit_ddp_mesh()
  with jax.set_mesh(mesh):

    @jax.jit
    def step(params, state, batch, emit_now):
      (loss, n), grads = grad_fn(params, batch)
      updates, state = tx.update(
        grads, state, params, num_tokens=n, loss=loss, emit_now=emit_now
      )
      return optax.apply_updates(params, updates), state

    data = NamedSharding(mesh, P('data'))
    placed = jax.device_put(params, P(None, None, reduced={'data'}))
    state = tx.init(placed)
    for batch, emit_now in placements.micro_batches(windows):
      batch = jax.tree.map(lambda x: jax.device_put(x, data), batch)
      placed, state = step(placed, state, batch, jnp.asarray(emit_now))
    helpers.assert_within_round_off(placements.plain(placed), expected)


# Flax nnx, token_cross_entropy's partial sums, a data axis of one device,
# what a micro-step copies, and a literal count.


def test_nnx_optimizer_with_reduced_parameters():
  """``optax_tokacc.flax.Optimizer`` over an nnx model whose parameters
  are typed reduced (``jax.set_mesh``, as nnx's sharding guide does):
  exact, its step counts updates, the parameters keep their type."""
  from flax import nnx  # noqa: PLC0415

  from optax_tokacc.flax import Optimizer  # noqa: PLC0415

  class Model(nnx.Module):
    def __init__(self, params):
      self.w = nnx.Param(jnp.asarray(params['w']))
      self.v = nnx.Param(jnp.asarray(params['v']))

    def __call__(self, batch):
      return helpers.loss_sum({'w': self.w[...], 'v': self.v[...]}, batch)

  windows, expected = reference(helpers.sgd())
  mesh = placements.explicit_ddp_mesh()
  with jax.set_mesh(mesh):
    placed = placements.place_params(
      helpers.init_params(), mesh, placements.EXPLICIT_LAYOUTS['ddp'].specs
    )
    model = Model(placed)
    optimizer = Optimizer(
      model, tokacc.token_weighted_multistep(helpers.sgd(), K), wrt=nnx.Param
    )

    @nnx.jit
    def step(model, optimizer, batch, emit_now):
      loss, grads = nnx.value_and_grad(lambda m: m(batch))(model)
      optimizer.update(
        model,
        grads,
        num_tokens=helpers.token_count(batch),
        loss=loss,
        emit_now=emit_now,
      )

    data = NamedSharding(mesh, P('data'))
    for batch, emit_now in placements.micro_batches(windows):
      batch = jax.tree.map(lambda x: jax.device_put(x, data), batch)
      step(model, optimizer, batch, jnp.asarray(emit_now))
      assert jax.typeof(model.w[...]) == jax.typeof(placed['w'])
    actual = placements.plain({'w': model.w[...], 'v': model.v[...]})
    helpers.assert_within_round_off(actual, expected)
    assert int(optimizer.step[...]) == len(WINDOW_SIZES)


def test_token_cross_entropy_partial_sums_need_no_collective():
  """``out_sharding=P(unreduced=...)`` gives the loss sum and the count as
  per-device partial sums: the same totals, and no collective at all."""
  mesh = placements.explicit_ddp_mesh()
  rng = np.random.default_rng(0)
  logits = rng.normal(size=(8, 5, 7)).astype(np.float32)
  labels = rng.integers(0, 7, size=(8, 5)).astype(np.int32)
  labels[::3, 2:] = -100
  expected = tokacc.token_cross_entropy(logits, labels)
  with jax.set_mesh(mesh):
    logits_d = jax.device_put(logits, P('data'))
    labels_d = jax.device_put(labels, P('data'))
    fn = jax.jit(
      lambda x, y: tokacc.token_cross_entropy(
        x, y, out_sharding=placements.U_DATA
      )
    )
    loss_sum, count = fn(logits_d, labels_d)
    assert str(jax.typeof(loss_sum)) == 'float32[]{U:data}'
    assert str(jax.typeof(count)) == 'int32[]{U:data}'
    totals = jax.jit(lambda t: jax.reshard(t, P()))((loss_sum, count))
    text = hlo.compiled_text(fn, logits_d, labels_d)
  # A sum of 40 non-negative terms in two orders (per device, then across
  # devices; whole), each term through about 7 + 10 roundings (7 classes'
  # logsumexp): within 2 gamma(40 + 17) of each other relatively (Higham).
  m = labels.size + 17
  gamma = m * 2.0**-24 / (1 - m * 2.0**-24)
  np.testing.assert_allclose(totals[0], expected[0], rtol=2 * gamma)
  assert int(totals[1]) == int(expected[1])
  sites = collectives.compiled_collectives(text)
  assert sites == []


@pytest.mark.slow
def test_a_data_axis_of_one_device():
  """On a mesh whose data axis has one device (the same code on one
  accelerator), partial sums over it are the sum: the state holds no
  unreduced type (JAX cannot lower those over a size-1 axis), and
  training equals full-batch training."""
  windows, expected = reference(helpers.sgd(), num_devices=1)
  tx = tokacc.token_weighted_multistep(
    helpers.sgd(),
    K,
    should_skip_update_fn=tokacc.skip_not_finite,
    compensated=True,
  )
  mesh = jax.make_mesh((1,), ('data',), devices=jax.devices()[:1])
  with jax.set_mesh(mesh):
    data = NamedSharding(mesh, P('data'))
    params = placements.place_params(
      helpers.init_params(), mesh, placements.EXPLICIT_LAYOUTS['ddp'].specs
    )
    state = tx.init(params)
    assert str(jax.typeof(state.grad_sums['w'])) == 'float32[8,8]'
    specs = tokacc.state_partition_specs(tx, params)
    assert specs.grad_sums['w'] == P(None, None) and specs.acc_tokens == P()
    step = placements.explicit_step(tx, 'unreduced')
    for batch, emit_now in placements.micro_batches(windows):
      batch = jax.tree.map(lambda x: jax.device_put(x, data), batch)
      params, state = step(params, state, batch, jnp.asarray(emit_now))
    helpers.assert_within_round_off(placements.plain(params), expected)


def test_ddp_micro_step_copies_nothing_parameter_sized():
  """Under explicit DDP the updates are held in the accumulator's buffer
  (typed unreduced, the updates reduced: the same bytes on every device),
  so the branch a micro-step takes passes every buffer through: no
  parameter-sized copy or fresh zeros, as without explicit sharding."""
  make_mesh, specs, _ = placements.EXPLICIT_LAYOUTS['ddp']
  mesh = make_mesh()
  tx = tokacc.token_weighted_multistep(helpers.adamw(), K)
  with jax.set_mesh(mesh):
    params = placements.place_params(helpers.init_params(), mesh, specs)
    state = tx.init(params)
    batch = helpers.make_windows((1,), 4)[0][0]
    batch = jax.device_put(batch, NamedSharding(mesh, P('data')))
    text = hlo.compiled_text(
      placements.explicit_step(tx, 'unreduced'),
      params,
      state,
      batch,
      jnp.asarray(False),
    )
  module = hlo.parse_hlo(text)
  closing = [
    i
    for instructions in module.computations.values()
    for i in instructions
    if i.branches and any(s == ('f32', (8, 8)) for s in i.shapes)
  ]
  accumulating = {c.branches[0] for c in closing}  # the false branch
  assert accumulating
  for name in accumulating:
    big = [
      i.opcode
      for i in module.computations[name]
      if i.opcode in ('copy', 'broadcast', 'fusion')
      and ('f32', (8, 8)) in i.shapes
    ]
    assert not big, (name, big)


@pytest.mark.parametrize('reduction', ['sum', 'mean'])
@pytest.mark.parametrize('host_closes', [False, True])
def test_a_literal_count_and_no_loss(host_closes, reduction):
  """A count written as a literal (``num_tokens=2``: the loss sums two
  counted tokens) is the micro-batch's count once, not once per device, and
  no ``loss`` gives a NaN window loss; closed by the device or by the host.

  ``jax.reshard`` to unreduced of a literal equal to another constant of
  the program (here ``k``, 2) was merged with it and held whole by every
  device: the window counted 4 times its tokens (gradients 4x too small,
  silently, on jax 0.10.2 and 0.12). On jax >= 0.11 the NaN of no loss
  was merged with the window metrics' NaN, which no longer compiled.
  Under ``loss_reduction='mean'`` the literal also scales the gradient
  (typed reduced, then multiplied into the partial sums)."""
  rng = np.random.default_rng(0)
  batches = [rng.normal(size=(8, 8)).astype(np.float32) for _ in range(2)]
  w0 = rng.normal(size=(8,)).astype(np.float32)
  tx = tokacc.token_weighted_multistep(
    optax.sgd(0.1), len(batches), loss_reduction=reduction
  )

  def loss_sum(w, x):
    return jnp.sum(jnp.tanh(x @ w) ** 2)

  def loss(w, x):  # what tx takes: the sum, or its mean over the 2 tokens
    return loss_sum(w, x) / (2 if reduction == 'mean' else 1)

  # Full batch, plainly: the summed gradient over the window's 2 x 2 tokens.
  full = np.concatenate(batches)
  expected = w0 - 0.1 * np.asarray(jax.grad(loss_sum)(w0, full)) / 4

  mesh = placements.explicit_ddp_mesh()
  with jax.set_mesh(mesh):
    w = jax.device_put(w0, NamedSharding(mesh, P(reduced={'data'})))
    state = tx.init(w)

    @jax.jit(static_argnames='close')
    def step(w, state, x, close):
      grads = jax.grad(loss)(w, x)  # unreduced over data
      updates, state = tx.update(grads, state, w, num_tokens=2, close=close)
      return optax.apply_updates(w, updates), state

    rows = NamedSharding(mesh, P('data'))
    for m, x in enumerate(batches):
      close = m == len(batches) - 1 if host_closes else None
      w, state = step(w, state, jax.device_put(x, rows), close=close)
    metrics = tokacc.window_metrics(state)
    w = placements.plain({'w': w})['w']
  assert int(metrics.tokens) == 4
  assert np.isnan(float(metrics.loss))
  # float32 round-off of the sums of 64 products (the values are O(1)).
  np.testing.assert_allclose(w, expected, rtol=0, atol=1e-5)


# A micro-step issues no collective, whatever reductions the user writes
# inside the loss (issue 22): DDP with ``loss=``, the parameters typed
# ``P(reduced={'data'})``, the loss a partial sum written as issue 22 writes
# it (the squared error summed over the outputs with ``jnp.sum(..., -1)``,
# then an einsum with the mask into ``P(unreduced={'data'})``), the token
# count a partial sum too. The compiled step (k = 4, so that a step from
# ``tx.init`` does not close the window) is read with ``optax_tokacc.testing.hlo``: a
# collective on the micro-step's path is one outside the closing branch
# (branch 1 of the transform's conditional). Controls: the user's loss and
# gradient compiled alone have no collective at all, and the step without
# ``loss=`` has none on the micro-step's path. The configuration also trains
# exactly as full-batch SGD (``helpers.linear_reference``).

PARTIAL_K = 4  # a step from tx.init does not close the window
PARTIAL_OUTPUTS = 2
PARTIAL_LEARNING_RATE = 0.05
PARTIAL = placements.U_DATA  # P(unreduced={'data'}): per-device sums


def partial_params():
  """The linear model with two outputs per token, no bias (``helpers``)."""
  return helpers.linear_params(PARTIAL_OUTPUTS, seed=11, bias=False)


def partial_loss_sum(params, batch):
  """``helpers.linear_loss_sum`` as issue 22 writes it: the squared error
  summed over the outputs, then over the counted tokens into a partial sum
  per device."""
  error = batch['x'] @ params['w'] - batch['y']
  per_token = jnp.sum(error**2, axis=-1)
  return jnp.einsum('bt,bt->', per_token, batch['mask'], out_sharding=PARTIAL)


def partial_count(batch):
  return jnp.einsum('bt->', batch['mask'], out_sharding=PARTIAL)


def partial_step(tx, with_loss):
  step = helpers.train_step(
    tx, partial_loss_sum, count_fn=partial_count, with_loss=with_loss
  )
  return jax.jit(step)


def partial_windows(window_sizes):
  """``helpers.make_windows`` (unequal counts per device and micro-step,
  devices without tokens) with two targets per token."""
  windows = helpers.make_windows(window_sizes, 4, seed=3)
  return helpers.with_outputs(windows, PARTIAL_OUTPUTS, seed=12)


def partial_placed(mesh):
  """The parameters typed reduced over 'data', a placer of batches."""
  data = NamedSharding(mesh, P('data'))
  params = jax.device_put(partial_params(), placements.DDP)
  return params, lambda batch: jax.device_put(batch, data)


def compiled_step_sites(with_loss):
  tx = tokacc.token_weighted_multistep(
    optax.sgd(PARTIAL_LEARNING_RATE), PARTIAL_K
  )
  mesh = placements.explicit_ddp_mesh()
  with jax.set_mesh(mesh):
    params, place = partial_placed(mesh)
    batch = place(partial_windows((1,))[0][0])
    step = partial_step(tx, with_loss)
    text = hlo.compiled_text(step, params, tx.init(params), batch)
  return collectives.compiled_collectives(text)


def assert_one_reduction_when_closing(sites):
  """The closing branch holds the window's one all-reduce: the gradient,
  flattened, with the count's four parts and the loss after it (so the
  reader does see the step's collectives)."""
  closing = collectives.on_closing_step_only(sites)
  assert [site.collective for site in closing] == ['all-reduce'], closing
  carried = helpers.FEATURES * PARTIAL_OUTPUTS + 5
  assert closing[0].shapes == (('f32', (carried,)),)


def test_user_loss_and_grad_alone_issue_no_collective():
  """Control: the loss, its gradient and the count, without the transform,
  are partial sums computed with no collective."""
  mesh = placements.explicit_ddp_mesh()
  with jax.set_mesh(mesh):
    params, place = partial_placed(mesh)
    batch = place(partial_windows((1,))[0][0])

    @jax.jit
    def loss_grad_count(params, batch):
      loss, grads = jax.value_and_grad(partial_loss_sum)(params, batch)
      return loss, grads, partial_count(batch)

    loss, grads, _ = loss_grad_count(params, batch)
    assert str(jax.typeof(loss)) == 'float32[]{U:data}'
    assert str(jax.typeof(grads['w'])).endswith('{U:data}')
    text = hlo.compiled_text(loss_grad_count, params, batch)
  assert collectives.compiled_collectives(text) == []


def test_micro_step_without_loss_issues_no_collective():
  """Control: without ``loss=``, the micro-step's path holds no
  collective."""
  sites = compiled_step_sites(with_loss=False)
  assert collectives.on_micro_step_path(sites) == []
  assert_one_reduction_when_closing(sites)


def test_micro_step_with_loss_issues_no_collective():
  """With ``loss=`` a partial sum, the micro-step's path holds no collective
  either (0.3 issued an all-reduce of a float32 scalar on every call, from
  the select that reset the window's loss on unreduced values)."""
  sites = compiled_step_sites(with_loss=True)
  assert collectives.on_micro_step_path(sites) == []
  assert_one_reduction_when_closing(sites)


def test_with_loss_equals_full_batch_sgd():
  """The same configuration trains as full-batch SGD on each window's
  token-mean loss, window after window, within the float32 round-off bound
  of ``helpers.linear_reference``; the window loss too."""
  windows = partial_windows((PARTIAL_K,) * 3)
  tx = tokacc.token_weighted_multistep(
    optax.sgd(PARTIAL_LEARNING_RATE), PARTIAL_K
  )
  mesh = placements.explicit_ddp_mesh()
  trajectory = []
  with jax.set_mesh(mesh):
    params, place = partial_placed(mesh)
    state = tx.init(params)
    step = partial_step(tx, with_loss=True)
    for window in windows:
      for batch in window:
        params, state = step(params, state, place(batch))
      assert bool(tokacc.has_updated(state))
      theta = helpers.linear_theta(placements.plain(params))
      trajectory.append(([theta], np.asarray(tokacc.window_loss(state))))
  expected = helpers.linear_reference(
    partial_params(), windows, PARTIAL_LEARNING_RATE
  )
  helpers.assert_within_linear_bound(trajectory, expected)
