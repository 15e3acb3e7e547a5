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
"""The accelerator tier's steps, compiled for targets that are not here.

A placement of ``tests/placements.py`` is built on 8 fake CPU devices, as
the other tests build it; its arguments become abstract values laid out
the same way on a mesh of the target's devices (:func:`abstract_on`), and
its step is lowered there (``Run.lower``). One-device steps are written
here as a user writes them (:func:`one_device_programs`): the ideal's
micro-step and window update, the step closed by the device, the host's
two programs, and ``optax.MultiSteps``.
"""

import functools
import itertools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
import optax
import placements
import pytest

import optax_tokacc as tokacc
from optax_tokacc import testing

K = 4  # micro-steps per window
GPU_TARGETS = ('h100', 'h200')
TPU_TARGETS = ('tpu v5e 1x1', 'tpu v6e 1x1')
EIGHT_DEVICES = ('h100 x8', 'h200 x8', 'tpu v5e 2x4', 'tpu v6e 2x4')
CLOSE_MODES = {'device': None, 'host_open': False, 'host_closing': True}


def on_target(target: str, *values: Any, marks: tuple = ()) -> Any:
  """A test case on ``target`` (its first value): the tests of one target
  share an ``xdist_group``, so that its programs compile once per worker
  (``one_device_reports`` caches them) and TPU compiles stay together."""
  return pytest.param(
    target,
    *values,
    marks=(pytest.mark.xdist_group(target), *marks),
    id='-'.join(map(str, (target, *values))),
  )


def grid(targets: tuple, *axes: tuple) -> list:
  """:func:`on_target` cases for every target and combination of ``axes``."""
  return [on_target(t, *v) for t in targets for v in itertools.product(*axes)]


def _spec(x: Any) -> P:
  """``x``'s spec, reduced and unreduced axes included where typed."""
  sharding = x.sharding
  mesh = sharding.mesh
  explicit = any(
    t == jax.sharding.AxisType.Explicit for t in getattr(mesh, 'axis_types', ())
  )
  return jax.typeof(x).sharding.spec if explicit else sharding.spec


def mesh_of(tree: Any) -> Any:
  """The mesh of the first leaf laid out on one (None: no leaf is, or
  only on the mesh JAX makes for ``pmap``, whose axis is its own)."""
  for leaf in jax.tree.leaves(tree):
    sharding = getattr(leaf, 'sharding', None)
    if isinstance(sharding, NamedSharding):
      internal = all(str(a).startswith('_') for a in sharding.mesh.axis_names)
      return None if internal else sharding.mesh
  return None


def target_mesh(target: testing.Target, mesh: Any) -> jax.sharding.Mesh:
  """A mesh of ``target``'s devices shaped, named and typed as ``mesh``."""
  return target.mesh(
    tuple(mesh.shape.values()), tuple(mesh.axis_names), mesh.axis_types
  )


def abstract_on(tree: Any, mesh: Any) -> Any:
  """``tree``'s arrays as abstract values laid out on ``mesh`` as they are
  on their own mesh (replicated there where they are on one device; no
  sharding for ``pmap``'s stacked arrays, or with no ``mesh``)."""

  def leaf(x):
    sharding = getattr(x, 'sharding', None)
    if mesh is None:
      return jax.ShapeDtypeStruct(x.shape, x.dtype)
    spec = _spec(x) if isinstance(sharding, NamedSharding) else P()
    return jax.ShapeDtypeStruct(
      x.shape, x.dtype, sharding=NamedSharding(mesh, spec)
    )

  return jax.tree.map(leaf, tree)


def adamw_tx(axis_name: Any) -> optax.GradientTransformationExtraArgs:
  return tokacc.token_weighted_multistep(
    optax.adamw(1e-3), K, axis_name=axis_name
  )


def compensated_tx(axis_name: Any) -> optax.GradientTransformationExtraArgs:
  """A bfloat16 accumulator with compensation (TwoSum)."""
  return tokacc.token_weighted_multistep(
    optax.adamw(1e-3),
    K,
    axis_name=axis_name,
    accumulator_dtype=jnp.bfloat16,
    compensated=True,
  )


def placement_report(
  name: str, target: testing.Target, close: Any, make_tx: Any = adamw_tx
) -> testing.StepReport:
  """``placements.PLACEMENTS[name]`` on 8 devices with ``make_tx(axis)``,
  compiled for ``target`` with ``close`` (None: the device decides)."""
  return run_report(placements.PLACEMENTS[name](8, make_tx), target, close)


def run_report(
  run: placements.Run,
  target: testing.Target,
  close: Any,
  params_dtype: Any = None,
) -> testing.StepReport:
  """A :class:`placements.Run` on 8 CPU devices, compiled for ``target``
  with ``close``; with ``params_dtype`` (mixed precision: bfloat16), its
  parameters in that dtype and its state as built (float32 moments and
  accumulator)."""
  import helpers  # noqa: PLC0415 - the tests' module, beside placements

  batch = run.place(helpers.make_windows([K], 8)[0][0])
  emit_now = run.emit(False)
  cpu_mesh = run.mesh or mesh_of((run.params, run.state, batch))
  if cpu_mesh is None:  # pmap: all 8 devices along its axis
    mesh, on = target.mesh((8,), ('data',)), None
  else:
    mesh = on = target_mesh(target, cpu_mesh)
  params, state, batch, emit_now = abstract_on(
    (run.params, run.state, batch, emit_now), on
  )
  if params_dtype is not None:
    params = jax.tree.map(
      lambda p: jax.ShapeDtypeStruct(
        p.shape, params_dtype, sharding=p.sharding
      ),
      params,
    )
  args = (params, state, batch, emit_now)
  lower = run.lower or placements.lower_jit(run.step)
  return testing.check(lower(mesh, close, *args), mesh=mesh)


class Model(NamedTuple):
  """A memory-bound MLP: what an open micro-step's traffic is about."""

  params: Any
  batch: Any

  @staticmethod
  def loss_sum(params, batch):
    hidden = batch['x'].astype(jax.tree.leaves(params)[0].dtype)
    for i in range(len(params)):
      hidden = hidden @ params[f'layer_{i}']['w'] + params[f'layer_{i}']['b']
      if i < len(params) - 1:
        hidden = jax.nn.relu(hidden)
    return tokacc.token_cross_entropy(
      hidden, batch['y'], where=batch['mask'] > 0
    )

  def loss_mean(self, params, batch):
    loss, count = self.loss_sum(params, batch)
    return loss / jnp.maximum(count, 1).astype(loss.dtype)


# The MLP's width per platform. A TPU's fast memory holds a 1024-wide MLP
# whole (16.8 MB in float32), and XLA:TPU's temporaries are then its own
# choices of what to evict from there (4 MiB values, and a fixed count of
# 16 KiB ones); at 4096 (268 MB) they are the program's buffers, so that
# temporaries beyond the ideal's in parameter bytes mean what they say.
WIDTHS = {'gpu': 1024, 'tpu': 4096}


def mlp(target: testing.Target, dtype: Any, width=None, depth=4, rows=64):
  """Abstract parameters and micro-batch of :class:`Model` on ``target``'s
  first device: ``depth`` layers of ``width`` x ``width`` in ``dtype``
  (:data:`WIDTHS` by default)."""
  width = width or WIDTHS[target.platform]

  def on(shape, dt):
    return jax.ShapeDtypeStruct(shape, dt, sharding=target.sharding())

  params = {
    f'layer_{i}': {'w': on((width, width), dtype), 'b': on((width,), dtype)}
    for i in range(depth)
  }
  batch = {
    'x': on((rows, width), jnp.float32),
    'y': on((rows,), jnp.int32),
    'mask': on((rows,), jnp.float32),
  }
  return Model(params, batch)


def adamw_for(dtype: Any) -> optax.GradientTransformation:
  """AdamW as mixed precision trains: its first moment in float32."""
  mixed = jnp.dtype(dtype) != jnp.float32
  return optax.adamw(1e-4, mu_dtype=jnp.float32 if mixed else None)


def _ideal(model: Model, adamw: optax.GradientTransformation):
  """The two-program ideal: ``acc + grad``, then one window update."""

  @functools.partial(jax.jit, donate_argnums=(1, 2))
  def micro_step(params, acc, acc_tokens, batch):
    grads, count = jax.grad(model.loss_sum, has_aux=True)(params, batch)
    acc = jax.tree.map(lambda a, g: a + g.astype(a.dtype), acc, grads)
    return acc, acc_tokens + count

  @functools.partial(jax.jit, donate_argnums=(0, 1, 2, 3))
  def window_update(params, opt_state, acc, acc_tokens):
    mean = jax.tree.map(
      lambda a, p: (a / acc_tokens.astype(a.dtype)).astype(p.dtype),
      acc,
      params,
    )
    updates, opt_state = adamw.update(mean, opt_state, params)
    zeros = jax.tree.map(jnp.zeros_like, acc)
    return (
      optax.apply_updates(params, updates),
      opt_state,
      zeros,
      jnp.zeros_like(acc_tokens),
    )

  return micro_step, window_update


def on_device(tree: Any, target: testing.Target) -> Any:
  """Abstract values of ``tree``'s shapes on ``target``'s first device."""
  return jax.tree.map(
    lambda x: jax.ShapeDtypeStruct(
      x.shape, x.dtype, sharding=target.sharding()
    ),
    tree,
  )


def _user_step(model: Model, tx: Any):
  """A user's step: gradient, ``tx.update``, ``optax.apply_updates``."""

  @functools.partial(jax.jit, donate_argnums=(0, 1), static_argnames='close')
  def step(params, opt_state, batch, close=None):
    grads, count = jax.grad(model.loss_sum, has_aux=True)(params, batch)
    updates, opt_state = tx.update(
      grads, opt_state, params, num_tokens=count, close=close
    )
    return optax.apply_updates(params, updates), opt_state

  return step


def _update_and_apply_step(model: Model, tx: Any):
  """A step that updates and applies in one call
  (``tokacc.update_and_apply``, as the Flax train states do), closed by
  the device or by the host (``close``)."""

  @functools.partial(jax.jit, donate_argnums=(0, 1), static_argnames='close')
  def step(params, opt_state, batch, close=None):
    grads, count = jax.grad(model.loss_sum, has_aux=True)(params, batch)
    return tokacc.update_and_apply(
      tx, grads, opt_state, params, num_tokens=count, close=close
    )

  return step


def _multisteps_step(model: Model, tx: Any):
  @functools.partial(jax.jit, donate_argnums=(0, 1))
  def step(params, opt_state, batch):
    grads = jax.grad(model.loss_mean)(params, batch)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state

  return step


@functools.cache
def one_device_reports(
  name: str,
  dtype_name: str,
  compensated: bool = False,
  window_norms: bool = True,
) -> dict[str, testing.StepReport]:
  """Every program of the MLP on target ``name``'s first device: the
  ideal's (``ideal_micro``, ``ideal_update``), ours by close mode
  (:data:`CLOSE_MODES`), ``update_and_apply`` (device-decided),
  ``update_and_apply_closing`` (the host's close) and ``multisteps``;
  with ``compensated`` a bfloat16 accumulator with compensation, ours
  only; without ``window_norms``, ours by close mode only."""
  target = testing.target(name)
  dtype = jnp.dtype(dtype_name)
  model = mlp(target, dtype)
  params, batch = model.params, model.batch
  adamw = adamw_for(dtype)
  reports = {}
  options = {'window_norms': window_norms}
  if compensated:
    options |= {'accumulator_dtype': jnp.bfloat16, 'compensated': True}
  elif window_norms:
    micro_step, window_update = _ideal(model, adamw)
    acc = on_device(
      jax.tree.map(
        lambda p: jax.ShapeDtypeStruct(p.shape, jnp.float32), params
      ),
      target,
    )
    tokens = on_device(jax.ShapeDtypeStruct((), jnp.int32), target)
    opt_state = on_device(jax.eval_shape(adamw.init, params), target)
    reports['ideal_micro'] = testing.check(
      micro_step, params, acc, tokens, batch
    )
    reports['ideal_update'] = testing.check(
      window_update, params, opt_state, acc, tokens
    )
    multisteps = optax.MultiSteps(adamw, K)
    reports['multisteps'] = testing.check(
      _multisteps_step(model, multisteps),
      params,
      on_device(jax.eval_shape(multisteps.init, params), target),
      batch,
    )
  tx = tokacc.token_weighted_multistep(adamw, K, **options)
  step = _user_step(model, tx)
  state = on_device(jax.eval_shape(tx.init, params), target)
  for mode, close in CLOSE_MODES.items():
    reports[mode] = testing.check(step, params, state, batch, close=close)
  if not compensated and window_norms:
    step = _update_and_apply_step(model, tx)
    reports['update_and_apply'] = testing.check(step, params, state, batch)
    reports['update_and_apply_closing'] = testing.check(
      step, params, state, batch, close=True
    )
  return reports


def param_bytes(name: str, dtype_name: str) -> int:
  """Bytes of the MLP's parameters (what 'parameter-sized' means)."""
  model = mlp(testing.target(name), jnp.dtype(dtype_name))
  return sum(
    x.size * jnp.dtype(x.dtype).itemsize for x in jax.tree.leaves(model.params)
  )


# A 2-layer MLP without biases, P = 557,056 bytes: on a TPU slice, the size
# at which the window's reduction across replicas went out as two
# all-reduces (issue 54); the tests' model (288 bytes) shows one.
MLP_SHAPES = {'w1': (256, 512), 'w2': (512, 16)}
MLP_BYTES = sum(4 * a * b for a, b in MLP_SHAPES.values())
MLP_ROWS = 64


def _whole(param):
  """A parameter as the forward pass uses it: split dimensions gathered
  into a copy reduced over every axis (JAX needs the contracting axes
  reduced; autodiff then reduce-scatters its gradient)."""
  spec = jax.typeof(param).sharding.spec
  split = set(jax.tree.leaves(tuple(e for e in spec.partitions if e)))
  if not split:
    return param
  return jax.reshard(param, P(reduced=set(spec.reduced) | split))


def _mlp_loss_sum(params, batch, axes):
  """The squared error summed over the micro-batch, as partial sums over
  ``axes`` (no collective of the step's own)."""
  params = jax.tree.map(_whole, params)
  error = jax.nn.relu(batch['x'] @ params['w1']) @ params['w2'] - batch['y']
  return jnp.einsum('bc,bc->', error, error, out_sharding=P(unreduced=axes))


def mlp_report(
  close: Any,
  mesh: jax.sharding.Mesh,
  spec: P,
  *,
  shapes: dict = MLP_SHAPES,
  **layout: Any,
) -> testing.StepReport:
  """The MLP of ``shapes`` (``w1``, ``w2``) under explicit sharding on
  ``mesh`` (a target's devices, or the CPU's), each parameter typed
  ``spec`` (the state from ``init_sharded(..., **layout)``), AdamW,
  compiled with ``close``; the count and the loss spelled unreduced, the
  batch split over every axis."""
  tx = adamw_tx(None)
  axes = set(mesh.axis_names)

  def on(shape, s):
    return jax.ShapeDtypeStruct(
      shape, jnp.float32, sharding=NamedSharding(mesh, s)
    )

  params = {name: on(shape, spec) for name, shape in shapes.items()}
  rows = P(tuple(mesh.axis_names))
  batch = {
    'x': on((MLP_ROWS, shapes['w1'][0]), rows),
    'y': on((MLP_ROWS, shapes['w2'][1]), rows),
    'mask': on((MLP_ROWS,), rows),
  }

  @functools.partial(jax.jit, static_argnames='close')
  def step(params, state, batch, close=None):
    loss, grads = jax.value_and_grad(_mlp_loss_sum)(params, batch, axes)
    count = jnp.einsum('b->', batch['mask'], out_sharding=P(unreduced=axes))
    updates, state = tx.update(
      grads, state, params, num_tokens=count, loss=loss, close=close
    )
    return optax.apply_updates(params, updates), state

  with jax.set_mesh(mesh):
    state = tokacc.init_sharded(tx, params, mesh, **layout)
    return testing.check(step, params, state, batch, close=close, mesh=mesh)


# shard_map layouts of the MLP: name -> (axis_name, the parameters' spec,
# the manual axes, whether the forward pass gathers the fsdp shards).
SHARD_MAP_LAYOUTS = {
  'ddp': ('data', P(), {'data'}, False),
  'hsdp': (('replica', 'fsdp'), P('fsdp', None), {'replica', 'fsdp'}, True),
  'hsdp_partial': ('replica', P('fsdp', None), {'replica'}, False),
}


def shard_map_mlp_report(
  close: Any, mesh: jax.sharding.Mesh, layout: str
) -> testing.StepReport:
  """The MLP of :data:`MLP_SHAPES` in a ``shard_map`` layout of
  :data:`SHARD_MAP_LAYOUTS` on ``mesh`` (``('data',)`` for DDP, ``('replica',
  'fsdp')`` for HSDP, as docs/sharded_training.md lays them out); AdamW,
  compiled with ``close``. The parameters are marked varying over
  ``data``/``replica`` (no reduction there on a micro-step). Fully manual
  HSDP gathers the ``fsdp`` shards in the forward pass (autodiff
  reduce-scatters the gradients within each replica); partial-manual HSDP
  (``axis_name='replica'``) leaves ``fsdp`` to the partitioner."""
  data, spec, manual, gathers = SHARD_MAP_LAYOUTS[layout]
  axes = tuple(mesh.axis_names)
  tx = adamw_tx(data)
  specs = {name: spec for name in MLP_SHAPES}

  def on(shape, s):
    return jax.ShapeDtypeStruct(
      shape, jnp.float32, sharding=NamedSharding(mesh, s)
    )

  params = {name: on(shape, spec) for name, shape in MLP_SHAPES.items()}
  batch = {
    'x': on((MLP_ROWS, MLP_SHAPES['w1'][0]), P(axes)),
    'y': on((MLP_ROWS, MLP_SHAPES['w2'][1]), P(axes)),
    'mask': on((MLP_ROWS,), P(axes)),
  }
  state_specs = tokacc.state_partition_specs(
    tx, params, param_specs=specs, axis_name=data
  )

  def whole(p):
    return jax.lax.all_gather(p, 'fsdp', tiled=True, axis=0) if gathers else p

  def local_step(params, state, batch):
    def loss_sum(local):
      w1, w2 = (whole(local[name]) for name in ('w1', 'w2'))
      error = jax.nn.relu(batch['x'] @ w1) @ w2 - batch['y']
      return jnp.sum(error * error)

    local = jax.tree.map(
      lambda p: jax.lax.pcast(p, axes[0], to='varying'), params
    )
    loss, grads = jax.value_and_grad(loss_sum)(local)
    count = jnp.sum(batch['mask'])
    updates, state = tx.update(
      grads, state, params, num_tokens=count, loss=loss, close=close
    )
    return optax.apply_updates(params, updates), state

  # the specs' manual axes only: the partitioner's are not shard_map's
  param_in, state_in = placements.manual_specs((specs, state_specs), manual)
  step = jax.jit(
    jax.shard_map(
      local_step,
      mesh=mesh,
      in_specs=(param_in, state_in, P(data)),
      out_specs=(param_in, state_in),
      axis_names=manual,
    ),
    out_shardings=jax.tree.map(
      lambda s: NamedSharding(mesh, s),
      (specs, state_specs),
      is_leaf=lambda x: isinstance(x, P),
    ),
  )
  state = tokacc.init_sharded(
    tx, params, mesh, param_specs=specs, axis_name=data
  )
  return testing.check(step, params, state, batch, mesh=mesh)


def one_leaf_zero1_report(
  mesh: jax.sharding.Mesh, shape: tuple[int, int]
) -> testing.StepReport:
  """ZeRO-1 of one float32 parameter of ``shape`` on ``mesh`` (8 devices
  over ``data``, explicit), AdamW's moments sharded on its first
  dimension, the host's closing program: how the window is reduced."""
  tx = adamw_tx(None)
  reduced = NamedSharding(mesh, P(None, None, reduced={'data'}))
  params = {'w': jax.ShapeDtypeStruct(shape, jnp.float32, sharding=reduced)}
  rows = NamedSharding(mesh, P('data'))
  x = jax.ShapeDtypeStruct((MLP_ROWS, shape[0]), jnp.float32, sharding=rows)
  partial = P(unreduced={'data'})

  @jax.jit
  def step(params, state, x):
    def loss_sum(params):
      out = x @ params['w']
      return jnp.einsum('bc,bc->', out, out, out_sharding=partial)

    loss, grads = jax.value_and_grad(loss_sum)(params)
    mask = jnp.ones((MLP_ROWS,), out_sharding=P('data'))
    count = jnp.einsum('b->', mask, out_sharding=partial)
    updates, state = tx.update(
      grads, state, params, num_tokens=count, loss=loss, close=True
    )
    return optax.apply_updates(params, updates), state

  with jax.set_mesh(mesh):
    state = tokacc.init_sharded(
      tx, params, mesh, shard_optimizer_over=('data',)
    )
    return testing.check(step, params, state, x, mesh=mesh)
