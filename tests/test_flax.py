"""optax_tokacc.flax: TrainState and Optimizer equal full-batch training."""

import functools
import importlib
import sys
from typing import NamedTuple

import chex
import flax
from flax import nnx
import flax.linen as nn
from flax.training import train_state
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import test_multistep

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


def reference_mean_loss(logits, labels):
  """Plain token-mean cross-entropy, written without the library."""
  counted = labels != -100
  log_probs = jax.nn.log_softmax(logits, axis=-1)
  safe_labels = jnp.where(counted, labels, 0)[..., None]
  picked = jnp.take_along_axis(log_probs, safe_labels, axis=-1)[..., 0]
  return -jnp.sum(jnp.where(counted, picked, 0)) / counted.sum()


# The roundings on one token's path to its gradient term, for
# test_multistep.round_off_atol (the linen model's; the nnx one has fewer):
# the terms of the dot products and reductions forward (three LayerNorms,
# 2 DIM each for their mean and variance; the query/key/value, output and
# two MLP projections, DIM, DIM, DIM and 2 DIM; the attention's scores,
# DIM // HEADS, softmax and weighted sum, LENGTH each; the logits, DIM, and
# their log-softmax, VOCAB), about 50 elementwise operations, and as many
# backward.
TERM_ROUNDINGS = 2 * (12 * DIM + DIM // HEADS + 2 * LENGTH + VOCAB + 50)


class Expected(NamedTuple):
  """How far float32 round-off can take accumulation from a window of
  full-batch training: its parameters after, and its loss."""

  atol: float
  loss_atol: float


def round_off_bounds(params, losses, gradient_norms) -> list[Expected]:
  """An :class:`Expected` per window of full-batch training, from the
  parameters before and after each window (``params``, one more than
  windows), each window's loss and the 1-norm of its gradient.

  ``atol`` is ``test_multistep.round_off_atol`` (its docstring derives it)
  with this model's ``TERM_ROUNDINGS``: per window 2 (n + m) u of the
  gradient, doubled by the update (linear in it: momentum SGD; or
  homogeneous of degree 0: a global-norm clip that binds), relative to the
  window's largest update, plus a rounding of each parameter in each run.
  As ``helpers.full_batch``, the window's loss, a sum
  of n one-signed terms, is within 2 (n + m) u of it relatively, taken at
  parameters up to the previous windows' ``atol`` apart: the 1-norm of its
  gradient times that, doubled for the second-order term.
  """
  windows = [[{'mask': make_batch(w)['valid']}] for w in range(NUM_WINDOWS)]
  n = test_multistep.window_tokens(windows)
  loss_rtol = 2 * (n + TERM_ROUNDINGS) * test_multistep.UNIT_ROUND_OFF
  largest_param = max(test_multistep.largest(p) for p in params)
  bounds, largest_updates, atol = [], [], 0.0
  for before, after, loss, gradient_norm in zip(
    params, params[1:], losses, gradient_norms
  ):
    loss_atol = 2 * (loss_rtol * float(loss) + float(gradient_norm) * atol)
    updates = jax.tree.map(jnp.subtract, after, before)
    largest_updates.append(test_multistep.largest(updates))
    atol = test_multistep.round_off_atol(
      largest_updates, largest_param, windows, TERM_ROUNDINGS
    )
    bounds.append(Expected(atol, loss_atol))
  return bounds


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


def assert_clipping_as_intended(grad_norms, clipping):
  """Whether clip_by_global_norm acted on the reference's gradients."""
  grad_norms = np.asarray(grad_norms)
  if clipping == 'clipping':
    assert np.all(grad_norms > MAX_NORMS['clipping']), grad_norms
  else:
    assert np.all(grad_norms < MAX_NORMS['not_clipping'] / 10), grad_norms


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


@jax.jit
def linen_reference_step(state, batch):
  def loss_fn(params):
    logits = state.apply_fn({'params': params}, batch['inputs'], batch['valid'])
    return reference_mean_loss(logits, batch['labels'])

  loss, grads = jax.value_and_grad(loss_fn)(state.params)
  grad_norms = (optax.tree.norm(grads), optax.tree.norm(grads, ord=1))
  return state.apply_gradients(grads=grads), loss, grad_norms


@functools.cache
def linen_reference_run(clipping):
  """Full-batch training with the plain Flax TrainState, one per window:
  (state, loss, :func:`round_off_bounds`) per window, and the full-batch
  gradient norms."""
  reference = linen_state(train_state.TrainState, optimizer(clipping))
  states, losses, grad_norms, one_norms = [], [], [], []
  params = [reference.params]
  for window in range(NUM_WINDOWS):
    reference, loss, (grad_norm, one_norm) = linen_reference_step(
      reference, make_batch(window)
    )
    states.append(reference)
    params.append(reference.params)
    losses.append(loss)
    grad_norms.append(grad_norm)
    one_norms.append(one_norm)
  bounds = round_off_bounds(params, losses, one_norms)
  return list(zip(states, losses, bounds)), grad_norms


@pytest.mark.slow
@pytest.mark.parametrize(('every_k', 'in_chain', 'clipping'), FULL_BATCH_CASES)
def test_linen_train_state_equals_full_batch(every_k, in_chain, clipping):
  state = linen_state(
    tokacc_flax.TrainState, multistep(every_k, in_chain, clipping)
  )
  reference_run, grad_norms = linen_reference_run(clipping)
  assert_clipping_as_intended(grad_norms, clipping)
  for window, (reference, reference_loss, bounds) in enumerate(reference_run):
    batch = make_batch(window)
    for i, micro_batch in enumerate(split(batch, every_k)):
      previous = state
      state = linen_train_step(state, micro_batch, False)
      if i < every_k - 1:
        assert not bool(state.has_updated)
        chex.assert_trees_all_equal(state.params, previous.params)
        assert int(state.step) == int(previous.step)
    assert bool(state.has_updated)
    assert int(state.step) == int(reference.step) == window + 1
    assert int(state.micro_step) == every_k * (window + 1)
    # Within the round-off bounds of round_off_bounds (derived there).
    chex.assert_trees_all_close(
      state.params, reference.params, rtol=0, atol=bounds.atol
    )
    chex.assert_trees_all_close(
      state.window_loss, reference_loss, rtol=0, atol=bounds.loss_atol
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


@nnx.jit
def nnx_train_step(model, optimizer, batch):
  def loss_fn(model):
    logits = model(batch['inputs'], batch['valid'])
    return tokacc.token_cross_entropy(logits, batch['labels'])

  (loss, num_tokens), grads = nnx.value_and_grad(loss_fn, has_aux=True)(model)
  optimizer.update(model, grads, num_tokens=num_tokens, loss=loss)


@nnx.jit
def nnx_reference_step(model, optimizer, batch):
  def loss_fn(model):
    logits = model(batch['inputs'], batch['valid'])
    return reference_mean_loss(logits, batch['labels'])

  loss, grads = nnx.value_and_grad(loss_fn)(model)
  optimizer.update(model, grads)
  return loss, (optax.tree.norm(grads), optax.tree.norm(grads, ord=1))


def nnx_params(model):
  return nnx.to_pure_dict(nnx.state(model, nnx.Param))


def assert_same_bits(actual, expected):
  """Bit-for-bit equality (unlike ==, tells -0.0 from 0.0)."""

  def same_bits(x, y):
    x, y = np.asarray(x), np.asarray(y)
    assert x.dtype == y.dtype and x.shape == y.shape
    np.testing.assert_array_equal(x.view(np.uint8), y.view(np.uint8))

  jax.tree.map(same_bits, actual, expected)


@functools.cache
def nnx_reference_run(clipping):
  """Full-batch training with nnx.Optimizer: (params, loss, step,
  :func:`round_off_bounds`) per window, and the full-batch gradient
  norms."""
  model = NnxLM(nnx.Rngs(0))
  opt = nnx.Optimizer(model, optimizer(clipping), wrt=nnx.Param)
  params, losses, steps, grad_norms, one_norms = (
    [nnx_params(model)],
    [],
    [],
    [],
    [],
  )
  for window in range(NUM_WINDOWS):
    loss, (grad_norm, one_norm) = nnx_reference_step(
      model, opt, make_batch(window)
    )
    params.append(nnx_params(model))
    losses.append(loss)
    steps.append(int(opt.step[...]))
    grad_norms.append(grad_norm)
    one_norms.append(one_norm)
  bounds = round_off_bounds(params, losses, one_norms)
  return list(zip(params[1:], losses, steps, bounds)), grad_norms


@pytest.mark.slow
@pytest.mark.parametrize(('every_k', 'in_chain', 'clipping'), FULL_BATCH_CASES)
def test_nnx_optimizer_equals_full_batch(every_k, in_chain, clipping):
  model = NnxLM(nnx.Rngs(0))
  opt = tokacc_flax.Optimizer(
    model, multistep(every_k, in_chain, clipping), wrt=nnx.Param
  )
  reference_run, grad_norms = nnx_reference_run(clipping)
  assert_clipping_as_intended(grad_norms, clipping)
  for window, (params, loss, step, bounds) in enumerate(reference_run):
    for i, micro_batch in enumerate(split(make_batch(window), every_k)):
      previous = nnx_params(model)
      nnx_train_step(model, opt, micro_batch)
      assert int(opt.micro_step[...]) == every_k * window + i + 1
      if i < every_k - 1:
        assert not bool(opt.has_updated)
        assert int(opt.step[...]) == window
        assert_same_bits(nnx_params(model), previous)
    assert bool(opt.has_updated)
    assert int(opt.step[...]) == step == window + 1
    # Within the round-off bounds of round_off_bounds (derived there).
    chex.assert_trees_all_close(
      nnx_params(model), params, rtol=0, atol=bounds.atol
    )
    chex.assert_trees_all_close(
      opt.window_loss, loss, rtol=0, atol=bounds.loss_atol
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


@jax.jit
def linen_feed(state, grads, num_tokens):
  return state.apply_gradients(grads=grads, num_tokens=num_tokens)


@nnx.jit
def nnx_feed(model, opt, grads, num_tokens):
  def linear_loss(model):  # its gradient is `grads`
    return jnp.sum(grads['a'] * model.a[...]) + jnp.sum(
      grads['b'] * model.b[...]
    )

  opt.update(model, nnx.grad(linear_loss)(model), num_tokens=num_tokens)


def run(framework, tx, feeds):
  """(params, step, has_updated, micro_step) after each micro-batch."""
  if framework == 'linen':
    state = tokacc_flax.TrainState.create(apply_fn=None, params=INITIAL, tx=tx)
  else:
    model = TwoParams()
    opt = tokacc_flax.Optimizer(model, tx, wrt=nnx.Param)
  trace = []
  for grads, num_tokens in feeds:
    if framework == 'linen':
      state = linen_feed(state, grads, num_tokens)
      params, step, updated = state.params, state.step, state.has_updated
      micro_step = state.micro_step
    else:
      nnx_feed(model, opt, grads, num_tokens)
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
