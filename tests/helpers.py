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
"""Parts the tests share: the model, the data, the one full-batch reference
with its round-off bound, global arrays, and the repository's files (the
placements, where a run's values live: ``placements.py``; the reader of
compiled programs is the package's ``optax_tokacc.testing.hlo`` and
``optax_tokacc.testing.collectives``, which the benchmarks import too).

The model is a one-hidden-layer per-token regression (``loss_sum``); the
data are global micro-batches of ``SEQS`` sequences per device with unequal
counted tokens (``make_windows``), or one device's micro-batches of given
counts (``windows_of``). Two models differ on purpose, each saying why: the
linear one (``linear_loss_sum``) and ZeRO-1's (``zero1_loss_sum``); the
optimizers many tests share are here too. The reference is plain optax on
one device, one step per window on all of its tokens (``full_batch``, with
arguments for what a test computes otherwise), with the bound within which
float32 round-off keeps any accumulation of the same windows from it
(``round_off_atol``, derived in its docstring); ``assert_within_round_off``
compares with it. The two references that are not full-batch training:
``split_reference`` (plain SGD beside the accumulator, every micro-step)
and, on the linear model, ``linear_reference`` (float64 SGD and an
elementwise bound). The tests that give gradients directly (small
integers) use ``DIVISION_RTOL`` and the budget's ``closing_steps``; those
that train through a step as users write it (the gradient, ``update``,
the updates applied) build it with ``train_step``.

The tests run against whatever ``optax_tokacc`` Python imports: the
checkout (``pip install -e``), or an installed wheel with a copy of
``tests/`` beside it (the ``release`` session of ``noxfile.py`` runs them
from the unpacked sdist). Tests of the repository's other files (README,
docs, examples, benchmarks) skip there, naming what is missing
(:func:`needs_repository`), and processes that tests start import the same
``optax_tokacc`` as the test itself (:func:`subprocess_env`).
"""

import functools
import os
import pathlib
from typing import Any, NamedTuple

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import optax_tokacc
from optax_tokacc import _closing
from optax_tokacc import _norms

TESTS_DIR = pathlib.Path(__file__).resolve().parent
REPO = TESTS_DIR.parent  # the checkout, or the unpacked sdist


def needs_repository(*names: str) -> pytest.MarkDecorator:
  """A ``skipif`` marker for a test of the repository's files ``names``
  (relative to its root), which an installed package with a copy of
  ``tests/`` does not have."""
  missing = [name for name in names if not (REPO / name).exists()]
  return pytest.mark.skipif(
    bool(missing),
    reason=f"needs the repository's {', '.join(missing)}, absent beside "
    'this copy of tests/ (an installed optax_tokacc, or the sdist)',
  )


def subprocess_env(**variables: str) -> dict[str, str]:
  """The environment of a Python process started by a test: it imports the
  ``optax_tokacc`` this process imported (the checkout or the installed
  wheel, never a source tree beside the tests), and the tests' modules;
  ``variables`` are set too."""
  package_root = pathlib.Path(optax_tokacc.__file__).resolve().parents[1]
  env = dict(os.environ, **variables)
  paths = [str(package_root), str(TESTS_DIR), env.get('PYTHONPATH')]
  env['PYTHONPATH'] = os.pathsep.join(filter(None, paths))
  return env


# The model and the data.

FEATURES = 8
SEQS = 2  # sequences per device per micro-step
SEQ_LEN = 4
LOCAL_TOKENS = SEQS * SEQ_LEN
LEARNING_RATE = 0.05


def force_tpu_forms(monkeypatch):
  """Every ``jax.lax.platform_dependent`` takes its ``tpu`` branch (its
  default where it has none): what XLA:TPU compiles, traced here."""

  def forced(*args, default=None, **branches):
    return branches.get('tpu', default)(*args)

  monkeypatch.setattr(jax.lax, 'platform_dependent', forced)


def written_out_here(monkeypatch):
  """The host's close written out here, as on a GPU
  (``_closing.WRITTEN_OUT_ON``)."""
  monkeypatch.setattr(_closing, 'WRITTEN_OUT_ON', ('cpu',))


def gpu_norms_here(monkeypatch):
  """A GPU's window norms here: each leaf's squares of the window's sums
  and of its updates summed in one reduction (``_norms.TOGETHER_ON``)."""
  monkeypatch.setattr(_norms, 'TOGETHER_ON', ('cpu',))


# The forms of the host's close, forced here (each a function of pytest's
# ``monkeypatch``): this platform's (a loop's trip), a GPU's (written
# out), a TPU's (written out, the sums restarted where the window closes
# and laid out as the parameters).
CLOSE_FORMS = {
  'in_loop': lambda monkeypatch: None,
  'written_out': written_out_here,
  'tpu': force_tpu_forms,
}


def init_params(dtype=jnp.float32):
  """Numpy parameters of a one-hidden-layer per-token regression model."""
  rng = np.random.default_rng(0)
  return {
    'w': rng.normal(size=(FEATURES, FEATURES)).astype(dtype),
    'v': rng.normal(size=(FEATURES,)).astype(dtype),
  }


def token_losses(params, batch):
  """Each token's squared error, shape ``[sequences, SEQ_LEN]``."""
  hidden = jnp.tanh(batch['x'] @ params['w'])
  return (hidden @ params['v'] - batch['y']) ** 2


def loss_sum(params, batch):
  """The squared error summed over the batch's counted tokens."""
  return jnp.sum(token_losses(params, batch) * batch['mask'])


def loss_mean(params, batch):
  """The micro-batch's token-mean loss (what ``optax.MultiSteps`` users
  pass); an all-padding micro-batch has no mean: 0 for it."""
  return loss_sum(params, batch) / jnp.maximum(jnp.sum(batch['mask']), 1)


def token_count(batch):
  return jnp.sum(batch['mask']).astype(jnp.int32)


def token_counts(window_sizes, num_devices, seed=0):
  """Counted tokens per window, micro-step and device: unequal, with zeros.

  Device 1 has no tokens on the first micro-step of every window, and device
  2 has none in the whole first window.
  """
  rng = np.random.default_rng(seed)
  counts = []
  for w, size in enumerate(window_sizes):
    window = rng.integers(0, LOCAL_TOKENS + 1, size=(size, num_devices))
    window[0, 1 % num_devices] = 0
    if w == 0:
      window[:, 2 % num_devices] = 0
    window[-1, 0] = LOCAL_TOKENS  # every window has tokens
    counts.append(window)
  return counts


def make_windows(window_sizes, num_devices, dtype=np.float32, seed=0):
  """Global micro-batches: device d holds rows [d * SEQS, (d + 1) * SEQS)."""
  rng = np.random.default_rng(seed + 1)
  windows = []
  for counts in token_counts(window_sizes, num_devices, seed):
    window = []
    for step_counts in counts:
      mask = np.zeros((num_devices, LOCAL_TOKENS))
      for device, count in enumerate(step_counts):
        mask[device, rng.permutation(LOCAL_TOKENS)[:count]] = 1
      shape = (num_devices * SEQS, SEQ_LEN)
      window.append(
        {
          'x': rng.normal(size=shape + (FEATURES,)).astype(dtype),
          'y': rng.normal(size=shape).astype(dtype),
          'mask': mask.reshape(shape).astype(dtype),
        }
      )
    windows.append(window)
  return windows


def micro_batch(seed, num_tokens, dtype=np.float32):
  """One device's micro-batch of ``SEQS`` sequences whose first
  ``num_tokens`` positions (of ``LOCAL_TOKENS``) are counted."""
  rng = np.random.default_rng(seed)
  mask = (np.arange(LOCAL_TOKENS) < num_tokens).reshape(SEQS, SEQ_LEN)
  return {
    'x': rng.normal(size=(SEQS, SEQ_LEN, FEATURES)).astype(dtype),
    'y': rng.normal(size=(SEQS, SEQ_LEN)).astype(dtype),
    'mask': mask.astype(dtype),
  }


def windows_of(token_counts, dtype=np.float32, seed=0):
  """One device's windows: ``token_counts[w][i]`` counted tokens in
  micro-batch ``i`` of window ``w``."""
  return [
    [micro_batch(seed + 10 * w + i, n, dtype) for i, n in enumerate(counts)]
    for w, counts in enumerate(token_counts)
  ]


def float64(tree):
  """``tree`` in float64 (numpy), for a reference run under
  ``jax.enable_x64``."""
  return jax.tree.map(lambda x: np.asarray(x, np.float64), tree)


def concat(micro_batches):
  """The micro-batches of a window as one batch."""
  return jax.tree.map(lambda *xs: np.concatenate(xs), *micro_batches)


def with_outputs(windows, outputs, seed):
  """``windows`` with ``outputs`` targets per token (float32)."""
  rng = np.random.default_rng(seed)
  return [
    [
      dict(b, y=rng.normal(size=b['y'].shape + (outputs,)).astype(np.float32))
      for b in window
    ]
    for window in windows
  ]


# Models that differ from the one above on purpose.

# The linear model: x @ w + b per token, its squared error summed over the
# outputs. It differs from the model above on purpose: its gradient is
# affine in the parameters, so that the float32 round-off of a run is
# bounded elementwise from the data (linear_reference), a tolerance that
# does not grow with the step sizes.


def linear_params(outputs, seed, bias=True):
  """``w`` of shape ``(FEATURES, outputs)``, and ``b`` (``outputs``)
  unless ``bias`` is False (explicit sharding cannot add a bias typed
  reduced to values split over the same axis)."""
  rng = np.random.default_rng(seed)
  params = {'w': rng.normal(size=(FEATURES, outputs)).astype(np.float32)}
  if bias:
    params['b'] = rng.normal(size=(outputs,)).astype(np.float32)
  return params


def linear_loss_sum(params, batch):
  """Squared error summed over the outputs and the counted tokens."""
  error = batch['x'] @ params['w'] + params.get('b', 0.0) - batch['y']
  return jnp.sum(jnp.sum(error**2, axis=-1) * batch['mask'])


def linear_theta(params):
  """The parameters as one matrix ``[w; b]`` of shape ``(FEATURES + 1,
  outputs)``, or ``w`` without a bias (with the leading axes they have)."""
  if 'b' not in params:
    return np.asarray(params['w'])
  w, b = np.asarray(params['w']), np.asarray(params['b'])
  return np.concatenate([w, b[..., None, :]], axis=-2)


# ZeRO-1's model: a linear map of each token to ZERO1_OUTPUTS values, and a
# bias of 3 entries that enters through its sum. It differs from the model
# above on purpose: ``w`` (FEATURES, 4) has a dimension that 4 devices
# divide, so that its optimizer state is sharded, and ``b`` has none, so
# that its state stays whole.

ZERO1_OUTPUTS = 4
ZERO1_MAX_NORM = 0.05  # below every window's gradient norm: the clip binds


def zero1_params():
  rng = np.random.default_rng(7)
  return {
    'w': rng.normal(size=(FEATURES, ZERO1_OUTPUTS)).astype(np.float32),
    'b': rng.normal(size=(3,)).astype(np.float32),  # no dimension divides 4
  }


def zero1_loss_sum(params, batch):
  """Squared error summed over the outputs and the counted tokens; ``b``
  enters through its sum."""
  pred = batch['x'] @ params['w'] + params['b'].sum()
  per_token = jnp.sum((pred - batch['y']) ** 2, axis=-1)
  return jnp.sum(per_token * batch['mask'])


def zero1_windows():
  """Three windows of 3 micro-batches on 4 devices, for the ZeRO-1 model."""
  windows = make_windows((3, 3, 3), 4, seed=4)
  return with_outputs(windows, ZERO1_OUTPUTS, seed=3)


# Optimizers many tests share.


def adamw():
  """AdamW whose update depends on the gradient's scale (large eps).

  With the default eps, Adam is nearly invariant to the gradient's scale and
  would hide a gradient summed over the devices twice.
  """
  return optax.adamw(LEARNING_RATE, eps=0.1, weight_decay=0.1)


def sgd():
  """SGD with momentum: linear in the gradients."""
  return optax.sgd(LEARNING_RATE, momentum=0.9)


def schedule_of(sizes):
  """An ``every_k_schedule`` that gives window ``w`` ``sizes[w]``
  micro-batches (the last size thereafter)."""

  def every_k(gradient_step):
    return jnp.asarray(sizes, jnp.int32)[
      jnp.minimum(gradient_step, len(sizes) - 1)
    ]

  return every_k


def plateau_inner():
  """SGD whose learning rate ``reduce_on_plateau`` halves whenever the
  loss does not improve on its best (no patience, no cooldown)."""
  return optax.chain(
    optax.sgd(0.3),
    optax.contrib.reduce_on_plateau(
      factor=0.5, patience=0, cooldown=0, rtol=1e-4, atol=0.0
    ),
  )


def plateau_scale(opt_state):
  """The learning-rate scale of ``plateau_inner``'s state."""
  return float(opt_state[1].scale)


# The training step as users write it.


def train_step(
  tx,
  loss_fn=loss_sum,
  *,
  count_fn=token_count,
  with_loss=True,
  apply_fn=None,
  with_updates=False,
):
  """A micro-step of ``tx`` as users write it, to be jitted by the caller
  (``jax.jit(train_step(tx))``; ``static_argnames='close'`` for the host's
  decision).

  ``step(params, opt_state, batch, **update_kwargs)`` takes the gradient
  of ``loss_fn`` (by default the loss summed over the batch's counted
  tokens) and hands it to ``tx.update`` with ``num_tokens=count_fn(batch)``,
  ``loss=`` the loss (``None``, ``update``'s default, unless
  ``with_loss``) and ``update_kwargs`` (``emit_now``, ``close``); it
  applies the updates with ``optax.apply_updates``, or ``apply_fn(params,
  updates, opt_state)`` (``optax_tokacc.apply_if_updated``). It returns
  the new parameters and state, and the updates after them with
  ``with_updates``.
  """

  def step(params, opt_state, batch, **update_kwargs):
    loss, grads = jax.value_and_grad(loss_fn)(params, batch)
    updates, opt_state = tx.update(
      grads,
      opt_state,
      params,
      num_tokens=count_fn(batch),
      loss=loss if with_loss else None,
      **update_kwargs,
    )
    if apply_fn is None:
      new_params = optax.apply_updates(params, updates)
    else:
      new_params = apply_fn(params, updates, opt_state)
    if with_updates:
      return new_params, opt_state, updates
    return new_params, opt_state

  return step


# The reference: full-batch training, and the round-off bound.

# The roundings on one token's path to its gradient term: the dot products'
# terms (2 FEATURES, forward and backward) and about 16 elementwise
# operations (tanh's own error counted as a few).
TERM_ROUNDINGS = 2 * FEATURES + 16
# float32's. The bounds derived from it assume float32 matmuls: the CPU's
# default; on another platform tests/conftest.py runs every test under
# ``jax.default_matmul_precision('highest')``, but those marked
# ``platform_precision``, which run at the platform's default and take
# their unit from :func:`default_matmul_unit_round_off`.
UNIT_ROUND_OFF = 2.0**-24

# The unit round-off of a float32 matmul at each platform's default
# precision (JAX's "Default matmul precision"). A format with p significand
# bits (the implicit one counted) rounds within u = 2**-p, relative. A CPU
# multiplies in float32 (23 explicit bits: u = 2**-24). NVIDIA GPUs (from
# Ampere on) round the inputs to TF32, 10 explicit bits: u = 2**-11; TPUs
# to bfloat16 in one pass, 7 explicit bits: u = 2**-8. Products and sums
# stay float32, so taking u for every rounding of a term's path
# (TERM_ROUNDINGS) over-estimates. ROCm is taken as TF32 too; a GPU that
# multiplies float32 by default (NVIDIA before Ampere) only makes the bound
# looser.
DEFAULT_MATMUL_UNIT_ROUND_OFF = {
  'cpu': UNIT_ROUND_OFF,
  'gpu': 2.0**-11,
  'cuda': 2.0**-11,
  'rocm': 2.0**-11,
  'tpu': 2.0**-8,
}


def default_matmul_unit_round_off(platform=None) -> float:
  """The unit round-off of float32 matmuls at ``platform``'s default
  precision (default: JAX's default backend's), for
  ``full_batch(..., unit_round_off=)``."""
  return DEFAULT_MATMUL_UNIT_ROUND_OFF[platform or jax.default_backend()]


class Window(NamedTuple):
  """One window of full-batch training (:func:`full_batch`)."""

  params: Any  # after the window's step
  opt_state: Any  # after it
  grads: Any  # the window's token-mean gradient (None: no token, no step)
  loss: float  # its token-mean loss, at the parameters before the step
  atol: float  # how far round-off can take a run's parameters from ``params``
  loss_atol: float  # and its window loss from ``loss``
  largest_update: float


class Reference(NamedTuple):
  """Full-batch training, and how far float32 round-off can take a run of
  the same windows from it (:func:`round_off_atol`): the last window's
  values, and each window's (``windows``)."""

  params: Any  # the final parameters
  atol: float  # of every parameter
  loss: float = float('nan')  # the last window's token-mean loss
  loss_atol: float = float('nan')  # of ``loss``
  losses: tuple = ()  # each window's token-mean loss
  windows: tuple = ()  # each window's :class:`Window`


def mask_count(batch) -> float:
  """The counted tokens of a batch: the sum of its mask."""
  return float(np.sum(batch['mask']))


def window_tokens(windows, count_fn=mask_count) -> int:
  """The counted tokens of the largest window."""
  return max(int(sum(count_fn(b) for b in w)) for w in windows)


def round_off_atol(
  largest_updates, largest_params, tokens, term_roundings, unit_round_off
) -> float:
  """How far round-off can take accumulation from full-batch training, over
  steps whose largest updates and parameters are ``largest_updates`` and
  ``largest_params``.

  A window's gradient sums the terms of its n counted tokens, each computed
  through m = ``term_roundings`` roundings. Two evaluations in different
  orders (per micro-batch and device, then over the window, against the
  whole window at once) differ by at most 2 (n + m) u times the terms' size
  (u the unit round-off of the parameters' dtype, 2**-24 in float32;
  Higham, Accuracy and Stability of Numerical Algorithms, 2002, sections
  3.1 and 4.2), taken relative to the step's largest update. SGD and
  momentum are linear in the gradients; Adam's update and a global-norm
  clip that binds are homogeneous of degree 0 in them, so the update moves
  by at most twice the relative error: a factor 2 for all. Adding an update
  rounds a parameter by at most u |p| in each run. This worst case (errors
  of one sign) exceeds the typical one (random signs) by sqrt(n + m) > 5,
  which covers terms that cancel and the growth of a difference over a few
  steps: measured, differences stay below 1/8 of it on two CPUs
  (``--xla_cpu_max_isa=AVX`` emulating an older one), where a fixed 1e-6
  came within 1/6. It is still below 1e-3 of the gap the average of
  averages leaves. n = ``tokens``: each step's window's counted tokens (or
  one count for all steps).
  """
  if not isinstance(tokens, (list, tuple)):
    tokens = [tokens] * len(largest_updates)
  return sum(
    2 * 2 * (n + term_roundings) * unit_round_off * update
    + 2 * unit_round_off * param
    for update, param, n in zip(largest_updates, largest_params, tokens)
  )


def largest(tree) -> float:
  return max(float(jnp.max(jnp.abs(x))) for x in jax.tree.leaves(tree))


@functools.cache
def _mean_value_and_grad(loss_fn):
  """The token-mean loss of a batch and its gradient, jitted once per
  ``loss_fn``."""
  return jax.jit(
    jax.value_and_grad(lambda p, batch, tokens: loss_fn(p, batch) / tokens)
  )


def full_batch(
  optimizer,
  params,
  windows,
  loss_fn=loss_sum,
  *,
  term_roundings=TERM_ROUNDINGS,
  count_fn=mask_count,
  gradient_fn=None,
  with_value=False,
  keep_state_dtypes=False,
  unit_round_off=None,
) -> Reference:
  """Plain ``optimizer`` on one device, one step per window on all of its
  tokens, with its round-off bounds.

  A window's step takes the gradient of ``loss_fn`` (summed over its
  tokens) on the window's micro-batches as one batch, divided by their
  count (``count_fn`` of each micro-batch, summed), at the parameters
  before it; a window without tokens takes no step. The gradient is taken
  in the parameters' dtype (float64 under ``jax.enable_x64``). Arguments
  for the references that compute something else:

  - ``term_roundings``: m of :func:`round_off_atol`, for another model;
  - ``gradient_fn(params, window)``: the window's token-mean gradient,
    computed another way (mixed precision: each micro-batch's in its own
    dtype, summed in float32, as ``optax.MultiSteps`` sums them);
  - ``with_value``: ``optimizer`` also gets ``value=`` the window's
    token-mean loss (what the transform gives ``inner``, e.g. for
    ``reduce_on_plateau``);
  - ``keep_state_dtypes``: the optimizer's new state is cast to the dtypes
    of its old one, as ``optax.MultiSteps`` keeps them;
  - ``unit_round_off``: u of the bounds, for runs whose matmuls round
    more than the parameters' dtype (:func:`default_matmul_unit_round_off`).

  The bounds: ``atol`` of every parameter (:func:`round_off_atol`, in
  ``unit_round_off``, by default the parameters' dtype's), and
  ``loss_atol`` of each window's token-mean loss: a sum of n one-signed
  terms (within 2 (n + m) u of it, relative), taken at parameters that may
  differ by the previous windows' ``atol``, which moves it by at most the
  1-norm of its gradient times that ``atol``, and a second-order term
  below it (twice the first covers both).
  """
  params = jax.tree.map(jnp.asarray, params)
  if not windows:
    return Reference(params, 0.0)
  leaf = jax.tree.leaves(params)[0]
  if unit_round_off is None:
    unit_round_off = float(jnp.finfo(leaf.dtype).eps) / 2
  value_and_grad = _mean_value_and_grad(loss_fn)
  opt_state = optimizer.init(params)
  largest_updates, largest_params, step_tokens = [], [], []
  records, atol = [], 0.0
  for window in windows:
    tokens = sum(count_fn(b) for b in window)
    if tokens == 0:  # no loss to take a step on
      records.append(
        Window(params, opt_state, None, float('nan'), atol, float('nan'), 0.0)
      )
      continue
    loss, grads = value_and_grad(params, concat(window), tokens)
    if gradient_fn is not None:
      grads = gradient_fn(params, window)
    gradient_norm = sum(
      float(jnp.sum(jnp.abs(g))) for g in jax.tree.leaves(grads)
    )
    loss_rtol = 2 * (tokens + term_roundings) * unit_round_off
    loss_atol = 2 * (loss_rtol * float(loss) + gradient_norm * atol)
    value = {'value': loss} if with_value else {}
    updates, new_state = optimizer.update(grads, opt_state, params, **value)
    if keep_state_dtypes:
      new_state = optax.tree.cast_like(new_state, opt_state)
    before, opt_state = largest(params), new_state
    params = optax.apply_updates(params, updates)
    largest_updates.append(largest(updates))
    largest_params.append(max(before, largest(params)))
    step_tokens.append(tokens)
    atol = round_off_atol(
      largest_updates,
      largest_params,
      step_tokens,
      term_roundings,
      unit_round_off,
    )
    records.append(
      Window(
        params,
        opt_state,
        grads,
        float(loss),
        atol,
        loss_atol,
        largest_updates[-1],
      )
    )
  last = records[-1]
  return Reference(
    params,
    atol,
    last.loss,
    last.loss_atol,
    tuple(w.loss for w in records),
    tuple(records),
  )


def assert_within_round_off(actual, reference) -> None:
  """``actual`` parameters equal ``reference``'s (a :class:`Reference` or
  a :class:`Window`) within its ``atol``."""
  chex.assert_trees_all_close(
    jax.tree.map(np.asarray, actual),
    jax.tree.map(np.asarray, reference.params),
    rtol=0,
    atol=reference.atol,
  )


def assert_same_bits(actual, expected, what=''):
  """Bit-for-bit equality of two trees (unlike ==, tells -0.0 from 0.0,
  and a NaN equals itself)."""
  assert jax.tree.structure(actual) == jax.tree.structure(expected), what
  for a, e in zip(jax.tree.leaves(actual), jax.tree.leaves(expected)):
    a, e = np.asarray(a), np.asarray(e)
    assert a.dtype == e.dtype and a.shape == e.shape, what
    assert a.tobytes() == e.tobytes(), (what, a[a != e], e[a != e])


def split_reference(inner, params, micro_batches, k, plain_learning_rate):
  """The reference of an accumulator on ``'w'`` beside plain SGD on
  ``'v'`` (``optax.multi_transform``, or two ``optax.masked``): ``inner``
  steps ``'w'`` once per ``k`` micro-batches, on their token-summed
  gradient over their tokens; SGD at ``plain_learning_rate`` steps ``'v'``
  on every micro-batch's token-summed gradient; both gradients are taken
  at the micro-step's parameters (``'v'`` moves within a window). Not
  full-batch training (``'v'`` steps every micro-step), so not
  :func:`full_batch`.

  Returns a :class:`Reference` per micro-step: the parameters, with the
  bound of :func:`round_off_atol` over the updates so far (``'v'``'s every
  micro-step, ``'w'``'s at the end of each window), each linear (SGD) or
  homogeneous of degree 0 (Adam) in a sum of at most a window's terms.
  """
  micro_grads = jax.jit(jax.grad(loss_sum))
  params = jax.tree.map(jnp.asarray, params)
  state = inner.init(params['w'])
  tokens = max(
    sum(mask_count(b) for b in micro_batches[i : i + k])
    for i in range(0, len(micro_batches), k)
  )
  window_grad, window_tokens_, trajectory = 0.0, 0.0, []
  largest_updates, largest_params = [], [largest(params)]
  for i, batch in enumerate(micro_batches):
    grads = micro_grads(params, batch)
    window_grad = window_grad + grads['w']
    window_tokens_ += mask_count(batch)
    w = params['w']
    plain_update = plain_learning_rate * grads['v']
    largest_updates.append(largest(plain_update))
    if (i + 1) % k == 0:
      updates, state = inner.update(window_grad / window_tokens_, state, w)
      w = w + updates
      largest_updates.append(largest(updates))
      window_grad, window_tokens_ = 0.0, 0.0
    params = {'w': w, 'v': params['v'] - plain_update}
    largest_params.append(largest(params))
    atol = round_off_atol(
      largest_updates,
      [max(largest_params)] * len(largest_updates),
      tokens,
      TERM_ROUNDINGS,
      UNIT_ROUND_OFF,
    )
    trajectory.append(Reference(params, atol))
  return trajectory


class LinearBound(NamedTuple):
  """A window of :func:`linear_reference`: the parameters after it (as
  :func:`linear_theta`), its token-mean loss before its update, and the
  bounds on a float32 run's (elementwise for the parameters)."""

  theta: np.ndarray
  loss: float
  theta_bound: np.ndarray
  loss_bound: float


def linear_reference(params, windows, learning_rate):
  """Full-batch SGD on the linear model in float64 (:func:`full_batch`),
  and a bound on how far a float32 run of the same windows can be, per
  window (:class:`LinearBound`).

  The model is ``z @ theta`` (``z = [x, 1]``, or ``x`` without a bias;
  ``theta`` of shape ``(P, O)``), the loss per token its squared error summed over the ``O``
  outputs. The bound is Higham's: a float32 sum or dot product of ``m``
  terms, each with its own rounded factors, in any order (micro-steps,
  devices, tokens), is within ``gamma(m) = m u / (1 - m u)`` of the exact
  sum, relative to the sum of the terms' absolute values. Each gradient
  entry and the loss see fewer than ``m = n + P + O + 10`` roundings on
  their way (the residual's P products and additions, the square or the
  product with the regressor, the sum over the outputs and over the
  window's ``n`` tokens, a mean's division and the transform's scaling by
  the count, the division by the window's count, the product with the
  learning rate). The subtraction from the parameter adds ``u`` of its
  size. An error ``e`` already in the parameters comes back through the
  affine gradient as ``(I - lr H) e``, ``H`` the Hessian; in the loss as
  ``g . e`` plus ``e H e / 2``.
  """
  with jax.enable_x64(True):
    reference = full_batch(
      optax.sgd(learning_rate),
      float64(params),
      float64(windows),
      linear_loss_sum,
    )
  thetas = [linear_theta(float64(params))]
  thetas += [linear_theta(w.params) for w in reference.windows]
  error = np.zeros_like(thetas[0])
  out = []
  for window, before, after, record in zip(
    windows, thetas, thetas[1:], reference.windows
  ):
    batch = concat(window)
    counted = batch['mask'].reshape(-1) > 0
    z = batch['x'].reshape(-1, batch['x'].shape[-1])[counted]
    if 'b' in params:
      z = np.concatenate([z, np.ones((len(z), 1))], 1)
    z = z.astype(np.float64)
    y = batch['y'].reshape(len(counted), -1)[counted].astype(np.float64)
    n, num_outputs = y.shape
    residual = z @ before - y
    gradient = 2 * z.T @ residual / n
    hessian = 2 * z.T @ z / n
    m = n + len(before) + num_outputs + 10
    gamma = m * UNIT_ROUND_OFF / (1 - m * UNIT_ROUND_OFF)
    size = np.abs(z) @ (np.abs(before) + error) + np.abs(y)
    loss_bound = (
      gamma * np.sum(size**2) / n
      + np.sum(np.abs(gradient) * error)
      + np.sum(error * (np.abs(hessian) @ error)) / 2
    )
    error = (
      np.abs(np.eye(len(before)) - learning_rate * hessian) @ error
      + learning_rate * gamma * 2 * np.abs(z).T @ size / n
      + UNIT_ROUND_OFF * (np.abs(after) + error)
    )
    out.append(LinearBound(after, record.loss, error, loss_bound))
  return out


def assert_within_linear_bound(trajectory, expected):
  """Every device's parameters (``linear_theta`` of them, with a leading
  device axis) and window loss, after every window, within the bound of
  :func:`linear_reference`."""
  for (thetas, losses), window in zip(trajectory, expected, strict=True):
    for theta in thetas:
      difference = np.abs(theta - window.theta)
      assert np.all(difference <= window.theta_bound), (
        theta - window.theta,
        window.theta_bound,
      )
    np.testing.assert_array_less(
      np.abs(np.asarray(losses) - window.loss), window.loss_bound
    )


# The tests that give gradients directly: small integers.

# The float32 sums of small integers are exact; the division by the count
# is rounded once (relative error <= 2**-24), and a count above 2**24 once
# more when cast to float32 (2**-24 again). Two roundings, and room for the
# float64 reference's own (2**-53): 3 * 2**-24.
DIVISION_RTOL = 3 * 2.0**-24


def closing_steps(counts, k_of, budget=None):
  """Reference: the micro-steps (from 1) at which windows close.

  A window closes after ``k_of(window index)`` micro-steps, or at the first
  micro-step at which its tokens reach ``budget``.
  """
  closes, size, total, window = [], 0, 0, 0
  for step, count in enumerate(counts, start=1):
    size, total = size + 1, total + count
    if size == k_of(window) or (budget is not None and total >= budget):
      closes.append(step)
      size, total, window = 0, 0, window + 1
  return closes


def budget_window_sizes(counts, budget, k):
  """Reference: micro-batches per window of ``tokens_per_update=budget``
  and ``every_k_schedule=k`` over micro-batches of ``counts`` tokens (all
  devices), the last window (closed by ``emit_now``) included."""
  closes = closing_steps(counts, lambda _: k, budget)
  ends = closes + [len(counts)] * (closes[-1:] != [len(counts)])
  return np.diff([0] + ends).tolist()


# Global arrays (several processes included).


def put(value, sharding):
  """A global array from a host value that every process holds in full."""
  value = np.asarray(value)
  return jax.make_array_from_callback(
    value.shape, sharding, lambda index: value[index]
  )


def fetch(tree):
  """Host copies of global arrays, gathered from all processes."""
  if jax.process_count() == 1:
    return jax.tree.map(np.asarray, tree)
  from jax.experimental import multihost_utils  # noqa: PLC0415

  return jax.tree.map(
    lambda x: np.asarray(multihost_utils.process_allgather(x, tiled=True)),
    tree,
  )
