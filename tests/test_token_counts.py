"""Token counts summed over 8 devices, whose parts carry (issue 45, item 5).

An integer count crosses the devices' ``psum`` in float32 as three 11-bit
parts (``_tokens.to_parts``), and the summed parts are put back together
with carries from the low part to the middle one and from the middle one to
the high one (``_tokens.from_parts``). No other test sums counts whose parts
carry: dropping the middle-to-high carry survived the suite, and a window of
4,194,304 tokens (524,288 per device) counted 0 with it. Here real windows
run over 8 devices (``shard_map`` and ``pmap`` with ``axis_name``, and
explicit sharding, whose count is typed unreduced over the data axis: the
placements that sum ``to_parts`` over devices; GSPMD's count is one global
scalar and is never split; and both over HSDP's two axes, issue 53) with
per-device counts that carry out of the low part, out of the middle one,
and out of both, and check:

- the window's counted tokens (``window_metrics(state).tokens``) against the
  exact total of plain Python ints, and the SGD(1) update and the gradient's
  norm against the token-weighted mean of the gradients (float64);
- a total beyond int32 over devices (every device's count valid alone): the
  window is dropped, emits nothing and never wraps; the next is exact; a
  total of exactly 2**31 - 1 is valid;
- ``tokens_per_update`` counted over devices with carries: the window closes
  on the micro-step its total reaches the budget, not one earlier or later,
  and a total beyond int32 reaches any budget (the window closes at once,
  and is dropped);
- ``token_dtype=jnp.float32`` over devices: fractional weights and large
  whole ones summed exactly; a total above the range a window is divided
  by (2**126), finite or overflowing to inf over the devices though every
  device's count is in it, drops the window (issue 53).

The counts are given as ``num_tokens`` directly, with small integer
gradients (as in ``test_boundaries.py``): a count need not be the size of a
real batch for the arithmetic of counting it, and the float32 sums of the
gradients are exact, so an update differs from its float64 reference only
by the rounding of the division (``helpers.DIVISION_RTOL``).
"""

import functools
from typing import Any, Callable, NamedTuple

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

NUM_DEVICES = 8
PARAMS = {'w': np.zeros(2, np.float32)}
INT32_MAX = 2**31 - 1
PART = 2**11  # what the low part's sum must reach to carry into the middle


def grads_of(device, step):
  """The token-summed gradient of ``device`` at micro-step ``step``: small
  integers (their float32 sums are exact)."""
  return np.array([device + step + 1.0, 2.0 * device - step - 3.0], np.float32)


def step_grads(step):
  return np.stack([grads_of(d, step) for d in range(NUM_DEVICES)])


# The placements that sum a count over devices through ``to_parts``: each
# builds ``make_tx(axis_name)`` and returns a Feed.


class Feed(NamedTuple):
  """A transform on 8 devices: its initial state, and ``step(state, grads,
  counts)`` feeding device ``d`` the gradient ``grads[d]`` and the count
  ``counts[d]`` (jitted), to ``(updates, state)``; ``mesh`` is set around
  every call (explicit types)."""

  state: Any
  step: Callable
  mesh: Any = None


# HSDP's mesh: 2 replicas of 4 devices; a count is summed over both axes
# (the parameters' layout does not enter the count).
HSDP = {'names': placements.HSDP_AXES, 'shape': (2, NUM_DEVICES // 2)}


def shard_map_feed(make_tx, names=('data',), shape=None):
  """``shard_map`` over every axis of a mesh of ``names`` (``axis_name``
  all of them)."""
  axes = names if len(names) > 1 else names[0]
  tx = make_tx(axes)
  mesh = placements.data_mesh(NUM_DEVICES, names, shape)
  params = jax.tree.map(
    lambda x: helpers.put(x, NamedSharding(mesh, P())), PARAMS
  )
  state = tokacc.init_sharded(tx, params, mesh, axis_name=axes)
  specs = tokacc.state_partition_specs(tx, PARAMS, axis_name=axes)

  def local(state, grads, counts):
    return tx.update({'w': grads[0]}, state, params, num_tokens=counts[0])

  step = jax.jit(
    jax.shard_map(
      local,
      mesh=mesh,
      in_specs=(specs, P(names), P(names)),
      out_specs=(P(), specs),
    )
  )
  data = NamedSharding(mesh, P(names))
  return Feed(
    state,
    lambda state, grads, counts: step(
      state, helpers.put(grads, data), helpers.put(counts, data)
    ),
  )


def pmap_feed(make_tx):
  tx = make_tx('data')
  devices = jax.devices()[:NUM_DEVICES]
  params = jax.tree.map(lambda x: placements.replicate(x, NUM_DEVICES), PARAMS)
  state = jax.pmap(tx.init, devices=devices)(params)
  step = jax.pmap(
    lambda state, params, grads, count: tx.update(
      {'w': grads}, state, params, num_tokens=count
    ),
    axis_name='data',
    devices=devices,
  )
  return Feed(
    state, lambda state, grads, counts: step(state, params, grads, counts)
  )


def explicit_feed(make_tx, names=('data',), shape=None):
  """Explicit DDP under plain ``jax.jit`` over every axis of a mesh of
  ``names``: the parameters typed reduced over them, each device's gradient
  and count summed by an ``einsum`` into partial sums typed unreduced (no
  collective: each device holds its own)."""
  tx = make_tx(None)
  mesh = placements.data_mesh(
    NUM_DEVICES, names, shape, axis_type=placements.EXPLICIT_AXES
  )
  unreduced = set(names)
  with jax.set_mesh(mesh):
    params = placements.place_params(PARAMS, mesh, {'w': P(reduced=unreduced)})
    state = tx.init(params)
  data = NamedSharding(mesh, P(names))

  @jax.jit
  def step(state, grads, counts):
    partial = jnp.einsum(
      'dk->k', grads, out_sharding=P(None, unreduced=unreduced)
    )
    count = jnp.einsum('d->', counts, out_sharding=P(unreduced=unreduced))
    return tx.update({'w': partial}, state, params, num_tokens=count)

  return Feed(
    state,
    lambda state, grads, counts: step(
      state, jax.device_put(grads, data), jax.device_put(counts, data)
    ),
    mesh,
  )


FEEDS = {
  'shard_map': shard_map_feed,
  'pmap': pmap_feed,
  'explicit_ddp': explicit_feed,
  # issue 53: the count's parts summed over two axes (Manual, PartialSums)
  'hsdp_shard_map': functools.partial(shard_map_feed, **HSDP),
  'hsdp_explicit': functools.partial(explicit_feed, **HSDP),
}
TYPED_FEEDS = ('explicit_ddp', 'hsdp_explicit')  # jax >= 0.10


class Seen(NamedTuple):
  """Host copies after a micro-step, the same on every device."""

  updates: np.ndarray
  emitted: bool
  gradient_step: int
  dropped_windows: int
  tokens: Any  # window_metrics(state).tokens: int, or float
  grad_norm: float


def same_everywhere(x, placement):
  """``x``'s one value: pmap holds a copy per device, all equal."""
  x = np.asarray(x)
  if placement == 'pmap':
    np.testing.assert_array_equal(x, np.broadcast_to(x[0], x.shape))
    return x[0]
  return x


def feed(placement, make_tx, counts_per_step, count_dtype=np.int32):
  """Feeds micro-step ``s`` (``step_grads(s)``, ``counts_per_step[s]``, one
  count per device) to ``make_tx`` on ``placement``; what each micro-step
  left (:class:`Seen`)."""
  if placement in TYPED_FEEDS and not placements.supported('explicit_ddp'):
    pytest.skip(placements.NEEDS_TYPED_SHARDING)
  run = FEEDS[placement](make_tx)
  # arrays typed reduced (explicit) are read under their mesh
  fetch = helpers.fetch if run.mesh is None else placements.plain
  state, history = run.state, []
  with placements.mesh_context(run.mesh):
    for s, counts in enumerate(counts_per_step):
      assert len(counts) == NUM_DEVICES
      counts = np.asarray(counts, count_dtype)
      updates, state = run.step(state, step_grads(s), counts)
      metrics = tokacc.window_metrics(state)
      host = jax.tree.map(
        lambda x: same_everywhere(x, placement),
        fetch(
          (
            updates['w'],
            tokacc.has_updated(state),
            state.gradient_step,
            state.dropped_windows,
            metrics.tokens,
            metrics.grad_norm,
          )
        ),
      )
      history.append(
        Seen(
          host[0],
          bool(host[1]),
          int(host[2]),
          int(host[3]),
          host[4].item(),
          float(host[5]),
        )
      )
  return history


def sgd_tx(k, **options):
  return lambda axis_name: tokacc.token_weighted_multistep(
    optax.sgd(1.0), k, axis_name=axis_name, **options
  )


def mean_gradient(counts_per_step, start, stop):
  """Reference: the token-weighted mean gradient of micro-steps ``[start,
  stop)`` over every device, in float64, and its count (a Python int, or
  float)."""
  total = sum(sum(c) for c in counts_per_step[start:stop])
  grads = sum(
    step_grads(s).astype(np.float64).sum(axis=0) for s in range(start, stop)
  )
  return grads / total, total


def assert_window(seen, counts_per_step, start, stop):
  """``seen`` is SGD(1) on the window of micro-steps ``[start, stop)``."""
  mean, total = mean_gradient(counts_per_step, start, stop)
  assert seen.emitted
  assert seen.tokens == total
  np.testing.assert_allclose(seen.updates, -mean, rtol=helpers.DIVISION_RTOL)
  # The norm of the float32 sums over the count: the squares, their sum
  # and the root add a few roundings to the division's: 4x its bound.
  np.testing.assert_allclose(
    seen.grad_norm, np.linalg.norm(mean), rtol=helpers.DIVISION_RTOL * 4
  )


def low_parts(counts):
  return [c % PART for c in counts]


def mid_parts(counts):
  return [(c // PART) % PART for c in counts]


# Carries out of each part. Two micro-steps per window (k = 2): each
# device's count is its sum over both, which the cases split unevenly.

ALL_CARRY = 2**22 - 1  # low and middle parts at 2047 (the most they hold)
CARRY_CASES = {
  # 2047 + 1500 + ... in the low parts: over 2**11, a carry into the middle.
  'low_to_mid': [
    [2047, 1500, 0, 1, 2047, 1999, 700, 1024],
    [0, 0, 2047, 0, 0, 48, 1, 1023],
  ],
  # The window: 524288 = 2**19 per device (middle part 256), 2**22
  # in all; middle parts 2048 over the devices: a carry into the high part.
  'mid_to_high': [[2**18] * NUM_DEVICES, [2**18] * NUM_DEVICES],
  # Both carries, and the middle's sum carries the low's carry out again.
  'every_part': [
    [ALL_CARRY - 5, 2**21, 0, 3, 2**21, 2**21 - 1, 1, ALL_CARRY],
    [5, 2**21 - 1, ALL_CARRY, ALL_CARRY - 3, 2**21 - 1, 2**21, ALL_CARRY - 1, 0],
  ],
}  # fmt: skip


def window_counts(counts_per_step):
  """Each device's count over the whole window."""
  return [sum(column) for column in zip(*counts_per_step)]


def test_carry_cases_carry():
  """The cases are as their names say (plain arithmetic on the counts)."""
  for name, counts_per_step in CARRY_CASES.items():
    counts = window_counts(counts_per_step)
    low_carries = sum(low_parts(counts)) >= PART
    mid_carries = (
      sum(mid_parts(counts)) + sum(low_parts(counts)) // PART >= PART
    )
    assert low_carries == (name != 'mid_to_high'), name
    assert mid_carries == (name != 'low_to_mid'), name
    assert sum(counts) <= INT32_MAX, name
  assert sum(window_counts(CARRY_CASES['mid_to_high'])) == 4_194_304


@pytest.mark.parametrize('placement', list(FEEDS))
@pytest.mark.parametrize('case', list(CARRY_CASES))
def test_counts_carry_over_devices(case, placement):
  """A window's tokens over 8 devices, whose parts carry: counted exactly,
  and the update is the token-weighted mean gradient."""
  counts_per_step = CARRY_CASES[case]
  first, second = feed(placement, sgd_tx(2), counts_per_step)
  assert not first.emitted
  assert second.gradient_step == 1 and second.dropped_windows == 0
  assert_window(second, counts_per_step, 0, 2)


# Beyond int32 over devices: every device's count valid alone.


@pytest.mark.parametrize('placement', list(FEEDS))
def test_total_beyond_int32_over_devices_drops_the_window(placement):
  """2**28 tokens on each of 8 devices: 2**31 in all, one beyond int32.
  The window is dropped on every device: zero updates, no step, no
  metrics of its own (it never wraps to a negative or small count); the
  next window, of exactly 2**31 - 1 tokens, is valid and exact."""
  beyond = [2**28] * NUM_DEVICES
  exactly_max = [2**28] * (NUM_DEVICES - 1) + [2**28 - 1]
  assert sum(beyond) == INT32_MAX + 1 and sum(exactly_max) == INT32_MAX
  counts_per_step = [[1] * NUM_DEVICES, beyond, exactly_max]
  first, dropped, last = feed(placement, sgd_tx(1), counts_per_step)
  assert_window(first, counts_per_step, 0, 1)
  assert not dropped.emitted
  assert dropped.dropped_windows == 1 and dropped.gradient_step == 1
  assert not np.any(dropped.updates)
  assert dropped.tokens == NUM_DEVICES  # the last emitted window's
  assert last.gradient_step == 2 and last.dropped_windows == 1
  assert_window(last, counts_per_step, 2, 3)


# tokens_per_update: the budget counts every device's tokens, with carries.

QUARTER = [2**18] * NUM_DEVICES  # 2**21 in all: middle parts 1024, no carry
SPLIT = [2047] * 4 + [1000] * 4  # 12188 in all
BUDGET_CASES = {
  # (budget, counts per micro-step, the micro-step that closes)
  # 2**21, 2**22 (exactly the budget, the middle parts carrying), then 8.
  'exactly': (2**22, [QUARTER, QUARTER, [1] * NUM_DEVICES], 2),
  # One token short at micro-step 2, over the budget at 3.
  'one_less': (2**22 + 1, [QUARTER, QUARTER, [1] * NUM_DEVICES], 3),
  # Exactly 2**14 at micro-step 2, devices at 2047 and 2049: low parts
  # 4 * 2047 + 4 * 1 = 8192, carrying into the middle ones.
  'low_carry': (2**14, [SPLIT, [0] * 4 + [1049] * 4, [1] * NUM_DEVICES], 2),
}
BUDGET_K = 8


@pytest.mark.parametrize('placement', list(FEEDS))
@pytest.mark.parametrize('case', list(BUDGET_CASES))
def test_budget_counts_carries_over_devices(case, placement):
  """The window closes on the micro-step at which its tokens over all
  devices reach ``tokens_per_update`` (their parts carrying), not one
  earlier or later, and is SGD(1) on its micro-steps."""
  budget, counts_per_step, close = BUDGET_CASES[case]
  totals = [sum(c) for c in counts_per_step]
  expected = helpers.closing_steps(totals, lambda _: BUDGET_K, budget)
  assert expected == [close]
  history = feed(
    placement, sgd_tx(BUDGET_K, tokens_per_update=budget), counts_per_step
  )
  assert [s for s, seen in enumerate(history, 1) if seen.emitted] == expected
  assert_window(history[expected[0] - 1], counts_per_step, 0, expected[0])


@pytest.mark.parametrize('placement', list(FEEDS))
def test_budget_beyond_int32_over_devices_closes_and_drops(placement):
  """Tokens beyond int32 over devices reach any budget: the window closes
  on that micro-step (before ``k``) and is dropped; the next window counts
  afresh and closes on its budget."""
  budget = 2**30
  counts_per_step = [
    [2**26] * NUM_DEVICES,  # 2**29: under the budget
    [2**28 - 2**26] * NUM_DEVICES,  # 2**31 in all: beyond int32
    [2**27] * NUM_DEVICES,  # 2**30: exactly the budget, a window afresh
  ]
  window_totals = [sum(counts_per_step[0]) + sum(counts_per_step[1])]
  assert window_totals == [INT32_MAX + 1]
  assert sum(counts_per_step[0]) < budget
  history = feed(
    placement, sgd_tx(BUDGET_K, tokens_per_update=budget), counts_per_step
  )
  first, dropped, last = history
  assert not first.emitted and first.dropped_windows == 0
  assert not dropped.emitted
  assert dropped.dropped_windows == 1 and dropped.gradient_step == 0
  assert not np.any(dropped.updates)
  assert last.gradient_step == 1 and last.dropped_windows == 1
  assert_window(last, counts_per_step, 2, 3)


# token_dtype=jnp.float32 over devices: counts carried as they are.

FLOAT_COUNTS = [
  [0.5, 1.25, 0.0, 3.75, 2.5, 0.25, 7.0, 1.75],
  [2.0**20, 0.5, 2.0**21, 0.25, 1.0, 2.0**19, 0.0, 3.0],
]


@pytest.mark.parametrize('placement', list(FEEDS))
def test_float_token_dtype_over_devices(placement):
  """Fractional weights and large whole ones, summed over 8 devices in
  float32: every sum is exact (multiples of 1/4 below 2**22, within
  float32's 24 bits, in any order), so the window holds the exact total,
  and the update is the weighted mean."""
  counts_per_step = FLOAT_COUNTS
  total = sum(sum(c) for c in counts_per_step)
  assert total < 2**22
  assert all(c * 4 == int(c * 4) for step in counts_per_step for c in step)
  first, second = feed(
    placement,
    sgd_tx(2, token_dtype=jnp.float32),
    counts_per_step,
    count_dtype=np.float32,
  )
  assert not first.emitted
  assert isinstance(second.tokens, float)
  assert_window(second, counts_per_step, 0, 2)


@pytest.mark.parametrize('placement', list(FEEDS))
def test_float_total_above_the_range_over_devices_drops_the_window(placement):
  """Every device's weight is in the range of float32 (2**-126 to 2**126),
  their sum is not: 2**127 (finite), then 2**129 (inf in float32). Each
  window is dropped and counted on every device; the next is exact."""
  above = [2.0**125] * (NUM_DEVICES // 2) + [0.0] * (NUM_DEVICES // 2)
  overflows = [2.0**126] * NUM_DEVICES
  assert sum(above) == 2.0**127 and sum(overflows) == 2.0**129
  counts_per_step = [above, overflows, FLOAT_COUNTS[0]]
  first, second, last = feed(
    placement,
    sgd_tx(1, token_dtype=jnp.float32),
    counts_per_step,
    count_dtype=np.float32,
  )
  for seen, dropped in ((first, 1), (second, 2)):
    assert not seen.emitted and not np.any(seen.updates)
    assert seen.dropped_windows == dropped and seen.gradient_step == 0
  assert last.gradient_step == 1 and last.dropped_windows == 2
  assert_window(last, counts_per_step, 2, 3)
