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
"""Fractional token weights against a plainly written weighted mean (issue 53).

Under a floating ``token_dtype`` each token of ``helpers``' model carries a
weight (``batch['mask']`` holds the weights: the loss of a micro-batch is
its weighted sum, ``num_tokens`` the sum of its weights). Windows of
weights drawn by a seeded generator from several ranges (below 1, tiny,
mixed magnitudes over 24 or 200 decades, exact zeros on some tokens and on
a whole device), then windows that must not step (all weights 0; a
negative, NaN or infinite weight; a total above the range a window is
divided by), and a clean one, run:

- on one device, and on 4 devices under ``shard_map``, explicit DDP,
  explicit HSDP, ``shard_map`` HSDP over both axes, and ZeRO-1 (the
  builders of ``placements``);
- in float32, and in float64 under ``jax.enable_x64`` (parameters, data and
  weights in float64);
- closed by the device (``close=None``: the schedule) and by the host
  (``close=True`` / ``False``; not ``shard_map`` HSDP, whose step takes
  none); and by budgets of ``tokens_per_update`` in the weights' units.

Each window that steps is checked against the reference written here:
``sum_t w_t g_t / sum_t w_t`` in float64 numpy, ``g_t`` each token's
gradient at the parameters the run had before the window (``jax.jacrev``
of ``helpers.token_losses`` in float64, nothing of the library). The
update of SGD is ``-LEARNING_RATE`` times it; the window's tokens, loss
and norms (``window_metrics``) are the reference's too. A window of total
0 does not step and is not counted; a window with a bad weight or a
total outside the range does not step and is counted in
``dropped_windows``; no window moves the parameters but one that steps.
The bounds are derived in :func:`window_bounds`. ``placements``' steps
count a micro-batch with ``helpers.token_count`` (int32, of a 0/1 mask):
here it is the sum of the micro-batch's weights (:func:`weight_counts`).
"""

import functools
from typing import Any, NamedTuple

import helpers
import jax
import jax.numpy as jnp
import numpy as np
import optax
import placements
import pytest

import optax_tokacc as tokacc

NUM_DEVICES = 4
K = 2  # micro-steps per window, where the schedule or the host closes
LEARNING_RATE = 0.5
SHAPE = (NUM_DEVICES * helpers.SEQS, helpers.SEQ_LEN)  # a micro-batch's
DTYPES = ('float32', 'float64')


@pytest.fixture(autouse=True)
def weight_counts(monkeypatch):
  """``num_tokens`` of ``placements``' steps: the sum of the micro-batch's
  weights in their dtype (``helpers.token_count`` makes an int32 count of
  a 0/1 mask, which would truncate them)."""
  monkeypatch.setattr(helpers, 'token_count', lambda b: jnp.sum(b['mask']))


# The weights: a window's kind, drawn per micro-batch by a seeded generator.


# The magnitudes of the ranges: float64 reaches far beyond float32.
TINY = {'float32': 1e-30, 'float64': 1e-200}
DECADES = {'float32': 12, 'float64': 100}  # mixed: 10**-d to 10**d


def weights_of(kind, rng, dtype):
  """The weights of one global micro-batch (``SHAPE``) of ``kind``."""
  below_one = rng.uniform(0.05, 1.0, SHAPE)
  if kind == 'below_one':
    return below_one
  if kind == 'tiny':
    return TINY[dtype] * rng.uniform(0.5, 2.0, SHAPE)
  if kind == 'mixed':
    return 10.0 ** rng.uniform(-DECADES[dtype], DECADES[dtype], SHAPE)
  if kind == 'zeros':  # zero tokens, and device 1 of no weight at all
    weights = below_one * (rng.random(SHAPE) < 0.5)
    weights[helpers.SEQS : 2 * helpers.SEQS] = 0.0
    return weights
  if kind == 'all_zero':
    return np.zeros(SHAPE)
  if kind in BAD:  # one token of device 2
    weights = below_one.copy()
    weights[2 * helpers.SEQS, 1] = BAD[kind]
    return weights
  assert kind == 'above_range'
  # A total of 1.5 times the range's end over the window: each device's
  # micro-batch finite, its window too (a quarter of the total).
  return np.full(SHAPE, 1.5 * range_end(dtype) / (K * np.prod(SHAPE)))


def range_end(dtype):
  """The largest total a window is divided by (docs/reliability.md): the
  reciprocal of the smallest normal number, 2**126 in float32."""
  return 1 / float(np.finfo(dtype).tiny)


# A bad weight of one token: the library sees each device's sum of weights
# (num_tokens), so -1000 is below the sum of the others (32 weights below
# 1): on any number of devices the count that holds it is negative.
BAD = {'negative': -1000.0, 'nan': np.nan, 'inf': np.inf}
KINDS = (
  'below_one',
  'tiny',
  'mixed',
  'zeros',
  'all_zero',
  *BAD,
  'above_range',
  'below_one',
)


def make_windows(kinds, dtype, seed, sizes=None):
  """Windows of global micro-batches of ``helpers``' model whose weights
  are of ``kinds`` (``sizes``: micro-batches per window, ``K`` each by
  default)."""
  rng = np.random.default_rng(seed)
  windows = []
  for kind, size in zip(kinds, sizes or [K] * len(kinds)):
    window = []
    for _ in range(size):
      window.append(
        {
          'x': rng.normal(size=SHAPE + (helpers.FEATURES,)),
          'y': rng.normal(size=SHAPE),
          'mask': weights_of(kind, rng, dtype),
        }
      )
    windows.append([jax.tree.map(lambda x: x.astype(dtype), b) for b in window])
  return windows


# The reference, written plainly: a weighted mean of each token's gradient.


@functools.cache
def token_gradients():
  """Each token's gradient of its squared error: ``[sequences, SEQ_LEN,
  *parameter shape]`` per parameter."""
  return jax.jit(jax.jacrev(helpers.token_losses))


class Expected(NamedTuple):
  """What a window must give: ``'step'`` (with its weighted mean gradient
  and loss), ``'empty'`` (total 0: no step, not counted) or
  ``'dropped'``."""

  outcome: str
  total: float = 0.0
  mean: Any = None  # sum_t w_t g_t / sum_t w_t, per parameter (float64)
  abs_mean: Any = None  # sum_t w_t |g_t| / sum_t w_t: the terms' size
  loss: float = 0.0  # sum_t w_t l_t / sum_t w_t
  tokens: int = 0  # the tokens of nonzero weight


def expected_window(window, params, dtype):
  """The reference for ``window`` at the host parameters ``params``."""
  weights = np.concatenate([np.asarray(b['mask'], np.float64) for b in window])
  total = float(np.sum(weights))
  if not np.all(np.isfinite(weights) & (weights >= 0)):
    return Expected('dropped')
  if total > range_end(dtype):
    return Expected('dropped')
  if total == 0:
    return Expected('empty')
  batch = jax.tree.map(
    lambda x: np.asarray(x, np.float64), helpers.concat(window)
  )
  params = jax.tree.map(lambda x: np.asarray(x, np.float64), params)
  with jax.enable_x64(True):
    gradients = token_gradients()(params, batch)
    losses = np.asarray(helpers.token_losses(params, batch))
  grads = {k: np.asarray(g) for k, g in gradients.items()}
  return Expected(
    'step',
    total,
    {k: np.tensordot(weights, g, axes=2) / total for k, g in grads.items()},
    {
      k: np.tensordot(weights, np.abs(g), axes=2) / total
      for k, g in grads.items()
    },
    float(np.sum(weights * losses) / total),
    int(np.count_nonzero(weights)),
  )


class Bounds(NamedTuple):
  """How far a run's window may be from :class:`Expected`."""

  update: float  # each parameter's change, absolute
  grad_norm: float  # absolute
  loss_rtol: float
  tokens_rtol: float


def window_bounds(expected, params, dtype):
  """The bounds of a window that steps, in ``dtype``'s unit round-off u.

  The run sums the window's ``n`` weighted terms ``w_t g_t``, each computed
  through ``m = helpers.TERM_ROUNDINGS`` roundings, in some order over
  micro-steps and devices: within ``(n + m) u`` of the exact sum relative
  to the sum of the terms' sizes ``sum_t w_t |g_t|`` (Higham, 2002,
  sections 3.1 and 4.2), doubled, as ``helpers.round_off_atol`` takes it,
  for terms whose own roundings are relative to their factors rather than
  to themselves. The total of positive weights is within ``n u`` of
  exact, relative; its reciprocal and the product round once each: the
  mean is within ``2 (n + m) u + (n + 2) u <= 3 (n + m) u`` times
  ``abs_mean`` (elementwise, ``sum_t w_t |g_t| / sum_t w_t``) of the
  reference, and the update ``-LEARNING_RATE`` times it rounds once more
  (a fourth ``(n + m) u`` covers it). Adding the update to a parameter
  rounds by at most ``u |p|``, here twice for the difference of the
  parameters read back. The gradient's norm over ``P`` parameters moves by
  at most ``sqrt(P)`` times the mean's bound, and its float32 sum of
  squares rounds within ``(P + 2) 2**-24`` of it, relative. The loss is a
  sum of positive terms: ``2 (n + m + 2) u``, relative. The tokens: ``(n +
  1) u``, relative.
  """
  u = float(jnp.finfo(dtype).eps) / 2
  roundings = expected.tokens + helpers.TERM_ROUNDINGS
  size = max(float(np.max(a)) for a in expected.abs_mean.values())
  largest = max(float(np.max(np.abs(p))) for p in jax.tree.leaves(params))
  count = sum(np.size(p) for p in jax.tree.leaves(params))
  mean_bound = 3 * roundings * u * size
  norm = np.sqrt(sum(np.sum(m**2) for m in expected.mean.values()))
  return Bounds(
    update=LEARNING_RATE * 4 * roundings * u * size + 2 * u * largest,
    grad_norm=np.sqrt(count) * mean_bound + (count + 2) * 2.0**-24 * norm,
    loss_rtol=2 * (roundings + 2) * u,
    tokens_rtol=(expected.tokens + 1) * u,
  )


# The runs: one device and 4 devices, built by placements' builders.


def explicit_mesh(names=('data',), shape=None):
  return placements.data_mesh(
    NUM_DEVICES, names, shape, axis_type=placements.EXPLICIT_AXES
  )


def layout_specs(layout):
  return placements.EXPLICIT_LAYOUTS[layout].specs


# name -> (axis_name of the transform, the Run of (tx, params))
RUNS = {
  'one_device': (
    None,
    lambda tx, p: placements.gspmd_run(tx, p, placements.data_mesh(1), 'data'),
  ),
  'shard_map': (
    'data',
    lambda tx, p: placements.shard_map_run(
      tx, p, placements.data_mesh(NUM_DEVICES), 'data'
    ),
  ),
  'explicit_ddp': (
    None,
    lambda tx, p: placements.jit_run(
      tx, p, explicit_mesh(), layout_specs('ddp'), 'data'
    ),
  ),
  'explicit_hsdp': (
    None,
    lambda tx, p: placements.jit_run(
      tx,
      p,
      explicit_mesh(placements.HSDP_AXES, (2, 2)),
      layout_specs('hsdp'),
      placements.HSDP_AXES,
    ),
  ),
  # the count summed over both axes by the manual placement
  'hsdp_manual': (
    placements.HSDP_AXES,
    lambda tx, p: placements.hsdp_run(
      tx,
      p,
      placements.hsdp_mesh(),
      placements.HSDP_SHARDED,
      placements.HSDP_AXES,
    ),
  ),
  'zero1': (
    None,
    lambda tx, p: placements.jit_run(
      tx,
      p,
      explicit_mesh(),
      layout_specs('ddp'),
      'data',
      placements.sharded_optimizer(('data',)),
    ),
  ),
}
TYPED = ('explicit_ddp', 'explicit_hsdp', 'zero1')
HOST_CLOSES = tuple(name for name in RUNS if name != 'hsdp_manual')


class Seen(NamedTuple):
  """Host copies after a micro-step."""

  params: Any
  gradient_step: int
  dropped_windows: int
  # window_metrics' (loss, tokens, grad_norm, update_norm, grad_norms)
  metrics: Any


def build(name, dtype, **options):
  """``RUNS[name]`` of SGD accumulating ``K`` micro-steps (``options`` go
  to the transform) from ``helpers.init_params`` in ``dtype``."""
  if name in TYPED and not placements.supported(name):
    pytest.skip(placements.NEEDS_TYPED_SHARDING)
  axis_name, make_run = RUNS[name]
  tx = tokacc.token_weighted_multistep(
    # a momentum of 0: the update is -LEARNING_RATE times the mean, and
    # the state parameter-shaped (ZeRO-1 shards it)
    optax.sgd(LEARNING_RATE, momentum=0.0),
    options.pop('every_k_schedule', K),
    axis_name=axis_name,
    token_dtype=dtype,
    **options,
  )
  return make_run(tx, helpers.init_params(dtype))


def recorder(run, seen, typed):
  """``on_step`` that appends a :class:`Seen` to ``seen`` (``typed``:
  the run's values are read as ``placements.plain`` reads them)."""
  read = placements.plain if typed else helpers.fetch

  def record(params, state):
    state = tokacc.find_state(state)
    m = tokacc.window_metrics(state)
    metrics = read((m.loss, m.tokens, m.grad_norm, m.update_norm))
    metrics += (read(m.grad_norms),)  # None: not asked for
    counters = read((state.gradient_step, state.dropped_windows))
    seen.append(Seen(run.host(params), *map(int, counters), metrics))

  return record


def train_host_closed(run, windows, on_step):
  """``run``'s step over ``windows``, the host closing each at its last
  micro-batch (``close=True``, ``close=False`` before)."""
  params, state = run.params, run.state
  with placements.mesh_context(run.mesh):
    for window in windows:
      for i, batch in enumerate(window):
        close = i == len(window) - 1
        params, state = run.step(
          params, state, run.place(batch), run.emit(False), close=close
        )
        on_step(params, state)


def run_windows(name, run, windows, host_closes):
  """Trains ``run`` (``RUNS[name]``) on ``windows``: what each micro-step
  left, the start first."""
  seen = [Seen(run.host(run.params), 0, 0, None)]
  record = recorder(run, seen, name in TYPED)
  if host_closes:
    train_host_closed(run, windows, record)
  else:
    placements.train_windows(run, windows, record)
  return seen


def assert_windows(seen, windows, dtype):
  """Every window, read where it closed, against :func:`expected_window`
  at the parameters the run had before it."""
  steps = dropped = 0
  stop = 0
  for window in windows:
    start, stop = stop, stop + len(window)
    before, after = seen[start], seen[stop]
    for mid in seen[start + 1 : stop]:  # open micro-steps: no update
      helpers.assert_same_bits(mid.params, before.params)
    expected = expected_window(window, before.params, dtype)
    steps += expected.outcome == 'step'
    dropped += expected.outcome == 'dropped'
    assert (after.gradient_step, after.dropped_windows) == (steps, dropped)
    if expected.outcome != 'step':
      helpers.assert_same_bits(after.params, before.params)
      continue
    assert_step(before, after, expected, dtype)


def assert_step(before, after, expected, dtype):
  """A window that stepped: its update, tokens, loss and norms."""
  bounds = window_bounds(expected, before.params, dtype)
  for name, mean in expected.mean.items():
    change = np.asarray(after.params[name], np.float64) - before.params[name]
    np.testing.assert_allclose(
      change, -LEARNING_RATE * mean, rtol=0, atol=bounds.update
    )
  loss, tokens, grad_norm, update_norm, grad_norms = after.metrics
  np.testing.assert_allclose(tokens, expected.total, rtol=bounds.tokens_rtol)
  np.testing.assert_allclose(loss, expected.loss, rtol=bounds.loss_rtol)
  norm = np.sqrt(sum(np.sum(m**2) for m in expected.mean.values()))
  np.testing.assert_allclose(grad_norm, norm, rtol=0, atol=bounds.grad_norm)
  np.testing.assert_allclose(
    update_norm,
    LEARNING_RATE * norm,
    rtol=0,
    atol=LEARNING_RATE * bounds.grad_norm,
  )
  for name, leaf_norm in (grad_norms or {}).items():
    expected_norm = np.linalg.norm(expected.mean[name])
    np.testing.assert_allclose(
      leaf_norm, expected_norm, rtol=0, atol=bounds.grad_norm
    )


def dtype_context(dtype):
  return jax.enable_x64(dtype == 'float64')


def cases(names):
  """``(name, dtype)`` of every run of ``names`` in both dtypes (none
  takes 2 s of a core: the file, about 40 s)."""
  return [
    pytest.param(name, dtype, id=f'{name}-{dtype}')
    for name in names
    for dtype in DTYPES
  ]


@pytest.mark.parametrize('name, dtype', cases(RUNS))
def test_device_decided_windows_equal_the_weighted_mean(name, dtype):
  with dtype_context(dtype):
    windows = make_windows(KINDS, dtype, seed=sorted(RUNS).index(name))
    seen = run_windows(name, build(name, dtype), windows, host_closes=False)
    assert_windows(seen, windows, dtype)


@pytest.mark.parametrize('name, dtype', cases(HOST_CLOSES))
def test_host_closed_windows_equal_the_weighted_mean(name, dtype):
  with dtype_context(dtype):
    windows = make_windows(KINDS, dtype, seed=10 + sorted(RUNS).index(name))
    seen = run_windows(name, build(name, dtype), windows, host_closes=True)
    assert_windows(seen, windows, dtype)


# Budgets in the weights' units: tokens_per_update closes a window at the
# first micro-step whose weights, over the window and the devices, reach it.

# About 1.5 micro-batches of weights below 1: a whole number and a
# fractional one.
BUDGETS = (20, 19.75)
BUDGET_K = 8


def budget_windows(dtype, seed, budget):
  """Micro-batches of weights below 1 and of mixed magnitudes, split into
  the windows the budget makes (reference: ``helpers.closing_steps`` of
  the float64 totals, none of which is within 1e-3 of the budget, so that
  no rounding decides a close)."""
  rng = np.random.default_rng(seed)
  kinds = ['below_one'] * 6 + ['mixed'] + ['below_one'] * 3
  batches = [
    batch
    for kind in kinds
    for batch in make_windows([kind], dtype, int(rng.integers(1 << 30)), [1])[0]
  ]
  totals = [float(np.sum(np.asarray(b['mask'], np.float64))) for b in batches]
  closes = helpers.closing_steps(totals, lambda _: BUDGET_K, budget)
  for stop in closes:
    start = max([0] + [s for s in closes if s < stop])
    window = sum(totals[start:stop])
    assert abs(window - budget) > 1e-3 * budget or stop - start == BUDGET_K
  ends = closes + [len(batches)] * (closes[-1:] != [len(batches)])
  starts = [0] + ends[:-1]
  return [batches[a:b] for a, b in zip(starts, ends)]


@pytest.mark.parametrize('budget', BUDGETS)
@pytest.mark.parametrize('name, dtype', cases(RUNS))
def test_budgets_in_fractional_units(name, dtype, budget):
  """The windows close where the float64 reference's totals reach the
  budget, a whole or a fractional number of weight units (some in one
  micro-step: a mixed-magnitude micro-batch holds far more), and each
  equals the weighted mean."""
  with dtype_context(dtype):
    seed = 20 + sorted(RUNS).index(name)
    windows = budget_windows(dtype, seed, budget)
    assert len(windows) >= 3
    run = build(
      name, dtype, every_k_schedule=BUDGET_K, tokens_per_update=budget
    )
    seen = run_windows(name, run, windows, host_closes=False)
    assert_windows(seen, windows, dtype)


@pytest.mark.parametrize('gpus', [False, True], ids=['here', 'gpus'])
@pytest.mark.parametrize('name', ['one_device', 'explicit_ddp'])
def test_per_leaf_norms_are_of_the_weighted_mean(name, gpus, monkeypatch):
  """``window_norms='per_leaf'``: each leaf's norm is its weighted mean's,
  tiny and mixed weights included (float32 squares of the sums of tiny
  weights are 0); and so with a GPU's norms (``gpus``: the squares of the
  mean and of the updates summed in one reduction, ``_norms.TOGETHER_ON``)."""
  if gpus:
    helpers.gpu_norms_here(monkeypatch)
  windows = make_windows(('tiny', 'mixed', 'below_one'), 'float32', seed=30)
  run = build(name, 'float32', window_norms='per_leaf')
  seen = run_windows(name, run, windows, host_closes=False)
  assert all(isinstance(s.metrics[-1], dict) for s in seen[1:])
  assert_windows(seen, windows, 'float32')
