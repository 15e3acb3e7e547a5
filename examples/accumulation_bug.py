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
r"""The gradient-accumulation bug, and its fix, on a real LM and real text.

Trains the same byte-level transformer from the same initialization on the
same windows of variable-length sequences, three ways:

1. reference: the full batch of each window at once, token-mean loss;
2. ``optax.MultiSteps``: k micro-batches, each with its own token-mean loss,
   averaged (the "average of averages");
3. ``optax_tokacc.token_weighted_multistep``: k micro-batches with
   token-summed losses and their token counts.

Prints, at checkpoint steps, the largest relative parameter difference from
the reference (over parameter arrays, ||p - p_ref|| / ||p_ref||) and the
difference of the held-out loss, and writes a plot and a markdown table::

  python examples/accumulation_bug.py             # about 2 min on 2 CPU cores
  python examples/accumulation_bug.py --out docs  # regenerates docs/
"""

import argparse
import pathlib

import _lm
import jax
from matplotlib import figure as mpl_figure
import numpy as np
import optax

import optax_tokacc as tokacc

METHODS = ('optax.MultiSteps', 'token_weighted_multistep')


def parse_args(argv=None) -> tuple[argparse.ArgumentParser, argparse.Namespace]:
  parser = argparse.ArgumentParser(
    description=__doc__.split('\n\n')[0],
    epilog='Example: python examples/accumulation_bug.py --updates 100 --k 8',
    formatter_class=argparse.ArgumentDefaultsHelpFormatter,
  )
  parser.add_argument(
    '--updates',
    type=int,
    default=300,
    help='optimizer updates of each run',
  )
  parser.add_argument(
    '--k',
    type=int,
    default=4,
    help='micro-batches per optimizer update',
  )
  parser.add_argument(
    '--micro-batch-size',
    type=int,
    default=8,
    help='sequences per micro-batch',
  )
  parser.add_argument(
    '--lr', type=float, default=1e-3, help='AdamW learning rate'
  )
  parser.add_argument(
    '--eval-every',
    type=int,
    default=10,
    help='updates between comparisons (plot points)',
  )
  parser.add_argument(
    '--table-every',
    type=int,
    default=50,
    help='updates between table rows',
  )
  parser.add_argument(
    '--group-by-length',
    action=argparse.BooleanOptionalAction,
    default=True,
    help='sort each window by sequence length before cutting micro-batches; '
    'without it micro-batches are cut at random (token counts then vary '
    'less between micro-batches, and so does the bug)',
  )
  _lm.add_data_args(
    parser, out=pathlib.Path('runs/accumulation_bug'), model={'seq_len': 64}
  )
  args = parser.parse_args(argv)
  _lm.check_positive(
    parser,
    updates=args.updates,
    k=args.k,
    micro_batch_size=args.micro_batch_size,
    eval_every=args.eval_every,
    table_every=args.table_every,
  )
  return parser, args


def make_updates(model, tx_reference, tx_multisteps, tx_ours):
  """One jitted function per method: a whole window -> new params, state."""
  loss_sum = _lm.loss_sum_fn(model)

  def mean_loss(params, tokens, lengths):
    total, num_tokens = loss_sum(params, tokens, lengths)
    return total / num_tokens

  @jax.jit
  def reference(params, opt_state, tokens, lengths):
    tokens = tokens.reshape(-1, tokens.shape[-1])  # the k micro-batches
    grads = jax.grad(mean_loss)(params, tokens, lengths.reshape(-1))
    updates, opt_state = tx_reference.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state

  @jax.jit
  def multisteps(params, opt_state, tokens, lengths):
    def micro_step(carry, batch):
      params, opt_state = carry
      grads = jax.grad(mean_loss)(params, *batch)  # per-micro-batch mean
      updates, opt_state = tx_multisteps.update(grads, opt_state, params)
      return (optax.apply_updates(params, updates), opt_state), None

    carry, _ = jax.lax.scan(micro_step, (params, opt_state), (tokens, lengths))
    return carry

  @jax.jit
  def ours(params, opt_state, tokens, lengths):
    def micro_step(carry, batch):
      params, opt_state = carry
      (loss, num_tokens), grads = jax.value_and_grad(loss_sum, has_aux=True)(
        params, *batch
      )
      updates, opt_state = tx_ours.update(
        grads, opt_state, params, num_tokens=num_tokens, loss=loss
      )
      return (
        tokacc.apply_if_updated(params, updates, opt_state),
        opt_state,
      ), None

    carry, _ = jax.lax.scan(micro_step, (params, opt_state), (tokens, lengths))
    return carry

  return reference, {METHODS[0]: multisteps, METHODS[1]: ours}


def max_relative_difference(params, reference) -> float:
  """max over parameter arrays of ||p - p_ref|| / ||p_ref||."""
  ratios = jax.tree.map(
    lambda p, r: (
      np.linalg.norm(np.asarray(p - r, np.float64))
      / np.linalg.norm(np.asarray(r, np.float64))
    ),
    params,
    reference,
  )
  return float(max(jax.tree.leaves(ratios)))


def markdown_table(rows, header: str) -> str:
  lines = [
    header,
    '',
    '| update | reference held-out loss | MultiSteps: max rel. param diff '
    '| MultiSteps: loss diff | ours: max rel. param diff | ours: loss diff |',
    '| ---: | ---: | ---: | ---: | ---: | ---: |',
  ]
  for row in rows:
    lines.append(
      f'| {row["update"]} | {row["reference_loss"]:.4f} '
      + ' '.join(
        f'| {row[m]["param_diff"]:.2e} | {row[m]["loss_diff"]:+.2e}'
        for m in METHODS
      )
      + ' |'
    )
  return '\n'.join(lines) + '\n'


def main(argv=None) -> None:
  parser, args = parse_args(argv)
  config, train, heldout = _lm.load_data(
    parser, args, args.k * args.micro_batch_size
  )
  out = args.out.resolve()
  out.mkdir(parents=True, exist_ok=True)

  model = _lm.CausalLM(config)
  params = _lm.init_params(model, args.seed)
  inner = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(args.lr))
  tx_reference = inner
  tx_multisteps = optax.MultiSteps(inner, every_k_schedule=args.k)
  tx_ours = tokacc.token_weighted_multistep(inner, every_k_schedule=args.k)
  reference_update, method_updates = make_updates(
    model, tx_reference, tx_multisteps, tx_ours
  )
  heldout_loss = _lm.heldout_loss_fn(model, heldout)
  txs = {METHODS[0]: tx_multisteps, METHODS[1]: tx_ours}
  reference = (params, tx_reference.init(params))
  runs = {m: (params, txs[m].init(params)) for m in METHODS}

  rng = np.random.default_rng(args.seed)
  tokens_per_micro_batch = []
  evals = []
  header = (
    f'{args.updates} AdamW updates (lr {args.lr:g}) of a '
    f'{_lm.count_params(params):,}-parameter byte-level transformer on '
    f'{args.corpus.name}; k = {args.k} micro-batches of '
    f'{args.micro_batch_size} sequences of <= {config.seq_len + 1} bytes'
    + (', grouped by length' if args.group_by_length else '')
  )
  print(header + '.')
  print(
    f'{"update":>6}  {"reference loss":>14}  '
    + '  '.join(f'{m + " param / loss diff":>44}' for m in METHODS)
  )
  for update in range(1, args.updates + 1):
    window = _lm.sample_window(
      rng, train, args.k, args.micro_batch_size, args.group_by_length
    )
    tokens_per_micro_batch.append((window.lengths - 1).sum(axis=1))
    reference = reference_update(*reference, window.tokens, window.lengths)
    for method in METHODS:
      runs[method] = method_updates[method](
        *runs[method], window.tokens, window.lengths
      )
    if update % args.eval_every and update != args.updates:
      continue
    reference_loss = float(heldout_loss(reference[0]))
    row = {'update': update, 'reference_loss': reference_loss}
    for method in METHODS:
      row[method] = {
        'param_diff': max_relative_difference(runs[method][0], reference[0]),
        'loss_diff': float(heldout_loss(runs[method][0])) - reference_loss,
      }
    evals.append(row)
    if update % args.table_every == 0 or update == args.updates:
      print(
        f'{update:>6}  {reference_loss:>14.4f}  '
        + '  '.join(
          f'{row[m]["param_diff"]:>32.2e} / {row[m]["loss_diff"]:>+9.2e}'
          for m in METHODS
        )
      )

  counts = np.concatenate(tokens_per_micro_batch)
  spread = np.stack(tokens_per_micro_batch)
  token_note = (
    f'Counted tokens per micro-batch: min {counts.min()}, median '
    f'{int(np.median(counts))}, max {counts.max()}; within a window the '
    f'largest micro-batch holds on average '
    f'{np.mean(spread.max(axis=1) / spread.min(axis=1)):.1f}x the tokens of '
    'the smallest.'
  )
  print(token_note)
  table_rows = [
    r
    for r in evals
    if r['update'] % args.table_every == 0 or r['update'] == args.updates
  ]
  table = markdown_table(
    table_rows,
    header + '. ' + token_note + ' Parameter difference: max over '
    'parameter arrays of ||p - p_ref|| / ||p_ref||; loss difference: '
    'held-out loss minus that of the full-batch reference (0: equal in '
    'float32).',
  )
  table_path = out / 'accumulation_bug.md'
  table_path.write_text(table)

  figure = mpl_figure.Figure(figsize=(10, 3.8), layout='tight')
  left, right = figure.subplots(1, 2)
  updates = [r['update'] for r in evals]
  for method, color in zip(METHODS, ('tab:red', 'tab:blue')):
    left.semilogy(
      updates,
      [max(r[method]['param_diff'], 1e-12) for r in evals],
      color=color,
      marker='.',
      label=method,
    )
    right.plot(
      updates,
      [r[method]['loss_diff'] for r in evals],
      color=color,
      marker='.',
      label=method,
    )
  left.axhline(
    np.finfo(np.float32).eps, color='gray', ls=':', lw=0.8, label='float32 eps'
  )
  left.set_title('parameters: max ||p - p_ref|| / ||p_ref||')
  right.set_title('held-out loss minus full-batch reference')
  right.axhline(0.0, color='gray', lw=0.8)
  for axis in (left, right):
    axis.set_xlabel('optimizer update')
    axis.legend()
  figure.suptitle(
    f'Gradient accumulation vs the full batch (k={args.k}, variable-length '
    'sequences)'
  )
  plot_path = out / 'accumulation_bug.png'
  figure.savefig(plot_path, dpi=110)
  final = evals[-1]
  print(
    f'Summary: after {args.updates} updates, max relative parameter '
    f'difference from the full batch: optax.MultiSteps '
    f'{final[METHODS[0]]["param_diff"]:.2e}, token_weighted_multistep '
    f'{final[METHODS[1]]["param_diff"]:.2e}.\n'
    f'Table: {table_path}\nPlot: {plot_path}'
  )


if __name__ == '__main__':
  main()
