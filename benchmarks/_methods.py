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
"""The methods of ``run.py``: each usage's train step, as a user writes it.

A builder ``(case) -> Trainer`` sets one method up on a model: its jitted
functions (parameters and optimizer state donated), what they carry from
call to call, and the compiled functions whose memory is reported. The
timer drives a :class:`Trainer` a window at a time: its micro-steps (the
calls that do not close the window), then the closing step. The Flax
methods are in ``_flax_methods.py`` (Flax is optional), the explicit DDP
ones in ``_explicit_methods.py``.
"""

from collections.abc import Callable
import contextlib
import dataclasses
import functools
import time
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from benchmarks import _models
import optax_tokacc as tokacc


class Case(NamedTuple):
  """What every method of one table section trains.

  Attributes:
    model: the model, its data and its loss.
    k: micro-batches per window.
    adamw: the optimizer (``optax.adamw`` with the model's ``mu_dtype``).
    ddp_devices: the devices of the explicit DDP mesh.
  """

  model: _models.Model
  k: int
  adamw: optax.GradientTransformation
  ddp_devices: tuple = ()


class Window(NamedTuple):
  """A window's micro-batches, and the same rows in one batch (for the
  method that takes the whole window in one call)."""

  micro_batches: list
  whole: Any


@dataclasses.dataclass
class Trainer:
  """A method set up on a model, as the timer drives it.

  Attributes:
    micro_step: ``(carry, batch) -> carry``: one call that does not close
      the window (None for a method that takes the window in one call).
    closing_step: ``(carry, window) -> carry``: what closes a window (the
      last micro-batch's call, and the ideal's update).
    carry: what the calls carry (parameters, optimizer state, ...).
    params_of: ``carry -> parameters``.
    windows: the :class:`Window` s it trains on, reused cyclically.
    compiled: label -> compiled function (for its memory analysis).
    reference: the method whose times its ratios divide by.
    compile_s: label -> seconds to lower and compile that program.
    optimizer_state_of: ``carry -> the optimizer's state`` (without the
      accumulator), whose bytes per device are reported; None: not reported.
  """

  micro_step: Callable[[Any, Any], Any] | None
  closing_step: Callable[[Any, Window], Any]
  carry: Any
  params_of: Callable[[Any], Any]
  windows: list
  compiled: dict
  reference: str = 'ideal'
  compile_s: dict = dataclasses.field(default_factory=dict)
  optimizer_state_of: Callable[[Any], Any] | None = None

  def run_micro_steps(self, index):
    """Feeds the first ``k - 1`` micro-batches of window ``index``."""
    if self.micro_step is not None:
      window = self.windows[index % len(self.windows)]
      for batch in window.micro_batches[:-1]:
        self.carry = self.micro_step(self.carry, batch)

  def run_closing_step(self, index):
    """Closes window ``index``."""
    window = self.windows[index % len(self.windows)]
    self.carry = self.closing_step(self.carry, window)

  def block(self):
    jax.block_until_ready(self.carry)

  def params(self):
    return self.params_of(self.carry)


def windows_of(model, put=lambda batch: batch):
  """The model's windows, each batch placed with ``put``."""

  def concatenate(batches):
    return jax.tree.map(lambda *xs: jnp.concatenate(xs), *batches)

  return [
    Window([put(b) for b in w], put(concatenate(w))) for w in model.windows
  ]


def copy(tree):
  """A copy of ``tree`` (each method donates its own buffers)."""
  return jax.tree.map(lambda x: x.copy(), tree)


def per_micro_batch(step, carry, compiled, windows, params_of, **kwargs):
  """A trainer that calls ``step(carry, batch)`` once per micro-batch."""

  def closing_step(carry, window):
    return step(carry, window.micro_batches[-1])

  return Trainer(
    step, closing_step, carry, params_of, windows, compiled, **kwargs
  )


def _gradients(model, loss, params, batch):
  """The micro-batch's gradients and the extra args of ``tx.update``:
  of the token-summed loss with ``num_tokens``, or of the mean loss."""
  if loss == 'mean':
    return jax.grad(model.loss_mean)(params, batch), {}
  grads, num_tokens = jax.grad(model.loss_sum, has_aux=True)(params, batch)
  return grads, {'num_tokens': num_tokens}


def _optax(case, tx, loss='sum'):
  """A user's step: gradient, ``tx.update``, ``optax.apply_updates``."""
  model = case.model

  @functools.partial(jax.jit, donate_argnums=(0, 1))
  def step(params, opt_state, batch):
    grads, extra_args = _gradients(model, loss, params, batch)
    updates, opt_state = tx.update(grads, opt_state, params, **extra_args)
    return optax.apply_updates(params, updates), opt_state

  @functools.partial(jax.jit, donate_argnums=(0, 1))
  def update(params, opt_state, grads, num_tokens):
    """The optimizer part alone, gradients given."""
    extra_args = {'num_tokens': num_tokens} if loss == 'sum' else {}
    updates, opt_state = tx.update(grads, opt_state, params, **extra_args)
    return optax.apply_updates(params, updates), opt_state

  params = copy(model.params)
  opt_state = tx.init(params)
  zero = jnp.zeros([], jnp.int32)
  compiled = {
    'step': step.lower(params, opt_state, model.windows[0][0]).compile(),
    'update': update.lower(params, opt_state, params, zero).compile(),
  }
  return per_micro_batch(
    lambda carry, batch: step(*carry, batch),
    (params, opt_state),
    compiled,
    windows_of(model),
    lambda carry: carry[0],
  )


def plain(case):
  """One AdamW step per micro-batch (no accumulation)."""
  return _optax(case, case.adamw, loss='mean')


def multisteps(case):
  """``optax.MultiSteps(adamw, k)`` on the mean loss."""
  return _optax(case, optax.MultiSteps(case.adamw, case.k), loss='mean')


def tokacc_apply_updates(case):
  """``token_weighted_multistep(adamw, k)``, ``optax.apply_updates``."""
  return _optax(case, tokacc.token_weighted_multistep(case.adamw, case.k))


def compile_timed(jitted, *args, **static):
  """``jitted`` lowered and compiled for ``args``, and the seconds taken."""
  start = time.perf_counter()
  compiled = jitted.lower(*args, **static).compile()
  return compiled, time.perf_counter() - start


def _tokacc_compiled(case, close, patch=contextlib.nullcontext, **options):
  """``token_weighted_multistep(adamw, k, **options)`` as compiled
  programs: one step (``close=None``), or the host's two (``close`` False
  and True). ``patch`` is entered while tracing (the ablations of
  ``ABLATIONS``)."""
  model = case.model
  tx = tokacc.token_weighted_multistep(case.adamw, case.k, **options)

  @functools.partial(jax.jit, donate_argnums=(0, 1), static_argnames='close')
  def step(params, opt_state, batch, close=None):
    grads, num_tokens = jax.grad(model.loss_sum, has_aux=True)(params, batch)
    updates, opt_state = tx.update(
      grads, opt_state, params, num_tokens=num_tokens, close=close
    )
    return optax.apply_updates(params, updates), opt_state

  params = copy(model.params)
  opt_state = tx.init(params)
  batch = model.windows[0][0]
  with patch():
    programs = {
      label: compile_timed(step, params, opt_state, batch, close=c)
      for label, c in close.items()
    }
  compiled = {label: program for label, (program, _) in programs.items()}
  micro, closing = compiled[next(iter(close))], compiled[list(close)[-1]]
  return Trainer(
    lambda carry, batch: micro(*carry, batch),
    lambda carry, window: closing(*carry, window.micro_batches[-1]),
    (params, opt_state),
    lambda carry: carry[0],
    windows_of(model),
    compiled,
    compile_s={label: seconds for label, (_, seconds) in programs.items()},
  )


def tokacc_device(case):
  """``tokacc``, compiled once: the device decides (``close=None``)."""
  return _tokacc_compiled(case, {'step': None})


def tokacc_host(case):
  """``close=False`` on the micro-steps, ``close=True`` on the k-th: two
  programs, no conditional."""
  return _tokacc_compiled(case, {'micro': False, 'close': True})


def tokacc_host_no_norms(case):
  """``tokacc_host`` with ``window_norms=False`` (no gradient or update
  norm at the close: the opt-out for the host's closing program)."""
  close = {'micro': False, 'close': True}
  return _tokacc_compiled(case, close, window_norms=False)


@contextlib.contextmanager
def _patched(module, name, replacement):
  """``module.name`` replaced while tracing (ablations only)."""
  original = getattr(module, name)
  setattr(module, name, replacement)
  try:
    yield
  finally:
    setattr(module, name, original)


def _ablation(patch):
  def method(case):
    return _tokacc_compiled(case, {'step': None}, patch)

  return method


def _no_buffer():
  """The updates written to fresh -0.0 zeros, not held in the
  accumulator's buffer (a parameter-sized write on every micro-step)."""
  from optax_tokacc import _closing  # noqa: PLC0415

  return _patched(_closing, '_holds_exactly', lambda *args: False)


def _select_restart():
  """A window's restart as a select fused into the add, not a ``cond``."""
  from optax_tokacc import _compensated  # noqa: PLC0415

  original = _compensated._restarted

  def select(trees, restart, select=False):
    del select
    return original(trees, restart, True)

  return _patched(_compensated, '_restarted', select)


# Each performance trick, undone: the rows that show what it pays.
ABLATIONS = {
  'tokacc_no_buffer': _ablation(_no_buffer),
  'tokacc_select_restart': _ablation(_select_restart),
}


def tokacc_chain(case):
  """A transform chained after the accumulator (the clip never binds)."""
  accumulate = tokacc.token_weighted_multistep(case.adamw, case.k)
  return _optax(case, optax.chain(accumulate, optax.clip(1.0)))


def ideal_micro_step(model):
  """The ideal's jitted micro-step: ``acc + grad`` (accumulator donated)."""

  @functools.partial(jax.jit, donate_argnums=(1, 2))
  def micro_step(params, acc, acc_tokens, batch):
    grads, num_tokens = jax.grad(model.loss_sum, has_aux=True)(params, batch)
    acc = jax.tree.map(lambda a, g: a + g.astype(a.dtype), acc, grads)
    return acc, acc_tokens + num_tokens

  return micro_step


def ideal(case):
  """The reference: a jitted micro-step ``acc + grad`` (accumulator
  donated) and, once per window, a jitted AdamW update of the token mean
  (in the float32 accumulator's dtype, handed to AdamW in the gradients'
  dtype, as ``token_weighted_multistep`` does)."""
  model, adamw = case.model, case.adamw
  micro_step = ideal_micro_step(model)

  @functools.partial(jax.jit, donate_argnums=(0, 1, 2, 3))
  def window_update(params, opt_state, acc, acc_tokens):
    mean = jax.tree.map(
      lambda g, p: (g / acc_tokens.astype(g.dtype)).astype(p.dtype),
      acc,
      params,
    )
    updates, opt_state = adamw.update(mean, opt_state, params)
    params = optax.apply_updates(params, updates)
    zeros = jax.tree.map(jnp.zeros_like, acc)
    return params, opt_state, zeros, jnp.zeros_like(acc_tokens)

  params = copy(model.params)
  acc = jax.tree.map(
    lambda p: jnp.zeros_like(p, jnp.promote_types(p.dtype, jnp.float32)),
    params,
  )
  carry = (params, adamw.init(params), acc, jnp.zeros([], jnp.int32))
  compiled = {
    'micro_step': micro_step.lower(
      params, acc, carry[3], model.windows[0][0]
    ).compile(),
    'window_update': window_update.lower(*carry).compile(),
  }
  return ideal_trainer(
    micro_step, window_update, carry, compiled, windows_of(model)
  )


def ideal_trainer(micro_step, window_update, carry, compiled, windows, **kw):
  """The ideal's trainer: ``carry = (params, opt_state, acc, tokens)``;
  the closing step is a micro-step then the window's update."""

  def step(carry, batch):
    params, opt_state, acc, acc_tokens = carry
    return (params, opt_state, *micro_step(params, acc, acc_tokens, batch))

  def closing_step(carry, window):
    return window_update(*step(carry, window.micro_batches[-1]))

  return Trainer(
    step, closing_step, carry, lambda c: c[0], windows, compiled, **kw
  )


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

  params = copy(model.params)
  carry = (params, adamw.init(params))
  windows = windows_of(model)
  compiled = {'window_step': step.lower(*carry, windows[0].whole).compile()}
  return Trainer(
    None,
    lambda carry, window: step(*carry, window.whole),
    carry,
    lambda carry: carry[0],
    windows,
    compiled,
  )


METHODS = {
  'plain': plain,
  'ideal': ideal,
  'multisteps': multisteps,
  'tokacc': tokacc_apply_updates,
  'tokacc_chain': tokacc_chain,
  'tokacc_device': tokacc_device,
  'tokacc_host': tokacc_host,
  'tokacc_host_no_norms': tokacc_host_no_norms,
  'microbatched': microbatched,
  **ABLATIONS,
}
# Methods that are not the same computation as the ideal (no max|dp| check).
INEXACT = ('plain', 'multisteps')
