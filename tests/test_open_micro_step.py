"""An open micro-step in the ideal's form (issue 46), read from the
compiled program through ``optax_tokacc.testing.hlo``.

The ideal's micro-step adds the gradient into its accumulator and does
nothing else: on a GPU that add sits inside the gradient's GEMM fusions.
Anything else on the accumulation path costs a pass over the parameters
there (measured on an H200: eight separate add kernels, 1.21x the ideal's
open micro-step, for a restart select on a scalar predicate). A CPU does
not show the cost, so these tests read the structure:

- the window's sums (``state.grad_sums``) are first read by an ``add``:
  no select, no conditional operand, in the host's open micro-step and in
  the device-decided step; the window restarts at its first micro-step,
  in a loop of 0 or 1 trips that hands the sums on untouched otherwise
  (``hlo.first_uses`` looks past it);
- the host's open micro-step holds no conditional, no parameter-sized
  select and no optimizer work; the device-decided step holds no optimizer
  work outside the closing conditional's branches (XLA:GPU flattened it
  into selects: what a CPU keeps is guarded here, the GPU's figures are in
  ``benchmarks/device_check.py``);
- compensated sums and rejected micro-batches: their arithmetic needs
  more than an add (TwoSum; a select on the micro-batch's gradient), but
  no restart on the sums.

The behaviour the restart kept (nothing of a closed window leaks into the
next, NaN included; rejected micro-batches and dropped windows exact; a
restored state correct whatever its ``mini_step``) is checked against
full-batch training at the end.
"""

import functools

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
from optax_tokacc.testing import hlo

K = 3
# Opcodes of an optimizer's update (AdamW: the square root of the second
# moment, the division): none may run on an open micro-step.
OPTIMIZER_OPCODES = ('sqrt', 'rsqrt', 'divide', 'power')


def _loss_sum(params, batch):
  return helpers.loss_sum(params, batch)


def _program(tx, close, params_dtype=jnp.float32):
  """The compiled text of a user's step (gradient, ``tx.update``,
  ``optax.apply_updates``) with ``close``, and the parameters' shapes."""
  params = helpers.init_params(params_dtype)
  batch = helpers.micro_batch(0, 5)

  @functools.partial(jax.jit, donate_argnums=(0, 1), static_argnames='close')
  def step(params, state, batch, close=None):
    grads = jax.grad(_loss_sum)(params, batch)
    updates, state = tx.update(
      grads, state, params, num_tokens=helpers.token_count(batch), close=close
    )
    return optax.apply_updates(params, updates), state

  text = hlo.compiled_text(step, params, tx.init(params), batch, close=close)
  shapes = {tuple(p.shape) for p in jax.tree.leaves(params) if p.ndim}
  return hlo.parse_hlo(text), shapes


def _parameter_sized(instruction, shapes):
  return any(dims in shapes for _, dims in instruction.shapes)


CONFIGS = {
  'plain': {},
  'no_norms': {'window_norms': False},
  'per_leaf': {'window_norms': 'per_leaf'},
  'bfloat16_accumulator': {'accumulator_dtype': jnp.bfloat16},
  'skip_not_finite': {'should_skip_update_fn': optax.skip_not_finite},
}
CLOSES = {'device': None, 'host': False}


@pytest.mark.parametrize('close', CLOSES.values(), ids=CLOSES)
@pytest.mark.parametrize('config', CONFIGS.values(), ids=CONFIGS)
def test_the_sums_are_first_read_by_an_add(config, close):
  tx = tokacc.token_weighted_multistep(helpers.adamw(), K, **config)
  module, _ = _program(tx, close)
  uses = hlo.first_uses(module, 'state.grad_sums')
  assert all(found == ['add'] for found in uses.values()), uses


@pytest.mark.parametrize('close', CLOSES.values(), ids=CLOSES)
def test_mixed_precision_sums_are_first_read_by_an_add(close):
  """bfloat16 parameters, a float32 accumulator."""
  tx = tokacc.token_weighted_multistep(helpers.adamw(), K)
  module, _ = _program(tx, close, params_dtype=jnp.bfloat16)
  uses = hlo.first_uses(module, 'state.grad_sums')
  assert all(found == ['add'] for found in uses.values()), uses


@pytest.mark.parametrize('close', CLOSES.values(), ids=CLOSES)
def test_compensated_sums_are_not_restarted_on_a_micro_step(close):
  """TwoSum reads the sums widened (``convert``) and adds: no select, no
  conditional operand."""
  tx = tokacc.token_weighted_multistep(
    helpers.adamw(), K, accumulator_dtype=jnp.bfloat16, compensated=True
  )
  module, _ = _program(tx, close)
  for prefix in ('state.grad_sums', 'state.acc_compensation'):
    uses = hlo.first_uses(module, prefix)
    for found in uses.values():
      assert not {'select', 'tuple', 'conditional'} & set(found), uses


def _returned_from_a_loop(module, tx, field):
  """The leaves of the state's ``field`` that the compiled step (which
  returns the parameters and the state) returns from a ``while`` loop,
  through copies."""
  params = helpers.init_params(jnp.float32)
  outputs = jax.tree_util.tree_flatten_with_path((params, tx.init(params)))[0]
  entry = list(module.computations[module.entry])
  by_name = {i.name: i for i in entry}
  root = next(i for i in entry if i.root)
  assert len(root.operands) == len(outputs)
  found = []
  for name, (path, _) in zip(root.operands, outputs):
    if path[0].idx != 1 or path[1].name != field:
      continue
    value = by_name[name]
    while value.opcode in ('copy', 'bitcast'):
      value = by_name[value.operands[0]]
    if value.opcode == 'get-tuple-element' and _a_loop(
      module, by_name[value.operands[0]]
    ):
      found.append(jax.tree_util.keystr(path))
  return found


def _a_loop(module, instruction):
  """Whether ``instruction`` is a ``while``, or a ``call`` of one (XLA:CPU
  outlines a loop into a computation of its own)."""
  if instruction.opcode == 'call':
    (callee,) = instruction.callees
    return any(
      i.root and i.opcode == 'while' for i in module.computations[callee]
    )
  return instruction.opcode == 'while'


@pytest.mark.parametrize('close', CLOSES.values(), ids=CLOSES)
def test_compensated_sums_are_not_carried_through_the_closing_loop(close):
  """The closing trip reads the window's sums and compensation, and hands
  them on unchanged: around the loop, not through it. Through it, XLA:CPU
  wrote the micro-step's TwoSum into new buffers and copied both into the
  state's (a compensated window 1.15x 3ceb33c's in float32, 0.5 P more
  temporaries)."""
  tx = tokacc.token_weighted_multistep(
    helpers.adamw(), K, accumulator_dtype=jnp.bfloat16, compensated=True
  )
  module, _ = _program(tx, close)
  for field in ('grad_sums', 'acc_compensation'):
    assert not _returned_from_a_loop(module, tx, field)


@pytest.mark.skipif(
  jax.__version_info__ < (0, 12),
  reason='XLA:CPU of jaxlib < 0.12 copies both fields in either order',
)
@pytest.mark.parametrize('params_dtype', [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize('close', CLOSES.values(), ids=CLOSES)
def test_compensated_sums_are_written_in_place(close, params_dtype):
  """TwoSum's new total and error are each written over the buffer they
  replace: the program copies neither field of the state. XLA:CPU
  computed them in two fusions that each read the total and the
  compensation, wrote the first into a new buffer and copied the state's
  (a bfloat16 model's compensated window 1.04x 3ceb33c's)."""
  tx = tokacc.token_weighted_multistep(
    helpers.adamw(), K, accumulator_dtype=jnp.bfloat16, compensated=True
  )
  module, _ = _program(tx, close, params_dtype)
  copied = [
    i.operands
    for i in hlo.reachable_instructions(module)
    if i.opcode == 'copy'
    and any(
      o.startswith(('state_grad_sums', 'state_acc_compensation'))
      for o in i.operands
    )
  ]
  assert not copied


# A rejected micro-batch adds nothing: a select on its gradient (not on the
# sums), the one parameter-sized select its arithmetic needs.
SELECT_FREE = {k: v for k, v in CONFIGS.items() if k != 'skip_not_finite'}


@pytest.mark.parametrize('config', SELECT_FREE.values(), ids=SELECT_FREE)
def test_the_hosts_open_micro_step_holds_no_select_and_no_optimizer(config):
  tx = tokacc.token_weighted_multistep(helpers.adamw(), K, **config)
  module, shapes = _program(tx, close=False)
  found = hlo.reachable_instructions(module)
  assert not [i.name for i in found if i.opcode == 'conditional']
  extra = [
    (i.name, i.opcode)
    for i in found
    if _parameter_sized(i, shapes)
    and i.opcode in ('select', *OPTIMIZER_OPCODES)
  ]
  assert not extra, extra


@pytest.mark.parametrize('config', CONFIGS.values(), ids=CONFIGS)
def test_the_device_step_runs_the_optimizer_only_in_its_branches(config):
  tx = tokacc.token_weighted_multistep(helpers.adamw(), K, **config)
  module, shapes = _program(tx, close=None)
  every_call = hlo.reachable_instructions(module, into_branches=False)
  optimizer = [
    (i.name, i.opcode)
    for i in every_call
    if _parameter_sized(i, shapes) and i.opcode in OPTIMIZER_OPCODES
  ]
  assert not optimizer, optimizer
  everything = hlo.reachable_instructions(module)
  assert any(i.opcode == 'sqrt' for i in everything)  # AdamW is there


# What the restart kept, now that it happens at a window's first
# micro-step (issue 55; where the window closed, issue 46): the
# updates of a window that follows a NaN window, a dropped window (an
# invalid count) and a window of rejected micro-batches, against the
# token-weighted mean written plainly, for every way to close (the device,
# the host, and the two mixed: a host's open micro-step after a window the
# device closed, and the reverse).
DECIDERS = {
  'device': ('device', 'device'),
  'host': ('host', 'host'),
  'device_then_host': ('device', 'host'),
  'host_then_device': ('host', 'device'),
}


def _run_two_windows(tx, first, second, grads, counts):
  """Feeds two windows of ``K`` micro-batches; each window's micro-steps
  closed as its decider says; returns the last updates of each window."""
  params = {'w': jnp.zeros(grads.shape[-1])}
  state = tx.init(params)

  @functools.partial(jax.jit, static_argnames='close')
  def step(state, grad, count, close=None):
    return tx.update({'w': grad}, state, params, num_tokens=count, close=close)

  last = []
  for window, decider in enumerate((first, second)):
    for i in range(K):
      close = None if decider == 'device' else i == K - 1
      n = window * K + i
      updates, state = step(state, grads[n], counts[n], close=close)
    last.append(np.asarray(updates['w'], np.float64))
  return last, state


def _assert_mean_of(updates, grads, counts, rows):
  """``updates`` are sgd(1)'s of the token-weighted mean of ``rows``,
  written plainly in float64. Bound: a float32 sum of at most K terms,
  the float32 count and one float32 reciprocal and product: within
  (K + 3) float32 roundings of the sum of the terms' magnitudes."""
  rows = list(rows)
  g = np.asarray(grads[rows], np.float64)
  total = np.asarray(counts[rows], np.float64).sum()
  atol = (K + 3) * 2.0**-24 * np.abs(g).sum(0) / total
  error = np.abs(updates - -g.sum(0) / total)
  assert np.all(error <= atol), (error, atol)


@pytest.mark.parametrize('deciders', DECIDERS.values(), ids=DECIDERS)
@pytest.mark.parametrize('first_window', ['nan', 'invalid_count'])
def test_nothing_of_a_closed_window_reaches_the_next(deciders, first_window):
  rng = np.random.default_rng(0)
  counts = rng.integers(1, 9, 2 * K).astype(np.float32)
  grads = counts[:, None] * rng.normal(size=(2 * K, 5)).astype(np.float32)
  if first_window == 'nan':
    grads[1, 2] = np.nan
  else:
    counts[1] = -3.0  # invalid: the window is dropped
  tx = tokacc.token_weighted_multistep(optax.sgd(1.0), K)
  (first, second), state = _run_two_windows(tx, *deciders, grads, counts)
  if first_window == 'nan':
    assert np.isnan(first[2]) and int(state.dropped_windows) == 0
  else:
    np.testing.assert_array_equal(first, 0.0)
    assert int(state.dropped_windows) == 1
  _assert_mean_of(second, grads, counts, range(K, 2 * K))


@pytest.mark.parametrize('first', ['device', 'host'])
def test_rejected_micro_batches_add_nothing(first):
  """``skip_not_finite`` rejects the NaN micro-batch of the second window,
  which the host closes after ``K`` calls (the device counts kept
  micro-batches only: ``test_multistep``): the window is the others',
  after a window the device or the host closed."""
  rng = np.random.default_rng(1)
  counts = rng.integers(1, 9, 2 * K).astype(np.float32)
  grads = counts[:, None] * rng.normal(size=(2 * K, 5)).astype(np.float32)
  grads[K, 1] = np.nan  # the second window's first micro-batch
  tx = tokacc.token_weighted_multistep(
    optax.sgd(1.0), K, should_skip_update_fn=tokacc.skip_not_finite
  )
  (first_updates, second), _ = _run_two_windows(
    tx, first, 'host', grads, counts
  )
  _assert_mean_of(first_updates, grads, counts, range(K))
  _assert_mean_of(second, grads, counts, range(K + 1, 2 * K))


# Data parallel: the same form where each device holds its share of the
# window (shard_map with axis_name) and where the types defer the reduction
# (explicit sharding, DDP and HSDP: the sums typed unreduced).


@pytest.mark.parametrize('close', CLOSES.values(), ids=CLOSES)
def test_shard_map_sums_are_first_read_by_an_add(close):
  mesh = placements.data_mesh(4)
  tx = tokacc.token_weighted_multistep(helpers.adamw(), K, axis_name='data')
  replicated = NamedSharding(mesh, P())
  params = jax.tree.map(
    lambda x: helpers.put(x, replicated), helpers.init_params()
  )
  state = placements.shard_map_state(tx, params, mesh, 'data')
  batch = helpers.make_windows((1,), 4)[0][0]
  data = NamedSharding(mesh, P('data'))
  batch = jax.tree.map(lambda x: helpers.put(x, data), batch)
  step = placements.shard_map_step(tx, mesh, 'data', with_emit_now=False)
  text = hlo.compiled_text(step, params, state, batch, close=close)
  uses = hlo.first_uses(hlo.parse_hlo(text), 'state.grad_sums')
  assert all(found == ['add'] for found in uses.values()), uses


@pytest.mark.skipif(
  not placements.supported('explicit_ddp'), reason='explicit types: jax 0.10'
)
@pytest.mark.parametrize('layout', ['ddp', 'hsdp'])
def test_explicit_sums_are_first_read_by_an_add(layout):
  """The device-decided step (``emit_now`` traced) of the explicit
  layouts whose sums are typed unreduced."""
  text = placements.explicit_compiled_text(layout, 'replicated')
  uses = hlo.first_uses(hlo.parse_hlo(text), 'state.grad_sums')
  assert all(found == ['add'] for found in uses.values()), uses
