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
r"""Explicit sharding under plain ``jax.jit``: one reduction per window.

Trains a small byte-level model on the shipped corpus with plain ``jax.jit``
on an explicit mesh (``jax.make_mesh``'s default since JAX 0.9; no
``shard_map``, ``axis_name=None``), ``k`` micro-batches per window, then
checks the parameters against full-batch training on one device
(``--optimizer sgd`` and ``--optimizer momentum`` check them against a bound
on float32 round-off, see :func:`sgd_round_off_bound`):

- ``--mesh data=N``, DDP: parameters typed reduced over ``data``
  (``jax.P(reduced={'data'})``), so their gradients arrive unreduced; the
  accumulator keeps each device's partial sums and one all-reduce closes the
  window.
- ``--mesh fsdp=N``, FSDP: parameters split over ``fsdp`` and gathered in
  the forward pass; their gradients are reduced over ``fsdp`` on every
  micro-step (FSDP needs it) and the accumulator is 1/N per device.
- ``--mesh replica=R,fsdp=F``, HSDP: split over ``fsdp``, typed reduced over
  ``replica``: collectives within ``fsdp`` on every micro-step, one
  all-reduce over ``replica`` per window.
- ``--shard-optimizer`` (with ``--mesh data=N``), the distributed-optimizer
  (ZeRO-1) layout: DDP with the optimizer's parameter-shaped state sharded
  over ``data`` (``tokacc.init_sharded(..., shard_optimizer_over=
  ('data',))``), each leaf on its first dimension that N divides. The window
  closes with a reduce-scatter of each gradient into the state's shards, the
  optimizer on the shards, and an all-gather of the updates: the bytes of
  one all-reduce, and 1/N of the optimizer state per device.

The loss and the token count are per-device partial sums
(``token_cross_entropy(..., out_sharding=jax.P(unreduced=...))``), so a
micro-step issues no collective for them either. It prints the collectives
of the compiled step, per micro-step and per window, e.g. for DDP::

  collectives: 0 per micro-step, 1 (1 all-reduce over data) per window of 4
  micro-steps

and the bytes of the optimizer's state that one device holds.

The model is written for explicit meshes: a one-hot embedding (a matmul, as
reduced parameters need), an MLP without biases and a tied output layer.
(Flax linen's ``Embed`` gathers without ``out_sharding``, which explicit
meshes refuse, so ``examples/train_lm.py`` keeps ``shard_map``.)

  python examples/explicit_sharding.py                  # DDP on 4 devices
  python examples/explicit_sharding.py --mesh replica=2,fsdp=2
  python examples/explicit_sharding.py --tokens-per-update 2000
  python examples/explicit_sharding.py --optimizer sgd  # bounded round-off
  python examples/explicit_sharding.py --shard-optimizer --optimizer momentum
"""

import argparse
import math
import pathlib

import _lm
import jax
import jax.numpy as jnp
import numpy as np
import optax

import optax_tokacc as tokacc
from optax_tokacc import testing

VOCAB = 256
LEARNING_RATES = {'adamw': 3e-3, 'momentum': 0.3, 'sgd': 1.0}
MOMENTUM = 0.9  # --optimizer momentum: optax.sgd(lr, momentum=MOMENTUM)
UNIT_ROUND_OFF = 2.0**-24  # float32
MESHES = 'data=N (DDP), fsdp=N (FSDP) or replica=R,fsdp=F (HSDP)'


def parse_args(argv=None) -> tuple[argparse.ArgumentParser, argparse.Namespace]:
  parser = argparse.ArgumentParser(
    description=__doc__.split('\n\n')[0],
    formatter_class=argparse.ArgumentDefaultsHelpFormatter,
  )
  parser.add_argument('--mesh', default='data=4', help=f'one of {MESHES}')
  parser.add_argument('--k', type=int, default=4, help='micro-batches/window')
  parser.add_argument('--steps', type=int, default=30, help='updates')
  parser.add_argument(
    '--micro-batch-size', type=int, default=2, help='sequences per device'
  )
  parser.add_argument(
    '--tokens-per-update',
    type=int,
    default=None,
    help='close a window once it holds this many counted tokens (all '
    'devices), at most --k micro-batches',
  )
  parser.add_argument(
    '--optimizer',
    choices=sorted(LEARNING_RATES),
    default='adamw',
    help='sgd, momentum (SGD with momentum 0.9, a parameter-shaped state '
    'to shard): the check against one device has a round-off bound',
  )
  parser.add_argument(
    '--shard-optimizer',
    action='store_true',
    help='ZeRO-1: shard the optimizer state over data (--mesh data=N)',
  )
  parser.add_argument(
    '--lr',
    type=float,
    default=None,
    help='learning rate; None: '
    + ', '.join(f'{lr:g} for {name}' for name, lr in LEARNING_RATES.items()),
  )
  parser.add_argument(
    '--corpus',
    type=pathlib.Path,
    default=_lm.DEFAULT_CORPUS,
    help='plain-text training corpus',
  )
  parser.add_argument('--seq-len', type=int, default=128, help='in bytes')
  parser.add_argument('--d-model', type=int, default=64, help='model width')
  parser.add_argument('--seed', type=int, default=0, help='init and data')
  args = parser.parse_args(argv)
  args.layers = 1  # what _lm.load_data checks; this model has one block
  _lm.check_positive(
    parser, k=args.k, steps=args.steps, micro_batch_size=args.micro_batch_size
  )
  args.mesh_axes = parse_mesh(parser, args.mesh)
  if args.shard_optimizer and tuple(args.mesh_axes) != ('data',):
    _lm.fail(
      parser,
      f'--shard-optimizer shards the optimizer state over data; use it '
      f'with --mesh data=N, not --mesh {args.mesh}.',
    )
  if args.lr is None:
    args.lr = LEARNING_RATES[args.optimizer]
  return parser, args


def parse_mesh(parser, text: str) -> dict[str, int]:
  """``{'replica': 2, 'fsdp': 2}`` from ``replica=2,fsdp=2``."""
  axes = {}
  for item in text.split(','):
    name, _, size = item.partition('=')
    if not size.isdigit() or int(size) < 1:
      _lm.fail(parser, f'--mesh {text}: use {MESHES}.')
    axes[name] = int(size)
  if tuple(axes) not in (('data',), ('fsdp',), ('replica', 'fsdp')):
    _lm.fail(parser, f'--mesh {text}: use {MESHES}.')
  return axes


def param_specs(params, mesh: jax.sharding.Mesh):
  """DDP: reduced over ``data``; FSDP: split over ``fsdp`` along the first
  dimension; HSDP: both, reduced over ``replica``."""
  names = mesh.axis_names
  reduced = {a for a in names if a in ('data', 'replica')}
  split = 'fsdp' if 'fsdp' in names else None

  def spec(p):
    return jax.P(split, *(None,) * (p.ndim - 1), reduced=reduced)

  return jax.tree.map(spec, params)


def init_params(seed: int, d_model: int):
  keys = jax.random.split(jax.random.key(seed), 3)
  normal = jax.random.normal
  return {
    'embed': normal(keys[0], (VOCAB, d_model)) * 0.02,
    'w_in': normal(keys[1], (d_model, 4 * d_model)) / math.sqrt(d_model),
    'w_out': normal(keys[2], (4 * d_model, d_model)) / math.sqrt(4 * d_model),
  }


def gathered(params):
  """Each parameter whole on every device, typed reduced over the axes it
  was split or reduced over: its gradient comes back unreduced there, and
  JAX reduces it back onto the split axes only (FSDP's reduce-scatter)."""

  def gather(p):
    spec = jax.typeof(p).sharding.spec
    split = {a for e in spec.partitions if e for a in jax.tree.leaves(e)}
    if not split:
      return p
    return jax.reshard(p, jax.P(reduced=set(spec.reduced) | split))

  return jax.tree.map(gather, params)


def loss_sum(params, tokens, lengths, out_sharding=None):
  """Token-summed next-byte cross-entropy and the counted tokens."""
  inputs, labels, mask = _lm.inputs_and_labels(tokens, lengths)
  p = gathered(params)
  x = jax.nn.one_hot(inputs, VOCAB) @ p['embed']
  x = x + jax.nn.gelu(x @ p['w_in']) @ p['w_out']
  logits = x @ p['embed'].T
  return tokacc.token_cross_entropy(
    logits, labels, where=mask, out_sharding=out_sharding
  )


def make_step(tx, mesh):
  partial = jax.P(unreduced=set(mesh.axis_names))

  @jax.jit
  def step(params, opt_state, tokens, lengths):
    (loss, num_tokens), grads = jax.value_and_grad(
      lambda p: loss_sum(p, tokens, lengths, partial), has_aux=True
    )(params)
    updates, opt_state = tx.update(
      grads, opt_state, params, num_tokens=num_tokens, loss=loss
    )
    return optax.apply_updates(params, updates), opt_state

  return step


def reference(optimizer, params, windows):
  """Full-batch training on one device: one step per window. Returns the
  parameters and the largest entry of each step's gradient."""

  @jax.jit
  def step(params, opt_state, tokens, lengths):
    (_, num_tokens), grads = jax.value_and_grad(loss_sum, has_aux=True)(
      params, tokens, lengths
    )
    grads = jax.tree.map(lambda g: g / num_tokens, grads)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    largest = jnp.max(
      jnp.stack([jnp.max(jnp.abs(g)) for g in jax.tree.leaves(grads)])
    )
    return optax.apply_updates(params, updates), opt_state, largest

  opt_state = optimizer.init(params)
  largest_gradients = []
  for window in windows:
    tokens = np.concatenate([t for t, _ in window])
    lengths = np.concatenate([n for _, n in window])
    params, opt_state, largest = step(params, opt_state, tokens, lengths)
    largest_gradients.append(float(largest))
  return params, largest_gradients


def sgd_round_off_bound(
  args, window_tokens, largest_gradients, params, momentum=0.0
):
  """How far float32 round-off can take SGD from full-batch training.

  SGD's update, with or without momentum, is linear in the gradients, so
  the two runs differ only by the round-off of their gradients and of
  adding the updates (u = 2**-24):

  - A window's gradient sums the terms of its n counted tokens, each
    computed through sums of at most m = 2 VOCAB + 11 d_model terms (the
    dot products and the softmax on a token's path, forward and backward).
    Two float32 evaluations in different orders (per device and micro-step,
    then over the devices, against one batch on one device) differ by at
    most 2 (n + m) u times the size of the terms (Higham, Accuracy and
    Stability of Numerical Algorithms, 2002, sections 3.1 and 4.2). Taken
    relative to the step's largest gradient times the learning rate (SGD's
    largest update): this worst case (errors of one sign, n u) exceeds the
    typical one (random signs, sqrt(n) u) by sqrt(n) > 40, which covers a
    gradient whose terms cancel.
  - With momentum b, step s's gradient enters the update of every later
    step t with weight b**(t - s) (``t = g + b t``), so its difference
    reaches the parameters (1 - b**(T - s + 1)) / (1 - b) times over T
    steps (at most 10 for b = 0.9); the trace's own roundings, a few u of
    the update, are far below that margin.
  - Adding an update rounds a parameter by at most u |p| in each run.
  - A later step carries an earlier difference multiplied by at most 1 + lr
    times the loss's curvature (about 1.2 at the start here), which the
    margin above covers over the few updates the tests run (3 to 6).

  AdamW has no such bound: it divides each gradient by its own size, so
  where a gradient is near zero (about eps, e.g. 1e-8 where the median is
  2e-5) its round-off moves the parameter by up to the learning rate.
  """
  m = 2 * VOCAB + 11 * args.d_model
  relative = 2 * (max(window_tokens) + m) * UNIT_ROUND_OFF
  largest_param = max(float(np.max(np.abs(p))) for p in jax.tree.leaves(params))
  rounding = 2 * UNIT_ROUND_OFF * largest_param
  steps = len(largest_gradients)
  reach = [
    sum(momentum**later for later in range(steps - s)) for s in range(steps)
  ]
  return sum(
    relative * args.lr * gradient * times + rounding
    for gradient, times in zip(largest_gradients, reach)
  )


def train(args, mesh, tx, params, opt_state, sequences):
  """Streams micro-batches until ``args.steps`` windows closed; returns
  the parameters, the windows (for the reference) and the window losses."""
  step = make_step(tx, mesh)
  batch = jax.NamedSharding(mesh, jax.P(mesh.axis_names))
  rows = mesh.size * args.micro_batch_size
  rng = np.random.default_rng(args.seed)
  windows, window, losses = [], [], []
  while len(windows) < args.steps:
    micro = _lm.sample_window(rng, sequences, 1, rows, False)
    tokens, lengths = micro.tokens[0], micro.lengths[0]
    if not windows and not window:
      print_collectives(args, step, params, opt_state, tokens, lengths, batch)
    params, opt_state = step(
      params,
      opt_state,
      jax.device_put(tokens, batch),
      jax.device_put(lengths, batch),
    )
    window.append((tokens, lengths))
    if bool(tokacc.has_updated(opt_state)):
      windows.append(window)
      window = []
      losses.append(float(tokacc.window_loss(opt_state)))
  return params, windows, losses


def print_collectives(args, step, params, opt_state, tokens, lengths, batch):
  report = testing.check(
    step,
    params,
    opt_state,
    jax.device_put(tokens, batch),
    jax.device_put(lengths, batch),
    mesh=batch.mesh,
  )
  print(_lm.describe_collectives(report, args.k))


def per_device_bytes(tree) -> tuple[int, int]:
  """The bytes of ``tree``'s arrays that one device holds, and in all."""
  leaves = jax.tree.leaves(tree)
  held = sum(leaf.addressable_shards[0].data.nbytes for leaf in leaves)
  return held, sum(leaf.nbytes for leaf in leaves)


def describe_optimizer_state(opt_state, shard_over) -> str:
  """One line: the inner optimizer's state bytes that one device holds."""
  held, whole = per_device_bytes(opt_state.inner_state)
  layout = f'ZeRO-1 over {shard_over[0]}' if shard_over else 'replicated'
  share = f'1/{whole / held:.3g}' if held else 'none'
  return (
    f'optimizer state: {held:,} bytes per device of {whole:,} ({share}, '
    f'{layout}).'
  )


def make_optimizer(args) -> optax.GradientTransformation:
  if args.optimizer == 'sgd':
    return optax.sgd(args.lr)
  if args.optimizer == 'momentum':
    return optax.sgd(args.lr, momentum=MOMENTUM)
  return optax.adamw(args.lr, weight_decay=0.01)


def main(argv=None) -> None:
  parser, args = parse_args(argv)
  jax.config.update('jax_num_cpu_devices', math.prod(args.mesh_axes.values()))
  mesh = jax.make_mesh(tuple(args.mesh_axes.values()), tuple(args.mesh_axes))
  _, sequences, _ = _lm.load_data(
    parser, args, args.k * mesh.size * args.micro_batch_size
  )
  inner = make_optimizer(args)
  shard_over = ('data',) if args.shard_optimizer else None
  tx = tokacc.token_weighted_multistep(
    inner, args.k, tokens_per_update=args.tokens_per_update
  )
  params0 = init_params(args.seed, args.d_model)
  with jax.set_mesh(mesh):
    specs = param_specs(params0, mesh)
    params = jax.device_put(params0, specs)
    if shard_over is None:
      opt_state = tx.init(params)  # the layout from the parameters' types
    else:
      opt_state = tokacc.init_sharded(
        tx, params, mesh, shard_optimizer_over=shard_over
      )
    print(
      f'{args.mesh}: parameters typed {specs["w_in"]}; accumulator typed '
      f'{jax.typeof(opt_state.grad_sums["w_in"])}.'
    )
    print(describe_optimizer_state(opt_state, shard_over))
    params, windows, losses = train(
      args, mesh, tx, params, opt_state, sequences
    )
    params = tokacc.to_checkpoint(params)  # typed replicated, for the host
  expected, largest_gradients = reference(inner, params0, windows)
  difference = max(
    float(np.max(np.abs(np.asarray(a) - np.asarray(b))))
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(expected))
  )
  sizes = [len(w) for w in windows]
  tokens = [sum(int((n - 1).sum()) for _, n in w) for w in windows]
  print(
    f'{len(windows)} updates of {min(sizes)}-{max(sizes)} micro-batches, '
    f'{sum(tokens) / len(tokens):,.0f} counted tokens per update; window '
    f'loss {losses[0]:.3f} -> {losses[-1]:.3f}.\nLargest difference from '
    f'full-batch training on one device: {difference:.1e}.'
  )
  if args.optimizer in ('sgd', 'momentum'):
    momentum = MOMENTUM if args.optimizer == 'momentum' else 0.0
    bound = sgd_round_off_bound(
      args, tokens, largest_gradients, expected, momentum
    )
    within = 'within' if difference <= bound else 'BEYOND'
    print(f'{within} the float32 round-off bound for SGD: {bound:.1e}.')
    if difference > bound:
      raise SystemExit(1)


if __name__ == '__main__':
  main()
