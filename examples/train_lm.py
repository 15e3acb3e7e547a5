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
r"""Trains a byte-level transformer LM with exact gradient accumulation.

Each optimizer step sees ``k`` micro-batches of ``--micro-batch-size``
sequences on each device of ``--mesh`` (fake CPU devices unless an
accelerator is present). Every micro-batch holds variable-length, padded
sequences, so micro-batches count different numbers of tokens;
``optax_tokacc.token_weighted_multistep`` sums the token-summed gradients
and the token counts over the window and the devices and hands AdamW the
exact full-batch gradient. ``--mesh`` picks the layout (the mesh's size is
the number of devices):

- ``data=N`` (the default, N = ``--devices``), DDP: ``jax.shard_map`` over
  ``data``, replicated parameters, ``axis_name='data'``; each device
  accumulates its own gradients, and one all-reduce per window sums them.
- ``fsdp=N``, FSDP with GSPMD: plain ``jax.jit`` over global arrays, each
  parameter split over ``fsdp`` along its largest dimension divisible by N
  (replicated if none is), ``axis_name=None``; the accumulator is split
  like the parameters, and XLA reduces the gradients on every micro-step.
- ``replica=R,fsdp=F``, HSDP: FSDP within each of R replicas;
  ``jax.shard_map`` manual over ``replica`` only (``fsdp`` left to GSPMD),
  ``axis_name='replica'``: each micro-step communicates within a replica
  only, and one all-reduce across the replicas closes the window.

Before training it prints the collectives of the compiled micro-step (read
by ``optax_tokacc.testing.check``) with the mesh axes they span: those run on every micro-step,
and per window ``k`` times those plus the ones of the step that closes the
window. On the default mesh, on one line::

  collectives: 0 per micro-step, 1 (1 all-reduce over data) per window of 4
  micro-steps

FSDP lists the all-gathers and all-reduces over ``fsdp`` of every
micro-step; HSDP the same within a replica, and ``1 all-reduce over
replica`` per window only. It then trains with a progress bar (window
loss, tokens/s) and writes an orbax checkpoint, a loss plot and
``summary.json`` to ``--out``::

  python examples/train_lm.py                 # DDP on 2 devices
  python examples/train_lm.py --steps 50 --k 8 --devices 4
  python examples/train_lm.py --mesh fsdp=4   # FSDP on 4 devices
  python examples/train_lm.py --mesh replica=2,fsdp=2   # HSDP on 4 devices
  python examples/train_lm.py --tokens-per-update 4096  # a token budget

With ``--tokens-per-update N`` a window closes once it holds N counted
tokens over all devices (or after ``--k`` micro-batches): the progress bar
shows each update's tokens, and ``summary.json`` their mean, minimum and
maximum, with the micro-batches per update.

On 2 shared CPU cores: about 1 minute for DDP, 1.5 for FSDP and HSDP (4
devices, twice the sequences per update).
"""

import argparse
import json
import math
import pathlib
import sys
import time
from typing import Callable, NamedTuple, Optional

import _lm
import jax
from matplotlib import figure as mpl_figure
import numpy as np
import optax
import orbax.checkpoint as ocp
from rich import progress

import optax_tokacc as tokacc
from optax_tokacc import testing
from optax_tokacc.flax import TrainState

AXES = ('data', 'replica', 'fsdp')
LAYOUTS = {('data',): 'DDP', ('fsdp',): 'FSDP', ('replica', 'fsdp'): 'HSDP'}
DEFAULT_MESH = 'data=<--devices>'
MESH_FORMS = 'data=N (DDP), fsdp=N (FSDP) or replica=R,fsdp=F (HSDP)'


def parse_args(argv=None) -> tuple[argparse.ArgumentParser, argparse.Namespace]:
  parser = argparse.ArgumentParser(
    description=__doc__.split('\n\n')[0].split('\n')[0],
    epilog='Example: python examples/train_lm.py --mesh replica=2,fsdp=2',
    formatter_class=argparse.ArgumentDefaultsHelpFormatter,
  )
  parser.add_argument(
    '--steps',
    type=int,
    default=200,
    help='optimizer updates (windows of k micro-batches)',
  )
  parser.add_argument(
    '--k',
    type=int,
    default=4,
    help='micro-batches accumulated per optimizer update',
  )
  parser.add_argument(
    '--micro-batch-size',
    type=int,
    default=8,
    help='sequences per micro-batch on each device',
  )
  parser.add_argument(
    '--mesh',
    default=DEFAULT_MESH,
    help=f'device mesh as axis=size pairs: {MESH_FORMS}; its size is the '
    'number of devices',
  )
  parser.add_argument(
    '--devices',
    type=int,
    default=2,
    help='devices of the default --mesh data=<devices>; on CPU this many '
    'fake devices are created',
  )
  parser.add_argument(
    '--tokens-per-update',
    type=int,
    default=None,
    help='close a window once it holds this many counted tokens over all '
    'devices (at most --k micro-batches): updates of a token budget',
  )
  parser.add_argument(
    '--lr', type=float, default=3e-3, help='peak learning rate of AdamW'
  )
  parser.add_argument(
    '--group-by-length',
    action=argparse.BooleanOptionalAction,
    default=False,
    help='sort each window by sequence length before cutting micro-batches '
    '(makes token counts per micro-batch vary even more)',
  )
  parser.add_argument(
    '--host-closes',
    action=argparse.BooleanOptionalAction,
    default=False,
    help='the host closes each window of k micro-batches (close=True on the '
    'k-th, close=False before): two programs, no conditional',
  )
  _lm.add_data_args(parser, out=pathlib.Path('runs/train_lm'))
  args = parser.parse_args(argv)
  _lm.check_positive(
    parser,
    steps=args.steps,
    k=args.k,
    micro_batch_size=args.micro_batch_size,
    devices=args.devices,
  )
  if args.tokens_per_update is not None:
    _lm.check_positive(parser, tokens_per_update=args.tokens_per_update)
    if args.host_closes:
      parser.error(
        '--host-closes and --tokens-per-update: the token budget is '
        'decided on the device; pass one of them'
      )
  args.mesh_axes = parse_mesh(parser, args)
  return parser, args


def parse_mesh(parser, args) -> tuple[tuple[str, int], ...]:
  """``(('replica', 2), ('fsdp', 2))`` from ``--mesh replica=2,fsdp=2``.

  Axes come in the order of ``AXES`` (replicas outermost). Anything but the
  layouts of ``LAYOUTS``, or a ``--devices`` that disagrees with the mesh,
  is a one-line error.
  """
  if args.mesh == DEFAULT_MESH:
    return (('data', args.devices),)
  sizes = _axis_sizes(parser, args.mesh)
  names = tuple(sorted(sizes, key=AXES.index))
  if names not in LAYOUTS:
    _lm.fail(
      parser,
      f'--mesh {args.mesh}: the axes {", ".join(names)} make no layout of '
      f'this example; use {MESH_FORMS}.',
    )
  if sizes.get('replica') == 1 and 'fsdp' in sizes:
    # XLA's SPMD partitioner rejects the window's all-reduce over a manual
    # axis of size 1 (jax 0.10.2).
    _lm.fail(
      parser,
      f'--mesh {args.mesh}: one replica is FSDP; use --mesh '
      f'fsdp={sizes["fsdp"]}.',
    )
  size = math.prod(sizes.values())
  if args.devices not in (parser.get_default('devices'), size):
    _lm.fail(
      parser,
      f'--devices {args.devices} disagrees with --mesh {args.mesh} ({size} '
      'devices): --devices only sets the default --mesh data=<devices>.',
    )
  return tuple((name, sizes[name]) for name in names)


def _axis_sizes(parser, text: str) -> dict[str, int]:
  """``{'replica': 2, 'fsdp': 2}`` from ``'replica=2,fsdp=2'``."""
  sizes = {}
  for item in text.split(','):
    name, _, size = (part.strip() for part in item.partition('='))
    if name not in AXES or name in sizes:
      problem = 'repeated' if name in sizes else 'unknown'
      _lm.fail(
        parser, f'--mesh {text}: {problem} axis {name!r}; use {MESH_FORMS}.'
      )
    if not size.isdigit() or int(size) < 1:
      _lm.fail(
        parser,
        f'--mesh {text}: the size of {name!r} must be an integer >= 1; got '
        f'{size!r}.',
      )
    sizes[name] = int(size)
  return sizes


def make_mesh(parser, args) -> jax.sharding.Mesh:
  """The mesh of ``args.mesh_axes`` on the first devices.

  The default mesh shrinks to the devices available (with a message); an
  explicit ``--mesh`` that needs more is a one-line error.
  """
  names = tuple(name for name, _ in args.mesh_axes)
  shape = tuple(size for _, size in args.mesh_axes)
  devices = jax.devices()
  if len(devices) < math.prod(shape):
    available = f'{len(devices)} {devices[0].platform} device(s) available'
    if args.mesh != DEFAULT_MESH:
      _lm.fail(
        parser,
        f'--mesh {args.mesh} needs {math.prod(shape)} devices; only '
        f'{available}.',
      )
    print(
      f'Only {available}; using {len(devices)} instead of --devices '
      f'{args.devices}.'
    )
    shape = (len(devices),)
  return jax.make_mesh(
    shape,
    names,
    axis_types=(jax.sharding.AxisType.Auto,) * len(shape),
    devices=devices[: math.prod(shape)],
  )


def layout_name(mesh: jax.sharding.Mesh) -> str:
  return LAYOUTS[tuple(mesh.axis_names)]


def data_axis(mesh: jax.sharding.Mesh) -> Optional[str]:
  """The transform's ``axis_name``: the axis ``shard_map`` is manual over
  (DDP's ``data``, HSDP's ``replica``); None for GSPMD FSDP."""
  return next((a for a in ('data', 'replica') if a in mesh.axis_names), None)


def param_specs(params, mesh: jax.sharding.Mesh):
  """Each parameter split over ``fsdp`` along its largest dimension divisible
  by the axis size; replicated if none is, or if the mesh has no ``fsdp``."""
  size = dict(mesh.shape).get('fsdp')

  def spec(param):
    dims = [d for d, n in enumerate(param.shape) if size and n % size == 0]
    if not dims:
      return jax.P()
    dim = max(dims, key=lambda d: param.shape[d])
    return jax.P(*(None,) * dim, 'fsdp')

  return jax.tree.map(spec, params)


def micro_step_fn(model, axis_name: Optional[str], close: Optional[bool]):
  """``micro_step(state, tokens, lengths) -> state``: one micro-batch.
  ``close``: None, the transform closes the window on the device (every
  ``k`` micro-batches, or the token budget); a bool, the host decides."""
  loss_fn = _lm.loss_sum_fn(model)

  def micro_step(state, tokens, lengths):
    params = state.params
    if axis_name is not None:  # this device's (replica's) share of a batch
      # Gradients of parameters marked varying stay per device (replica):
      # autodiff does not all-reduce them on every micro-step.
      params = jax.tree.map(
        lambda p: jax.lax.pcast(p, axis_name, to='varying'), params
      )
    (loss, num_tokens), grads = jax.value_and_grad(loss_fn, has_aux=True)(
      params, tokens, lengths
    )
    return state.apply_gradients(
      grads=grads, num_tokens=num_tokens, loss=loss, close=close
    )

  return micro_step


def placed_state(model, params, tx, mesh, layout):
  """The train state on ``mesh`` and its shardings.

  Parameters are laid out by ``layout['param_specs']``, the optimizer state
  by :func:`optax_tokacc.init_sharded` and
  :func:`optax_tokacc.state_shardings`, the counters replicated.
  """
  named = lambda spec: jax.NamedSharding(mesh, spec)  # noqa: E731
  params = jax.device_put(params, jax.tree.map(named, layout['param_specs']))

  def create(params):  # all but the optimizer state
    state = TrainState.create(apply_fn=model.apply, params=params, tx=tx)
    return state.replace(opt_state=None)

  shardings = jax.tree.map(
    lambda _: named(jax.P()), jax.eval_shape(create, params)
  ).replace(params=jax.tree.map(lambda p: p.sharding, params))
  state = jax.jit(create, out_shardings=shardings)(params).replace(
    opt_state=tokacc.init_sharded(tx, params, mesh, **layout)
  )
  return state, shardings.replace(
    opt_state=tokacc.state_shardings(tx, params, mesh, **layout)
  )


class HostClosed(NamedTuple):
  """The two programs of a loop whose host closes the windows: no
  conditional in either, and the closing step's reduction beside its
  backward pass, where XLA's scheduler can overlap them."""

  keep_open: Callable  # close=False: add the micro-batch
  close: Callable  # close=True: add it and run the optimizer

  def __call__(self, state, tokens, lengths, *, close: bool):
    return (self.close if close else self.keep_open)(state, tokens, lengths)


def sharded_training(model, params, tx, mesh, host_closes=False):
  """The train state laid out on ``mesh``, and a jitted micro-step over it.

  DDP and HSDP run the micro-step in ``jax.shard_map``, manual over the data
  axis only; its specs for the optimizer state come from
  :func:`optax_tokacc.state_partition_specs` with ``manual_axes`` (they name
  that axis only), while the jitted step's ``out_shardings`` keep the full
  layout. FSDP jits the micro-step over the global arrays.

  Returns:
    ``(state, train_step, batch_sharding)``; a batch is split over every
    mesh axis. With ``host_closes``, ``train_step`` is :class:`HostClosed`.
  """
  axis_name = data_axis(mesh)
  layout = dict(param_specs=param_specs(params, mesh), axis_name=axis_name)
  state, shardings = placed_state(model, params, tx, mesh, layout)
  if 'fsdp' in mesh.axis_names:  # GSPMD gathers parameters, not activations
    model = model.clone(constrain=_lm.batch_sharded(mesh, 'fsdp'))
  if axis_name is not None:
    specs = jax.tree.map(lambda _: jax.P(), state.replace(opt_state=None))
    specs = specs.replace(
      opt_state=tokacc.state_partition_specs(
        tx, state.params, manual_axes={axis_name}, **layout
      )
    )

  def compiled_step(close):
    step = micro_step_fn(model, axis_name, close)
    if axis_name is not None:
      step = jax.shard_map(
        step,
        mesh=mesh,
        in_specs=(specs, jax.P(axis_name), jax.P(axis_name)),
        out_specs=specs,
        axis_names={axis_name},
      )
    return jax.jit(step, out_shardings=shardings, donate_argnums=0)

  sharding = jax.NamedSharding(mesh, jax.P(mesh.axis_names))
  if host_closes:
    return (
      state,
      HostClosed(compiled_step(False), compiled_step(True)),
      sharding,
    )
  return state, compiled_step(None), sharding


def status_text(loss: float, tokens_per_s: float) -> str:
  """The progress bar's status after a window; NaN tokens/s is not shown."""
  if math.isnan(tokens_per_s):
    return f'loss {loss:.3f}'
  return f'loss {loss:.3f}  {tokens_per_s:,.0f} tok/s'


def micro_batches(args, sequences, rows):
  """Micro-batches ``(tokens, lengths)``, window after window of ``k``."""
  rng = np.random.default_rng(args.seed)
  while True:
    window = _lm.sample_window(
      rng, sequences, args.k, rows, args.group_by_length
    )
    yield from zip(window.tokens, window.lengths)


def train(args, state, train_step, sequences, batch_sharding):
  """Feeds micro-batches until ``args.steps`` updates, with a progress bar.

  A window closes after ``k`` micro-batches or, with ``--tokens-per-update``,
  once it holds that many counted tokens.

  Returns:
    ``(state, window_losses, (window_tokens, window_sizes),
    tokens_per_s)``: the counted tokens and micro-batches of each update;
    tokens/s is measured after the first window (warm-up), NaN with one
    window.
  """
  rows = batch_sharding.mesh.size * args.micro_batch_size
  window_losses, window_tokens, window_sizes = [], [], []
  columns = (
    *progress.Progress.get_default_columns()[:-1],
    progress.MofNCompleteColumn(),
    progress.TextColumn('{task.fields[status]}'),
    progress.TimeRemainingColumn(),
  )
  steady_start = steady_tokens = None  # throughput after the first window
  tokens_per_s = math.nan
  batches = micro_batches(args, sequences, rows)
  size = 0
  with progress.Progress(*columns) as bar:
    task = bar.add_task('training', total=args.steps, status='first window…')
    while len(window_losses) < args.steps:
      tokens, lengths = next(batches)
      batch = (
        jax.device_put(tokens, batch_sharding),
        jax.device_put(lengths, batch_sharding),
      )
      if isinstance(train_step, HostClosed):  # the host decides
        state = train_step(state, *batch, close=size + 1 == args.k)
      else:  # the transform decides, on the device
        state = train_step(state, *batch)
      size += 1
      if int(state.step) == len(window_losses):  # a micro-step
        continue
      window_sizes.append(size)
      size = 0
      window_losses.append(float(state.window_loss))
      window_tokens.append(int(_window_state(state).last_tokens))
      if steady_start is None:
        steady_start, steady_tokens = time.perf_counter(), 0
      else:
        steady_tokens += window_tokens[-1]
        tokens_per_s = steady_tokens / (time.perf_counter() - steady_start)
      status = status_text(window_losses[-1], tokens_per_s)
      bar.update(task, advance=1, status=f'{status}  {window_tokens[-1]} tok')
  return state, window_losses, (window_tokens, window_sizes), tokens_per_s


def _window_state(state) -> tokacc.TokenWeightedMultiStepState:
  return tokacc.find_state(state.opt_state)


def compile_step(args, state, train_step, batch_sharding, seq_len):
  """``train_step`` compiled for this run's micro-batches; prints its
  collectives per micro-step and per window."""
  rows = batch_sharding.mesh.size * args.micro_batch_size
  tokens = jax.ShapeDtypeStruct(
    (rows, seq_len + 1), np.int32, sharding=batch_sharding
  )
  lengths = jax.ShapeDtypeStruct((rows,), np.int32, sharding=batch_sharding)
  mesh = batch_sharding.mesh
  if not isinstance(train_step, HostClosed):
    compiled = train_step.lower(state, tokens, lengths).compile()
    report = testing.check(compiled, mesh=mesh)
    print(_lm.describe_collectives(report, args.k))
    return compiled
  keep_open, close = (
    step.lower(state, tokens, lengths).compile() for step in train_step
  )
  open_step, closing_step = (
    testing.check(program, mesh=mesh) for program in (keep_open, close)
  )
  print(_lm.describe_collectives(open_step, args.k, closing_step))
  return HostClosed(keep_open, close)


def save_plot(path, args, mesh, window_losses, heldout_loss) -> None:
  figure = mpl_figure.Figure(figsize=(6, 3.5), layout='tight')
  axis = figure.subplots()
  axis.plot(np.arange(1, args.steps + 1), window_losses, label='window loss')
  axis.axhline(heldout_loss, color='gray', ls='--', label='held-out (end)')
  axis.set_xlabel('optimizer update')
  axis.set_ylabel('loss (nats / byte)')
  axis.set_title(
    f'{args.corpus.name}: k={args.k}, {layout_name(mesh)} on {mesh.size} '
    'devices'
  )
  axis.legend()
  figure.savefig(path, dpi=120)


def save(out, args, mesh, state, window_losses, window_tokens, extra):
  """Writes the checkpoint, the loss plot and ``summary.json`` to ``out``;
  returns their paths."""
  checkpoint_dir = out / 'checkpoint'
  with ocp.StandardCheckpointer() as checkpointer:
    checkpointer.save(
      checkpoint_dir,
      {
        'step': state.step,
        'params': state.params,
        'opt_state': state.opt_state,
      },
      force=True,
    )
  plot_path = out / 'loss.png'
  save_plot(plot_path, args, mesh, window_losses, extra['heldout_loss'])
  summary = {
    'updates': args.steps,
    'counted_tokens': int(sum(window_tokens)),
    'tokens_per_update': {
      'budget': args.tokens_per_update,
      'mean': float(np.mean(window_tokens)),
      'min': int(min(window_tokens)),
      'max': int(max(window_tokens)),
    },
    'first_window_loss': window_losses[0],
    'last_window_loss': window_losses[-1],
    **extra,
  }
  summary_path = out / 'summary.json'
  summary_path.write_text(json.dumps(summary, indent=2) + '\n')
  return checkpoint_dir, plot_path, summary_path


def optimizer(args, mesh: jax.sharding.Mesh):
  """AdamW after clipping by the global norm, on windows of ``k``."""
  warmup = min(max(1, args.steps // 10), args.steps - 1)  # none for 1 step
  schedule = optax.warmup_cosine_decay_schedule(
    0.0, args.lr, warmup, args.steps, end_value=args.lr / 10
  )
  return tokacc.token_weighted_multistep(
    optax.chain(
      optax.clip_by_global_norm(1.0), optax.adamw(schedule, weight_decay=0.01)
    ),
    every_k_schedule=args.k,
    axis_name=data_axis(mesh),  # sum the window over this axis's devices
    tokens_per_update=args.tokens_per_update,
  )


def main(argv=None) -> None:
  parser, args = parse_args(argv)
  # Before anything starts a JAX backend.
  jax.config.update(
    'jax_num_cpu_devices', math.prod(dict(args.mesh_axes).values())
  )
  mesh = make_mesh(parser, args)
  config, train_data, heldout = _lm.load_data(
    parser, args, args.k * mesh.size * args.micro_batch_size
  )
  out = args.out.resolve()
  out.mkdir(parents=True, exist_ok=True)

  model = _lm.CausalLM(config)
  params = _lm.init_params(model, args.seed)
  state, train_step, batch_sharding = sharded_training(
    model, params, optimizer(args, mesh), mesh, args.host_closes
  )
  mesh_text = ','.join(f'{n}={s}' for n, s in mesh.shape.items())
  print(
    f'Byte-level transformer, {_lm.count_params(params):,} parameters, on '
    f'{len(train_data):,} sequences of <= {config.seq_len + 1} bytes from '
    f'{args.corpus.name}.\n{args.steps} updates x {args.k} micro-batches x '
    f'{mesh.size} {mesh.devices.flat[0].platform} devices x '
    f'{args.micro_batch_size} sequences; {layout_name(mesh)} on the mesh '
    f'{mesh_text}.'
  )
  start = time.perf_counter()
  train_step = compile_step(
    args, state, train_step, batch_sharding, config.seq_len
  )
  state, window_losses, (window_tokens, window_sizes), tokens_per_s = train(
    args, state, train_step, train_data, batch_sharding
  )
  state = jax.device_get(state)
  if int(state.step) != args.steps:
    sys.exit(
      f'error: expected {args.steps} updates, state.step is {state.step}'
    )
  heldout_loss = float(_lm.heldout_loss_fn(model, heldout)(state.params))
  elapsed = time.perf_counter() - start
  paths = save(
    out,
    args,
    mesh,
    state,
    window_losses,
    window_tokens,
    {
      'heldout_loss': heldout_loss,
      'micro_batches_per_update': {
        'mean': float(np.mean(window_sizes)),
        'min': int(min(window_sizes)),
        'max': int(max(window_sizes)),
      },
      'tokens_per_s': None if math.isnan(tokens_per_s) else tokens_per_s,
      'seconds': elapsed,
    },
  )
  print(
    f'Summary: {args.steps} updates on {sum(window_tokens):,} counted tokens '
    f'({min(window_tokens):,} to {max(window_tokens):,} per update) '
    f'in {elapsed:.0f} s ({tokens_per_s:,.0f} tokens/s after the first '
    f'window); window loss {window_losses[0]:.3f} -> {window_losses[-1]:.3f}, '
    f'held-out loss {heldout_loss:.3f} nats/byte.\n'
    'Checkpoint: {}\nLoss plot: {}\nSummary JSON: {}'.format(*paths)
  )


if __name__ == '__main__':
  main()
