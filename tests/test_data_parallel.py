"""Data parallelism on 8 fake CPU devices: pmap, shard_map and sharded jit.

Each run equals single-device full-batch training on the concatenation of
all devices' micro-batches (``helpers.full_batch``), with unequal token
counts per device and per micro-step (and devices without tokens). The
compiled step is inspected to show one reduction of the gradients per
window, none on micro-steps. A micro-batch rejected on one device closes
the window on every device, in a process of its own (issue 11, defect 1:
a deadlock). The warning of ``shard_map`` about gradients summed by
autodiff; bad ``axis_name`` values, and where that warning points:
``test_bad_placement``.
"""

import subprocess

import chex
import children
import helpers
import jax
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
import numpy as np
import optax
import placements
import pytest

import optax_tokacc as tokacc
from optax_tokacc import _closing
from optax_tokacc.testing import collectives
from optax_tokacc.testing import hlo

K = 3
WINDOW_SIZES = (3, 3, 2)  # the last window is closed early by emit_now
AUTO = jax.sharding.AxisType.Auto


OPTIMIZERS = {
  'adamw': helpers.adamw,
  'sgd': lambda: optax.sgd(helpers.LEARNING_RATE, momentum=0.9),
}


def mesh_and_axes(layout):
  if layout == '2d':
    return jax.make_mesh((4, 2), ('x', 'y'), axis_types=(AUTO, AUTO)), (
      'x',
      'y',
    )
  return jax.make_mesh((jax.device_count(),), ('data',), (AUTO,)), 'data'


def train(mode, optimizer, params, windows):
  """Final ``(params, window_loss)`` of a data-parallel run; ``params`` of
  every device for pmap (leading device axis), global arrays otherwise."""
  if mode == 'pmap':
    tx = tokacc.token_weighted_multistep(optimizer, K, axis_name='data')
    params, state = placements.train_windows(
      placements.pmap_run(tx, params), windows
    )
    return params, state.last_loss
  if mode == 'sharded_jit':
    mesh, axes = mesh_and_axes('1d')
    tx = tokacc.token_weighted_multistep(optimizer, K)
    run = placements.gspmd_run(tx, params, mesh, axes)
  else:
    mesh, axes = mesh_and_axes(mode.removeprefix('shard_map_'))
    tx = tokacc.token_weighted_multistep(optimizer, K, axis_name=axes)
    run = placements.shard_map_run(tx, params, mesh, axes)
  params, state = placements.train_windows(run, windows)
  return params, tokacc.window_loss(state)


MODES = ('pmap', 'shard_map_1d', 'shard_map_2d', 'sharded_jit')


def check_against_full_batch(mode, make_optimizer, dtype):
  """Within the round-off bounds of ``helpers.full_batch``
  (relative to each window's largest update, in ``dtype``'s unit
  round-off)."""
  windows = helpers.make_windows(WINDOW_SIZES, jax.device_count(), dtype)
  params = helpers.init_params(dtype)
  expected = helpers.full_batch(make_optimizer(), params, windows)
  actual, window_loss = train(mode, make_optimizer(), params, windows)
  if mode == 'pmap':  # each device's copy
    actual = [
      jax.tree.map(lambda x, d=d: x[d], actual)
      for d in range(jax.device_count())
    ]
  else:
    actual, window_loss = [actual], [window_loss]
  for device_params, loss in zip(actual, window_loss, strict=True):
    chex.assert_trees_all_close(
      device_params, expected.params, rtol=0, atol=expected.atol
    )
    np.testing.assert_allclose(
      loss, expected.loss, rtol=0, atol=expected.loss_atol
    )
  return windows


@pytest.mark.parametrize(
  ('mode', 'optimizer_name'),
  [
    pytest.param(
      mode,
      name,
      marks=pytest.mark.slow if (mode, name) == ('pmap', 'adamw') else (),
    )
    for mode in MODES
    for name in sorted(OPTIMIZERS)
  ],
)
def test_equals_full_batch_float32(mode, optimizer_name):
  windows = check_against_full_batch(
    mode, OPTIMIZERS[optimizer_name], np.float32
  )
  # The data is as described: unequal counts, and devices without tokens.
  counts = [
    np.reshape(batch['mask'], (jax.device_count(), -1)).sum(axis=1)
    for window in windows
    for batch in window
  ]
  assert min(np.min(c) for c in counts) == 0
  assert all(len(set(c.tolist())) > 1 for c in counts)


@pytest.mark.parametrize(
  'mode',
  [pytest.param('pmap', marks=pytest.mark.slow)]
  + [mode for mode in MODES if mode != 'pmap'],
)
def test_equals_full_batch_float64(mode):
  with jax.enable_x64(True):
    check_against_full_batch(mode, helpers.adamw, np.float64)


@pytest.mark.parametrize('mesh_kind', ['1d', '2d'])
def test_shard_map_gradients_already_summed_by_autodiff(mesh_kind):
  """Gradients of replicated parameters arrive summed: not summed again."""
  windows = helpers.make_windows(WINDOW_SIZES, jax.device_count(), np.float32)
  params = helpers.init_params(np.float32)
  expected = helpers.full_batch(helpers.adamw(), params, windows)
  mesh, axes = mesh_and_axes(mesh_kind)
  tx = tokacc.token_weighted_multistep(helpers.adamw(), K, axis_name=axes)
  with pytest.warns(UserWarning, match=r'already summed.*pcast'):
    run = placements.shard_map_run(tx, params, mesh, axes, mark_varying=False)
    actual, _ = placements.train_windows(run, windows)
  chex.assert_trees_all_close(
    actual, expected.params, rtol=0, atol=expected.atol
  )


def test_shard_map_params_stay_replicated_without_check_vma_off():
  """Parameters come back invariant: out_specs P() under check_vma=True."""
  mesh, axes = mesh_and_axes('1d')
  tx = tokacc.token_weighted_multistep(helpers.adamw(), K, axis_name=axes)
  windows = helpers.make_windows((1,), jax.device_count())
  params = helpers.init_params()
  state = placements.shard_map_state(tx, params, mesh, axes)
  step = placements.shard_map_step(tx, mesh, axes)
  data = NamedSharding(mesh, P(axes))
  new_params, _ = step(
    params,
    state,
    jax.device_put(windows[0][0], data),
    jax.device_put(np.zeros(jax.device_count(), bool), data),
  )
  for leaf in jax.tree.leaves(new_params):
    assert leaf.sharding.is_fully_replicated


# Compiled-HLO inspection.


def compiled_step_text(mode, with_emit_now):
  """The compiled HLO of one micro-step (k = K) under pmap or shard_map."""
  params = helpers.init_params()
  batch = helpers.make_windows((1,), jax.device_count())[0][0]
  flags = (np.zeros(jax.device_count(), bool),) if with_emit_now else ()
  if mode == 'pmap':
    tx = tokacc.token_weighted_multistep(helpers.adamw(), K, axis_name='data')
    params = jax.tree.map(placements.replicate, params)
    state = jax.pmap(tx.init)(params)
    step = placements.pmap_step(tx, with_emit_now)
    batch = jax.tree.map(placements.per_device, batch)
  else:
    mesh, axes = mesh_and_axes(mode.removeprefix('shard_map_'))
    tx = tokacc.token_weighted_multistep(helpers.adamw(), K, axis_name=axes)
    state = placements.shard_map_state(tx, params, mesh, axes)
    step = placements.shard_map_step(tx, mesh, axes, with_emit_now)
  return hlo.compiled_text(step, params, state, batch, *flags)


@pytest.mark.parametrize('with_emit_now', [False, True])
@pytest.mark.parametrize('mode', ['pmap', 'shard_map_1d', 'shard_map_2d'])
def test_one_gradient_reduction_per_window(mode, with_emit_now):
  """What is counted: collective instructions of the compiled step (an
  all-reduce of a tuple is one), located by the conditional branches that
  lead to them from the entry computation.

  - micro-step path: the entry computation and the branch not taken on
    emitting steps hold no all-reduce (with a traced ``emit_now``: exactly
    one, of a scalar: the flag's pmax);
  - emitting path: the one other collective sits in the branch that runs
    the inner optimizer (AdamW's ``sqrt``): a single all-reduce of each
    gradient leaf, the window's token count and its loss.
  """
  module = hlo.parse_hlo(compiled_step_text(mode, with_emit_now))
  sites = collectives.collective_sites(module)
  assert {site.collective for site, _ in sites} == {'all-reduce'}

  every_step = collectives.on_every_call(sites)
  if with_emit_now:
    assert len(every_step) == 1
    assert all(dims == () for _, dims in every_step[0].shapes)
  else:
    assert every_step == []

  branches = {path[0] for _, path in sites if path}
  assert len(branches) == 1, branches
  ((conditional_name, emit_index),) = branches
  conditional = hlo.find_instruction(module, conditional_name)
  emit_branch = conditional.branches[emit_index]
  assert hlo.reachable_opcodes(module, emit_branch)['sqrt'] > 0
  for index, branch in enumerate(conditional.branches):
    if index != emit_index:
      opcodes = hlo.reachable_opcodes(module, branch)
      assert opcodes['sqrt'] == 0  # the micro-step does not run AdamW
      assert not set(opcodes) & set(hlo.COLLECTIVE_OPCODES)

  # One all-reduce per window: each gradient leaf once, the smallest (v, 8
  # floats) flattened with the token count's four float32 parts and the
  # loss appended (the scalars ride in a leaf's reduction: no operand of
  # their own, which XLA:TPU may leave uncombined).
  sizes = sorted(np.size(p) for p in jax.tree.leaves(helpers.init_params()))
  carried = [('f32', (sizes[0] + 5,))]
  shapes = [
    ('f32', tuple(np.shape(p)))
    for p in jax.tree.leaves(helpers.init_params())
    if np.size(p) != sizes[0]
  ]
  (reduction,) = collectives.in_branches(sites)
  assert sorted(reduction.shapes) == sorted(shapes + carried)


def test_count_collectives_of_the_usual_pattern():
  """pmean every micro-step (outside any branch) is counted as such."""
  mesh, axes = mesh_and_axes('1d')

  def step(x):
    return lax.pmean(x, axes), lax.cond(
      x[0] > 0, lambda: lax.psum(x, axes) + x, lambda: x
    )

  text = hlo.compiled_text(
    jax.jit(
      jax.shard_map(
        step, mesh=mesh, in_specs=P(axes), out_specs=(P(axes), P(axes))
      )
    ),
    np.ones(jax.device_count(), np.float32),
  )
  sites = collectives.compiled_collectives(text)
  every_step = [site.collective for site, path in sites if not path]
  in_branches = [site.collective for site, path in sites if path]
  assert every_step == ['all-reduce'] and in_branches == ['all-reduce']


# Sharding under jax.jit with NamedSharding (GSPMD, no axis_name).


def assert_same_sharding(tree, params):
  for leaf, param in zip(jax.tree.leaves(tree), jax.tree.leaves(params)):
    assert leaf.sharding.is_equivalent_to(param.sharding, param.ndim), (
      leaf.sharding,
      param.sharding,
    )


def test_acc_grads_sharding_equals_params_sharding():
  mesh, axes = mesh_and_axes('1d')
  tx = tokacc.token_weighted_multistep(helpers.adamw(), K)
  windows = helpers.make_windows(WINDOW_SIZES, jax.device_count())
  calls = []

  def on_step(params, state):
    calls.append(state.emitted)
    assert not params['w'].sharding.is_fully_replicated
    assert_same_sharding(state.grad_sums, params)

  run = placements.gspmd_run(tx, helpers.init_params(), mesh, axes)
  on_step(run.params, run.state)
  params, _ = placements.train_windows(run, windows, on_step=on_step)
  assert len(calls) == 1 + sum(WINDOW_SIZES)
  assert sum(bool(emitted) for emitted in calls) == len(WINDOW_SIZES)
  for name, sharding in placements.fsdp_shardings(mesh, axes).items():
    assert params[name].sharding.is_equivalent_to(sharding, params[name].ndim)


def test_jit_init_keeps_sharding_on_explicit_mesh():
  mesh = jax.make_mesh(
    (jax.device_count(),),
    ('data',),
    axis_types=(jax.sharding.AxisType.Explicit,),
  )
  tx = tokacc.token_weighted_multistep(helpers.adamw(), K)
  with jax.set_mesh(mesh):
    params = jax.tree.map(
      helpers.put,
      helpers.init_params(),
      placements.fsdp_shardings(mesh, 'data'),
    )
    state = jax.jit(tx.init)(params)
  assert_same_sharding(state.grad_sums, params)


# A micro-batch rejected on one device closes the window everywhere: run in
# a process of its own, so that a hang fails the test instead of stalling
# CI. The process: 78 s on 2 loaded cores (load 17), about 10 s of CPU;
# 600 s is 7x the loaded run (issue 33).
REJECTED_LIMIT_S = 600
# (window, micro-step, device) whose micro-batch has a NaN gradient: one in
# the middle of the first window, one on the emitting step of the second.
REJECTED = ((0, 1, 1), (1, 2, 3))


def poisoned_and_reference(windows):
  """The micro-batches of ``windows`` with ``REJECTED`` poisoned (NaN, all
  tokens counted), and the reference's (the rejected device's rows without
  tokens, finite)."""
  poisoned, reference = [], []
  for w, window in enumerate(windows):
    poisoned.append([]), reference.append([])
    for m, batch in enumerate(window):
      bad = {k: v.copy() for k, v in batch.items()}
      good = {k: v.copy() for k, v in batch.items()}
      for rw, rm, device in REJECTED:
        if (rw, rm) == (w, m):
          rows = slice(device * helpers.SEQS, (device + 1) * helpers.SEQS)
          bad['mask'][rows] = 1.0
          bad['y'][rows] = np.nan
          good['mask'][rows] = 0.0
      poisoned[-1].append(bad)
      reference[-1].append(good)
  return poisoned, reference


def rejected_micro_batches(mode):
  """In a process of its own (``python -m children
  rejected_micro_batches``): ``skip_not_finite`` with ``axis_name``
  under ``mode`` (``pmap`` or ``shard_map``, 4 devices) on windows with
  micro-batches rejected on one device equals full-batch training without
  them."""

  def make_tx(axis_name):
    return tokacc.token_weighted_multistep(
      helpers.adamw(),
      K,
      axis_name=axis_name,
      should_skip_update_fn=tokacc.skip_not_finite,
    )

  poisoned, reference = poisoned_and_reference(helpers.make_windows((K, K), 4))
  run = placements.PLACEMENTS[mode](4, make_tx)
  batches = [batch for window in poisoned for batch in window]
  params, state = placements.train(run, run.params, run.state, batches)
  expected = helpers.full_batch(
    helpers.adamw(), helpers.init_params(), reference
  )
  helpers.assert_within_round_off(run.host(params), expected)
  state = helpers.fetch(state)
  np.testing.assert_array_equal(np.ravel(state.gradient_step), 2)
  np.testing.assert_array_equal(np.ravel(state.mini_step), 0)
  np.testing.assert_allclose(
    np.ravel(tokacc.window_loss(state)),
    expected.loss,
    atol=expected.loss_atol,
  )


@pytest.mark.parametrize(
  'mode',
  [
    m
    for m in ('pmap', 'shard_map', 'explicit_ddp', 'zero1', 'explicit_hsdp')
    if placements.supported(m)
  ],
)
def test_the_tpus_emitting_trip_is_the_loops(mode, monkeypatch):
  """On a TPU a window reduced over devices emits in a ``cond``, not a loop
  (``_closing.BRANCHED_ON``): run here in its place, on 4 devices, it
  gives the loop's parameters and state bit for bit, a window without
  tokens included (it emits nothing), and equals full-batch training
  without that window."""
  windows = helpers.make_windows((K, K, K), 4)
  empty = [dict(b, mask=np.zeros_like(b['mask'])) for b in windows[1]]
  batches = [b for window in (windows[0], empty, windows[2]) for b in window]

  def trained():
    run = placements.PLACEMENTS[mode](
      4,
      lambda axis: tokacc.token_weighted_multistep(
        helpers.adamw(), K, axis_name=axis
      ),
    )
    params, state = placements.train(run, run.params, run.state, batches)
    kept = ('inner_state', 'gradient_step', 'mini_step', 'last_loss')
    # (the window's sums are scratch at its boundary, and unreduced)
    return run.host(params), helpers.fetch([getattr(state, f) for f in kept])

  looped = trained()
  monkeypatch.setattr(_closing, 'BRANCHED_ON', ('cpu',))
  branched = trained()
  helpers.assert_same_bits(branched, looped, 'parameters and state')
  expected = helpers.full_batch(
    helpers.adamw(), helpers.init_params(), [windows[0], windows[2]]
  )
  helpers.assert_within_round_off(branched[0], expected)
  np.testing.assert_array_equal(np.ravel(branched[1][1]), 2)


@pytest.mark.waits_on_processes(REJECTED_LIMIT_S)
@pytest.mark.slow  # starts a Python process
@pytest.mark.parametrize('mode', ['pmap', 'shard_map'])
def test_a_micro_batch_rejected_on_one_device_closes_the_window_everywhere(
  mode,
):
  """Regression (issue 11, defect 1): ``axis_name`` with
  ``should_skip_update_fn`` deadlocked when one device rejected its
  micro-batch."""
  env = helpers.subprocess_env()  # the same optax_tokacc as this process
  env.pop('XLA_FLAGS', None)
  try:
    result = children.run(
      'rejected_micro_batches', mode, limit_s=REJECTED_LIMIT_S, env=env
    )
  except subprocess.TimeoutExpired:
    pytest.fail(
      f'{mode}: one NaN micro-batch on one device hung the data-parallel '
      f'job (no result after {REJECTED_LIMIT_S} s): a deadlock.'
    )
  output = result.stdout + result.stderr
  stuck = [line for line in output.splitlines() if 'stuck' in line.lower()]
  assert result.returncode == 0, (
    f'{mode} worker failed (exit code {result.returncode}):\n'
    + '\n'.join(stuck[:3])
    + '\n...\n'
    + output[-3000:]
  )
