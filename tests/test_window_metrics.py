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
"""``window_metrics``: each metric against full-batch training, written
plainly here, in every placement; what empty and dropped windows, a
checkpoint and the ``acc_grads`` alias do; and the HLO of a micro-step.

The reference (:func:`full_batch_metrics`) is taken at the parameters the
run had when each window began (recorded), so that it differs from the run
by round-off only (a reference trained on its own, ``helpers.full_batch``,
would drift by the parameters' round-off too): not a trainer, the metrics
of full-batch windows at given parameters. The bound: a window's gradient
is a sum over its ``n`` tokens of per-token terms with at most
``TERM_ROUNDINGS`` roundings each, in any order (devices, micro-steps), so
each entry is within ``gamma(n + TERM_ROUNDINGS)`` of the sum of its terms'
magnitudes (Higham), which per-token gradients give; the run and the
reference both round, hence twice that, and the norms differ by at most the norm of the
difference (triangle inequality). The update of momentum SGD (after a
global-norm clip, a projection: 1-Lipschitz) differs by the learning rate
times the momentum-weighted sum of the gradients' differences. Each norm's
own summation of ``P`` squares adds ``(P + 2) u`` of it.
"""

import functools
import subprocess
import sys
import warnings

import helpers
import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P
import numpy as np
import optax
import placements
import pytest

import optax_tokacc as tokacc
from optax_tokacc.testing import collectives
from optax_tokacc.testing import hlo

# Explicit sharding (parameters typed reduced) and ZeRO-1 need jax >= 0.10.

K = 3
WINDOW_SIZES = (3, 3, 2)  # the last closed by emit_now
U = np.finfo(np.float32).eps / 2
# a token's forward and backward pass (either model)
TERM_ROUNDINGS = 2 * (helpers.FEATURES + helpers.ZERO1_OUTPUTS) + 8


def gamma(m):
  return m * U / (1 - m * U)


def momentum_sgd(lr=helpers.LEARNING_RATE):
  return optax.sgd(lr, momentum=0.9)


def full_batch_metrics(
  windows, params_before, lr, loss_sum=helpers.loss_sum, inner=None
):
  """Per window: full-batch ``(loss, tokens, grad_norm, update_norm)`` at
  the recorded parameters, and the bounds on the two norms (see the
  module's docstring); ``inner`` (momentum SGD at ``lr`` unless given) runs
  on the full-batch gradients."""
  inner = inner or momentum_sgd(lr)
  opt_state = inner.init(params_before[0])
  trace_error, out = 0.0, []
  for window, params in zip(windows, params_before):
    batch = jax.tree.map(lambda *xs: np.concatenate(xs), *window)
    tokens = float(np.sum(batch['mask']))
    mean = jax.value_and_grad(lambda p, b, t: loss_sum(p, b) / t)
    loss, grads = mean(params, batch, tokens)
    rows = jax.tree.map(lambda x: x.reshape((-1, 1, 1) + x.shape[2:]), batch)
    per_token = jax.vmap(jax.grad(loss_sum), in_axes=(None, 0))(params, rows)
    magnitudes = jax.tree.map(lambda g: jnp.sum(jnp.abs(g), 0), per_token)
    n = int(tokens) + TERM_ROUNDINGS
    # the loss: n one-signed terms, both sides rounding
    loss_rtol = 2 * gamma(n)
    grad_error = 2 * gamma(n) * float(optax.tree.norm(magnitudes)) / tokens
    updates, opt_state = inner.update(grads, opt_state, params)
    trace_error = grad_error + 0.9 * trace_error
    size = sum(np.size(g) for g in jax.tree.leaves(grads))
    g, u = map(float, map(optax.tree.norm, (grads, updates)))
    out.append(
      dict(
        loss=float(loss),
        loss_rtol=loss_rtol,
        tokens=tokens,
        grad_norm=g,
        update_norm=u,
        grad_atol=grad_error + 2 * (size + 2) * U * g,
        update_atol=lr * trace_error + 2 * (size + 2) * U * u,
        # Each leaf's: its difference is at most the whole tree's (and its
        # own summation of fewer squares rounds less than the tree's).
        grad_norms=jax.tree.map(lambda x: float(optax.tree.norm(x)), grads),
        update_norms=jax.tree.map(lambda x: float(optax.tree.norm(x)), updates),
      )
    )
  return out


def assert_metrics(records, windows, lr=helpers.LEARNING_RATE, **kwargs):
  """``records``: per window, the parameters before it (host values) and
  ``window_metrics`` after it; with ``window_norms='per_leaf'`` each
  leaf's norms too."""
  params_before = [p for p, _ in records]
  for (_, metrics), want in zip(
    records, full_batch_metrics(windows, params_before, lr, **kwargs)
  ):
    assert float(metrics.tokens) == want['tokens']
    np.testing.assert_allclose(
      float(metrics.loss), want['loss'], rtol=want['loss_rtol']
    )
    for name in ('grad', 'update'):
      atol = want[f'{name}_atol']
      got = float(getattr(metrics, f'{name}_norm'))
      np.testing.assert_allclose(got, want[f'{name}_norm'], atol=atol)
      leaves = getattr(metrics, f'{name}_norms')
      if leaves is None:  # not asked for
        continue
      for leaf, value in leaves.items():
        expected = want[f'{name}_norms'][leaf]
        np.testing.assert_allclose(
          float(value), expected, atol=atol, err_msg=leaf
        )


def plain_host(x):
  """A host copy of ``x`` (typed reduced arrays read as replicated)."""
  spec = getattr(jax.typeof(x).sharding, 'spec', None)
  if spec is not None and spec.reduced:
    x = jax.reshard(x, P(*spec.partitions))
  return np.asarray(x)


def plain_tree(tree):
  return jax.tree.map(plain_host, tree)


def recorder(windows, host=plain_tree):
  """``(on_step, records)``: call ``on_step(params, state)`` with the
  initial parameters and after every micro-step; ``records`` then holds,
  per window, the parameters before it (``host``'s copies) and
  ``window_metrics`` after it."""
  ends = set(np.cumsum([len(w) for w in windows]).tolist())
  steps, records = [], []

  def on_step(params, state):
    n = len(steps)
    steps.append(n)
    if n in ends:
      records[-1][1] = tokacc.window_metrics(state)
    if n == 0 or (n in ends and len(records) < len(windows)):
      records.append([host(params), None])

  return on_step, records


def one_copy(metrics):
  """Host copies of ``metrics``, one per device where the state has a
  device axis (``pmap``): the same bits on every device, read once."""

  def read(x):
    copies = np.ravel(plain_host(x))
    np.testing.assert_array_equal(copies, copies[0])
    return copies[0]

  return jax.tree.map(read, metrics)


def train_recorded(run, windows):
  """``run`` trained on ``windows`` (the last closed by ``emit_now``):
  :func:`recorder`'s records, the parameters read by ``run.host`` and the
  metrics once (:func:`one_copy`)."""
  on_step, records = recorder(windows, run.host)
  with placements.mesh_context(run.mesh):
    on_step(run.params, run.state)
  placements.train_windows(run, windows, on_step=on_step)
  return [[params, one_copy(metrics)] for params, metrics in records]


def run_single(windows, host_closes, window_norms=True):
  tx = tokacc.token_weighted_multistep(
    momentum_sgd(), K, window_norms=window_norms
  )
  params = jax.tree.map(jnp.asarray, helpers.init_params())
  state = tx.init(params)
  step = jax.jit(helpers.train_step(tx), static_argnames='close')
  on_step, records = recorder(windows)
  on_step(params, state)
  for w, window in enumerate(windows):
    for m, batch in enumerate(window):
      last = m == len(window) - 1
      if host_closes:
        params, state = step(params, state, batch, close=last)
      else:
        emit_now = jnp.asarray(w == len(windows) - 1 and last)
        params, state = step(params, state, batch, emit_now=emit_now)
      on_step(params, state)
  return records


def run_explicit(windows, layout, window_norms=True):
  tx = tokacc.token_weighted_multistep(
    momentum_sgd(), K, window_norms=window_norms
  )
  return train_recorded(placements.explicit_run(layout, tx), windows)


def assert_equal_full_batch(records, windows, window_norms):
  """The global norms, and with ``window_norms='per_leaf'`` each leaf's
  (issue 41), against full batch."""
  assert len(records) == len(windows)
  per_leaf = [metrics.grad_norms is not None for _, metrics in records]
  assert per_leaf == [window_norms == 'per_leaf'] * len(windows)
  assert_metrics(records, windows)


@pytest.mark.parametrize(
  'host_closes', [False, True], ids=['single', 'single_host']
)
@pytest.mark.parametrize('window_norms', [True, 'per_leaf'])
def test_equal_full_batch_on_one_device(window_norms, host_closes):
  """On one device, the window closed by the device (``emit_now``) or by
  the host (``close``)."""
  windows = helpers.make_windows(WINDOW_SIZES, 4)
  records = run_single(windows, host_closes, window_norms)
  assert_equal_full_batch(records, windows, window_norms)


def run_placement(placement, windows, window_norms):
  """:func:`train_recorded` on 4 devices of ``placement`` (of
  ``placements.PLACEMENTS``)."""
  if not placements.supported(placement):
    pytest.skip(placements.NEEDS_TYPED_SHARDING)

  def make_tx(axis_name):
    return tokacc.token_weighted_multistep(
      momentum_sgd(), K, axis_name=axis_name, window_norms=window_norms
    )

  run = placements.PLACEMENTS[placement](4, make_tx)
  return train_recorded(run, windows)


@pytest.mark.parametrize('placement', placements.PLACEMENTS)
@pytest.mark.parametrize('window_norms', [True, 'per_leaf'])
# shard_map_summed: the gradients' all-reduce per micro-step is warned of
@pytest.mark.filterwarnings('ignore:token_weighted_multistep. gradients arrive')
def test_equal_full_batch(placement, window_norms):
  """On 4 devices of every placement of ``placements.PLACEMENTS``."""
  windows = helpers.make_windows(WINDOW_SIZES, 4)
  records = run_placement(placement, windows, window_norms)
  assert_equal_full_batch(records, windows, window_norms)


@pytest.mark.parametrize(
  'placement', ['single', 'single_host', *placements.PLACEMENTS]
)
@pytest.mark.filterwarnings('ignore:token_weighted_multistep. gradients arrive')
def test_a_gpus_norms_equal_full_batch(placement, monkeypatch):
  """A GPU's norms (``helpers.gpu_norms_here``), each leaf's too, against
  full batch: on one device, closed by the device or by the host, and on
  4 devices of every placement."""
  helpers.gpu_norms_here(monkeypatch)
  windows = helpers.make_windows(WINDOW_SIZES, 4)
  if placement.startswith('single'):
    records = run_single(windows, placement == 'single_host', 'per_leaf')
  else:
    records = run_placement(placement, windows, 'per_leaf')
  assert_equal_full_batch(records, windows, 'per_leaf')


@pytest.mark.parametrize('gpus', [False, True], ids=['here', 'gpus'])
def test_a_gpus_norms_sum_both_squares_in_one_reduction(gpus, monkeypatch):
  """Where a GPU's norms are forced, the closing step sums each leaf's
  squares of the sums and of the updates in one ``reduce`` (of complex
  numbers, the two squares their parts); here, none does (the check can
  fail)."""
  if gpus:
    helpers.gpu_norms_here(monkeypatch)
  tx = tokacc.token_weighted_multistep(momentum_sgd(), K)
  params = jax.tree.map(jnp.asarray, helpers.init_params())
  step = jax.jit(helpers.train_step(tx), static_argnames='close')
  batch = helpers.make_windows([1], 4)[0][0]
  text = step.lower(params, tx.init(params), batch, close=True).as_text()
  reduces = [line for line in text.splitlines() if 'stablehlo.reduce(' in line]
  pairs = sum('complex<f32>' in line for line in reduces)
  assert pairs == (len(jax.tree.leaves(params)) if gpus else 0)


def test_explicit_fsdp_on_every_jax(monkeypatch):
  """FSDP typed sharded on an explicit mesh, the compiler reducing the
  gradients (no reduced or unreduced type): exact metrics on every JAX,
  the declared floor included. Regression: summing the squares on each
  shard, typed unreduced (one all-reduce, jax >= 0.10), made jax 0.8.2
  refuse the step (its ``shard_map`` cannot give an unreduced output);
  there the compiler sums them, as before."""

  def mesh():
    devices = jax.devices()[:4]
    explicit = (jax.sharding.AxisType.Explicit,)
    return jax.make_mesh((4,), ('fsdp',), explicit, devices=devices)

  layout = placements.Layout(mesh, {'w': P('fsdp'), 'v': P('fsdp')})
  monkeypatch.setitem(placements.EXPLICIT_LAYOUTS, 'fsdp_explicit', layout)
  windows = helpers.make_windows(WINDOW_SIZES, 4)
  records = run_explicit(windows, 'fsdp_explicit')
  assert len(records) == len(windows)
  assert_metrics(records, windows)


@placements.needs_typed_sharding
@pytest.mark.parametrize('window_norms', [True, 'per_leaf'])
@pytest.mark.parametrize(
  'host_closes', [pytest.param(False, marks=pytest.mark.slow), True]
)
@pytest.mark.parametrize('layout', sorted(placements.ZERO1_LAYOUTS))
def test_zero1_equals_full_batch(layout, host_closes, window_norms):
  """ZeRO-1: the norms of the shards summed over the devices (clip, then
  momentum SGD at 0.5, ``placements.zero1_inner``)."""
  windows = helpers.zero1_windows()
  on_step, records = recorder(windows)
  placements.train_zero1(
    windows,
    layout=layout,
    host_closes=host_closes,
    on_step=on_step,
    window_norms=window_norms,
  )
  assert_metrics(
    records,
    windows,
    lr=0.5,
    loss_sum=helpers.zero1_loss_sum,
    inner=placements.zero1_inner(),
  )


def small_run(every_k=2):
  tx = tokacc.token_weighted_multistep(momentum_sgd(), every_k)
  params = {'w': jnp.ones(3)}

  @jax.jit
  def step(state, grads, num_tokens):
    return tx.update(grads, state, params, num_tokens=num_tokens, loss=2.0)[1]

  return tx, params, step


def as_tuple(metrics):
  return tuple(np.asarray(x) for x in metrics)


def test_nan_before_the_first_window_kept_by_empty_and_dropped_windows():
  """Before the first window: NaN loss and norms, 0 tokens. A window
  without tokens and one with an invalid count (dropped) emit nothing and
  keep the last emitted window's metrics."""
  tx, params, step = small_run()
  state = tx.init(params)
  first = tokacc.window_metrics(state)
  assert np.isnan(first.loss) and int(first.tokens) == 0
  assert np.isnan(first.grad_norm) and np.isnan(first.update_norm)
  grads = {'w': jnp.array([3.0, 0.0, 4.0])}
  for n in (1, 1):
    state = step(state, grads, n)
  emitted = as_tuple(tokacc.window_metrics(state))
  # mean gradient [6, 0, 8] / 2: norm 5; the first momentum update is the
  # gradient times the learning rate (exact in float32 up to one rounding)
  np.testing.assert_allclose(emitted[2], 5.0, rtol=4 * U)
  np.testing.assert_allclose(
    emitted[3], helpers.LEARNING_RATE * 5.0, rtol=4 * U
  )
  for counts in ((0, 0), (-1, 1)):  # empty, then dropped
    for n in counts:
      state = step(state, grads, n)
    assert int(state.gradient_step) == 1
    chex_equal(as_tuple(tokacc.window_metrics(state)), emitted)
  assert int(state.dropped_windows) == 1


@pytest.mark.parametrize('window_norms', [True, 'per_leaf'])
def test_readers_of_an_abstract_state_give_abstract_values(window_norms):
  """Ahead of time (issue 54): ``window_loss``, ``window_metrics`` and
  ``has_updated`` of a state of ``jax.ShapeDtypeStruct`` (``eval_shape``
  of ``init``, in a chain) give the shapes and dtypes of what they give for
  the real state, as ``jax.eval_shape`` of them would; they raised a
  ``TypeError`` (``float()`` of a ``ShapeDtypeStruct``)."""
  tx = optax.chain(
    optax.clip(1.0),
    tokacc.token_weighted_multistep(
      optax.sgd(0.1), K, window_norms=window_norms
    ),
  )
  params = {'w': jnp.zeros(3), 'b': jnp.zeros((2, 2), jnp.bfloat16)}
  state = tx.init(params)
  abstract = jax.eval_shape(tx.init, params)

  def shapes(tree):
    return jax.tree.map(lambda x: (jnp.shape(x), jnp.result_type(x)), tree)

  for read in (tokacc.window_loss, tokacc.window_metrics, tokacc.has_updated):
    found = read(abstract)
    leaves = jax.tree.leaves(found)
    assert leaves and all(isinstance(x, jax.ShapeDtypeStruct) for x in leaves)
    assert shapes(found) == shapes(read(state)), read.__name__


@pytest.mark.parametrize('window_norms', [True, 'per_leaf'])
def test_a_state_from_init_is_donated_whole(window_norms):
  """``tx.init``'s state holds each NaN norm in its own array, so that a
  step that donates it runs (a buffer held by two leaves cannot be
  donated: 4b3827a's init failed on its first donated call)."""
  params = {'w': jnp.ones(3), 'b': jnp.zeros(2)}
  tx = tokacc.token_weighted_multistep(
    optax.adamw(1e-3), 2, window_norms=window_norms
  )

  @functools.partial(jax.jit, donate_argnums=(0, 1))
  def step(params, state):
    grads = jax.tree.map(jnp.ones_like, params)
    updates, state = tx.update(grads, state, params, num_tokens=3)
    return optax.apply_updates(params, updates), state

  state = tx.init(params)
  buffers = [x.unsafe_buffer_pointer() for x in jax.tree.leaves(state)]
  assert len(set(buffers)) == len(buffers)
  params, state = step(jax.tree.map(jnp.copy, params), state)
  assert int(state.mini_step) == 1


def chex_equal(a, b):
  for x, y in zip(a, b):
    np.testing.assert_array_equal(x, y)


def test_checkpoint_mid_window_keeps_the_metrics():
  """Saved (host copies) and restored one micro-step into the second
  window, the state gives the same metrics, and the run goes on alike."""
  tx, params, step = small_run()
  state = tx.init(params)
  grads = {'w': jnp.array([1.0, 2.0, 2.0])}
  for n in (3, 1, 2):
    state = step(state, grads, n)
  saved = jax.device_get(tokacc.to_checkpoint(state))
  restored = tokacc.from_checkpoint(saved, state)
  chex_equal(
    as_tuple(tokacc.window_metrics(restored)),
    as_tuple(tokacc.window_metrics(state)),
  )
  chex_equal(
    as_tuple(tokacc.window_metrics(step(restored, grads, 5))),
    as_tuple(tokacc.window_metrics(step(state, grads, 5))),
  )


def test_acc_grads_alias_warns_and_reads_the_renamed_field():
  tx, params, _ = small_run()
  state = tx.init(params)
  with pytest.warns(FutureWarning, match='grad_sums'):
    alias = state.acc_grads
  assert alias is state.grad_sums


def test_acc_grads_warns_once_per_trace():
  """The property runs when ``jit`` traces the function that reads it:
  once for any number of calls with the same shapes, again on a retrace.
  Every warning is recorded (``always``), so the count is the traces'."""
  tx, params, step = small_run()
  grad_norm = jax.jit(lambda state: optax.tree.norm(state.acc_grads))
  grads = {'w': jnp.ones(3)}
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter('always')
    state = tx.init(params)
    for n in (1, 2, 3):
      state = step(state, grads, n)
      grad_norm(state)
    traced_once = list(caught)
    grad_norm(tx.init({'w': jnp.ones(4)}))  # another shape: a new trace
  assert [w.category for w in traced_once] == [FutureWarning]
  assert [w.category for w in caught] == [FutureWarning] * 2
  assert {w.filename for w in caught} == {__file__}


# A trainer's metrics module, as nanodo's metrics.py reads MultiSteps' field:
# in a library module, where default filters hide a DeprecationWarning.
TRAINER_METRICS = """\
import optax


def get_metrics(opt_state):
  grads = opt_state.acc_grads
  return {'grads/all/norm': optax.global_norm(grads)}
"""
TRAINER_SCRIPT = """\
import jax
import jax.numpy as jnp
import optax

import optax_tokacc as tokacc
from mytrainer import metrics

tx = tokacc.token_weighted_multistep(optax.sgd(0.1), every_k_schedule=2)
params = {'w': jnp.ones(3)}


@jax.jit
def train_step(state, grads, num_tokens):
  _, state = tx.update(grads, state, params, num_tokens=num_tokens)
  return state, metrics.get_metrics(state)


state = tx.init(params)
for num_tokens in (1, 2, 3, 4, 5):
  state, logged = train_step(state, {'w': jnp.ones(3)}, num_tokens)
print('updates', int(tokacc.find_state(state).gradient_step))
"""


# The trainer's run takes 0.9 s on a quiet 2-core machine, 1.5 s with both
# cores busy, and it passed 10 s on jax 0.10.2 beside two pytest workers and
# an accelerator compile (load about 4, 2026-11-29): 60 s is a hang guard,
# not a speed check; the test's own work is well under a second.
TRAINER_LIMIT_S = 60


@pytest.mark.waits_on_processes(TRAINER_LIMIT_S)
def test_acc_grads_warning_shows_under_default_filters(tmp_path):
  """Issue 41: a plain ``python train.py`` whose library module reads
  ``acc_grads`` under ``jit`` prints the warning once, at that module's
  line, with no warning filter set (a DeprecationWarning printed nothing
  there, and the trainer logged its gradient norms 77-96x off)."""
  package = tmp_path / 'mytrainer'
  package.mkdir()
  (package / '__init__.py').write_text('')
  (package / 'metrics.py').write_text(TRAINER_METRICS)
  (tmp_path / 'train.py').write_text(TRAINER_SCRIPT)
  env = helpers.subprocess_env(JAX_PLATFORMS='cpu')
  for name in ('PYTHONWARNINGS', 'PYTHONDEVMODE'):  # default filters
    env.pop(name, None)
  result = subprocess.run(
    [sys.executable, 'train.py'],
    capture_output=True,
    text=True,
    env=env,
    cwd=tmp_path,
    timeout=TRAINER_LIMIT_S,
  )
  assert result.returncode == 0, result.stderr
  assert result.stdout == 'updates 2\n'
  lines = TRAINER_METRICS.splitlines()
  line = 1 + next(i for i, text in enumerate(lines) if '.acc_grads' in text)
  where = f'{package / "metrics.py"}:{line}: FutureWarning: '
  warned = [text for text in result.stderr.splitlines() if where in text]
  assert len(warned) == 1, result.stderr
  for words in (
    'token-summed',
    'scratch right after a window closes',
    'window_metrics(state).grad_norm',
  ):
    assert words in warned[0], warned[0]


def test_micro_step_gains_no_work():
  """The norms are computed in the closing branch only (plain SGD takes
  no square root of its own): a micro-step computes no norm. Without a
  conditional, the host's micro-step (``close=False``) computes none
  either. Collectives: ``test_explicit`` (DDP: the closing branch holds
  the one reduction only; HSDP: plus the norms' scalar all-reduce) and
  ``test_closing_collectives`` below."""
  tx = tokacc.token_weighted_multistep(optax.sgd(0.1), 2)
  params = {'w': jnp.ones(37)}
  state = tx.init(params)

  @functools.partial(jax.jit, static_argnames='close')
  def step(state, grads, close=None):
    return tx.update(grads, state, params, num_tokens=2, close=close)

  device = hlo.compiled_text(step, state, params)
  opcodes = hlo.compiled_opcodes(device)
  assert opcodes['sqrt'] + opcodes['rsqrt'] > 0  # in the closing branch
  every_call = hlo.compiled_opcodes(device, into_branches=False)
  assert every_call['sqrt'] == every_call['rsqrt'] == 0
  host_micro = hlo.compiled_text(step, state, params, close=False)
  opcodes = hlo.compiled_opcodes(host_micro)
  assert opcodes['sqrt'] == opcodes['rsqrt'] == 0


@placements.needs_typed_sharding
def test_closing_collectives():
  """Where the gradient is whole (DDP) the norms cost no collective; where
  its type splits it (FSDP typed sharded, the compiler reducing the
  gradients), one all-reduce of the two norms' squares in the closing
  branch: the gradient's are summed on each device's shard before inner
  runs (so that the buffer inner's updates are written into is read
  first, not copied) and reduced with the update's; no micro-step
  collective is the norms'. (Partial sums and shard_map: one as well,
  test_explicit and test_sharded. Under AxisType.Auto axes, whose types
  do not say what is split, two: the compiler all-reduces the gradient's
  squares where they are summed, before inner runs; test_sharded's
  partial-manual HSDP.)"""
  sites = collectives.compiled_collectives(
    placements.explicit_compiled_text('ddp', 'unreduced', sgd())
  )
  assert (
    collectives.on_every_call(sites) == []
    and len(collectives.in_branches(sites)) == 1
  )
  sites = collectives.compiled_collectives(
    placements.explicit_compiled_text('fsdp', 'replicated', sgd())
  )
  window = collectives.in_branches(sites)
  assert [site.shapes for site in window] == [(('f32', (2,)),)]


def sgd():
  return momentum_sgd()


def _closing_sites(layout, window_norms):
  """The closing branch's collective sites of one compiled step: the
  explicit layouts of ``placements`` (FSDP typed sharded, the compiler
  reducing the gradients), or ZeRO-1 (``zero1_*``)."""
  if not layout.startswith('zero1_'):
    spelling = 'replicated' if layout == 'fsdp' else 'unreduced'
    text = placements.explicit_compiled_text(
      layout, spelling, sgd(), window_norms=window_norms
    )
    return collectives.in_branches(collectives.compiled_collectives(text))
  layout = layout.removeprefix('zero1_')
  mesh, tx, step = placements.zero1_run(layout, window_norms=window_norms)
  with jax.set_mesh(mesh):
    params, place = placements.zero1_placed(mesh, layout)
    state = placements.zero1_init(tx, params, mesh, layout)
    batch = place(helpers.zero1_windows()[0][0])
    text = hlo.compiled_text(step, params, state, batch)
  return collectives.in_branches(collectives.compiled_collectives(text))


@placements.needs_typed_sharding
@pytest.mark.parametrize(
  'layout', ['ddp', 'fsdp', 'hsdp', 'zero1_ddp', 'zero1_hsdp']
)
def test_per_leaf_norms_cost_no_collective_more(layout):
  """``window_norms='per_leaf'`` (issue 41) sums each leaf's squares in the
  collective the global norms already use: as many collectives at the
  close as with the global norms only, the norms' all-reduce a vector of
  one more entry per leaf of the gradient and of the update (none where
  the gradient is whole: DDP)."""
  global_only = _closing_sites(layout, True)
  per_leaf = _closing_sites(layout, 'per_leaf')
  assert len(per_leaf) == len(global_only)
  widened = [
    (a.shapes, b.shapes)
    for a, b in zip(global_only, per_leaf)
    if a.shapes != b.shapes
  ]
  for before, after in widened:  # the norms' vector: 2 entries, then 2 + 2L
    ((dtype, (entries,)),), ((dtype_after, (entries_after,)),) = before, after
    assert dtype == dtype_after == 'f32' and entries_after > entries
  assert len(widened) == (0 if layout == 'ddp' else 1)


def test_window_norms_is_checked():
  with pytest.raises(
    TypeError, match="window_norms must be True, False or 'per_leaf'"
  ):
    tokacc.token_weighted_multistep(sgd(), K, window_norms='per_layer')
  params = {'w': jnp.ones(3)}
  state = tokacc.token_weighted_multistep(sgd(), K).init(params)
  tx = tokacc.token_weighted_multistep(sgd(), K, window_norms='per_leaf')
  with pytest.raises(TypeError, match='state has window_norms=True or False'):
    tx.update({'w': jnp.ones(3)}, state, params, num_tokens=1)


def test_without_window_norms_they_stay_nan_and_cost_nothing():
  """``window_norms=False`` (the opt-out for programs where two more
  passes over the parameters matter, e.g. a host-closed step): the loss
  and tokens are logged as before, the norms stay NaN, and the closing
  step computes no norm (plain SGD takes no square root of its own) and,
  where the compiler splits the gradient, runs no collective."""
  tx = tokacc.token_weighted_multistep(momentum_sgd(), 2, window_norms=False)
  params = {'w': jnp.ones(3)}

  @functools.partial(jax.jit, static_argnames='close')
  def step(state, grads, num_tokens, close=None):
    return tx.update(
      grads, state, params, num_tokens=num_tokens, loss=2.0, close=close
    )[1]

  grads = {'w': jnp.array([3.0, 0.0, 4.0])}
  for close in (None, True):  # the device's close, then the host's
    state = tx.init(params)
    state = step(state, grads, 1, close=None if close is None else False)
    state = step(state, grads, 3, close=close)
    metrics = tokacc.window_metrics(state)
    assert int(metrics.tokens) == 4 and float(metrics.loss) == 1.0  # 4 / 4
    assert np.isnan(metrics.grad_norm) and np.isnan(metrics.update_norm)
    assert int(state.gradient_step) == 1
    text = hlo.compiled_text(step, state, grads, 1, close=close)
    opcodes = hlo.compiled_opcodes(text)
    assert opcodes['sqrt'] == opcodes['rsqrt'] == 0
  if jax.__version_info__ >= (0, 10):  # explicit types (test_explicit)
    text = placements.explicit_compiled_text(
      'fsdp', 'replicated', sgd(), window_norms=False
    )
    assert collectives.in_branches(collectives.compiled_collectives(text)) == []


@pytest.mark.skipif(
  jax.__version_info__ < (0, 10),
  reason='the XLA of jax < 0.10 copies the accumulator on this program with '
  'or without the norms (the code before them: 1.0x on jax 0.8.2)',
)
def test_closing_step_holds_no_parameter_sized_temporary():
  """The window's norms add no parameter-sized buffer to the compiled step
  (``memory_analysis()``, deterministic for a given XLA): with buffers
  donated, the emitted update is written into the accumulator's buffer,
  and the gradient's squares are summed before ``inner`` runs. A norm of
  the mean taken beside ``inner`` made XLA copy the accumulator on every
  close: temporaries of 1.0x the parameter bytes, where the gradient's
  working set here is under 0.35x (4 layers of 512 x 512, a batch of 32).
  The window's restart where it closes (``_window.reset_if``, after the
  ``cond``, issue 46) gives one leaf's zeros a buffer of its own (0.25x):
  with the norms or without, the same temporaries but for the norms'
  scalars, under 0.75x. With biases, XLA:CPU copied every leaf of the
  sums where the squares were read beside ``inner``'s in-place write
  (0.50x against 0.33x): their reads are ordered before it by a value the
  means depend on (``_inner_step._after_squares``)."""
  params = {f'w{i}': jnp.full((512, 512), 0.01) for i in range(4)}
  params.update({f'b{i}': jnp.zeros(512) for i in range(4)})

  def loss_sum(params, x):
    for i in range(4):
      x = jnp.tanh(x @ params[f'w{i}'] + params[f'b{i}'])
    return jnp.sum(x**2)

  def temporaries(window_norms):
    tx = tokacc.token_weighted_multistep(
      optax.adamw(1e-3), 4, window_norms=window_norms
    )

    @functools.partial(jax.jit, donate_argnums=(0, 1))
    def step(params, state, x):
      grads = jax.grad(loss_sum)(params, x)
      updates, state = tx.update(grads, state, params, num_tokens=32)
      return optax.apply_updates(params, updates), state

    lowered = step.lower(params, tx.init(params), jnp.ones((32, 512)))
    return lowered.compile().memory_analysis().temp_size_in_bytes

  param_bytes = sum(x.nbytes for x in params.values())
  with_norms = temporaries(True)
  assert with_norms <= temporaries(False) + 1024  # the norms' scalars
  assert with_norms < 0.75 * param_bytes
