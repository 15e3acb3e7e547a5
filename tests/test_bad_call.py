"""Bad arguments of ``update``: error type and message.

Every argument of the call refused at trace time (``num_tokens``, ``loss``,
the gradients, the state, ``emit_now``, a schedule's value, an unbound
``axis_name``); counts and ``emit_now`` of the wrong kind or out of range
(issue 11, defect 6); ``close`` of the wrong kind or with another decider
(``tokens_per_update``, ``emit_now``).
"""

import re

from bad_input import GRADS
from bad_input import PARAMS
from bad_input import build
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import optax_tokacc as tokacc


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
  # Regression (issue 53): a weight the floating counter cannot honour,
  # known at trace time (traced, it drops its window: test_boundaries).
  (
    'num_tokens_subnormal',
    {'tx_kwargs': {'token_dtype': jnp.float32}, 'num_tokens': 1e-40},
    ValueError,
    r'num_tokens must be 0 or a float32 number from 2\*\*-126 to 2\*\*126'
    r'; got num_tokens=1e-40\. Scale every weight by one factor',
  ),
  (
    'num_tokens_above_the_range',
    {'tx_kwargs': {'token_dtype': jnp.float32}, 'num_tokens': 2.0**127},
    ValueError,
    r'from 2\*\*-126 to 2\*\*126; got num_tokens=1\.7',
  ),
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
