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
"""The method registry of ``run.py``: :data:`METHODS`, name -> builder
``(case) -> trainers.Trainer``, each usage's train step as a user writes it
(``benchmarks/README.md`` describes every method). The hand-written
references are in ``ideals.py``, the Flax methods in ``flax_methods.py``
(Flax is optional)."""

import contextlib
import functools
import sys
import time

import jax
import jax.numpy as jnp
import optax

from benchmarks import common
from benchmarks import ideals
from benchmarks import trainers
import optax_tokacc as tokacc

# The programs of a step compiled with ``close``: one that the device
# closes, or the host's two (the micro-step's first).
DEVICE = {'step': None}
HOST = {'micro': False, 'close': True}


def _gradients(model, loss, params, batch):
  """The micro-batch's gradients and the extra args of ``tx.update``:
  of the token-summed loss with ``num_tokens``, or of the mean loss."""
  if loss == 'mean':
    return jax.grad(model.loss_mean)(params, batch), {}
  grads, num_tokens = jax.grad(model.loss_sum, has_aux=True)(params, batch)
  return grads, {'num_tokens': num_tokens}


def user_step(model, tx, loss='sum', together=False):
  """A user's jitted step: gradient, ``tx.update``, ``apply_updates``
  (``close`` static, given to ``tx.update`` unless None); with
  ``together``, ``tokacc.update_and_apply`` instead of the two."""

  @functools.partial(jax.jit, donate_argnums=(0, 1), static_argnames='close')
  def step(params, opt_state, batch, close=None):
    grads, extra_args = _gradients(model, loss, params, batch)
    if close is not None:
      extra_args['close'] = close
    if together:
      return tokacc.update_and_apply(tx, grads, opt_state, params, **extra_args)
    updates, opt_state = tx.update(grads, opt_state, params, **extra_args)
    return optax.apply_updates(params, updates), opt_state

  return step


def _optax(case, tx, loss='sum'):
  """``tx`` in a user's step; its compiled memory also for the optimizer
  part alone (``update``: the gradients given)."""
  model = case.model
  step = user_step(model, tx, loss)

  @functools.partial(jax.jit, donate_argnums=(0, 1))
  def update(params, opt_state, grads, num_tokens):
    extra_args = {'num_tokens': num_tokens} if loss == 'sum' else {}
    updates, opt_state = tx.update(grads, opt_state, params, **extra_args)
    return optax.apply_updates(params, updates), opt_state

  params = trainers.copy(model.params)
  opt_state = tx.init(params)
  zero = jnp.zeros([], jnp.int32)
  compiled = {
    'step': step.lower(params, opt_state, model.windows[0][0]).compile(),
    'update': update.lower(params, opt_state, params, zero).compile(),
  }
  return trainers.per_micro_batch(
    lambda carry, batch: step(*carry, batch),
    (params, opt_state),
    compiled,
    trainers.windows_of(model),
    lambda carry: carry[0],
  )


def plain(case):
  """One AdamW step per micro-batch (no accumulation)."""
  return _optax(case, case.adamw, loss='mean')


def multisteps(case):
  """``optax.MultiSteps(adamw, k)`` on the mean loss."""
  return _optax(case, optax.MultiSteps(case.adamw, case.k), loss='mean')


def tokacc_apply_updates(case, **options):
  """``token_weighted_multistep(adamw, k)``, ``optax.apply_updates``."""
  tx = tokacc.token_weighted_multistep(case.adamw, case.k, **options)
  return _optax(case, tx)


def tokacc_per_leaf(case):
  """``tokacc`` with ``window_norms='per_leaf'``: each leaf's gradient
  and update norm at the close, beside the global ones."""
  return tokacc_apply_updates(case, window_norms='per_leaf')


def tokacc_compensated(case):
  """``tokacc`` with a bfloat16 accumulator, Kahan-compensated (each
  addition's rounding forced with ``lax.reduce_precision``)."""
  return tokacc_apply_updates(
    case, accumulator_dtype=jnp.bfloat16, compensated=True
  )


def tokacc_chain(case):
  """A transform chained after the accumulator (the clip never binds)."""
  accumulate = tokacc.token_weighted_multistep(case.adamw, case.k)
  return _optax(case, optax.chain(accumulate, optax.clip(1.0)))


def _programs(
  case,
  layout,
  close,
  reference='ideal',
  init=None,
  patch=contextlib.nullcontext,
  **options,
):
  """``token_weighted_multistep(adamw, k, **options)`` as the compiled
  programs of ``close`` (:data:`DEVICE` or :data:`HOST`) on ``layout``.
  ``init(tx, params, layout)`` lays its state out (default ``tx.init``);
  ``patch`` is entered while tracing (:data:`ABLATIONS`)."""
  tx = tokacc.token_weighted_multistep(case.adamw, case.k, **options)
  step = user_step(case.model, tx)
  with layout.context():
    params, windows = layout.place(case.model)
    opt_state = tx.init(params) if init is None else init(tx, params, layout)
    batch = windows[0].micro_batches[0]
    with patch():
      programs = {
        label: trainers.compile_timed(step, params, opt_state, batch, close=c)
        for label, c in close.items()
      }
  compiled = {label: program for label, (program, _) in programs.items()}
  # The micro-step's program is the first of ``close``, the closing one the
  # last (one program that the device closes is both).
  micro = compiled[next(iter(close))]
  closing = compiled[list(close)[-1]]

  def inner_state(carry):
    return carry[1].inner_state

  state_of = None if layout.mesh is None else inner_state
  return trainers.Trainer(
    layout.on_mesh(lambda carry, batch: micro(*carry, batch)),
    layout.on_mesh(
      lambda carry, window: closing(*carry, window.micro_batches[-1])
    ),
    (params, opt_state),
    lambda carry: carry[0],
    windows,
    compiled,
    reference=reference,
    compile_s={label: seconds for label, (_, seconds) in programs.items()},
    optimizer_state_of=state_of,
  )


def tokacc_device(case):
  """``tokacc``, compiled once: the device decides (``close=None``)."""
  return _programs(case, trainers.OneDevice(), DEVICE)


def tokacc_host(case, **options):
  """``close=False`` on the micro-steps, ``close=True`` on the k-th: two
  programs, no conditional."""
  return _programs(case, trainers.OneDevice(), HOST, **options)


def tokacc_host_no_norms(case):
  """``tokacc_host`` with ``window_norms=False`` (no gradient or update
  norm at the close: the opt-out for the host's closing program)."""
  return tokacc_host(case, window_norms=False)


def tokacc_host_per_leaf(case):
  """``tokacc_host`` with ``window_norms='per_leaf'`` (each leaf's norms
  in the host's closing program)."""
  return tokacc_host(case, window_norms='per_leaf')


def microbatched(case):
  """One jitted step per window on the whole window's batch:
  ``tokacc.microbatched_value_and_grad`` then AdamW."""
  model, adamw = case.model, case.adamw
  micro_size = jax.tree.leaves(model.windows[0][0])[0].shape[0]
  value_and_grad = tokacc.microbatched_value_and_grad(
    model.loss_sum, micro_size
  )

  @functools.partial(jax.jit, donate_argnums=(0, 1))
  def step(params, opt_state, batch):
    (_, num_tokens), grads = value_and_grad(params, batch)
    mean = jax.tree.map(lambda g: g / num_tokens.astype(g.dtype), grads)
    updates, opt_state = adamw.update(mean, opt_state, params)
    return optax.apply_updates(params, updates), opt_state

  params = trainers.copy(model.params)
  carry = (params, adamw.init(params))
  windows = trainers.windows_of(model)
  compiled = {'window_step': step.lower(*carry, windows[0].whole).compile()}
  return trainers.Trainer(
    None,
    lambda carry, window: step(*carry, window.whole),
    carry,
    lambda carry: carry[0],
    windows,
    compiled,
  )


def tokacc_explicit_ddp(case):
  """``token_weighted_multistep`` on parameters typed reduced over
  ``data`` (one program: judged against the one-program ideal)."""
  layout = trainers.explicit_data(case)
  return _programs(case, layout, DEVICE, 'ideal_explicit_ddp_one')


def tokacc_explicit_ddp_host(case, **options):
  """``tokacc_explicit_ddp`` closed by the host (two programs)."""
  layout = trainers.explicit_data(case)
  return _programs(case, layout, HOST, 'ideal_explicit_ddp', **options)


def tokacc_explicit_ddp_host_no_norms(case):
  """``tokacc_explicit_ddp_host`` with ``window_norms=False``."""
  return tokacc_explicit_ddp_host(case, window_norms=False)


def _zero1_init(tx, params, layout):
  """AdamW's state sharded over ``data`` (the distributed optimizer)."""
  return tokacc.init_sharded(
    tx, params, layout.mesh, shard_optimizer_over=('data',)
  )


def tokacc_explicit_zero1(case):
  """``tokacc_explicit_ddp`` with AdamW's state sharded over ``data``."""
  layout = trainers.explicit_data(case)
  return _programs(
    case, layout, DEVICE, 'ideal_explicit_zero1', init=_zero1_init
  )


@contextlib.contextmanager
def _patched(module, name, replacement):
  """``module.name`` replaced while tracing. The ablations undo a trick
  of the package's private modules: no public name reaches it."""
  original = getattr(module, name)
  setattr(module, name, replacement)
  try:
    yield
  finally:
    setattr(module, name, original)


def _no_buffer():
  """The updates written to fresh -0.0 zeros, not held in the
  accumulator's buffer (a parameter-sized write on every micro-step)."""
  from optax_tokacc import _held_updates  # noqa: PLC0415

  return _patched(_held_updates, 'holds_exactly', lambda *args: False)


def _kept_conditional():
  """The device's closing ``cond`` kept by XLA: an optimization barrier
  in its closing branch is an instruction XLA's conditional simplifier
  counts as expensive, so it does not turn the ``cond`` into selects (on
  a GPU the conditional then waits on the host every call: what costs
  more is for a GPU to measure). An experiment, not an ablation."""
  from optax_tokacc import _closing  # noqa: PLC0415

  original = _closing.reduced

  def reduce(ctx, window):
    return jax.lax.optimization_barrier(original(ctx, window))

  return _patched(_closing, 'reduced', reduce)


def _ablation(patch):
  def method(case):
    return _programs(case, trainers.OneDevice(), DEVICE, patch=patch)

  return method


# Each performance trick, undone: the rows that show what it pays.
ABLATIONS = {
  'tokacc_no_buffer': _ablation(_no_buffer),
  'tokacc_device_kept_cond': _ablation(_kept_conditional),
}


def _flax(name):
  """The Flax method ``name``, imported when built (Flax is optional)."""

  def method(case):
    from benchmarks import flax_methods  # noqa: PLC0415

    return getattr(flax_methods, name)(case)

  return method


EXPLICIT = {
  'ideal_explicit_ddp': ideals.ideal_explicit_ddp,
  'ideal_explicit_ddp_one': ideals.ideal_explicit_ddp_one,
  'tokacc_explicit_ddp': tokacc_explicit_ddp,
  'tokacc_explicit_ddp_host': tokacc_explicit_ddp_host,
  'tokacc_explicit_ddp_host_no_norms': tokacc_explicit_ddp_host_no_norms,
  'ideal_explicit_zero1': ideals.ideal_explicit_zero1,
  'tokacc_explicit_zero1': tokacc_explicit_zero1,
}
METHODS = {
  'plain': plain,
  'ideal': ideals.ideal,
  'multisteps': multisteps,
  'tokacc': tokacc_apply_updates,
  'tokacc_per_leaf': tokacc_per_leaf,
  'tokacc_compensated': tokacc_compensated,
  'tokacc_chain': tokacc_chain,
  'tokacc_device': tokacc_device,
  'tokacc_host': tokacc_host,
  'tokacc_host_no_norms': tokacc_host_no_norms,
  'tokacc_host_per_leaf': tokacc_host_per_leaf,
  'tokacc_flax': _flax('tokacc_flax'),
  'tokacc_nnx': _flax('tokacc_nnx'),
  'microbatched': microbatched,
  **EXPLICIT,
  **ABLATIONS,
}
# Methods that are not the same computation as the ideal (no max|dp| check).
INEXACT = ('plain', 'multisteps')


def build_all(case, names):
  """name -> trainer of each method of ``names`` that runs on ``case``
  (the explicit ones need a loss that takes reduced parameters; the Flax
  ones, Flax), each one's set-up seconds in its ``setup_s``."""
  built = {}
  for name in names:
    if name in EXPLICIT and not case.model.explicit:
      continue
    start = time.perf_counter()
    try:
      built[name] = METHODS[name](case)
    except ImportError as e:
      print(f'  skipped {name}: {e}', file=sys.stderr)
      continue
    built[name].setup_s = time.perf_counter() - start
  return built


def differences(built):
  """Largest parameter difference of each exact method to its reference.

  After one window all exact methods hold the same parameters up to
  rounding. (Later, AdamW's normalization of near-zero gradient entries
  lets rounding differences grow to ~lr.)
  """
  return {
    name: common.max_difference(
      trainer.params(), built[trainer.reference].params()
    )
    for name, trainer in built.items()
    if name not in INEXACT and trainer.reference in built
  }
