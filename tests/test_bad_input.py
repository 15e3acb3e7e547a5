"""Every bad input the API can receive: its error type and message.

Also the documented behaviour for inputs that cannot be rejected at trace
time (a negative ``num_tokens``, a non-finite ``loss``), and the opt-in
``checkify`` checks that report them; counts and ``emit_now`` of the wrong
kind or out of range (issue 11, defect 6); ``close`` of the wrong kind or
with another decider (``tokens_per_update``, ``emit_now``).
"""

import re

import chex
import jax
from jax.experimental import checkify
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P
import numpy as np
import optax
import pytest

import optax_tokacc as tokacc
from optax_tokacc import _typed_sharding as tokacc_explicit

PARAMS = {'w': jnp.ones((2, 3)), 'b': jnp.zeros(3)}
GRADS = {'w': jnp.full((2, 3), 0.5), 'b': jnp.ones(3)}


def build(**kwargs):
  kwargs.setdefault('inner', optax.sgd(0.1))
  kwargs.setdefault('every_k_schedule', 2)
  return tokacc.token_weighted_multistep(**kwargs)


# (id, constructor keyword arguments, error type, message pattern)
CONSTRUCTOR_CASES = [
  ('inner_is_factory', {'inner': optax.adam}, TypeError, r'inner must be an'),
  ('inner_none', {'inner': None}, TypeError, r'optax\.GradientTransformation'),
  (
    'k_zero',
    {'every_k_schedule': 0},
    ValueError,
    r'must be >= 1; got every_k_schedule=0',
  ),
  ('k_negative', {'every_k_schedule': -3}, ValueError, r'must be >= 1'),
  ('k_float', {'every_k_schedule': 2.0}, TypeError, r'an int >= 1 or a'),
  ('k_str', {'every_k_schedule': '4'}, TypeError, r'every_k_schedule=4'),
  ('k_bool', {'every_k_schedule': True}, TypeError, r'type bool'),
  ('k_none', {'every_k_schedule': None}, TypeError, r'every_k_schedule must'),
  (
    'k_vector',
    {'every_k_schedule': jnp.array([2, 3])},
    TypeError,
    r'integer scalar; got shape \(2,\)',
  ),
  (
    'k_float_array',
    {'every_k_schedule': jnp.array(2.0)},
    TypeError,
    r'integer scalar.*float32',
  ),
  ('reduction_avg', {'loss_reduction': 'avg'}, ValueError, r"one of \('sum'"),
  ('reduction_none', {'loss_reduction': None}, ValueError, r'loss_reduction'),
  (
    'acc_dtype_int',
    {'accumulator_dtype': jnp.int32},
    TypeError,
    r'accumulator_dtype must be a floating dtype.*got int32',
  ),
  (
    'acc_dtype_bool',
    {'accumulator_dtype': jnp.bool_},
    TypeError,
    r'accumulator_dtype must be a floating',
  ),
  (
    'acc_dtype_garbage',
    {'accumulator_dtype': 'not-a-dtype'},
    TypeError,
    r"got 'not-a-dtype'.*static_args",
  ),
  (
    'token_dtype_bool',
    {'token_dtype': jnp.bool_},
    TypeError,
    r'token_dtype must be int32 or a floating dtype; got bool',
  ),
  (
    'token_dtype_garbage',
    {'token_dtype': 'not-a-dtype'},
    TypeError,
    r"token_dtype must be int32 or a floating dtype; got 'not-a-dtype'",
  ),
  (
    'tokens_per_update_zero',
    {'tokens_per_update': 0},
    ValueError,
    r'tokens_per_update must be >= 1; got tokens_per_update=0',
  ),
  (
    'tokens_per_update_negative',
    {'tokens_per_update': -8},
    ValueError,
    r'tokens_per_update must be >= 1',
  ),
  (
    'tokens_per_update_float',
    {'tokens_per_update': 2048.0},
    TypeError,
    r'tokens_per_update must be None or an int >= 1.*type float',
  ),
  (
    'tokens_per_update_bool',
    {'tokens_per_update': True},
    TypeError,
    r'tokens_per_update must be None or an int.*type bool',
  ),
  (
    'tokens_per_update_str',
    {'tokens_per_update': '2048'},
    TypeError,
    r"tokens_per_update must be None or an int.*'2048'",
  ),
  ('axis_name_int', {'axis_name': 3}, TypeError, r'axis_name must be a str'),
  ('axis_name_empty', {'axis_name': ()}, TypeError, r'axis_name must be a'),
  (
    'axis_name_list',
    {'axis_name': ['data']},
    TypeError,
    r"tuple of str; got \['data'\]",
  ),
  ('compensated_str', {'compensated': 'yes'}, TypeError, r'True or False'),
  ('compensated_none', {'compensated': None}, TypeError, r'compensated must'),
  (
    'window_norms_str',
    {'window_norms': 'no'},
    TypeError,
    r"window_norms must be True, False or 'per_leaf'; got 'no'",
  ),
  (
    'skip_fn_not_callable',
    {'should_skip_update_fn': True},
    TypeError,
    r'should_skip_update_fn must be None or a function',
  ),
  (
    'skip_fn_returns_bool',
    {'should_skip_update_fn': lambda g, s, p: jnp.array(False)},
    TypeError,
    r'must be a pair \(should_skip, skip_state\)',
  ),
  (
    'skip_fn_returns_vector',
    {'should_skip_update_fn': lambda g, s, p: (jnp.zeros(3, bool), ())},
    ValueError,
    r'\[0\] must be a boolean scalar; got shape \(3,\)',
  ),
]


@pytest.mark.parametrize(
  'kwargs, error, match',
  [case[1:] for case in CONSTRUCTOR_CASES],
  ids=[case[0] for case in CONSTRUCTOR_CASES],
)
def test_bad_constructor_input(kwargs, error, match):
  with pytest.raises(error, match=match):
    tx = build(**kwargs)
    tx.init(PARAMS)  # the skip fn is first called here


def call_update(tx_kwargs=None, grads=GRADS, state=None, params=PARAMS, **kw):
  tx = build(**(tx_kwargs or {}))
  state = tx.init(PARAMS) if state is None else state
  kw.setdefault('num_tokens', 3)
  return tx.update(grads, state, params, **kw)


# (id, call_update keyword arguments, error type, message pattern)
UPDATE_CASES = [
  ('num_tokens_missing', {'num_tokens': None}, TypeError, r'num_tokens='),
  (
    'num_tokens_vector',
    {'num_tokens': jnp.ones(4)},
    ValueError,
    r'num_tokens must be a real scalar.*shape \(4,\).*mask\.sum\(\)',
  ),
  (
    'num_tokens_fraction',
    {'num_tokens': 2.5},
    ValueError,
    r'whole number.*got num_tokens=2\.5.*token_dtype=jnp\.float32',
  ),
  (
    'num_tokens_wraps',
    {'num_tokens': np.int64(2**32 + 5)},
    ValueError,
    r'fits the int32 token counter; got num_tokens=4294967301',
  ),
  ('num_tokens_bool', {'num_tokens': True}, TypeError, r'num_tokens must be'),
  ('num_tokens_str', {'num_tokens': '3'}, TypeError, r'num_tokens must be'),
  # A string that names a dtype: jnp.result_type reads it as one.
  ('num_tokens_dtype_name', {'num_tokens': 'f4'}, TypeError, r'num_tokens'),
  ('num_tokens_inf', {'num_tokens': np.inf}, ValueError, r'num_tokens=inf'),
  ('num_tokens_complex', {'num_tokens': 3j}, TypeError, r'num_tokens must'),
  ('loss_complex', {'loss': 1j}, TypeError, r'loss must be a real scalar'),
  ('loss_dtype_name', {'loss': 'float32'}, TypeError, r'loss must be a real'),
  # A dtype passed as a value: it used to fail later, comparing a type.
  ('num_tokens_dtype', {'num_tokens': jnp.int32}, TypeError, r'num_tokens'),
  ('num_tokens_type', {'num_tokens': int}, TypeError, r'num_tokens must be'),
  ('loss_dtype', {'loss': jnp.float32}, TypeError, r'loss must be a real'),
  ('emit_now_str', {'emit_now': 'False'}, TypeError, r'emit_now must be'),
  (
    'loss_vector',
    {'loss': jnp.ones(3)},
    ValueError,
    r"loss must be a real scalar \(this micro-batch's loss\); got shape \(3,\)",
  ),
  (
    'grads_missing_leaf',
    {'grads': {'w': GRADS['w']}},
    ValueError,
    r'does not match the parameters',
  ),
  (
    'grads_vs_state',
    {'grads': {'w': GRADS['w']}, 'params': None},
    ValueError,
    r'does not match the accumulator',
  ),
  (
    'grads_leaf_shape',
    {'grads': {'w': GRADS['w'].T, 'b': GRADS['b']}},
    ValueError,
    r'shape \(3, 2\) where the parameter has shape \(2, 3\)',
  ),
  (
    'state_of_other_optimizer',
    {'state': optax.adam(0.1).init(PARAMS)},
    TypeError,
    r'state must be the TokenWeightedMultiStepState.*got tuple',
  ),
  (
    'emit_now_vector',
    {'emit_now': jnp.array([True, False])},
    ValueError,
    r'emit_now must be a boolean scalar.*shape \(2,\)',
  ),
  (
    'schedule_returns_vector',
    {'tx_kwargs': {'every_k_schedule': lambda step: jnp.array([2, 3])}},
    TypeError,
    r'every_k_schedule\(gradient_step\) must be an integer scalar',
  ),
  (
    'schedule_returns_float',
    {'tx_kwargs': {'every_k_schedule': lambda step: 2.5}},
    TypeError,
    r'jnp\.round\(k\)\.astype\(jnp\.int32\)',
  ),
  (
    'loss_str',
    {'loss': 'x'},
    TypeError,
    r"loss must be a real scalar \(this micro-batch's loss\); got 'x'",
  ),
  ('loss_bool', {'loss': True}, TypeError, r'loss must be a real scalar'),
  (
    'schedule_returns_str',
    {'tx_kwargs': {'every_k_schedule': lambda step: '2'}},
    TypeError,
    r"every_k_schedule\(gradient_step\) must be an integer scalar; got '2'",
  ),
  (
    'value_passed',
    {'loss': 1.0, 'value': 1.0},
    TypeError,
    r'got value=.*as loss= instead',
  ),
  (
    'value_fn_passed',
    {'value_fn': lambda params: 0.0},
    TypeError,
    r'got value_fn=.*re-evaluates the objective',
  ),
  (
    'axis_name_unbound',
    {'tx_kwargs': {'axis_name': 'data'}},
    ValueError,
    r"axis_name='data' is not bound here.*leave axis_name=None",
  ),
]


@pytest.mark.parametrize('use_jit', [False, True])
@pytest.mark.parametrize(
  'kwargs, error, match',
  [case[1:] for case in UPDATE_CASES],
  ids=[case[0] for case in UPDATE_CASES],
)
def test_bad_update_input(kwargs, error, match, use_jit):
  kwargs = dict(kwargs)
  tx_kwargs = kwargs.pop('tx_kwargs', None)
  update = lambda **kw: call_update(tx_kwargs, **kw, **kwargs)  # noqa: E731
  if use_jit:
    update = jax.jit(update)
  with pytest.raises(error, match=match):
    update()


def test_input_checks_need_a_multistep_state():
  tx = tokacc.with_input_checks(optax.adam(0.1))
  with pytest.raises(ValueError, match=r'exactly one TokenWeightedMultiStep'):
    tx.update(GRADS, tx.init(PARAMS), PARAMS, num_tokens=3)


# Documented behaviour of bad values that only exist at run time.


def run_window(tx, num_tokens, losses=(1.0, 2.0), grads=GRADS):
  """Two jitted micro-steps; returns the last updates and state."""
  step = jax.jit(tx.update)
  state = tx.init(PARAMS)
  for n, loss in zip(num_tokens, losses):
    updates, state = step(grads, state, PARAMS, num_tokens=n, loss=loss)
  return updates, state


@pytest.mark.parametrize('token_dtype', [None, jnp.float32])
@pytest.mark.parametrize('bad_tokens', [-1, -5])
def test_negative_num_tokens_drops_the_window(token_dtype, bad_tokens):
  tx = build(token_dtype=token_dtype)
  # -1 + 4 would be a "valid" 3 if negative counts were just added.
  updates, state = run_window(tx, [bad_tokens, 4])
  chex.assert_trees_all_equal(updates, optax.tree.zeros_like(GRADS))
  assert not bool(tokacc.has_updated(state))
  assert int(state.gradient_step) == 0
  assert int(state.dropped_windows) == 1
  # The next window is unaffected.
  step = jax.jit(tx.update)
  for _ in range(2):
    updates, state = step(GRADS, state, PARAMS, num_tokens=2)
  # Full batch: 2 * GRADS over 4 tokens.
  chex.assert_trees_all_close(
    updates, jax.tree.map(lambda g: -0.1 * g / 2, GRADS)
  )
  assert int(state.dropped_windows) == 1
  assert int(state.last_tokens) == 4


def test_nan_float_num_tokens_drops_the_window():
  tx = build(token_dtype=jnp.float32)
  updates, state = run_window(tx, [jnp.float32(np.nan), 4.0])
  chex.assert_trees_all_equal(updates, optax.tree.zeros_like(GRADS))
  assert int(state.dropped_windows) == 1


def test_non_finite_loss_is_reported_not_applied():
  """The loss is for reporting: a NaN shows in window_loss for its window."""
  tx = build()
  updates, state = run_window(tx, [1, 3], losses=(np.nan, 2.0))
  expected = jax.tree.map(lambda g: -0.1 * 2 * g / 4, GRADS)
  chex.assert_trees_all_close(updates, expected)
  assert np.isnan(tokacc.window_loss(state))
  step = jax.jit(tx.update)
  for loss in (1.0, 3.0):
    updates, state = step(GRADS, state, PARAMS, num_tokens=2, loss=loss)
  np.testing.assert_allclose(tokacc.window_loss(state), 1.0)


@pytest.mark.parametrize('bad', ['nan', 'inf'])
def test_non_finite_grads_are_skipped_with_skip_not_finite(bad):
  tx = build(should_skip_update_fn=tokacc.skip_not_finite)
  bad_grads = {'w': GRADS['w'].at[0, 0].set(float(bad)), 'b': GRADS['b']}
  step = jax.jit(tx.update)
  state = tx.init(PARAMS)
  updates, state = step(GRADS, state, PARAMS, num_tokens=1)
  updates, state = step(bad_grads, state, PARAMS, num_tokens=5)
  assert int(state.mini_step) == 1  # rejected: the window did not advance
  updates, state = step(GRADS, state, PARAMS, num_tokens=3)
  # Full batch over the two good micro-batches: 2 * GRADS / 4 tokens.
  chex.assert_trees_all_close(
    updates, jax.tree.map(lambda g: -0.1 * g / 2, GRADS)
  )
  assert int(state.last_tokens) == 4


# Opt-in checkify checks.


def checked_step(tx):
  @jax.jit
  @checkify.checkify
  def step(state, num_tokens, loss):
    return tx.update(GRADS, state, PARAMS, num_tokens=num_tokens, loss=loss)

  return step


def test_checks_pass_on_good_input():
  tx = tokacc.with_input_checks(build())
  unchecked = build()
  step = checked_step(tx)
  state = expected_state = tx.init(PARAMS)
  for n in (3, 4, 0, 2):
    err, (updates, state) = step(state, n, 1.0)
    err.throw()
    expected, expected_state = unchecked.update(
      GRADS, expected_state, PARAMS, num_tokens=n, loss=1.0
    )
    chex.assert_trees_all_equal((updates, state), (expected, expected_state))


# (id, micro-steps before the bad one, bad num_tokens, bad loss, message)
CHECK_CASES = [
  ('negative', 0, -3, 1.0, r'num_tokens=-3 is negative.*mini_step=0'),
  ('loss_nan', 1, 2, np.nan, r'loss=nan is not finite at mini_step=1'),
  ('loss_inf', 2, 2, np.inf, r'loss=inf is not finite.*gradient_step=1'),
  (
    'overflow',
    1,
    2**31 - 1,
    1.0,
    r'window closed at mini_step=1, gradient_step=0 was dropped',
  ),
]


@pytest.mark.parametrize(
  'good_steps, num_tokens, loss, match',
  [case[1:] for case in CHECK_CASES],
  ids=[case[0] for case in CHECK_CASES],
)
def test_checks_report_the_bad_micro_step(good_steps, num_tokens, loss, match):
  tx = tokacc.with_input_checks(build())
  step = checked_step(tx)
  state = tx.init(PARAMS)
  for _ in range(good_steps):
    err, (_, state) = step(state, 1, 1.0)
    err.throw()
  err, _ = step(state, num_tokens, loss)
  with pytest.raises(checkify.JaxRuntimeError, match=match):
    err.throw()


def test_checks_inside_a_chain_without_loss():
  tx = tokacc.with_input_checks(optax.chain(optax.scale(1.0), build()))

  @jax.jit
  @checkify.checkify
  def step(state, num_tokens):
    return tx.update(GRADS, state, PARAMS, num_tokens=num_tokens)

  err, (_, state) = step(tx.init(PARAMS), 2)
  err.throw()
  err, _ = step(state, -1)
  with pytest.raises(checkify.JaxRuntimeError, match=r'mini_step=1'):
    err.throw()


@pytest.mark.skipif(
  tokacc_explicit.SUPPORTED, reason='the gate applies to jax < 0.10'
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


# Counts and emit_now of the wrong kind or out of range.


def one_update(num_tokens=None, missing=False, **kwargs):
  """One ``update`` of a fresh transform over Adam (k = 3)."""
  tx = tokacc.token_weighted_multistep(optax.adam(0.1), 3)
  params = {'w': jnp.ones((2, 3)), 'b': jnp.zeros(3)}
  grads = jax.tree.map(jnp.ones_like, params)
  extra = {} if missing else {'num_tokens': num_tokens}
  return tx.update(grads, tx.init(params), params, **extra, **kwargs)


@pytest.mark.parametrize('use_jit', [False, True], ids=['eager', 'jit'])
@pytest.mark.parametrize(
  'num_tokens',
  [
    np.int64(2**32 + 5),
    2**32 + 5,
    np.uint32(2**31),
    2.5,
  ],
  ids=['np_int64', 'python_int', 'np_uint32', 'python_float'],
)
def test_concrete_count_not_representable_is_refused(num_tokens, use_jit):
  """Regression (issue 11, defect 6): out of int32's range, or not whole:
  never wrapped nor rounded."""
  fn = jax.jit(lambda: one_update(num_tokens)) if use_jit else None
  with pytest.raises(ValueError, match='num_tokens'):
    fn() if use_jit else one_update(num_tokens)


@pytest.mark.parametrize(
  'num_tokens',
  [True, np.bool_(True), jnp.asarray(True), 'False', '5', jnp.ones(2), None],
  ids=['bool', 'np_bool', 'jnp_bool', 'str_false', 'str_5', 'vector', 'none'],
)
def test_num_tokens_of_wrong_kind_is_refused(num_tokens):
  """Regression (issue 11, defect 6)."""
  with pytest.raises((TypeError, ValueError), match='num_tokens'):
    one_update(num_tokens)


def test_missing_num_tokens_is_refused():
  """Regression (issue 11, defect 6)."""
  with pytest.raises((TypeError, ValueError), match='num_tokens'):
    one_update(missing=True)


@pytest.mark.parametrize(
  'emit_now',
  ['False', 'True', jnp.int32(1), np.float32(1.0), jnp.asarray(0)],
  ids=['str_false', 'str_true', 'int32', 'float32', 'int_array'],
)
def test_emit_now_of_wrong_kind_is_refused(emit_now):
  """Regression (issue 11, defect 6)."""
  with pytest.raises(TypeError, match='emit_now'):
    one_update(3, emit_now=emit_now)


# ``close`` of the wrong kind, or with another decider of the window.


@pytest.mark.parametrize(
  'close', ['yes', 1, 0, np.bool_(True), jnp.asarray(True)], ids=repr
)
def test_close_must_be_none_or_a_python_bool(close):
  with pytest.raises(TypeError, match=re.escape(f'close={close!r}')):
    call_update(close=close)


def test_a_traced_close_names_emit_now():
  with pytest.raises(TypeError, match=r'close must be .*traced.*emit_now'):
    jax.jit(lambda close: call_update(close=close))(True)


@pytest.mark.parametrize('close', [False, True])
def test_close_with_tokens_per_update_is_refused(close):
  with pytest.raises(ValueError, match=rf'close={close}.*tokens_per_update=10'):
    call_update({'tokens_per_update': 10}, close=close)


@pytest.mark.parametrize('emit_now', [True, jnp.asarray(False)], ids=repr)
@pytest.mark.parametrize('close', [False, True])
def test_close_with_emit_now_is_refused(close, emit_now):
  """Unless ``emit_now`` is statically False: one decider per call (a
  static False: ``test_host_close``)."""
  with pytest.raises(ValueError, match=rf'close={close}.*emit_now'):
    call_update(close=close, emit_now=emit_now)
