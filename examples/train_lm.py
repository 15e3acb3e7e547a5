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

Each optimizer step sees ``k`` micro-batches on each of ``--devices`` data-
parallel devices (fake CPU devices unless an accelerator is present). Every
micro-batch holds variable-length, padded sequences, so micro-batches count
different numbers of tokens; ``optax_tokacc.token_weighted_multistep`` sums
the token-summed gradients and the token counts over the window and the
devices (one ``psum`` per window) and hands AdamW the exact full-batch
gradient. Writes an orbax checkpoint and a loss plot to ``--out``::

  python examples/train_lm.py                 # about 30 s on 2 CPU cores
  python examples/train_lm.py --steps 50 --k 8 --devices 4
"""

import argparse
import json
import math
import pathlib
import sys
import time

import _lm
import jax
from matplotlib import figure as mpl_figure
import numpy as np
import optax
import orbax.checkpoint as ocp
from rich import progress

import optax_tokacc as tokacc
from optax_tokacc.flax import TrainState


def parse_args(argv=None) -> tuple[argparse.ArgumentParser, argparse.Namespace]:
  parser = argparse.ArgumentParser(
    description=__doc__.split('\n\n')[0].split('\n')[0],
    epilog='Example: python examples/train_lm.py --steps 50 --k 8 --devices 4',
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
    '--devices',
    type=int,
    default=2,
    help='data-parallel devices; on CPU this many fake devices are created',
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
  _lm.add_data_args(parser, out=pathlib.Path('runs/train_lm'))
  args = parser.parse_args(argv)
  _lm.check_positive(
    parser,
    steps=args.steps,
    k=args.k,
    micro_batch_size=args.micro_batch_size,
    devices=args.devices,
  )
  return parser, args


def data_parallel(model, params, tx, mesh):
  """The train state on ``mesh`` and a jitted micro-step over it.

  DDP with ``shard_map``: parameters and counters are replicated; each device
  accumulates its own token-summed gradients, tokens and loss (the per-device
  fields that :func:`optax_tokacc.state_partition_specs` lays out), and the
  window is summed over the devices once, when it closes.
  """
  replicated = jax.NamedSharding(mesh, jax.P())
  params = jax.device_put(params, replicated)
  state = TrainState.create(apply_fn=model.apply, params=params, tx=tx)
  state = jax.device_put(state.replace(opt_state=None), replicated).replace(
    opt_state=tokacc.init_sharded(tx, params, mesh, axis_name='data')
  )
  specs = jax.tree.map(lambda _: jax.P(), state.replace(opt_state=None))
  specs = specs.replace(
    opt_state=tokacc.state_partition_specs(tx, params, axis_name='data')
  )
  loss_fn = _lm.loss_sum_fn(model)

  def micro_step(state, tokens, lengths):  # one device's share of a batch
    # Gradients of parameters marked varying stay per device: autodiff does
    # not all-reduce them on every micro-step.
    local = jax.tree.map(
      lambda p: jax.lax.pcast(p, 'data', to='varying'), state.params
    )
    (loss, num_tokens), grads = jax.value_and_grad(loss_fn, has_aux=True)(
      local, tokens, lengths
    )
    return state.apply_gradients(grads=grads, num_tokens=num_tokens, loss=loss)

  train_step = jax.jit(
    jax.shard_map(
      micro_step,
      mesh=mesh,
      in_specs=(specs, jax.P('data'), jax.P('data')),
      out_specs=specs,
    ),
    donate_argnums=0,
  )
  return state, train_step


def status_text(loss: float, tokens_per_s: float) -> str:
  """The progress bar's status after a window; NaN tokens/s is not shown."""
  if math.isnan(tokens_per_s):
    return f'loss {loss:.3f}'
  return f'loss {loss:.3f}  {tokens_per_s:,.0f} tok/s'


def train(args, state, train_step, sequences, mesh):
  """Runs ``args.steps`` windows with a progress bar.

  Returns:
    ``(state, window_losses, window_tokens, tokens_per_s)``; tokens/s is
    measured after the first window (compilation), NaN with one window.
  """
  rng = np.random.default_rng(args.seed)
  sharded = jax.NamedSharding(mesh, jax.P('data'))
  rows = mesh.size * args.micro_batch_size
  window_losses, window_tokens = [], []
  columns = (
    *progress.Progress.get_default_columns()[:-1],
    progress.MofNCompleteColumn(),
    progress.TextColumn('{task.fields[status]}'),
    progress.TimeRemainingColumn(),
  )
  steady_start = steady_tokens = None  # throughput after compilation
  tokens_per_s = math.nan
  with progress.Progress(*columns) as bar:
    task = bar.add_task('training', total=args.steps, status='compiling…')
    for _ in range(args.steps):
      window = _lm.sample_window(
        rng, sequences, args.k, rows, args.group_by_length
      )
      for tokens, lengths in zip(window.tokens, window.lengths):
        state = train_step(
          state,
          jax.device_put(tokens, sharded),
          jax.device_put(lengths, sharded),
        )
      window_losses.append(float(state.window_loss))
      window_tokens.append(int(window.lengths.sum() - window.lengths.size))
      if steady_start is None:
        steady_start, steady_tokens = time.perf_counter(), 0
      else:
        steady_tokens += window_tokens[-1]
        tokens_per_s = steady_tokens / (time.perf_counter() - steady_start)
      bar.update(
        task, advance=1, status=status_text(window_losses[-1], tokens_per_s)
      )
  return state, window_losses, window_tokens, tokens_per_s


def save_plot(path, args, num_devices, window_losses, heldout_loss) -> None:
  figure = mpl_figure.Figure(figsize=(6, 3.5), layout='tight')
  axis = figure.subplots()
  axis.plot(np.arange(1, args.steps + 1), window_losses, label='window loss')
  axis.axhline(heldout_loss, color='gray', ls='--', label='held-out (end)')
  axis.set_xlabel('optimizer update')
  axis.set_ylabel('loss (nats / byte)')
  axis.set_title(f'{args.corpus.name}: k={args.k}, {num_devices} devices')
  axis.legend()
  figure.savefig(path, dpi=120)


def main(argv=None) -> None:
  parser, args = parse_args(argv)
  # Before anything starts a JAX backend.
  jax.config.update('jax_num_cpu_devices', args.devices)
  devices = jax.devices()[: args.devices]
  num_devices = len(devices)
  if num_devices < args.devices:
    print(
      f'Only {num_devices} {devices[0].platform} device(s) available; '
      f'using {num_devices} instead of --devices {args.devices}.'
    )
  config, train_data, heldout = _lm.load_data(
    parser, args, args.k * num_devices * args.micro_batch_size
  )
  out = args.out.resolve()
  out.mkdir(parents=True, exist_ok=True)

  model = _lm.CausalLM(config)
  params = _lm.init_params(model, args.seed)
  schedule = optax.warmup_cosine_decay_schedule(
    0.0, args.lr, max(1, args.steps // 10), args.steps, end_value=args.lr / 10
  )
  tx = tokacc.token_weighted_multistep(
    optax.chain(
      optax.clip_by_global_norm(1.0), optax.adamw(schedule, weight_decay=0.01)
    ),
    every_k_schedule=args.k,
    axis_name='data',  # sum the window over the data-parallel devices
  )
  mesh = jax.make_mesh((num_devices,), ('data',), devices=devices)
  state, train_step = data_parallel(model, params, tx, mesh)
  print(
    f'Byte-level transformer, {_lm.count_params(params):,} parameters, on '
    f'{len(train_data):,} sequences of <= {config.seq_len + 1} bytes from '
    f'{args.corpus.name}.\n{args.steps} updates x {args.k} micro-batches x '
    f'{num_devices} {devices[0].platform} devices x {args.micro_batch_size} '
    'sequences.'
  )
  start = time.perf_counter()
  state, window_losses, window_tokens, tokens_per_s = train(
    args, state, train_step, train_data, mesh
  )
  state = jax.device_get(state)
  if int(state.step) != args.steps:
    sys.exit(
      f'error: expected {args.steps} updates, state.step is {state.step}'
    )
  heldout_loss = float(_lm.heldout_loss_fn(model, heldout)(state.params))
  elapsed = time.perf_counter() - start

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
  save_plot(plot_path, args, num_devices, window_losses, heldout_loss)
  summary = {
    'updates': args.steps,
    'counted_tokens': int(sum(window_tokens)),
    'first_window_loss': window_losses[0],
    'last_window_loss': window_losses[-1],
    'heldout_loss': heldout_loss,
    'tokens_per_s': None if math.isnan(tokens_per_s) else tokens_per_s,
    'seconds': elapsed,
  }
  summary_path = out / 'summary.json'
  summary_path.write_text(json.dumps(summary, indent=2) + '\n')
  print(
    f'Summary: {args.steps} updates on {sum(window_tokens):,} counted tokens '
    f'in {elapsed:.0f} s ({tokens_per_s:,.0f} tokens/s after compilation); '
    f'window loss {window_losses[0]:.3f} -> {window_losses[-1]:.3f}, '
    f'held-out loss {heldout_loss:.3f} nats/byte.\n'
    f'Checkpoint: {checkpoint_dir}\nLoss plot: {plot_path}\n'
    f'Summary JSON: {summary_path}'
  )


if __name__ == '__main__':
  main()
