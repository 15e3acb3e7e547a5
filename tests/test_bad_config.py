"""Bad arguments of ``token_weighted_multistep``: error type and message.

Arguments of ``update``: ``test_bad_call``; values that exist only at run
time: ``test_bad_values``; bad input under a placement:
``test_bad_placement``.
"""

from bad_input import PARAMS
from bad_input import build
import jax.numpy as jnp
import optax
import pytest

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
    r'token_dtype must be int32, float32 or float64; got bool',
  ),
  (
    'token_dtype_garbage',
    {'token_dtype': 'not-a-dtype'},
    TypeError,
    r"token_dtype must be int32, float32 or float64; got 'not-a-dtype'",
  ),
  # Regression (issue 53): accepted, and silently inexact (a bfloat16 sum
  # keeps 8 significant bits).
  (
    'token_dtype_bfloat16',
    {'token_dtype': jnp.bfloat16},
    TypeError,
    r'token_dtype must be int32, float32 or float64; got bfloat16\. A sum '
    r'of bfloat16 weights keeps 8 significant bits.*token_dtype=jnp\.float32'
    r' \(num_tokens may stay bfloat16\)',
  ),
  (
    'token_dtype_float16',
    {'token_dtype': jnp.float16},
    TypeError,
    r'got float16\. A sum of float16 weights keeps 11 significant bits',
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
  # Under a floating token_dtype: a budget in the weights' units.
  (
    'tokens_per_update_zero_weight',
    {'tokens_per_update': 0.0, 'token_dtype': jnp.float32},
    ValueError,
    r'tokens_per_update must be a finite number > 0; got tokens_per_update=0',
  ),
  (
    'tokens_per_update_inf_weight',
    {'tokens_per_update': float('inf'), 'token_dtype': jnp.float32},
    ValueError,
    r'tokens_per_update must be a finite number > 0; got .*=inf',
  ),
  (
    'tokens_per_update_nan_weight',
    {'tokens_per_update': float('nan'), 'token_dtype': jnp.float32},
    ValueError,
    r'tokens_per_update must be a finite number > 0; got .*=nan',
  ),
  (
    'tokens_per_update_bool_weight',
    {'tokens_per_update': True, 'token_dtype': jnp.float32},
    TypeError,
    r'tokens_per_update must be None or a real number > 0 \(token_dtype=f',
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
