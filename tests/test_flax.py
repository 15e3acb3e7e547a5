"""optax_tokacc.flax: the linen TrainState and the nnx Optimizer.

Both equal full-batch training of a small transformer LM
(``helpers.full_batch`` with its loss and roundings), count windows (also
under ``optax.apply_if_finite``: issue 11, defect 4), keep the updates of
other transforms (``optax.multi_transform``: defect 3), forward
``emit_now`` and ``close`` (a host-closed window equals the device's, bit
for bit: issue 24), report ``window_loss`` and ``window_metrics``, and
refuse what they cannot take.
"""

import functools
import importlib
import sys

import chex
import flax
from flax import nnx
import flax.linen as nn
import helpers
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import optax_tokacc as tokacc
from optax_tokacc import flax as tokacc_flax

VOCAB, DIM, HEADS, LENGTH = 13, 16, 2, 8
WINDOW_SIZE, NUM_WINDOWS = 8, 3
# Thresholds of clip_by_global_norm: below every window's gradient norm
# (clipping acts, the update is non-linear in the window), or far above it
# (clipping does not act: the update is linear in the gradient, so that a
# gradient of the wrong scale shows).
MAX_NORMS = {'clipping': 1.0, 'not_clipping': 1e3}
# (every_k, in_chain, clipping) of the full-batch tests.
FULL_BATCH_CASES = [(2, False, 'clipping'), (4, True, 'clipping')]
FULL_BATCH_CASES += [(2, True, 'not_clipping')]


def make_batch(seed):
  """Padded sequences of lengths 1..LENGTH; labels are -100 on padding."""
  rng = np.random.default_rng(seed)
  tokens = rng.integers(1, VOCAB, size=(WINDOW_SIZE, LENGTH + 1))
  lengths = rng.integers(1, LENGTH + 1, size=WINDOW_SIZE)
  valid = np.arange(LENGTH)[None, :] < lengths[:, None]
  return {
    'inputs': jnp.asarray(np.where(valid, tokens[:, :-1], 0), jnp.int32),
    'valid': jnp.asarray(valid),
    'labels': jnp.asarray(np.where(valid, tokens[:, 1:], -100), jnp.int32),
  }


def split(batch, every_k):
  """The window's micro-batches; checks that their token counts differ."""
  micro_batches = [
    jax.tree.map(lambda x, i=i: np.split(x, every_k)[i], batch)
    for i in range(every_k)
  ]
  counts = {int(m['valid'].sum()) for m in micro_batches}
  assert len(counts) > 1, 'equal token counts would not test the weighting'
  return micro_batches


# The roundings on one token's path to its gradient term, for
# helpers.round_off_atol (the linen model's; the nnx one has fewer):
# the terms of the dot products and reductions forward (three LayerNorms,
# 2 DIM each for their mean and variance; the query/key/value, output and
# two MLP projections, DIM, DIM, DIM and 2 DIM; the attention's scores,
# DIM // HEADS, softmax and weighted sum, LENGTH each; the logits, DIM, and
# their log-softmax, VOCAB), about 50 elementwise operations, and as many
# backward.
TERM_ROUNDINGS = 2 * (12 * DIM + DIM // HEADS + 2 * LENGTH + VOCAB + 50)


def reference_cross_entropy(logits, labels):
  """Plain cross-entropy summed over the counted tokens, written without
  the library."""
  counted = labels != -100
  log_probs = jax.nn.log_softmax(logits, axis=-1)
  safe_labels = jnp.where(counted, labels, 0)[..., None]
  picked = jnp.take_along_axis(log_probs, safe_labels, axis=-1)[..., 0]
  return -jnp.sum(jnp.where(counted, picked, 0))


def valid_count(batch):
  return float(np.sum(batch['valid']))


def full_batch(clipping, params, loss_fn):
  """``helpers.full_batch`` of this file's windows (one batch each) and
  language model (``loss_fn(params, inputs, valid)`` gives its logits),
  with its ``TERM_ROUNDINGS``: ``optimizer(clipping)``'s updates are linear
  in the gradient (momentum SGD) or homogeneous of degree 0 in it (a
  global-norm clip that binds), as the bound needs."""

  def loss_sum(params, batch):
    logits = loss_fn(params, batch['inputs'], batch['valid'])
    return reference_cross_entropy(logits, batch['labels'])

  windows = [[make_batch(window)] for window in range(NUM_WINDOWS)]
  return helpers.full_batch(
    optimizer(clipping),
    params,
    windows,
    loss_sum,
    term_roundings=TERM_ROUNDINGS,
    count_fn=valid_count,
  )


def assert_clipping_as_intended(reference, clipping):
  """Whether clip_by_global_norm acted on the reference's gradients."""
  grad_norms = np.asarray([optax.tree.norm(w.grads) for w in reference.windows])
  if clipping == 'clipping':
    assert np.all(grad_norms > MAX_NORMS['clipping']), grad_norms
  else:
    assert np.all(grad_norms < MAX_NORMS['not_clipping'] / 10), grad_norms


def attention_mask(valid):
  causal = jnp.tril(jnp.ones((LENGTH, LENGTH), jnp.bool_))
  pairs = jnp.logical_and(valid[:, None, :, None], valid[:, None, None, :])
  return jnp.logical_and(causal, pairs)


@functools.cache
def optimizer(clipping='clipping'):
  # Adam would amplify rounding noise in exactly-zero gradients (e.g. the
  # attention key bias).
  return optax.chain(
    optax.clip_by_global_norm(MAX_NORMS[clipping]),
    optax.sgd(0.1, momentum=0.9),
  )


@functools.cache
def multistep(every_k, in_chain=False, clipping='clipping'):
  """One transform object per setting, so jitted steps compile once."""
  tx = tokacc.token_weighted_multistep(optimizer(clipping), every_k)
  return optax.chain(tx) if in_chain else tx


class LinenBlock(nn.Module):
  @nn.compact
  def __call__(self, x, mask):
    x = x + nn.MultiHeadDotProductAttention(num_heads=HEADS)(
      nn.LayerNorm()(x), mask=mask
    )
    hidden = nn.gelu(nn.Dense(2 * DIM)(nn.LayerNorm()(x)))
    return x + nn.Dense(DIM)(hidden)


class LinenLM(nn.Module):
  """A causal transformer LM: embedding, an attention block, logits."""

  @nn.compact
  def __call__(self, inputs, valid):
    positions = self.param(
      'positions', nn.initializers.normal(0.1), (LENGTH, DIM)
    )
    x = nn.Embed(VOCAB, DIM)(inputs) + positions
    mask = attention_mask(valid)
    x = LinenBlock()(x, mask)
    return nn.Dense(VOCAB)(nn.LayerNorm()(x))


@functools.cache
def linen_model_and_params():
  """One model object, so that jitted steps on its apply compile once."""
  model = LinenLM()
  batch = make_batch(0)
  params = model.init(jax.random.key(0), batch['inputs'], batch['valid'])
  return model, params['params']


@functools.cache
def linen_reference_run(clipping):
  """Full-batch training of the linen model."""
  model, params = linen_model_and_params()

  def logits(params, inputs, valid):
    return model.apply({'params': params}, inputs, valid)

  return full_batch(clipping, params, logits)


def linen_state(state_class, tx):
  model, params = linen_model_and_params()
  return state_class.create(apply_fn=model.apply, params=params, tx=tx)


@jax.jit
def linen_train_step(state, batch, emit_now):
  def loss_fn(params):
    logits = state.apply_fn({'params': params}, batch['inputs'], batch['valid'])
    return tokacc.token_cross_entropy(logits, batch['labels'])

  (loss, num_tokens), grads = jax.value_and_grad(loss_fn, has_aux=True)(
    state.params
  )
  return state.apply_gradients(
    grads=grads, num_tokens=num_tokens, loss=loss, emit_now=emit_now
  )


@pytest.mark.slow
@pytest.mark.parametrize(('every_k', 'in_chain', 'clipping'), FULL_BATCH_CASES)
def test_linen_train_state_equals_full_batch(every_k, in_chain, clipping):
  state = linen_state(
    tokacc_flax.TrainState, multistep(every_k, in_chain, clipping)
  )
  reference = linen_reference_run(clipping)
  assert_clipping_as_intended(reference, clipping)
  for window, expected in enumerate(reference.windows):
    batch = make_batch(window)
    for i, micro_batch in enumerate(split(batch, every_k)):
      previous = state
      state = linen_train_step(state, micro_batch, False)
      if i < every_k - 1:
        assert not bool(state.has_updated)
        chex.assert_trees_all_equal(state.params, previous.params)
        assert int(state.step) == int(previous.step)
    assert bool(state.has_updated)
    assert int(state.step) == window + 1
    assert int(state.micro_step) == every_k * (window + 1)
    helpers.assert_within_round_off(state.params, expected)
    chex.assert_trees_all_close(
      state.window_loss, expected.loss, rtol=0, atol=expected.loss_atol
    )
    if window == 0:
      compiled = linen_train_step._cache_size()
  assert linen_train_step._cache_size() == compiled, 'retraced'


@pytest.mark.slow
def test_linen_emit_now_is_forwarded():
  state = linen_state(tokacc_flax.TrainState, multistep(4, True))
  micro_batches = split(make_batch(0), 4)
  state = linen_train_step(state, micro_batches[0], False)
  assert int(state.step) == 0
  previous = state
  state = linen_train_step(state, micro_batches[1], True)
  assert int(state.step) == 1 and int(state.micro_step) == 2
  assert not np.allclose(
    state.params['Dense_0']['kernel'], previous.params['Dense_0']['kernel']
  )


def test_linen_train_state_needs_the_transform():
  with pytest.raises(ValueError, match='needs tx to be optax_tokacc'):
    linen_state(tokacc_flax.TrainState, optimizer())


@pytest.mark.parametrize('mapping', [dict, flax.core.FrozenDict])
def test_linen_train_state_rejects_fp8_collections(mapping):
  """Also in a ``FrozenDict`` (what ``model.init`` gives in older Flax)."""
  state = linen_state(tokacc_flax.TrainState, multistep(2))
  grads = mapping({'_overwrite_with_gradient': {}, 'params': state.params})
  with pytest.raises(ValueError, match='fp8'):
    state.apply_gradients(grads=grads, num_tokens=1)


class NnxLM(nnx.Module):
  """A causal transformer LM: embedding, one attention block, logits."""

  def __init__(self, rngs):
    self.embed = nnx.Embed(VOCAB, DIM, rngs=rngs)
    self.positions = nnx.Param(0.1 * jax.random.normal(rngs(), (LENGTH, DIM)))
    self.norm = nnx.LayerNorm(DIM, rngs=rngs)
    self.attention = nnx.MultiHeadAttention(
      num_heads=HEADS, in_features=DIM, decode=False, rngs=rngs
    )
    self.out = nnx.Linear(DIM, VOCAB, rngs=rngs)

  def __call__(self, inputs, valid):
    x = self.embed(inputs) + self.positions[...]
    x = x + self.attention(self.norm(x), mask=attention_mask(valid))
    return self.out(x)


def nnx_loss(model, batch):
  """The token-summed loss and the count of the micro-batch."""
  logits = model(batch['inputs'], batch['valid'])
  return tokacc.token_cross_entropy(logits, batch['labels'])


@nnx.jit
def nnx_train_step(model, optimizer, batch):
  loss_fn = functools.partial(nnx_loss, batch=batch)
  (loss, num_tokens), grads = nnx.value_and_grad(loss_fn, has_aux=True)(model)
  return optimizer.update(model, grads, num_tokens=num_tokens, loss=loss)


def nnx_params(model):
  return nnx.to_pure_dict(nnx.state(model, nnx.Param))


@functools.cache
def nnx_reference_run(clipping):
  """Full-batch training of the nnx model's parameters (a pure dict)."""
  graphdef, params, rest = nnx.split(NnxLM(nnx.Rngs(0)), nnx.Param, ...)

  def logits(params, inputs, valid):
    state = nnx.State(params)
    return nnx.merge(graphdef, state, rest)(inputs, valid)

  return full_batch(clipping, nnx.to_pure_dict(params), logits)


@pytest.mark.slow
@pytest.mark.parametrize(('every_k', 'in_chain', 'clipping'), FULL_BATCH_CASES)
def test_nnx_optimizer_equals_full_batch(every_k, in_chain, clipping):
  model = NnxLM(nnx.Rngs(0))
  opt = tokacc_flax.Optimizer(
    model, multistep(every_k, in_chain, clipping), wrt=nnx.Param
  )
  reference = nnx_reference_run(clipping)
  assert_clipping_as_intended(reference, clipping)
  for window, expected in enumerate(reference.windows):
    for i, micro_batch in enumerate(split(make_batch(window), every_k)):
      previous = nnx_params(model)
      nnx_train_step(model, opt, micro_batch)
      assert int(opt.micro_step[...]) == every_k * window + i + 1
      if i < every_k - 1:
        assert not bool(opt.has_updated)
        assert int(opt.step[...]) == window
        helpers.assert_same_bits(nnx_params(model), previous)
    assert bool(opt.has_updated)
    assert int(opt.step[...]) == window + 1
    helpers.assert_within_round_off(nnx_params(model), expected)
    chex.assert_trees_all_close(
      opt.window_loss, expected.loss, rtol=0, atol=expected.loss_atol
    )


def test_nnx_optimizer_keeps_the_step_dtype_of_nnx():
  model = NnxLM(nnx.Rngs(0))
  plain = nnx.Optimizer(model, optimizer(), wrt=nnx.Param)
  opt = tokacc_flax.Optimizer(model, multistep(2), wrt=nnx.Param)
  assert opt.step[...].dtype == plain.step[...].dtype
  assert opt.micro_step[...].dtype == plain.step[...].dtype
  assert int(opt.step[...]) == int(opt.micro_step[...]) == 0
  assert not bool(opt.has_updated)


def test_nnx_optimizer_needs_the_transform():
  model = NnxLM(nnx.Rngs(0))
  with pytest.raises(ValueError, match='needs tx to be optax_tokacc'):
    tokacc_flax.Optimizer(model, optimizer(), wrt=nnx.Param)


# Compositions with other optax transformations, on two parameters 'a' and
# 'b' and gradients given directly: each micro-batch is (grads, num_tokens).

INITIAL = {
  'a': np.array([1.0, -2.0], np.float32),
  'b': np.array([0.5, 3.0], np.float32),
}


def micro_batches(finite):
  """One micro-batch per entry of ``finite``; NaN gradients where False."""
  rng = np.random.default_rng(1)
  feeds = []
  for is_finite in finite:
    grads = {
      k: rng.normal(size=v.shape).astype(np.float32) for k, v in INITIAL.items()
    }
    if not is_finite:
      grads['a'][0] = np.nan
    feeds.append((grads, int(rng.integers(1, 20))))
  return feeds


class TwoParams(nnx.Module):
  def __init__(self):
    self.a = nnx.Param(jnp.asarray(INITIAL['a']))
    self.b = nnx.Param(jnp.asarray(INITIAL['b']))


@functools.partial(jax.jit, static_argnames='close')
def linen_feed(state, grads, num_tokens, close=None):
  return state.apply_gradients(grads=grads, num_tokens=num_tokens, close=close)


@functools.partial(nnx.jit, static_argnames='close')
def nnx_feed(model, opt, grads, num_tokens, close=None):
  def linear_loss(model):  # its gradient is `grads`
    return jnp.sum(grads['a'] * model.a[...]) + jnp.sum(
      grads['b'] * model.b[...]
    )

  opt.update(
    model, nnx.grad(linear_loss)(model), num_tokens=num_tokens, close=close
  )


def run(framework, tx, feeds, closes=None):
  """(params, step, has_updated, micro_step) after each micro-batch;
  ``closes[i]``: who closes the window at micro-batch ``i`` (None: the
  device; a bool: the host)."""
  if framework == 'linen':
    state = tokacc_flax.TrainState.create(apply_fn=None, params=INITIAL, tx=tx)
  else:
    model = TwoParams()
    opt = tokacc_flax.Optimizer(model, tx, wrt=nnx.Param)
  trace = []
  for (grads, num_tokens), close in zip(feeds, closes or [None] * len(feeds)):
    if framework == 'linen':
      state = linen_feed(state, grads, num_tokens, close)
      params, step, updated = state.params, state.step, state.has_updated
      micro_step = state.micro_step
    else:
      nnx_feed(model, opt, grads, num_tokens, close)
      params = {'a': model.a[...], 'b': model.b[...]}
      step, updated, micro_step = (
        opt.step[...],
        opt.has_updated,
        opt.micro_step[...],
      )
    trace.append(
      (jax.device_get(params), int(step), bool(updated), int(micro_step))
    )
  return trace


def window_update(window, learning_rate):
  """Plain SGD on the token-mean gradient of a window of (grads, tokens).

  Equal to the transform's update bit for bit, on any IEEE float32 CPU:
  for windows of two micro-batches, the sum of two gradients rounds once
  here and in the transform (Kahan's compensation of two terms gives the
  same sum), the division by the token count (exact in float32) rounds
  once in both, and scaling by a learning rate that is a power of two
  (0.5, 1.0) is exact in any order; adding the update to a parameter
  rounds once in both.
  """
  num_tokens = sum(tokens for _, tokens in window)
  return {
    k: -learning_rate * sum(grads[k] for grads, _ in window) / num_tokens
    for k in INITIAL
  }


@pytest.mark.parametrize('framework', ['linen', 'nnx'])
def test_step_counts_windows_under_apply_if_finite(framework):
  # A rejected micro-batch returns the previous state, whose `emitted` flag
  # may be True: the step must not advance on it.
  every_k, learning_rate = 2, 0.5
  finite = [True, True, False, True, False, False, True, False, True, True]
  feeds = micro_batches(finite)
  tx = optax.apply_if_finite(
    tokacc.token_weighted_multistep(optax.sgd(learning_rate), every_k),
    max_consecutive_errors=100,
  )
  trace = run(framework, tx, feeds)

  params, window, step = dict(INITIAL), [], 0
  for i, ((grads, num_tokens), actual) in enumerate(zip(feeds, trace)):
    if finite[i]:
      window.append((grads, num_tokens))
    updated = len(window) == every_k
    if updated:
      update = window_update(window, learning_rate)
      params = {k: params[k] + update[k] for k in params}
      window, step = [], step + 1
    actual_params, actual_step, actual_updated, micro_step = actual
    assert (actual_step, actual_updated, micro_step) == (step, updated, i + 1)
    # Bit for bit: see window_update.
    chex.assert_trees_all_equal(actual_params, params)
  assert step == 3


@pytest.mark.parametrize('framework', ['linen', 'nnx'])
def test_multi_transform_keeps_the_updates_of_other_transforms(framework):
  every_k, learning_rate = 2, 0.5

  def labels(params):
    def label(path, _):
      key = path[0]  # nnx.Optimizer.__init__ passes Variables
      name = getattr(key, 'key', getattr(key, 'name', None))
      return 'acc' if name == 'a' else 'plain'

    return jax.tree_util.tree_map_with_path(label, params)

  tx = optax.multi_transform(
    {
      'acc': tokacc.token_weighted_multistep(optax.sgd(learning_rate), every_k),
      'plain': optax.sgd(1.0),
    },
    labels,
  )
  feeds = micro_batches([True] * 3 * every_k)
  trace = run(framework, tx, feeds)

  a, b = INITIAL['a'].copy(), INITIAL['b'].copy()
  for i, ((grads, _), actual) in enumerate(zip(feeds, trace)):
    b = b - 1.0 * grads['b']  # plain SGD moves 'b' on every micro-batch
    updated = (i + 1) % every_k == 0
    if updated:
      a = a + window_update(feeds[i + 1 - every_k : i + 1], learning_rate)['a']
    actual_params, actual_step, actual_updated, _ = actual
    assert (actual_step, actual_updated) == ((i + 1) // every_k, updated)
    # Bit for bit: see window_update ('b': one rounding of b - g, in both).
    chex.assert_trees_all_equal(actual_params, {'a': a, 'b': b})


@pytest.mark.parametrize(
  'framework', ['linen', pytest.param('nnx', marks=pytest.mark.slow)]
)
def test_host_closed_windows_equal_device_decided(framework):
  """``close`` forwarded (issue 24): the host closes windows of 2, 3 and
  1 micro-batches: the same
  parameters (bit for bit), steps and flags as the device deciding with a
  schedule that agrees, and plain SGD on each window's token-mean
  gradient."""
  sizes, learning_rate = (2, 3, 1), 0.5  # a power of two: -lr * g is exact
  tx = tokacc.token_weighted_multistep(
    optax.sgd(learning_rate), helpers.schedule_of(sizes)
  )
  feeds = micro_batches([True] * sum(sizes))
  ends = np.cumsum(sizes) - 1
  closes = [i in ends for i in range(len(feeds))]
  expected = run(framework, tx, feeds)
  actual = run(framework, tx, feeds, closes)
  params, start = dict(INITIAL), 0
  for i, ((a_params, *a_counts), (e_params, *e_counts)) in enumerate(
    zip(actual, expected)
  ):
    helpers.assert_same_bits(a_params, e_params, f'params after call {i}')
    assert a_counts == e_counts, i
    step, updated, micro_step = a_counts
    assert (updated, micro_step) == (closes[i], i + 1)
    if closes[i]:
      update = window_update(feeds[start : i + 1], learning_rate)
      params = {k: params[k] + update[k] for k in params}
      start = i + 1
    assert step == int(np.sum(np.asarray(closes[: i + 1])))
    # Sums of at most 3 float32 terms, one division: a few 2**-24.
    chex.assert_trees_all_close(a_params, params, rtol=1e-6)


@pytest.mark.parametrize('framework', ['linen', 'nnx'])
def test_window_loss_is_nan_until_known(framework):
  # Before the first window, and after windows fed without `loss`.
  tx = tokacc.token_weighted_multistep(optax.sgd(0.1), 2)
  feeds = micro_batches([True] * 2)
  if framework == 'linen':
    state = tokacc_flax.TrainState.create(apply_fn=None, params=INITIAL, tx=tx)
    assert np.isnan(state.window_loss)
    for grads, num_tokens in feeds:
      state = linen_feed(state, grads, num_tokens)
    assert bool(state.has_updated) and np.isnan(state.window_loss)
  else:
    model = TwoParams()
    opt = tokacc_flax.Optimizer(model, tx, wrt=nnx.Param)
    assert np.isnan(opt.window_loss)
    for grads, num_tokens in feeds:
      nnx_feed(model, opt, grads, num_tokens)
    assert bool(opt.has_updated) and np.isnan(opt.window_loss)


@pytest.mark.parametrize('framework', ['linen', 'nnx'])
@pytest.mark.parametrize('window_norms', [True, 'per_leaf'])
def test_window_metrics(framework, window_norms):
  """NaN before the first window, then the window's token-mean gradient's
  norm and SGD's update norm (0.1 of it), as computed here, and with
  ``window_norms='per_leaf'`` each leaf's (issue 41); the bound: one
  rounding per summed term (two micro-batches, the division, the P
  squares), relative to the norm."""
  tx = tokacc.token_weighted_multistep(
    optax.sgd(0.1), 2, window_norms=window_norms
  )
  feeds = micro_batches([True] * 2)
  if framework == 'linen':
    state = tokacc_flax.TrainState.create(apply_fn=None, params=INITIAL, tx=tx)
    assert np.isnan(state.window_metrics.grad_norm)
    for grads, num_tokens in feeds:
      state = linen_feed(state, grads, num_tokens)
    metrics = state.window_metrics
  else:
    model = TwoParams()
    opt = tokacc_flax.Optimizer(model, tx, wrt=nnx.Param)
    assert np.isnan(opt.window_metrics.grad_norm)
    for grads, num_tokens in feeds:
      nnx_feed(model, opt, grads, num_tokens)
    metrics = opt.window_metrics
  tokens = sum(n for _, n in feeds)
  mean = {
    k: sum(g[k].astype(np.float64) for g, _ in feeds) / tokens for k in INITIAL
  }
  norm = np.sqrt(sum(np.sum(m**2) for m in mean.values()))
  size = sum(np.size(v) for v in INITIAL.values())
  rtol = (size + 8) * np.finfo(np.float32).eps
  assert int(metrics.tokens) == tokens
  np.testing.assert_allclose(metrics.grad_norm, norm, rtol=rtol)
  np.testing.assert_allclose(metrics.update_norm, 0.1 * norm, rtol=rtol)
  if window_norms != 'per_leaf':
    assert metrics.grad_norms is None and metrics.update_norms is None
    return
  leaves = jax.tree.leaves_with_path(metrics.grad_norms)
  assert len(leaves) == len(INITIAL)
  for path, value in leaves:
    key = path[0].key  # the parameter's name (nnx: then its Variable's value)
    leaf_norm = np.sqrt(np.sum(mean[key] ** 2))
    np.testing.assert_allclose(value, leaf_norm, rtol=rtol)
    update = jax.tree.leaves(metrics.update_norms)  # same order
    np.testing.assert_allclose(
      update[[p for p, _ in leaves].index(path)], 0.1 * leaf_norm, rtol=rtol
    )


def test_nnx_emit_now_is_forwarded():
  model = TwoParams()
  opt = tokacc_flax.Optimizer(model, multistep(4), wrt=nnx.Param)
  ((grads, num_tokens),) = micro_batches([True])
  grads = nnx.State({k: nnx.Param(jnp.asarray(v)) for k, v in grads.items()})
  opt.update(model, grads, num_tokens=num_tokens, emit_now=True)
  assert int(opt.step[...]) == 1 and int(opt.micro_step[...]) == 1
  assert bool(opt.has_updated)
  assert not np.allclose(model.a[...], INITIAL['a'])


def test_import_without_flax_names_the_extra(monkeypatch):
  """Without Flax installed, ``import optax_tokacc.flax`` says which extra
  installs it (issue 39), and stays a ``ModuleNotFoundError`` naming the
  missing module, as ``importlib`` callers expect."""
  for name in list(sys.modules):
    if name == 'flax' or name.startswith('flax.'):
      monkeypatch.setitem(sys.modules, name, None)  # import raises
  monkeypatch.delitem(sys.modules, 'optax_tokacc.flax')
  with pytest.raises(ModuleNotFoundError, match=r'optax_tokacc\[flax\]') as e:
    importlib.import_module('optax_tokacc.flax')
  assert e.value.name.split('.')[0] == 'flax'


# The linen TrainState on the model of helpers.


def model_step(state, batch):
  loss, grads = jax.value_and_grad(helpers.loss_sum)(state.params, batch)
  return state.apply_gradients(
    grads=grads, num_tokens=helpers.token_count(batch), loss=loss
  )


def test_train_state_applies_the_updates_of_other_transforms():
  """Regression (issue 11, defect 3): under ``optax.multi_transform`` the
  TrainState applies the plain transform's updates on every micro-step and
  the accumulator's once per window (``helpers.split_reference``); its
  step counts windows."""
  k, plain_learning_rate = 3, 0.01
  inner = optax.adam(0.1)
  tx = optax.multi_transform(
    {
      'acc': tokacc.token_weighted_multistep(inner, k),
      'plain': optax.sgd(plain_learning_rate),
    },
    {'w': 'acc', 'v': 'plain'},
  )
  windows = helpers.windows_of(((5, 0, 8), (2, 7, 1)))
  micro_batches = [batch for window in windows for batch in window]
  expected = helpers.split_reference(
    inner, helpers.init_params(), micro_batches, k, plain_learning_rate
  )
  step = jax.jit(model_step)
  state = tokacc_flax.TrainState.create(
    apply_fn=helpers.loss_sum, params=helpers.init_params(), tx=tx
  )
  for i, batch in enumerate(micro_batches):
    state = step(state, batch)
    helpers.assert_within_round_off(state.params, expected[i])
    assert int(state.step) == (i + 1) // k


def test_train_state_step_under_apply_if_finite_after_each_window():
  """Regression (issue 11, defect 4): under ``optax.apply_if_finite``, a
  NaN micro-batch right after each window's last (rejected entirely: the
  previous state, whose window had just closed, is kept) does not advance
  the TrainState's step; training equals full-batch training."""
  k = 3
  inner = optax.adam(0.1)
  tx = optax.apply_if_finite(
    tokacc.token_weighted_multistep(inner, k), max_consecutive_errors=10
  )
  windows = helpers.windows_of(((5, 0, 8), (2, 7, 1)))
  stream = []
  for window in windows:
    stream.extend(window)
    nan = helpers.micro_batch(99, helpers.LOCAL_TOKENS)
    nan['y'][0, 0] = np.nan
    stream.append(nan)
  windows_closed, closed = [], 0
  for batch in stream:
    closed += bool(np.isfinite(batch['y']).all())
    windows_closed.append(closed // k)
  step = jax.jit(model_step)
  state = tokacc_flax.TrainState.create(
    apply_fn=helpers.loss_sum, params=helpers.init_params(), tx=tx
  )
  steps = []
  for batch in stream:
    state = step(state, batch)
    steps.append(int(state.step))
  assert steps == windows_closed
  assert int(tokacc.find_state(state.opt_state).gradient_step) == len(windows)
  expected = helpers.full_batch(inner, helpers.init_params(), windows)
  helpers.assert_within_round_off(state.params, expected)


def nnx_runs(make_optimizer, every_k=4, num_windows=2):
  """The model's parameters, the optimizer's state and the returned updates
  after each micro-step of ``nnx_train_step``'s model, with an optimizer
  made by ``make_optimizer(model, tx)``; a micro-batch without tokens in
  the first window."""
  model = NnxLM(nnx.Rngs(0))
  opt = make_optimizer(model, multistep(every_k))
  found = []
  for window in range(num_windows):
    for i, batch in enumerate(split(make_batch(window), every_k)):
      if (window, i) == (0, 1):
        batch = dict(batch, labels=jnp.full_like(batch['labels'], -100))
      updates = nnx_train_step(model, opt, batch)
      state = nnx.to_pure_dict(nnx.state(opt.opt_state))
      if updates is not None:  # nnx.Optimizer.update returns them (0.12.8)
        updates = nnx.to_pure_dict(updates)
      found.append((nnx_params(model), state, updates))
  return found


def test_nnx_optimizer_is_nnx_optimizers_update_bit_for_bit():
  """Issue 55: the nnx ``Optimizer`` applies through ``update_and_apply``.
  Its parameters, state and returned updates are ``nnx.Optimizer``'s
  (``tx.update`` then ``optax.apply_updates``), bit for bit, on every
  micro-step (the updates where ``nnx.Optimizer`` returns them)."""
  ours = nnx_runs(
    lambda model, tx: tokacc_flax.Optimizer(model, tx, wrt=nnx.Param)
  )
  theirs = nnx_runs(lambda model, tx: nnx.Optimizer(model, tx, wrt=nnx.Param))
  for i, (found, expected) in enumerate(zip(ours, theirs, strict=True)):
    if expected[2] is None:  # Flax 0.12.2's returns no updates
      found, expected = found[:2], expected[:2]
    helpers.assert_same_bits(found, expected, f'micro-step {i}')
  helpers.assert_same_bits(ours[0][0], ours[1][0], 'an open micro-step')
  moved = jax.tree.map(
    lambda a, b: bool(np.any(a != b)), ours[-1][0], ours[0][0]
  )
  assert any(jax.tree.leaves(moved))  # the windows did update them


def test_nnx_optimizers_open_micro_step_adds_nothing_to_the_parameters():
  """Compiled, the nnx ``Optimizer``'s step adds nothing to the parameters
  outside the loop's trip (the forward pass alone reads them); with
  ``nnx.Optimizer`` an add does on every call (the check can fail)."""
  from optax_tokacc.testing import hlo  # noqa: PLC0415

  def uses(make_optimizer):
    model = NnxLM(nnx.Rngs(0))
    opt = make_optimizer(model, multistep(4), wrt=nnx.Param)
    graphdef, params, rest = nnx.split((model, opt), nnx.Param, ...)

    @functools.partial(jax.jit, donate_argnums=(0, 1))
    def step(params, rest, batch):
      model, opt = nnx.merge(graphdef, params, rest)
      grads = nnx.grad(lambda m: nnx_loss(m, batch)[0])(model)
      opt.update(model, grads, num_tokens=jnp.sum(batch['valid']))
      return nnx.split((model, opt), nnx.Param, ...)[1:]

    text = hlo.compiled_text(step, params, rest, make_batch(0))
    return hlo.first_uses(hlo.parse_hlo(text), 'params')

  ours = uses(tokacc_flax.Optimizer)
  theirs = uses(nnx.Optimizer)
  assert all('add' not in found for found in ours.values()), ours
  assert any('add' in found for found in theirs.values()), theirs
