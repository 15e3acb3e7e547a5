"""Windows closed by the host against windows closed by the device, each
step written as users write it (issue 33).

``jax.jit(step, static_argnames='close')`` with ``optax.apply_updates`` in
the step: a window closed by the host (``close=False`` calls, then
``close=True``) and the same window closed by the device (``close=None``)
give bit for bit the same updates and state, on one device and data
parallel (``shard_map`` with ``axis_name``, explicit DDP, ZeRO-1). The
window's mean is one computation in both programs (``_closing._step``'s
``mean``: before, XLA rewrote the host program's division into a
multiplication by the reciprocal inside the device program's ``cond``
only, and 3 of 32 elements differed by up to 2.4e-7). The parameters are
the user's arithmetic: XLA may fuse ``w + u`` with the optimizer's last
multiply into one rounding in one program only (getting_started, "Windows
closed by the host"); they are compared within that rounding.

Also the three rules of ``close`` that getting_started writes down: the
sign of ``close=False``'s zero updates per placement, ``emit_now=False``
passed with a Python ``close``, and ``close=None`` after ``close=False``
calls of the same window.
"""

import contextlib
import functools

import helpers
import hlo
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

NUM_DEVICES = 4
EXPLICIT_ONLY = pytest.mark.skipif(
  not _typed_sharding.SUPPORTED,
  reason='reduced/unreduced types need jax >= 0.10',
)


def momentum_sgd():
  """The issue's optimizer: its first step is ``-1.0 * g``, exact, so that
  the parameters' rounding is the add alone."""
  return optax.sgd(1.0, momentum=0.9)


def user_step(tx, loss_sum, count, at=lambda params: params):
  """``step(params, state, batch, close) -> (params, state, updates)``: as
  users write it, ``optax.apply_updates`` in the same program; the
  gradients are taken at ``at(params)``."""

  def step(params, state, batch, close):
    loss, grads = jax.value_and_grad(loss_sum)(at(params), batch)
    updates, state = tx.update(
      grads, state, params, num_tokens=count(batch), loss=loss, close=close
    )
    return optax.apply_updates(params, updates), state, updates

  return step


def within_the_users_rounding(params, expected, before, updates):
  """``optax.apply_updates`` computes ``w + u``; fused with the multiply
  that made ``u`` (one rounding of ``w - lr * g``) or not (``u`` rounded,
  then the sum), the two results differ by at most the rounding of ``u``
  (half an ulp of ``u``) and of the sum (an ulp of the result, half in
  each program): within ``spacing(u) + spacing(w')`` per element."""
  for p, e, w, u in zip(
    *(jax.tree.leaves(t) for t in (params, expected, before, updates))
  ):
    p, e, w, u = (np.asarray(x, np.float64) for x in (p, e, w, u))
    bound = np.spacing(np.abs(u).astype(np.float32))
    bound += np.spacing(np.abs(e).astype(np.float32))
    assert np.all(np.abs(p - e) <= bound), (p - e, bound)
    assert np.any(e != w)  # the window moved the parameters


def host_and_device(step, params, state, window):
  """The window closed by the host (``close=False``, then ``True``) and by
  the device (``close=None`` throughout, the schedule's k the window's
  length): ``(params, state, updates)`` of each, after the window."""
  runs = {}
  for decider in ('host', 'device'):
    p, s = params, state
    for m, batch in enumerate(window):
      close = None if decider == 'device' else m == len(window) - 1
      p, s, u = step(p, s, batch, close)
    assert int(tokacc.find_state(s).gradient_step) == 1, decider
    runs[decider] = (p, s, u)
  return runs['host'], runs['device']


# The state after a window closed: the accumulator's fields aside (scratch,
# or per-device partial sums under explicit sharding).
STATE_FIELDS = ('inner_state', 'mini_step', 'gradient_step', 'last_loss')
STATE_FIELDS += ('last_tokens', 'dropped_windows', 'emitted')


def assert_same_window(host, device, before):
  """The updates and the state bit for bit, the parameters within the
  user's rounding (host copies)."""
  (params, state, updates), (e_params, e_state, e_updates) = host, device
  helpers.assert_same_bits(updates, e_updates, 'updates')
  state, e_state = tokacc.find_state(state), tokacc.find_state(e_state)
  for field in STATE_FIELDS:
    helpers.assert_same_bits(
      getattr(state, field), getattr(e_state, field), field
    )
  within_the_users_rounding(params, e_params, before, e_updates)


@pytest.mark.parametrize(
  ('make_inner', 'k'), [(lambda: optax.sgd(0.1), 1), (momentum_sgd, 2)]
)
def test_one_device_host_closed_equals_device_decided(make_inner, k):
  """The issue's one-device case (``sgd(0.1)``, k = 1: the parameters
  differed in the last bit, XLA fusing ``w + (-0.1 * g)`` in the host's
  program only) and a window of two micro-batches."""
  tx = tokacc.token_weighted_multistep(make_inner(), k)
  step = jax.jit(
    user_step(tx, helpers.loss_sum, helpers.token_count),
    static_argnames='close',
  )
  params = jax.tree.map(jnp.asarray, helpers.init_params())
  window = helpers.make_windows((k,), NUM_DEVICES, seed=3)[0]
  host, device = host_and_device(step, params, tx.init(params), window)
  assert_same_window(host, device, helpers.init_params())


def shard_map_run(mesh):
  """Per-device code under ``jax.shard_map`` with ``axis_name='data'``,
  gradients taken at parameters ``pcast`` to varying (``test_host_close``)."""
  tx = tokacc.token_weighted_multistep(momentum_sgd(), 2, axis_name='data')
  specs = placements.state_specs(tx, 'data')

  def varying(params):  # so that autodiff does not reduce every micro-step
    return jax.tree.map(lambda p: lax.pcast(p, 'data', to='varying'), params)

  per_device = user_step(tx, helpers.loss_sum, helpers.token_count, varying)

  def step(params, state, batch, close):
    return jax.shard_map(
      functools.partial(per_device, close=close),
      mesh=mesh,
      in_specs=(P(), specs, P('data')),
      out_specs=(P(), specs, P()),
    )(params, state, batch)

  replicated = NamedSharding(mesh, P())
  params = jax.tree.map(
    lambda x: helpers.put(x, replicated), helpers.init_params()
  )
  state = tokacc.init_sharded(tx, params, mesh, axis_name='data')
  data = NamedSharding(mesh, P('data'))
  return jax.jit(step, static_argnames='close'), params, state, data


def data_mesh(axis_type=jax.sharding.AxisType.Auto):
  return jax.make_mesh(
    (NUM_DEVICES,), ('data',), (axis_type,), devices=jax.devices()[:4]
  )


def explicit_ddp_run(mesh):
  specs = placements.EXPLICIT_LAYOUTS['ddp'].specs
  tx = tokacc.token_weighted_multistep(momentum_sgd(), 2)
  loss_sum = placements.explicit_loss('unreduced')
  step = user_step(
    tx,
    lambda p, b: loss_sum(placements.forward_params(p), b),
    placements.unreduced_count,
  )
  params = placements.place_params(helpers.init_params(), mesh, specs)
  data = NamedSharding(mesh, P('data'))
  return jax.jit(step, static_argnames='close'), params, tx.init(params), data


def zero1_run(mesh):
  tx = tokacc.token_weighted_multistep(momentum_sgd(), 2)

  step = user_step(tx, placements.zero1_loss_sum, placements.unreduced_count)
  params, _ = placements.zero1_placed(mesh)
  state = placements.zero1_init(tx, params, mesh)
  data = NamedSharding(mesh, P('data'))
  return jax.jit(step, static_argnames='close'), params, state, data


def window_for(make_run):
  """Two micro-batches for the model of ``make_run``: unequal token
  counts per device, some devices without any."""
  if make_run is zero1_run:
    return helpers.zero1_windows()[0][:2]
  return helpers.make_windows((2,), NUM_DEVICES, seed=3)[0]


DATA_PARALLEL = {
  # placement: (mesh, make_run, whether the step runs under jax.set_mesh)
  'shard_map': (lambda: data_mesh(), shard_map_run, False),
  'explicit_ddp': (placements.explicit_ddp_mesh, explicit_ddp_run, True),
  'zero1': (placements.explicit_ddp_mesh, zero1_run, True),
}


@contextlib.contextmanager
def placed(make_mesh, make_run, with_mesh):
  """``(step, params, state, data, fetch)`` of ``make_run`` on
  ``make_mesh()``, set with ``jax.set_mesh`` where ``with_mesh`` (explicit
  sharding: skipped before jax 0.10); ``fetch`` gives host copies."""
  if with_mesh and not _typed_sharding.SUPPORTED:
    pytest.skip('reduced/unreduced types need jax >= 0.10')
  mesh = make_mesh()
  fetch = placements.plain if with_mesh else jax.device_get
  with jax.set_mesh(mesh) if with_mesh else contextlib.nullcontext():
    yield make_run(mesh) + (fetch,)


@pytest.mark.parametrize(
  'placement',
  [
    pytest.param(p, marks=pytest.mark.slow if p == 'shard_map' else ())
    for p in sorted(DATA_PARALLEL)
  ],
)
def test_data_parallel_host_closed_equals_device_decided(placement):
  """The issue's data-parallel case: ``sgd(1.0, momentum=0.9)``, k = 2,
  one window, unequal token counts per device (some devices count none)."""
  make_run = DATA_PARALLEL[placement][1]
  with placed(*DATA_PARALLEL[placement]) as (step, params, state, data, fetch):
    window = [jax.device_put(b, data) for b in window_for(make_run)]
    host, device = host_and_device(step, params, state, window)
    host, device = ((fetch(p), s, fetch(u)) for p, s, u in (host, device))
    assert_same_window(host, device, fetch(params))


# The three rules of ``close`` (getting_started, "Windows closed by the
# host").


def all_negative_zeros(tree):
  leaves = [np.asarray(u) for u in jax.tree.leaves(tree)]
  return all(not np.any(u) and np.all(np.signbit(u)) for u in leaves)


def all_positive_zeros(tree):
  leaves = [np.asarray(u) for u in jax.tree.leaves(tree)]
  return all(not np.any(u) and not np.any(np.signbit(u)) for u in leaves)


ZERO_SIGNS = {
  # placement: (mesh, make_run, the step runs under jax.set_mesh, sign)
  'shard_map, auto axes': (lambda: data_mesh(), shard_map_run, False, '-'),
  'shard_map, explicit axes': (
    lambda: data_mesh(jax.sharding.AxisType.Explicit),
    shard_map_run,
    True,
    '-',
  ),
  'explicit ddp': (placements.explicit_ddp_mesh, explicit_ddp_run, True, '+'),
  'zero1': (placements.explicit_ddp_mesh, zero1_run, True, '+'),
}


@pytest.mark.parametrize('placement', sorted(ZERO_SIGNS))
def test_sign_of_the_zero_updates_of_close_false(placement):
  """``close=False`` returns -0.0 (as the device's micro-steps), except
  where ``jax.jit`` runs on a mesh with Explicit axes outside
  ``shard_map``: +0.0 (``_closing._zeros``). Inside ``shard_map`` the axes
  are Manual, whatever ``jax.make_mesh`` made them: -0.0. The parameters
  keep their bits in both cases."""
  make_mesh, make_run, with_mesh, sign = ZERO_SIGNS[placement]
  with placed(make_mesh, make_run, with_mesh) as run:
    step, params, state, data, fetch = run
    batch = jax.device_put(window_for(make_run)[0], data)
    new_params, _, updates = step(params, state, batch, False)
    updates, new_params, params = map(fetch, (updates, new_params, params))
  signed = all_negative_zeros if sign == '-' else all_positive_zeros
  assert signed(updates), updates
  helpers.assert_same_bits(new_params, params, 'parameters')


def test_sign_of_the_zero_updates_on_one_device():
  tx = tokacc.token_weighted_multistep(momentum_sgd(), 2)
  step = jax.jit(
    user_step(tx, helpers.loss_sum, helpers.token_count),
    static_argnames='close',
  )
  params = jax.tree.map(jnp.asarray, helpers.init_params())
  batch = helpers.make_windows((1,), NUM_DEVICES)[0][0]
  new_params, _, updates = step(params, tx.init(params), batch, False)
  assert all_negative_zeros(updates)
  helpers.assert_same_bits(new_params, params, 'parameters')


PARAMS = {'w': jnp.ones((2, 3)), 'b': jnp.zeros(3)}
GRADS = {'w': jnp.full((2, 3), 0.5), 'b': jnp.ones(3)}


@pytest.mark.parametrize('emit_now', [False, np.False_], ids=repr)
@pytest.mark.parametrize('close', [False, True])
def test_a_static_false_emit_now_with_close_is_not_passing_it(close, emit_now):
  """``emit_now=False`` is the default: passed with a Python ``close``, it
  is the same call as without it (a wrapper that forwards its own
  ``emit_now=False`` works). ``emit_now=True`` or any array is refused
  (``test_host_close.test_close_with_emit_now_is_refused``)."""
  tx = tokacc.token_weighted_multistep(momentum_sgd(), 2)
  state = tx.init(PARAMS)
  expected = tx.update(GRADS, state, PARAMS, num_tokens=3, close=close)
  actual = tx.update(
    GRADS, state, PARAMS, num_tokens=3, close=close, emit_now=emit_now
  )
  helpers.assert_same_bits(
    actual, expected, f'close={close}, emit_now={emit_now!r}'
  )


# (closes of the calls, the call that closes the window): k = 3.
COUNTED = {
  'two host calls, then the device': ((False, False, None), 2),
  'one host call, then the device': ((False, None, None), 2),
  'the host past k, then the device': ((False,) * 4 + (None,), 4),
}


@pytest.mark.parametrize(
  'name',
  [
    pytest.param(
      name,
      marks=pytest.mark.slow
      if name == 'two host calls, then the device'
      else (),
    )
    for name in sorted(COUNTED)
  ],
)
def test_close_none_counts_the_host_calls_of_its_window(name):
  """``close=False`` calls count toward k (``mini_step``): the first
  ``close=None`` call at which the window holds k micro-batches, these
  calls included, closes it, at once where the host went past k. The
  window then holds every call's micro-batch: the same update and loss as
  the host closing it there."""
  closes, closing = COUNTED[name]
  tx = tokacc.token_weighted_multistep(momentum_sgd(), 3)
  step = jax.jit(
    user_step(tx, helpers.loss_sum, helpers.token_count),
    static_argnames='close',
  )
  params = jax.tree.map(jnp.asarray, helpers.init_params())
  window = helpers.make_windows((len(closes),), NUM_DEVICES, seed=5)[0]
  host_closes = [m == closing for m in range(len(closes))]
  runs = []
  for decisions in (closes, host_closes):
    p, s, trace = params, tx.init(params), []
    for batch, close in zip(window, decisions):
      p, s, u = step(p, s, batch, close)
      trace.append((bool(tokacc.has_updated(s)), int(s.mini_step), u, s))
    runs.append(trace)
  mixed, host = runs
  assert [t[0] for t in mixed] == host_closes
  expected_mini_steps = [m + 1 for m in range(closing)] + [0]
  assert [t[1] for t in mixed][: closing + 1] == expected_mini_steps
  tokens = sum(int(np.sum(b['mask'])) for b in window[: closing + 1])
  assert int(mixed[closing][3].last_tokens) == tokens
  helpers.assert_same_bits(mixed[closing][2], host[closing][2], 'updates')
  helpers.assert_same_bits(
    mixed[closing][3].last_loss, host[closing][3].last_loss, 'loss'
  )


@pytest.mark.parametrize(
  'placement',
  [
    pytest.param(p, marks=pytest.mark.slow if p == 'shard_map' else ())
    for p in sorted(DATA_PARALLEL)
  ],
)
def test_the_mean_is_one_reciprocal_in_both_programs(placement):
  """In the compiled programs of ``close=True`` and of ``close=None``, the
  only divisions are of scalars (the reciprocal of the window's count, the
  window's loss by its count): the gradients are multiplied by the
  reciprocal in both, never divided in one of them."""
  make_run = DATA_PARALLEL[placement][1]
  with placed(*DATA_PARALLEL[placement]) as (step, params, state, data, _):
    batch = jax.device_put(window_for(make_run)[0], data)
    for close in (True, None):
      text = step.lower(params, state, batch, close).compile().as_text()
      divisions = [
        i.shapes for i in hlo.instructions_of(hlo.parse_hlo(text), 'divide')
      ]
      assert divisions, close  # the reader finds them
      assert all(dims == () for s in divisions for _, dims in s), divisions
