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
"""The shortest flax.nnx training loop with exact gradient accumulation.

A tiny next-token model trains on padded sequences of random lengths, so
micro-batches hold different numbers of tokens. ``optax_tokacc.flax.Optimizer``
(an ``nnx.Optimizer``) forwards ``num_tokens`` and ``loss`` to
``optax_tokacc.token_weighted_multistep``; the model changes once per window
of ``k`` micro-batches, and ``optimizer.step`` counts those windows while
``optimizer.micro_step`` counts micro-batches. Each window prints the exact
token-mean loss (``optimizer.window_loss``) next to the average of the
micro-batch means that naive accumulation would report::

  python examples/nnx_quickstart.py            # a few seconds on a CPU
  python examples/nnx_quickstart.py --k 8 --windows 20
"""

import argparse

from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np
import optax

import optax_tokacc as tokacc
from optax_tokacc.flax import Optimizer

VOCAB, DIM, LENGTH, ROWS = 32, 32, 16, 4


class BigramLM(nnx.Module):
  def __init__(self, rngs: nnx.Rngs):
    self.embed = nnx.Embed(VOCAB, DIM, rngs=rngs)
    self.out = nnx.Linear(DIM, VOCAB, rngs=rngs)

  def __call__(self, tokens):
    return self.out(jax.nn.gelu(self.embed(tokens)))


def micro_batch(rng):
  """ROWS sequences 'i, i+1, i+2, ...' of random lengths, padded with -100."""
  starts = rng.integers(0, VOCAB, size=(ROWS, 1))
  tokens = (starts + np.arange(LENGTH + 1)) % VOCAB
  lengths = rng.integers(1, LENGTH + 1, size=(ROWS, 1))
  labels = np.where(np.arange(LENGTH) < lengths, tokens[:, 1:], -100)
  return jnp.asarray(tokens[:, :-1]), jnp.asarray(labels)


@nnx.jit
def train_step(model, optimizer, inputs, labels):
  def loss_fn(model):  # summed over counted tokens, not averaged
    return tokacc.token_cross_entropy(model(inputs), labels)

  (loss, num_tokens), grads = nnx.value_and_grad(loss_fn, has_aux=True)(model)
  optimizer.update(model, grads, num_tokens=num_tokens, loss=loss)
  return loss / num_tokens


def main():
  parser = argparse.ArgumentParser(
    description=__doc__.splitlines()[0],
    formatter_class=argparse.ArgumentDefaultsHelpFormatter,
  )
  parser.add_argument('--k', type=int, default=4, help='micro-batches/step')
  parser.add_argument('--windows', type=int, default=10, help='optimizer steps')
  args = parser.parse_args()
  for flag, value in (('--k', args.k), ('--windows', args.windows)):
    if value < 1:
      parser.error(f'{flag} must be >= 1; got {value}')

  model = BigramLM(nnx.Rngs(0))
  tx = tokacc.token_weighted_multistep(optax.adamw(3e-2), args.k)
  optimizer = Optimizer(model, tx, wrt=nnx.Param)
  rng = np.random.default_rng(0)

  print(f'{args.k} micro-batches of {ROWS} padded sequences per step')
  print('step  micro  tokens  window_loss  mean of micro-batch means (wrong)')
  for _ in range(args.windows):
    kernel = model.out.kernel[...]
    micro_means = []
    for micro in range(args.k):
      micro_means.append(float(train_step(model, optimizer, *micro_batch(rng))))
      if micro < args.k - 1:  # micro-steps leave the model as it was
        assert not bool(optimizer.has_updated)
        assert bool(jnp.all(model.out.kernel[...] == kernel))
    tokens = tokacc.find_state(optimizer.opt_state).last_tokens[...]
    print(
      f'{int(optimizer.step[...]):4d}  {int(optimizer.micro_step[...]):5d}'
      f'  {int(tokens):6d}  {float(optimizer.window_loss):11.4f}'
      f'  {np.mean(micro_means):11.4f}'
    )


if __name__ == '__main__':
  main()
