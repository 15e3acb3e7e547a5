"""Windows closed by the host: ``close=True`` / ``close=False`` (issue 24).

``tx.update(..., close=...)`` with a Python bool traces one path:
``close=False`` adds the micro-batch and returns zero updates (-0.0; +0.0
under an explicit mesh, see ``_held_updates.zeros``; no inner work, no
collective), ``close=True`` closes the window with what it holds,
this micro-batch included; neither holds a ``conditional``, so that
``jax.jit(step, static_argnames='close')`` compiles two programs.

The host closes windows of 2, 3 and 1 micro-batches while the schedule says
2 (a host-closed window does not consult it). Token counts differ per
micro-batch and per device, some devices count none (``helpers``).
Checked here:

- exactness against single-device full-batch training
  (``helpers.full_batch``, with ``value=`` for ``reduce_on_plateau``), in
  float64, for the plain
  accumulator, ``skip_not_finite`` (a rejected micro-batch may close a
  window), ``compensated``, ``loss_reduction='mean'``, ``optax.chain``
  around it; in float32 for ``reduce_on_plateau`` inside it and for
  bfloat16 parameters (with a bound derived from bfloat16's ulp);
- that host-closed and device-decided windows mix: each mix gives bit for
  bit the updates and the state of the run that leaves every call to the
  device (``tx.update`` compiled on its own), except for a mean loss,
  compensated sums under AdamW and bf16 AdamW, where XLA may contract a
  multiply-add in one program only: there within a few roundings (those
  mixes also equal full-batch training);
- a window without tokens or with an invalid count closed by the host;
- data parallel: ``shard_map`` with ``axis_name`` (parameters ``pcast`` to
  varying), ``pmap``, and explicit sharding (the DDP, HSDP and FSDP layouts
  of ``placements``);
- the compiled programs: no ``conditional``; ``close=False`` runs no AdamW
  (no ``sqrt``) and no collective under DDP; ``close=True`` runs exactly one
  all-reduce under DDP, beside the backward pass; two programs in all;
- each step written as users write it (issue 33), ``optax.apply_updates``
  in the same program: the window closed by the host and by the device give
  bit for bit the same updates and state, on one device and data parallel
  (``shard_map``, explicit DDP, ZeRO-1), the parameters within the user's
  rounding; the mean is one reciprocal in both programs;
- the three rules of ``close`` (getting_started, "Windows closed by the
  host"): the sign of ``close=False``'s zero updates per placement,
  ``emit_now=False`` passed with a Python ``close``, and ``close=None``
  after ``close=False`` calls of the same window.

The Flax ``TrainState`` and nnx ``Optimizer`` with ``close``:
``test_flax``; bad ``close`` values, and ``close`` with
``tokens_per_update`` or ``emit_now``: ``test_bad_call``.
"""

from collections.abc import Callable
import contextlib
import functools
from typing import NamedTuple

import chex
import children
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

NUM_DEVICES = 4
SIZES = (2, 3, 1)  # micro-batches of each window, as the host closes them
# every_k_schedule that agrees with the host (for runs that mix host and
# device)
sizes_schedule = helpers.schedule_of(SIZES)
EVERY_K = 2  # the schedule, which the host-closed windows do not follow
NAN_DEVICE = 2  # the device whose rows of the rejected micro-batch hold a NaN
# float64 runs against the float64 full-batch reference: both add the same
# per-token terms (at most 3 micro-steps x 32 tokens = 96 per window) in
# another order, which moves each window's gradient by at most 96 eps
# (96 * 2**-52 = 2e-14) of the sum of the terms' magnitudes; over 3 windows
# of steps no larger than the gradient's, the parameters and window losses
# are off by about 1e-13. 1e-11 leaves a factor of 100 for cancellation in
# the sums, and is far below what a wrong weighting does: a token counted
# wrongly in a window of at most 96 moves its gradient by about 1e-2.
F64_TOLERANCE = 1e-11
AUTO = jax.sharding.AxisType.Auto


class Case(NamedTuple):
  """A composition: ``make_tx(every_k, axis_name)``, the optimizer that
  full-batch training runs, whether the loss is a token mean, whether a
  rejected (NaN) micro-batch is fed."""

  make_tx: Callable
  reference: Callable
  mean: bool = False
  with_nan: bool = False


def accumulate(inner, every_k, axis_name, **options):
  return tokacc.token_weighted_multistep(
    inner, every_k, axis_name=axis_name, **options
  )


CASES = {
  'plain': Case(lambda k, a: accumulate(helpers.adamw(), k, a), helpers.adamw),
  'skip_not_finite': Case(
    lambda k, a: accumulate(
      helpers.adamw(), k, a, should_skip_update_fn=tokacc.skip_not_finite
    ),
    helpers.adamw,
    with_nan=True,
  ),
  'compensated': Case(
    lambda k, a: accumulate(helpers.adamw(), k, a, compensated=True),
    helpers.adamw,
  ),
  'mean': Case(
    lambda k, a: accumulate(helpers.adamw(), k, a, loss_reduction='mean'),
    helpers.adamw,
    mean=True,
  ),
  # Both options at once (data parallel runs, to keep them few).
  'skip_not_finite_compensated': Case(
    lambda k, a: accumulate(
      helpers.adamw(),
      k,
      a,
      should_skip_update_fn=tokacc.skip_not_finite,
      compensated=True,
    ),
    helpers.adamw,
    with_nan=True,
  ),
  # A linear stage before the accumulator (it sees each micro-batch's
  # gradient) and one after it (it sees the emitted updates).
  'chain': Case(
    lambda k, a: optax.chain(
      optax.scale(2.0), accumulate(helpers.sgd(), k, a), optax.scale(3.0)
    ),
    lambda: optax.chain(optax.scale(2.0), helpers.sgd(), optax.scale(3.0)),
  ),
}
SINGLE_DEVICE_CASES = (
  'plain',
  'skip_not_finite',
  'compensated',
  'mean',
  'chain',
)


def rejected_batch(batch):
  """A micro-batch that ``skip_not_finite`` rejects: a NaN in the rows of
  ``NAN_DEVICE``, no counted token on any device (so that it adds nothing
  wherever it is rejected, and full-batch training simply leaves it out)."""
  nan = placements.with_nan(batch, NAN_DEVICE)
  return dict(nan, mask=np.zeros_like(batch['mask']))


def micro_steps(windows, deciders, nan=None):
  """``(batch, close)`` in training order.

  ``deciders[w]``: ``'h'`` the host closes window ``w`` at its last
  micro-batch (``close=False`` before); ``'d'`` the device decides every
  call (``close=None``); ``'m'`` the device decides all but the last call,
  which the host closes. ``nan='inside'`` adds a rejected micro-batch
  after the first of window 1; ``nan='closing'`` also closes the last
  window with one (host-closed windows only).
  """
  steps = []
  for w, (window, decider) in enumerate(zip(windows, deciders)):
    for m, batch in enumerate(window):
      last = m == len(window) - 1
      close = None if decider == 'd' or (decider == 'm' and not last) else last
      if nan == 'closing' and last and w == len(windows) - 1:
        steps.append((batch, False))
        steps.append((rejected_batch(batch), True))
        continue
      steps.append((batch, close))
      if nan is not None and w == 1 and m == 0:
        steps.append((rejected_batch(window[1]), close))
  return steps


def loss_fn(mean):
  """The token-mean loss for ``'mean'``, else the token-summed one."""
  return helpers.loss_mean if mean else helpers.loss_sum


def split_step(tx, mean=False):
  """A micro-step as three programs: the gradient, ``tx.update`` (one
  program per ``close``) and ``optax.apply_updates``. Runs that differ only
  in ``close`` then run the same gradient and apply programs, so that
  comparing them bit for bit compares what ``tx.update`` returns. (With
  ``optax.apply_updates`` in the same program, XLA may fuse the addition
  of the updates to the parameters into the optimizer's arithmetic in one
  program and not in the other: a fused multiply-add rounds once where a
  multiply and an add round twice, an ulp apart.)

  Returns ``step(params, state, batch, close, num_tokens=None) -> (params,
  state, updates)``.
  """
  value_and_grad = jax.jit(jax.value_and_grad(loss_fn(mean)))
  apply = jax.jit(optax.apply_updates)

  @functools.partial(jax.jit, static_argnames='close')
  def update(grads, state, params, num_tokens, loss, close):
    return tx.update(
      grads, state, params, num_tokens=num_tokens, loss=loss, close=close
    )

  def step(params, state, batch, close, num_tokens=None):
    if num_tokens is None:
      num_tokens = helpers.token_count(batch)
    loss, grads = value_and_grad(params, batch)
    updates, state = update(grads, state, params, num_tokens, loss, close)
    return apply(params, updates), state, updates

  return step


def windows64():
  return helpers.make_windows(SIZES, NUM_DEVICES, np.float64)


@functools.cache
def full_batch(reference, without=None):
  """Float64 full-batch training with ``reference()`` on the windows of
  ``SIZES`` (window ``without`` left out): host copies of the final
  parameters and of each window's token-mean loss. Cached: many runs here
  share the optimizer, and each run of the reference compiles a step."""
  with jax.enable_x64(True):
    windows = windows64()
    if without is not None:
      del windows[without]
    expected = helpers.full_batch(
      reference(), helpers.init_params(np.float64), windows
    )
    params, losses = expected.params, expected.losses
    return jax.tree.map(np.asarray, params), np.asarray(losses)


def device_params(dtype):
  return jax.tree.map(jnp.asarray, helpers.init_params(dtype))


def window_tokens(window):
  return int(sum(np.sum(batch['mask']) for batch in window))


def movement_bound(expected, dtype):
  """How far float32 training moved the parameters from their start, and
  how far a bfloat16 run may end from it.

  Each window rounds the parameters to bfloat16 once, as does the start: at
  most half an ulp of the largest parameter each time. The gradients and
  updates rounded to bfloat16 are off by 2**-9 of themselves, far below an
  ulp of the parameters they move; another half ulp per window covers that
  and its effect on the next windows' gradients.
  """
  start = helpers.init_params()
  largest = max(float(np.max(np.abs(x))) for x in jax.tree.leaves(expected))
  ulp = 2.0 ** (np.floor(np.log2(largest)) - jnp.finfo(dtype).nmant)
  moved = max(
    float(np.max(np.abs(e - s)))
    for e, s in zip(jax.tree.leaves(expected), jax.tree.leaves(start))
  )
  return moved, (len(SIZES) + 1) * ulp


# Exactness against full-batch training, on one device.


# mini_step after each call of ``micro_steps(windows, ..., nan)``: the second
# window reaches k = 2 and goes on (the schedule is not consulted); a
# rejected micro-batch does not advance it.
MINI_STEPS = {
  None: [1, 0, 1, 2, 0, 0],
  'inside': [1, 0, 1, 1, 2, 0, 0],
  'closing': [1, 0, 1, 1, 2, 0, 1, 0],
}


# Every case closed by the host; where host and device round differently
# (``NOT_BIT_FOR_BIT``), also mixed with the device.
EXACT_CASES = [(name, 'hhh') for name in sorted(SINGLE_DEVICE_CASES)]
EXACT_CASES += [('mean', 'dhm'), ('compensated', 'dhm')]


@pytest.mark.parametrize(('name', 'deciders'), EXACT_CASES)
def test_host_closed_windows_equal_full_batch(name, deciders):
  """Each window is one step of full-batch training, whoever closes it
  (``'hhh'``: the host, the schedule saying k = 2; ``'dhm'``: the device,
  the host, both, with a schedule that agrees); its loss and tokens are
  reported; a host-closed window may end on a rejected micro-batch, with
  what it holds."""
  case = CASES[name]
  host_only = deciders == 'hhh'
  nan = None
  if case.with_nan:
    nan = 'closing' if host_only else 'inside'
  with jax.enable_x64(True):
    windows = windows64()
    expected, losses = full_batch(case.reference)
    tx = case.make_tx(EVERY_K if host_only else sizes_schedule, None)
    step = placements.global_step(tx, loss_fn(case.mean))
    params = device_params(np.float64)
    state = tx.init(params)
    closed, mini_steps = 0, []
    for batch, close in micro_steps(windows, deciders, nan):
      params, state = step(params, state, batch, close=close)
      inner = tokacc.find_state(state)
      mini_steps.append(int(inner.mini_step))
      if close is not None:
        assert bool(tokacc.has_updated(state)) == close
      if bool(tokacc.has_updated(state)):
        np.testing.assert_allclose(
          tokacc.window_loss(state), losses[closed], rtol=F64_TOLERANCE
        )
        assert int(inner.last_tokens) == window_tokens(windows[closed])
        closed += 1
        assert int(inner.gradient_step) == closed
    assert closed == len(SIZES)
    chex.assert_trees_all_close(params, expected, atol=F64_TOLERANCE)
  assert mini_steps == MINI_STEPS[nan]


def test_reduce_on_plateau_sees_the_host_closed_window():
  """``reduce_on_plateau`` inside ``inner`` takes the decisions of
  full-batch training with ``value=`` the window's loss, window by window;
  ``window_loss`` is the token-mean loss of the window at the parameters
  its gradients were taken at. float32: ``test_window_rules``' reference."""
  sizes = (2, 3, 1, 3, 2, 1, 3, 2)
  windows = helpers.make_windows(sizes, NUM_DEVICES, seed=4)
  expected = helpers.full_batch(
    helpers.plateau_inner(), helpers.init_params(), windows, with_value=True
  ).windows
  expected_scales = [helpers.plateau_scale(w.opt_state) for w in expected]
  assert min(expected_scales) < 1.0, 'the plateau must act on these data'
  loss_sum = jax.jit(helpers.loss_sum)
  tx = accumulate(helpers.plateau_inner(), EVERY_K, None)
  step = placements.global_step(tx)
  params = device_params(np.float32)
  state = tx.init(params)
  start, travelled = params, 0.0
  for w, window in enumerate(windows):
    for m, batch in enumerate(window):
      params, state = step(params, state, batch, close=m == len(window) - 1)
    full = jax.tree.map(lambda *xs: np.concatenate(xs), *window)
    expected_loss = loss_sum(start, full) / window_tokens(window)
    # A sum of at most 96 non-negative float32 terms in another order:
    # at most 96 * 2**-24 (6e-6) of itself.
    np.testing.assert_allclose(
      tokacc.window_loss(state), expected_loss, rtol=1e-5
    )
    assert float(state.last_loss) == float(tokacc.window_loss(state))
    assert helpers.plateau_scale(state.inner_state) == expected_scales[w]
    expected_params = expected[w].params
    before = expected[w - 1].params if w else helpers.init_params()
    travelled += max(
      float(jnp.max(jnp.abs(e - b)))
      for e, b in zip(jax.tree.leaves(expected_params), jax.tree.leaves(before))
    )
    # float32: summing a window's at most 96 per-token terms in another
    # order moves its gradient by about 96 * 2**-24 (6e-6) of itself; SGD's
    # steps are linear in it, so each step is off by that fraction of its
    # length, and the parameters by that fraction of the way they have
    # travelled. 1e-4 leaves a factor of 16 for the parameters' own
    # rounding and for cancellation.
    chex.assert_trees_all_close(params, expected_params, atol=1e-4 * travelled)
    start = params


def test_bfloat16_parameters_stay_close_to_float32_training():
  """bfloat16 parameters, float32 data and accumulator: the parameters and
  updates stay bfloat16, and host-closed windows stay within the rounding
  bound of ``movement_bound`` of float32 full-batch training (which they
  really move further than)."""
  windows = helpers.make_windows(SIZES, NUM_DEVICES)
  expected = helpers.full_batch(
    helpers.sgd(), helpers.init_params(), windows
  ).params
  tx = accumulate(helpers.sgd(), EVERY_K, None)
  step = placements.global_step(tx)
  params = device_params(jnp.bfloat16)
  state = tx.init(params)
  assert state.grad_sums['w'].dtype == jnp.float32
  for batch, close in micro_steps(windows, 'hhh'):
    params, state = step(params, state, batch, close=close)
    assert {x.dtype for x in jax.tree.leaves(params)} == {
      jnp.dtype(jnp.bfloat16)
    }
  moved, bound = movement_bound(expected, jnp.bfloat16)
  assert moved > 4 * bound, (moved, bound)
  chex.assert_trees_all_close(
    jax.tree.map(lambda x: x.astype(np.float32), params), expected, atol=bound
  )


# Host-closed and device-decided windows mix freely.


MIX_CASES = {
  **{
    name: (CASES[name], np.float32) for name in ('plain', 'compensated', 'mean')
  },
  # Rejected micro-batches, compensated sums and ``value=`` for
  # ``reduce_on_plateau`` at once, under SGD (no multiply-add: see below).
  'skip_compensated_plateau': (
    Case(
      lambda k, a: accumulate(
        helpers.plateau_inner(),
        k,
        a,
        should_skip_update_fn=tokacc.skip_not_finite,
        compensated=True,
      ),
      None,
      with_nan=True,
    ),
    np.float32,
  ),
  'bfloat16_adamw': (
    Case(
      lambda k, a: accumulate(
        optax.adamw(helpers.LEARNING_RATE, mu_dtype=jnp.float32), k, a
      ),
      None,
    ),
    jnp.bfloat16,
  ),
}
# Where XLA contracts multiply-adds (FMA), the host's programs and the
# device's round some of them differently: a ``close=False`` micro-step of
# a mean loss adds ``grad * num_tokens`` into the accumulator with another
# rounding than a ``close=None`` one; with compensated sums, the program of
# ``close=True`` rounds AdamW's first moment otherwise. An ulp, but not the
# same bits. With ``--xla_cpu_max_isa=AVX`` (no FMA) these cases pass.
# bf16 AdamW too on older XLA (jax 0.8.2, the floors). These are compared
# within a few roundings instead (``assert_close_run``).
NOT_BIT_FOR_BIT = {
  'mean': 'a mean loss adds grad * num_tokens with another rounding',
  'compensated': "AdamW's moment is rounded otherwise after Kahan sums",
  'bfloat16_adamw': 'bf16 updates: XLA versions fuse AdamW otherwise',
}


def assert_same_run(actual, expected):
  """Every micro-step of two runs gave the same bits: updates, parameters,
  and every field of the accumulator's state that holds a value at that
  point (:func:`held_fields`)."""
  assert len(actual) == len(expected)
  for i, (
    (params, state, updates),
    (e_params, e_state, e_updates),
  ) in enumerate(zip(actual, expected)):
    helpers.assert_same_bits(params, e_params, f'params after call {i}')
    helpers.assert_same_bits(updates, e_updates, f'updates of call {i}')
    fields, e_fields = held_fields(state), held_fields(e_state)
    assert fields.keys() == e_fields.keys(), i
    for field, value in fields.items():
      helpers.assert_same_bits(value, e_fields[field], f'{field} at {i}')


def held_fields(state):
  """The state's fields by name, but for the window's sums and compensation
  right after a window closed (``mini_step`` 0): scratch there (DESIGN,
  the state's docstring), restarted by the next window's first micro-step.
  A device's close leaves the updates it emitted in them (GPU, CPU), the
  host's the closed window's sums, a TPU's zeros."""
  state = tokacc.find_state(state)
  fields = state._asdict()
  if int(np.asarray(state.mini_step).max()) == 0:
    del fields['grad_sums'], fields['acc_compensation']
  return fields


def assert_close_run(actual, expected):
  """Every micro-step of two runs within a few roundings of each other.

  The two runs do the same arithmetic in programs that XLA fuses
  differently (a multiply-add contracted into one rounding in one of them).
  Each value then differs by at most one rounding per operation, which
  AdamW carries through its moments, its division and square root into the
  update, and the update into the parameters, once per window: within
  ``16 * windows`` units of its dtype's epsilon of the leaf's largest
  magnitude. A window closed at the wrong call, or a micro-batch lost,
  moves the parameters by a learning-rate-sized step, orders of magnitude
  more. Counters must be equal.
  """
  assert len(actual) == len(expected)

  def close(a, e, what):
    a, e = np.asarray(a), np.asarray(e)
    if not jnp.issubdtype(e.dtype, jnp.floating):
      np.testing.assert_array_equal(a, e, err_msg=what)
      return
    eps = float(jnp.finfo(e.dtype).eps)
    a, e = a.astype(np.float64), e.astype(np.float64)
    scale = np.max(np.abs(e[np.isfinite(e)]), initial=0.0)
    tol = 16 * len(SIZES) * eps * max(scale, np.finfo(np.float32).tiny)
    np.testing.assert_allclose(a, e, rtol=0, atol=tol, err_msg=what)

  for i, (
    (params, state, updates),
    (e_params, e_state, e_updates),
  ) in enumerate(zip(actual, expected)):
    pairs = [(params, e_params, 'params'), (updates, e_updates, 'updates')]
    fields, e_fields = held_fields(state), held_fields(e_state)
    assert fields.keys() == e_fields.keys(), i
    for field, value in fields.items():
      pairs.append((value, e_fields[field], field))
    for tree, e_tree, what in pairs:
      for a, e in zip(jax.tree.leaves(tree), jax.tree.leaves(e_tree)):
        close(a, e, f'{what} at call {i}')


def run_split(tx, dtype, deciders, case):
  """Every micro-step's ``(params, state, updates)`` of a split run."""
  windows = helpers.make_windows(SIZES, NUM_DEVICES)
  step = split_step(tx, case.mean)
  params = device_params(dtype)
  state = tx.init(params)
  trace = []
  nan = 'inside' if case.with_nan else None
  for batch, close in micro_steps(windows, deciders, nan):
    params, state, updates = step(params, state, batch, close)
    trace.append((params, state, updates))
  return trace


WITHOUT_FMA_LIMIT_S = 300  # about 15 s on a quiet 2-core machine


@pytest.mark.slow
@pytest.mark.waits_on_processes(WITHOUT_FMA_LIMIT_S)
@pytest.mark.parametrize('name', sorted(MIX_CASES))
def test_host_and_device_decisions_mix_bit_for_bit(name):
  """With a schedule that agrees with the host, runs whose windows are
  closed by the host, by the device, or by both (the device deciding a
  window's first calls, the host its last) give the bits of the run that
  leaves every call to the device."""
  # Documented (getting_started, "Windows closed by the host"): bit for bit
  # where the programs round alike; one rounding apart where XLA contracts
  # a multiply-add in one program only (issue 24). Which programs contract
  # depends on the CPU: where this one's do (AVX-512 machines contract more
  # than the ones the cases of NOT_BIT_FOR_BIT were found on), the runs
  # are within a few roundings here, and bit for bit in a process that
  # forbids FMA (``--xla_cpu_max_isa=AVX``), where no program contracts.
  for _, actual, expected in mixed_runs(name):
    if name in NOT_BIT_FOR_BIT:
      assert_close_run(actual, expected)
      continue
    try:
      assert_same_run(actual, expected)
    except AssertionError:
      assert_close_run(actual, expected)
      bit_for_bit_without_fma(name)


@pytest.mark.parametrize('form', ['written_out', 'tpu'])
@pytest.mark.parametrize('name', sorted(MIX_CASES))
def test_a_written_out_host_close_mixes_with_device_decisions(
  name, form, monkeypatch
):
  """On a GPU and a TPU the host's close is written out, not run in the
  device's closing loop (``_closing.WRITTEN_OUT_ON``; on a TPU in its
  forms, ``helpers.CLOSE_FORMS``): run here in its place, its runs are
  within a few roundings of the run that leaves every call to the device
  (NaN and dropped windows, rejected micro-batches, compensated sums and
  ``value=`` included), and close the same windows."""
  helpers.CLOSE_FORMS[form](monkeypatch)
  for _, actual, expected in mixed_runs(name):
    assert_close_run(actual, expected)


def mixed_runs(name):
  """``(deciders, run, run the device decides)`` of case ``name``."""
  case, dtype = MIX_CASES[name]
  tx = case.make_tx(sizes_schedule, None)
  expected = run_split(tx, dtype, 'ddd', case)
  assert int(tokacc.find_state(expected[-1][1]).gradient_step) == len(SIZES)
  return [
    (deciders, run_split(tx, dtype, deciders, case), expected)
    for deciders in ('hdm', 'dhh')
  ]


def bit_for_bit_without_fma(name):
  """The runs of case ``name`` bit for bit in a new process whose XLA
  emits no FMA (so that no program contracts a multiply-add)."""
  env = helpers.subprocess_env(XLA_FLAGS='--xla_cpu_max_isa=AVX')
  result = children.run(
    'mixed_runs_bit_for_bit', name, limit_s=WITHOUT_FMA_LIMIT_S, env=env
  )
  assert result.returncode == 0, result.stderr[-3000:]


# Windows that emit nothing.


def host_closed(step, params, state, windows):
  """``step`` (:func:`split_step`) over ``windows``, the host closing each
  at its last micro-batch: the parameters and state after them."""
  for batch, close in micro_steps(windows, 'h' * len(windows)):
    params, state, _ = step(params, state, batch, close)
  return params, state


@pytest.mark.slow
@pytest.mark.parametrize('form', sorted(helpers.CLOSE_FORMS))
def test_closing_a_window_without_tokens(form, monkeypatch):
  """``close=True`` on a window that counted no token: -0.0 updates (the
  parameters keep their bits), the inner state kept, no optimizer step, no
  dropped window; the window loss still the last one's. Training goes on
  as full-batch training without that window."""
  helpers.CLOSE_FORMS[form](monkeypatch)
  with jax.enable_x64(True):
    windows = windows64()
    empty = [dict(b, mask=np.zeros_like(b['mask'])) for b in windows[1]]
    expected, _ = full_batch(helpers.adamw, without=1)
    tx = accumulate(helpers.adamw(), EVERY_K, None)
    step = split_step(tx)
    params = device_params(np.float64)
    params, state = host_closed(step, params, tx.init(params), windows[:1])
    before_params, before = params, state
    for batch, close in micro_steps([empty], 'h'):
      params, state, updates = step(params, state, batch, close)
    assert all(
      np.all(np.signbit(u)) and not np.any(u) for u in jax.tree.leaves(updates)
    )
    helpers.assert_same_bits(params, before_params, 'parameters')
    helpers.assert_same_bits(
      state.inner_state, before.inner_state, 'inner state'
    )
    for field in ('gradient_step', 'dropped_windows', 'last_loss'):
      helpers.assert_same_bits(
        getattr(state, field), getattr(before, field), field
      )
    assert not bool(tokacc.has_updated(state)) and int(state.mini_step) == 0
    params, state = host_closed(step, params, state, windows[2:])
    assert int(state.gradient_step) == 2
    chex.assert_trees_all_close(params, expected, atol=F64_TOLERANCE)


@pytest.mark.slow
@pytest.mark.parametrize('form', sorted(helpers.CLOSE_FORMS))
def test_closing_a_window_with_an_invalid_count(form, monkeypatch):
  """A window holding an invalid count (negative, or fractional under the
  int32 counter) is dropped when the host closes it: -0.0 updates, the
  inner state kept, ``dropped_windows`` + 1; the next window trains as
  full-batch training without it."""
  helpers.CLOSE_FORMS[form](monkeypatch)
  with jax.enable_x64(True):
    windows = windows64()
    expected, _ = full_batch(helpers.sgd, without=1)
    tx = accumulate(helpers.sgd(), EVERY_K, None)
    step = split_step(tx)
    params = device_params(np.float64)
    before_params, before = host_closed(
      step, params, tx.init(params), windows[:1]
    )
    for count in (-3.0, 2.5):
      params, state = before_params, before
      for m, (batch, close) in enumerate(micro_steps([windows[1]], 'h')):
        num_tokens = jnp.asarray(count) if m == 1 else None
        params, state, updates = step(params, state, batch, close, num_tokens)
      assert int(state.dropped_windows) == int(before.dropped_windows) + 1
      assert int(state.gradient_step) == int(before.gradient_step)
      assert not bool(tokacc.has_updated(state))
      assert all(np.all(np.signbit(u)) for u in jax.tree.leaves(updates))
      helpers.assert_same_bits(params, before_params, 'parameters')
      helpers.assert_same_bits(
        state.inner_state, before.inner_state, 'inner state'
      )
      params, state = host_closed(step, params, state, windows[2:])
      assert int(state.gradient_step) == 2
      chex.assert_trees_all_close(params, expected, atol=F64_TOLERANCE)


# Data parallel, on 4 devices: each window equals full-batch training on all
# devices' micro-batches (float64).


def train_shard_map(tx, windows, mean=False, nan=None):
  mesh = placements.data_mesh(NUM_DEVICES)
  replicated = NamedSharding(mesh, P())
  data = NamedSharding(mesh, P('data'))
  params = jax.tree.map(
    lambda x: helpers.put(x, replicated), helpers.init_params(np.float64)
  )
  state = tokacc.init_sharded(tx, params, mesh, axis_name='data')
  step = placements.shard_map_step(
    tx,
    mesh,
    'data',
    with_emit_now=False,
    loss_fn=loss_fn(mean),
  )
  for batch, close in micro_steps(windows, 'hhh', nan):
    batch = jax.tree.map(lambda x: helpers.put(x, data), batch)
    params, state = step(params, state, batch, close=close)
  assert step._cache_size() == 2
  return helpers.fetch(params), state


def train_pmap(tx, windows):
  def per_device(x):
    return np.reshape(x, (NUM_DEVICES, -1) + np.shape(x)[1:])

  params = jax.tree.map(
    lambda x: np.broadcast_to(x, (NUM_DEVICES,) + x.shape),
    helpers.init_params(np.float64),
  )
  state = jax.pmap(tx.init, devices=jax.devices()[:NUM_DEVICES])(params)
  step = placements.pmap_step(
    tx, devices=jax.devices()[:NUM_DEVICES], host_closes=True
  )
  for batch, close in micro_steps(windows, 'hhh'):
    params, state = step(params, state, jax.tree.map(per_device, batch), close)
  return params, state


@pytest.mark.slow
@pytest.mark.parametrize(
  'name', ['plain', 'skip_not_finite_compensated', 'mean']
)
def test_shard_map_equals_full_batch(name):
  """``axis_name='data'`` under ``shard_map``: a rejected micro-batch holds
  a NaN on one device only; a mean loss is each device's own mean."""
  case = CASES[name]
  with jax.enable_x64(True):
    windows = windows64()
    expected, losses = full_batch(case.reference)
    tx = case.make_tx(EVERY_K, 'data')
    nan = 'closing' if case.with_nan else None
    params, state = train_shard_map(tx, windows, case.mean, nan)
    chex.assert_trees_all_close(params, expected, atol=F64_TOLERANCE)
    np.testing.assert_allclose(
      tokacc.window_loss(state), losses[-1], rtol=F64_TOLERANCE
    )
    assert int(tokacc.find_state(state).gradient_step) == len(SIZES)


@pytest.mark.slow
def test_pmap_equals_full_batch():
  with jax.enable_x64(True):
    windows = windows64()
    expected, losses = full_batch(helpers.adamw)
    tx = accumulate(helpers.adamw(), EVERY_K, 'data')
    params, state = train_pmap(tx, windows)
    for device in range(NUM_DEVICES):
      chex.assert_trees_all_close(
        jax.tree.map(lambda x, d=device: x[d], params),
        expected,
        atol=F64_TOLERANCE,
      )
      np.testing.assert_allclose(
        state.last_loss[device], losses[-1], rtol=F64_TOLERANCE
      )


# layout of ``test_placements.EXPLICIT_LAYOUTS``: how the step spells the count
EXPLICIT_SPELLINGS = {
  'ddp': 'unreduced',
  'hsdp': 'unreduced',
  'fsdp': 'replicated',
  'replicated': 'replicated',
}


def train_explicit(tx, layout, windows, nan=None):
  make_mesh, specs, _ = placements.EXPLICIT_LAYOUTS[layout]
  mesh = make_mesh()
  with jax.set_mesh(mesh):
    data = NamedSharding(mesh, P(placements.batch_axes(mesh)))
    params = placements.place_params(
      helpers.init_params(np.float64), mesh, specs
    )
    state = tx.init(params)
    step = placements.explicit_step(tx, EXPLICIT_SPELLINGS[layout])
    for batch, close in micro_steps(windows, 'hhh', nan):
      batch = jax.tree.map(lambda x: jax.device_put(x, data), batch)
      params, state = step(params, state, batch, close=close)
    assert step._cache_size() == 2
    return placements.plain(params), float(tokacc.window_loss(state))


EXPLICIT_CASES = [(layout, 'plain') for layout in ('ddp', 'hsdp', 'fsdp')]
EXPLICIT_CASES += [('ddp', 'skip_not_finite_compensated')]


@pytest.mark.skipif(
  not _typed_sharding.SUPPORTED,
  reason='reduced/unreduced types need jax >= 0.10',
)
@pytest.mark.parametrize(('layout', 'name'), EXPLICIT_CASES)
def test_explicit_sharding_equals_full_batch(layout, name):
  """Plain ``jax.jit`` on an explicit mesh: DDP (parameters typed reduced,
  gradients unreduced), HSDP, FSDP and replicated parameters."""
  case = CASES[name]
  with jax.enable_x64(True):
    windows = windows64()
    expected, losses = full_batch(case.reference)
    tx = case.make_tx(EVERY_K, None)
    nan = 'closing' if case.with_nan else None
    params, window_loss = train_explicit(tx, layout, windows, nan)
    chex.assert_trees_all_close(params, expected, atol=F64_TOLERANCE)
    np.testing.assert_allclose(window_loss, losses[-1], rtol=F64_TOLERANCE)


# The compiled programs.


def check_programs(texts, reduction_shapes=None):
  """``texts[close]`` for ``close`` in (False, True): neither holds a
  ``conditional``; ``close=False`` runs no AdamW (its ``sqrt``: the model
  has none) and no collective; ``close=True`` runs AdamW and, with
  ``reduction_shapes``, exactly one collective, in the entry computation
  (beside the backward pass): an all-reduce of those shapes."""
  for close, text in texts.items():
    ops = hlo.compiled_opcodes(text)
    assert ops['conditional'] == 0, close
    square_roots = ops['sqrt'] + ops['rsqrt']
    sites = collectives.compiled_collectives(text)
    if not close:
      assert square_roots == 0
      assert sites == []
    else:
      assert square_roots > 0  # the signature finds AdamW where it runs
      if reduction_shapes is not None:
        ((site, path),) = sites
        assert site.collective == 'all-reduce' and path == ()
        assert sorted(site.shapes) == sorted(reduction_shapes)


# One all-reduce per window: each gradient leaf, the token count's four
# float32 parts and the loss travelling inside the smallest leaf, v (issue
# 54: one all-reduce on a TPU too), under shard_map as under explicit
# sharding (as ``test_data_parallel`` counts them).
WINDOW_REDUCTION = [('f32', (8, 8)), ('f32', (8 + 5,))]


@pytest.mark.slow
def test_single_device_programs():
  """Also: the program of ``close=None`` does hold the closing loop (a
  flag loop, read as a conditional) and AdamW's ``sqrt`` (in its trip)
  that the checks look for."""
  tx = accumulate(helpers.adamw(), EVERY_K, None)
  step = placements.global_step(tx)
  params = device_params(np.float32)
  state = tx.init(params)
  batch = helpers.make_windows((1,), NUM_DEVICES)[0][0]
  texts = {
    close: hlo.compiled_text(step, params, state, batch, close=close)
    for close in (False, True, None)
  }
  device_decided = hlo.parse_hlo(texts.pop(None))
  found = hlo.reachable_instructions(device_decided)
  assert any(i.opcode == 'while' and i.branches for i in found)
  assert any(i.opcode == 'sqrt' for i in found)
  check_programs(texts)


@pytest.mark.slow
def test_shard_map_programs():
  """Under ``shard_map`` with ``axis_name``: no collective on a micro-step,
  one all-reduce in the closing program, outside any branch."""
  mesh = placements.data_mesh(NUM_DEVICES)
  tx = accumulate(helpers.adamw(), EVERY_K, 'data')
  params = jax.tree.map(
    lambda x: helpers.put(x, NamedSharding(mesh, P())), helpers.init_params()
  )
  state = tokacc.init_sharded(tx, params, mesh, axis_name='data')
  batch = jax.device_put(
    helpers.make_windows((1,), NUM_DEVICES)[0][0],
    NamedSharding(mesh, P('data')),
  )
  step = placements.shard_map_step(tx, mesh, 'data', with_emit_now=False)
  texts = {
    close: hlo.compiled_text(step, params, state, batch, close=close)
    for close in (False, True)
  }
  check_programs(texts, WINDOW_REDUCTION)


@pytest.mark.skipif(
  not _typed_sharding.SUPPORTED,
  reason='reduced/unreduced types need jax >= 0.10',
)
def test_explicit_ddp_programs():
  """Parameters typed reduced, count and loss unreduced: no collective on
  a micro-step, one all-reduce in the closing program."""
  make_mesh, specs, _ = placements.EXPLICIT_LAYOUTS['ddp']
  mesh = make_mesh()
  tx = accumulate(helpers.adamw(), EVERY_K, None)
  with jax.set_mesh(mesh):
    params = placements.place_params(helpers.init_params(), mesh, specs)
    state = tx.init(params)
    batch = jax.device_put(
      helpers.make_windows((1,), NUM_DEVICES)[0][0],
      NamedSharding(mesh, P('data')),
    )
    step = placements.explicit_step(tx, 'unreduced')
    texts = {
      close: hlo.compiled_text(step, params, state, batch, close=close)
      for close in (False, True)
    }
  check_programs(texts, WINDOW_REDUCTION)


def compiled_micro_step(step, params, state, batch):
  """The HLO of the host's micro-step giving only the new parameters,
  donated as in a user's step."""
  micro_step = lambda *args: step(*args, close=False)[0]  # noqa: E731
  jitted = jax.jit(micro_step, donate_argnums=0)
  return hlo.compiled_text(jitted, params, state, batch)


def assert_returns_its_parameters(text):
  """The program's entry holds nothing but its parameters and the tuple
  of them it returns: XLA removed the add of the zero updates."""
  returns, found = hlo.returns_its_parameters(hlo.parse_hlo(text))
  assert returns, found


def test_micro_step_program_leaves_parameters_untouched():
  """On one device and under ``shard_map``, XLA removes the user's add of
  the host's -0.0 zero updates (through their negation): the compiled
  micro-step returns its parameters."""
  tx = accumulate(helpers.adamw(), EVERY_K, None)
  params = device_params(np.float32)
  batch = helpers.make_windows((1,), NUM_DEVICES)[0][0]
  text = compiled_micro_step(
    placements.global_step(tx), params, tx.init(params), batch
  )
  assert_returns_its_parameters(text)
  mesh = placements.data_mesh(NUM_DEVICES)
  tx = accumulate(helpers.adamw(), EVERY_K, 'data')
  replicated = NamedSharding(mesh, P())
  params = jax.tree.map(
    lambda x: helpers.put(x, replicated), helpers.init_params()
  )
  state = tokacc.init_sharded(tx, params, mesh, axis_name='data')
  batch = jax.device_put(batch, NamedSharding(mesh, P('data')))
  text = compiled_micro_step(
    placements.shard_map_step(tx, mesh, 'data', with_emit_now=False),
    params,
    state,
    batch,
  )
  assert_returns_its_parameters(text)


@pytest.mark.skipif(
  not _typed_sharding.SUPPORTED,
  reason='reduced/unreduced types need jax >= 0.10',
)
@pytest.mark.parametrize('layout', sorted(EXPLICIT_SPELLINGS))
def test_explicit_micro_step_program_leaves_parameters_untouched(layout):
  """Under explicit sharding, XLA removes the user's ``apply_updates`` of
  the host's micro-step: the compiled program that gives the new
  parameters reads and writes none of them (returns its inputs). Before,
  its -0.0 zeros were typed through a sharding constraint, which kept XLA
  from folding ``p + -0.0``, so every micro-step copied and rewrote every
  parameter (2.5x the ideal's micro-step on 4 devices)."""
  make_mesh, specs, _ = placements.EXPLICIT_LAYOUTS[layout]
  mesh = make_mesh()
  tx = accumulate(helpers.adamw(), EVERY_K, None)
  step = placements.explicit_step(tx, EXPLICIT_SPELLINGS[layout])
  with jax.set_mesh(mesh):
    params = placements.place_params(helpers.init_params(), mesh, specs)
    state = tx.init(params)
    batch = jax.device_put(
      helpers.make_windows((1,), NUM_DEVICES)[0][0],
      NamedSharding(mesh, P(placements.batch_axes(mesh))),
    )
    text = compiled_micro_step(step, params, state, batch)
  assert_returns_its_parameters(text)


@pytest.mark.skipif(
  not _typed_sharding.SUPPORTED,
  reason='reduced/unreduced types need jax >= 0.10',
)
@pytest.mark.parametrize('layout', sorted(placements.ZERO1_LAYOUTS))
def test_zero1_micro_step_program_leaves_parameters_untouched(layout):
  """The same with the optimizer's state sharded (the distributed-optimizer
  layout, ``init_sharded(..., shard_optimizer_over=...)``)."""
  mesh, tx, step = placements.zero1_run(layout)
  with jax.set_mesh(mesh):
    params, place = placements.zero1_placed(mesh, layout)
    state = placements.zero1_init(tx, params, mesh, layout)
    batch = place(helpers.zero1_windows()[0][0])
    text = compiled_micro_step(step, params, state, batch)
  assert_returns_its_parameters(text)


def test_two_programs_in_all():
  """A step jitted with ``static_argnames='close'`` is traced and compiled
  twice over many windows, whatever their lengths."""
  tx = accumulate(helpers.adamw(), EVERY_K, None)
  traces = []
  train_step = helpers.train_step(tx)

  def step(params, state, batch, close):
    traces.append(close)
    return train_step(params, state, batch, close=close)

  step = jax.jit(step, static_argnames='close')
  windows = helpers.make_windows(SIZES * 2, NUM_DEVICES)
  params = device_params(np.float32)
  state = tx.init(params)
  for batch, close in micro_steps(windows, 'h' * len(windows)):
    params, state = step(params, state, batch, close)
  assert sorted(traces) == [False, True]
  assert step._cache_size() == 2
  assert int(state.gradient_step) == len(windows)


# Windows closed by the host against windows closed by the device, each step
# written as users write it (issue 33): ``jax.jit(step,
# static_argnames='close')`` with ``optax.apply_updates`` in the step. A
# window closed by the host (``close=False`` calls, then ``close=True``)
# and the same window closed by the device (``close=None``) give bit for bit
# the same updates and state, on one device and data parallel (``shard_map``
# with ``axis_name``, explicit DDP, ZeRO-1). The window's mean is one
# computation in both programs (``_inner_step._step``'s ``mean``: before, XLA
# rewrote the host program's division into a multiplication by the
# reciprocal inside the device program's ``cond`` only, and 3 of 32
# elements differed by up to 2.4e-7). The parameters are the user's
# arithmetic: XLA may fuse ``w + u`` with the optimizer's last multiply into
# one rounding in one program only (getting_started, "Windows closed by the
# host"); they are compared within that rounding.


def momentum_sgd():
  """The issue's optimizer: its first step is ``-1.0 * g``, exact, so that
  the parameters' rounding is the add alone."""
  return optax.sgd(1.0, momentum=0.9)


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
      p, s, u = step(p, s, batch, close=close)
    assert int(tokacc.find_state(s).gradient_step) == 1, decider
    runs[decider] = (p, s, u)
  return runs['host'], runs['device']


# The state after a window closed: the accumulator's fields aside (per-device
# partial sums under explicit sharding).
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
  step = placements.global_step(tx, with_updates=True)
  params = jax.tree.map(jnp.asarray, helpers.init_params())
  window = helpers.make_windows((k,), NUM_DEVICES, seed=3)[0]
  host, device = host_and_device(step, params, tx.init(params), window)
  assert_same_window(host, device, helpers.init_params())


def shard_map_run(mesh):
  """Per-device code under ``jax.shard_map`` with ``axis_name='data'``,
  gradients taken at parameters ``pcast`` to varying."""
  tx = tokacc.token_weighted_multistep(momentum_sgd(), 2, axis_name='data')
  step = placements.shard_map_step(
    tx, mesh, 'data', with_emit_now=False, with_updates=True
  )
  replicated = NamedSharding(mesh, P())
  params = jax.tree.map(
    lambda x: helpers.put(x, replicated), helpers.init_params()
  )
  state = tokacc.init_sharded(tx, params, mesh, axis_name='data')
  return step, params, state, NamedSharding(mesh, P('data'))


def explicit_ddp_run(mesh):
  specs = placements.EXPLICIT_LAYOUTS['ddp'].specs
  tx = tokacc.token_weighted_multistep(momentum_sgd(), 2)
  step = placements.explicit_step(tx, 'unreduced', with_updates=True)
  params = placements.place_params(helpers.init_params(), mesh, specs)
  return step, params, tx.init(params), NamedSharding(mesh, P('data'))


def zero1_run(mesh):
  _, tx, step = placements.zero1_run(
    inner=momentum_sgd(), k=2, with_updates=True
  )
  params, _ = placements.zero1_placed(mesh)
  state = placements.zero1_init(tx, params, mesh)
  return step, params, state, NamedSharding(mesh, P('data'))


def window_for(make_run):
  """Two micro-batches for the model of ``make_run``: unequal token
  counts per device, some devices without any."""
  if make_run is zero1_run:
    return helpers.zero1_windows()[0][:2]
  return helpers.make_windows((2,), NUM_DEVICES, seed=3)[0]


DATA_PARALLEL = {
  # placement: (mesh, make_run, whether the step runs under jax.set_mesh)
  'shard_map': (lambda: placements.data_mesh(), shard_map_run, False),
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
  'shard_map, auto axes': (
    lambda: placements.data_mesh(),
    shard_map_run,
    False,
    '-',
  ),
  'shard_map, explicit axes': (
    lambda: placements.data_mesh(axis_type=jax.sharding.AxisType.Explicit),
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
  ``shard_map``: +0.0 (``_held_updates.zeros``). Inside ``shard_map`` the axes
  are Manual, whatever ``jax.make_mesh`` made them: -0.0. The parameters
  keep their bits in both cases."""
  make_mesh, make_run, with_mesh, sign = ZERO_SIGNS[placement]
  with placed(make_mesh, make_run, with_mesh) as run:
    step, params, state, data, fetch = run
    batch = jax.device_put(window_for(make_run)[0], data)
    new_params, _, updates = step(params, state, batch, close=False)
    updates, new_params, params = map(fetch, (updates, new_params, params))
  signed = all_negative_zeros if sign == '-' else all_positive_zeros
  assert signed(updates), updates
  helpers.assert_same_bits(new_params, params, 'parameters')


def test_sign_of_the_zero_updates_on_one_device():
  tx = tokacc.token_weighted_multistep(momentum_sgd(), 2)
  step = placements.global_step(tx, with_updates=True)
  params = jax.tree.map(jnp.asarray, helpers.init_params())
  batch = helpers.make_windows((1,), NUM_DEVICES)[0][0]
  new_params, _, updates = step(params, tx.init(params), batch, close=False)
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
  (``test_bad_call.test_close_with_emit_now_is_refused``)."""
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
  step = placements.global_step(tx, with_updates=True)
  params = jax.tree.map(jnp.asarray, helpers.init_params())
  window = helpers.make_windows((len(closes),), NUM_DEVICES, seed=5)[0]
  host_closes = [m == closing for m in range(len(closes))]
  runs = []
  for decisions in (closes, host_closes):
    p, s, trace = params, tx.init(params), []
    for batch, close in zip(window, decisions):
      p, s, u = step(p, s, batch, close=close)
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
      text = hlo.compiled_text(step, params, state, batch, close=close)
      divisions = [
        i.shapes for i in hlo.instructions_of(hlo.parse_hlo(text), 'divide')
      ]
      assert divisions, close  # the reader finds them
      assert all(dims == () for s in divisions for _, dims in s), divisions
