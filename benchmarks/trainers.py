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
"""What every method of ``run.py`` is built from.

A method is a builder ``(case) -> Trainer``: its jitted functions
(parameters and optimizer state donated), what they carry from call to
call, and its compiled programs, whose memory is reported. The timer
drives a :class:`Trainer` a window at a time: its micro-steps (the calls
that do not close the window), then the closing step. A :class:`Layout`
says where the method's arrays live: on one device as the model gives
them (:class:`OneDevice`), or on an explicit ``data`` mesh
(:class:`ExplicitData`).
"""

from collections.abc import Callable
import contextlib
import dataclasses
import time
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
import optax

from benchmarks import models


class Case(NamedTuple):
  """What every method of one table section trains.

  Attributes:
    model: the model, its data and its loss.
    k: micro-batches per window.
    adamw: the optimizer (``optax.adamw`` with the model's ``mu_dtype``).
    ddp_devices: the devices of the explicit DDP mesh.
  """

  model: models.Model
  k: int
  adamw: optax.GradientTransformation
  ddp_devices: tuple = ()


def make_case(model: models.Model, k: int, ddp_devices=()) -> Case:
  """A :class:`Case` with AdamW (learning rate 1e-4, ``model.mu_dtype``)."""
  adamw = optax.adamw(1e-4, mu_dtype=model.mu_dtype)
  return Case(model, k, adamw, tuple(ddp_devices))


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
    setup_s: seconds its builder took (tracing and compiling its programs).
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
  setup_s: float = 0.0

  def run_micro_steps(self, index: int):
    """Feeds the first ``k - 1`` micro-batches of window ``index``."""
    if self.micro_step is not None:
      window = self.windows[index % len(self.windows)]
      for batch in window.micro_batches[:-1]:
        self.carry = self.micro_step(self.carry, batch)

  def run_closing_step(self, index: int):
    """Closes window ``index``."""
    window = self.windows[index % len(self.windows)]
    self.carry = self.closing_step(self.carry, window)

  def block(self):
    jax.block_until_ready(self.carry)

  def params(self):
    return self.params_of(self.carry)


def per_micro_batch(step, carry, compiled, windows, params_of, **kwargs):
  """A trainer that calls ``step(carry, batch)`` once per micro-batch."""

  def closing_step(carry, window):
    return step(carry, window.micro_batches[-1])

  return Trainer(
    step, closing_step, carry, params_of, windows, compiled, **kwargs
  )


def windows_of(model: models.Model, put=lambda batch: batch) -> list[Window]:
  """The model's windows, each batch placed with ``put``."""

  def concatenate(batches):
    return jax.tree.map(lambda *xs: jnp.concatenate(xs), *batches)

  return [
    Window([put(b) for b in w], put(concatenate(w))) for w in model.windows
  ]


def copy(tree):
  """A copy of ``tree`` (each method donates its own buffers)."""
  return jax.tree.map(lambda x: x.copy(), tree)


def compile_timed(jitted, *args, **static):
  """``jitted`` lowered and compiled for ``args``, and the seconds taken."""
  start = time.perf_counter()
  compiled = jitted.lower(*args, **static).compile()
  return compiled, time.perf_counter() - start


def spec(x, reduced: bool = True) -> P:
  """The partition spec of ``x``'s type (``reduced=False``: without its
  reduced or unreduced axes)."""
  x_spec = jax.typeof(x).sharding.spec
  return x_spec if reduced else P(*x_spec.partitions)


class OneDevice:
  """The model's arrays on the default device, as it gives them."""

  mesh = None

  def context(self):
    return contextlib.nullcontext()

  def place(self, model: models.Model):
    """A copy of the parameters, and the windows."""
    return copy(model.params), windows_of(model)

  def on_mesh(self, call: Callable) -> Callable:
    return call

  def sum_zeros(self, param: jax.Array) -> jax.Array:
    """The zeros a parameter's gradients are added into (float32 at
    least)."""
    dtype = jnp.promote_types(param.dtype, jnp.float32)
    return jnp.zeros(param.shape, dtype)

  def whole(self, x: jax.Array) -> jax.Array:
    """``x`` as AdamW's nonlinear update takes it: itself."""
    return x

  def typed_like(self, update: jax.Array, param: jax.Array) -> jax.Array:
    """An update typed like its parameter: as it is."""
    del param
    return update

  def scalar_zero(self) -> jax.Array:
    return jnp.zeros([], jnp.int32)


class ExplicitData:
  """An explicit ``data`` mesh over ``devices``: parameters placed typed
  reduced over ``data`` with their full spec (``P(None, None,
  reduced={'data'})``), micro-batches sharded over ``data``. The gradients
  of such parameters are unreduced."""

  def __init__(self, devices):
    self.mesh = jax.make_mesh(
      (len(devices),),
      ('data',),
      axis_types=(jax.sharding.AxisType.Explicit,),
      devices=devices,
    )

  def context(self):
    return jax.set_mesh(self.mesh)

  def place(self, model: models.Model):
    """The parameters typed reduced over ``data``, and the windows."""

    def reduced(x):
      x_spec = P(*(None,) * x.ndim, reduced={'data'})
      return jax.device_put(x.copy(), NamedSharding(self.mesh, x_spec))

    rows = NamedSharding(self.mesh, P('data'))
    params = jax.tree.map(reduced, model.params)
    return params, windows_of(model, lambda b: jax.device_put(b, rows))

  def on_mesh(self, call: Callable) -> Callable:
    """``call`` run under ``jax.set_mesh(mesh)``, as it was traced."""

    def on_mesh(*args):
      with jax.set_mesh(self.mesh):
        return call(*args)

    return on_mesh

  def sum_zeros(self, param: jax.Array) -> jax.Array:
    """Float32 (at least) zeros typed like ``param`` with reduced turned
    unreduced: what unreduced gradients add into."""
    param_spec = spec(param)
    dtype = jnp.promote_types(param.dtype, jnp.float32)
    unreduced = P(*param_spec.partitions, unreduced=param_spec.reduced)
    return jnp.zeros(param.shape, dtype, out_sharding=unreduced)

  def whole(self, x: jax.Array) -> jax.Array:
    """``x`` without its reduced type (free: the values are replicated),
    or an unreduced sum reduced (one all-reduce)."""
    return jax.reshard(x, spec(x, reduced=False))

  def typed_like(self, update: jax.Array, param: jax.Array) -> jax.Array:
    """An update typed like its parameter (reduced over ``data``)."""
    return jax.reshard(update, spec(param))

  def scalar_zero(self) -> jax.Array:
    zero = jnp.zeros([], jnp.int32)
    return jax.device_put(zero, NamedSharding(self.mesh, P()))


def explicit_data(case: Case) -> ExplicitData:
  """The explicit mesh of ``case.ddp_devices`` (default: one device)."""
  return ExplicitData(case.ddp_devices or jax.devices()[:1])
