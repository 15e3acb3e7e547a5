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
"""Model and data shared by ``train_lm.py`` and ``accumulation_bug.py``.

A byte-level causal transformer (Flax linen) and a corpus cut into
variable-length sequences: each paragraph of the text is split into chunks
of whole sentences of at most ``seq_len + 1`` bytes, then padded. Sequence
lengths, and so the counted tokens of each micro-batch, vary a lot. Also
the line that the examples print of a compiled step's collectives, read by
``optax_tokacc.testing.check``.
"""

import argparse
import collections
from collections.abc import Sequence
import dataclasses
import os
import pathlib
import re
from typing import Callable, NoReturn, Optional

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

import optax_tokacc as tokacc
from optax_tokacc import testing

DEFAULT_CORPUS = pathlib.Path(__file__).parent / 'data' / 'persuasion.txt'
VOCAB_SIZE = 256  # bytes
_PARAGRAPH_BREAK = re.compile(rb'\n[ \t]*\n')
_SENTENCE_END = re.compile(rb'(?<=[.!?;])\s+')


# ------------------------------------------------------------------ data


@dataclasses.dataclass(frozen=True)
class Sequences:
  """Padded byte sequences.

  Attributes:
    tokens: int32 array ``[num_sequences, seq_len + 1]``, zero padded.
    lengths: int32 array ``[num_sequences]``, bytes before the padding.
  """

  tokens: np.ndarray
  lengths: np.ndarray

  def __len__(self) -> int:
    return len(self.lengths)

  def take(self, index: np.ndarray) -> 'Sequences':
    return Sequences(self.tokens[index], self.lengths[index])


def read_corpus(path: os.PathLike) -> bytes:
  """The corpus bytes; raises ValueError with a one-line message if unusable."""
  path = pathlib.Path(path)
  if not path.exists():
    raise ValueError(
      f'--corpus {path}: no such file. Pass a plain-text file, e.g. '
      f'--corpus {DEFAULT_CORPUS}.'
    )
  if not path.is_file():
    raise ValueError(f'--corpus {path}: not a regular file.')
  try:
    text = path.read_bytes()
  except OSError as e:
    raise ValueError(
      f'--corpus {path}: cannot read it ({e.strerror}). Pass a readable '
      'plain-text file.'
    ) from None
  if not text.strip():
    raise ValueError(f'--corpus {path}: the file is empty.')
  return text


def _chunks(paragraph: bytes, max_len: int) -> list[bytes]:
  """Greedily packs whole sentences into chunks of at most ``max_len``."""
  chunks, current = [], b''
  for sentence in _SENTENCE_END.split(paragraph):
    while len(sentence) > max_len:  # a sentence longer than a sequence
      if current:
        chunks.append(current)
        current = b''
      chunks.append(sentence[:max_len])
      sentence = sentence[max_len:]
    if current and len(current) + 1 + len(sentence) > max_len:
      chunks.append(current)
      current = sentence
    else:
      current = current + b' ' + sentence if current else sentence
  if current:
    chunks.append(current)
  return chunks


def make_sequences(text: bytes, seq_len: int) -> Sequences:
  """Cuts ``text`` into padded sequences of at most ``seq_len + 1`` bytes."""
  chunks = [
    chunk
    for paragraph in _PARAGRAPH_BREAK.split(text)
    if paragraph.strip()
    for chunk in _chunks(paragraph.strip(), seq_len + 1)
    if len(chunk) >= 2  # at least one (input, label) pair
  ]
  tokens = np.zeros((len(chunks), seq_len + 1), np.int32)
  lengths = np.zeros(len(chunks), np.int32)
  for i, chunk in enumerate(chunks):
    tokens[i, : len(chunk)] = np.frombuffer(chunk, np.uint8)
    lengths[i] = len(chunk)
  return Sequences(tokens, lengths)


def split_heldout(
  sequences: Sequences, heldout_fraction: float = 0.05
) -> tuple[Sequences, Sequences]:
  """Splits off the last sequences of the text as a held-out set."""
  num_heldout = max(1, int(len(sequences) * heldout_fraction))
  index = np.arange(len(sequences))
  return sequences.take(index[:-num_heldout]), sequences.take(
    index[-num_heldout:]
  )


def sample_window(
  rng: np.random.Generator,
  sequences: Sequences,
  num_micro_batches: int,
  micro_batch_size: int,
  group_by_length: bool,
) -> Sequences:
  """Samples one optimizer step's data: ``[k, micro_batch_size, ...]``.

  With ``group_by_length`` the window's sequences are sorted by length before
  being cut into micro-batches, as length-grouped samplers do to save padding
  (e.g. ``group_by_length`` in the Hugging Face Trainer): micro-batches of
  short sequences then count far fewer tokens than those of long ones.
  """
  index = rng.choice(
    len(sequences), num_micro_batches * micro_batch_size, replace=False
  )
  if group_by_length:
    index = index[np.argsort(sequences.lengths[index], kind='stable')]
  window = sequences.take(index)
  shape = (num_micro_batches, micro_batch_size)
  return Sequences(
    window.tokens.reshape(shape + window.tokens.shape[1:]),
    window.lengths.reshape(shape),
  )


def inputs_and_labels(
  tokens: jax.Array, lengths: jax.Array
) -> tuple[jax.Array, jax.Array, jax.Array]:
  """Next-byte prediction: ``(inputs, labels, mask)`` of a padded batch."""
  inputs, labels = tokens[..., :-1], tokens[..., 1:]
  positions = jnp.arange(inputs.shape[-1])
  mask = positions < (lengths[..., None] - 1)
  return inputs, labels, mask


# ----------------------------------------------------------------- model


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  seq_len: int = 128
  d_model: int = 64
  num_heads: int = 4
  num_layers: int = 2


class Block(nn.Module):
  """Pre-norm transformer block: causal self-attention and an MLP."""

  d_model: int
  num_heads: int

  @nn.compact
  def __call__(self, x: jax.Array, mask: jax.Array) -> jax.Array:
    h = nn.LayerNorm()(x)
    # No biases: a key bias has an exactly zero gradient (softmax is shift
    # invariant), so AdamW would move it by pure round-off noise.
    attention = nn.MultiHeadDotProductAttention(self.num_heads, use_bias=False)
    x = x + attention(h, mask=mask)
    h = nn.LayerNorm()(x)
    h = nn.gelu(nn.Dense(4 * self.d_model)(h))
    return x + nn.Dense(self.d_model)(h)


class CausalLM(nn.Module):
  """A small byte-level causal transformer language model.

  Attributes:
    config: its size.
    constrain: None, or a function applied to the activations between
      blocks and to the logits, such as :func:`batch_sharded`.
  """

  config: ModelConfig
  constrain: Optional[Callable[[jax.Array], jax.Array]] = None

  @nn.compact
  def __call__(self, tokens: jax.Array) -> jax.Array:
    config = self.config
    constrain = self.constrain or (lambda x: x)
    embed = nn.Embed(VOCAB_SIZE, config.d_model)
    positions = self.param(
      'positions',
      nn.initializers.normal(0.02),
      (config.seq_len, config.d_model),
    )
    x = constrain(embed(tokens) + positions[: tokens.shape[-1]])
    mask = nn.make_causal_mask(tokens)
    for _ in range(config.num_layers):
      x = constrain(Block(config.d_model, config.num_heads)(x, mask))
    # Logits tied to the embedding.
    return constrain(embed.attend(nn.LayerNorm()(x)))


def batch_sharded(mesh: jax.sharding.Mesh, axis: str):
  """A ``constrain`` for :class:`CausalLM`: activations split over ``axis``
  along their batch dimension, so that GSPMD gathers the parameters (FSDP)
  rather than the activations.

  Inside a partial-manual ``jax.shard_map`` the constraint names the
  abstract mesh that it sets (with its manual axes).
  """

  def constrain(x: jax.Array) -> jax.Array:
    current = jax.sharding.get_abstract_mesh()
    on = mesh if current.empty else current
    return jax.lax.with_sharding_constraint(
      x, jax.NamedSharding(on, jax.P(axis))
    )

  return constrain


def init_params(model: CausalLM, seed: int):
  tokens = jnp.zeros((1, model.config.seq_len), jnp.int32)
  # Jitted: one compilation instead of one per initializer op.
  return jax.jit(model.init)(jax.random.key(seed), tokens)['params']


def loss_sum_fn(model: CausalLM):
  """``fn(params, tokens, lengths) -> (token-summed loss, counted tokens)``."""

  def loss_fn(params, tokens, lengths):
    inputs, labels, mask = inputs_and_labels(tokens, lengths)
    logits = model.apply({'params': params}, inputs)
    return tokacc.token_cross_entropy(logits, labels, where=mask)

  return loss_fn


def heldout_loss_fn(model: CausalLM, heldout: Sequences):
  """A jitted ``fn(params) -> token-mean loss`` on the held-out sequences."""
  loss_fn = loss_sum_fn(model)
  tokens, lengths = jnp.asarray(heldout.tokens), jnp.asarray(heldout.lengths)

  @jax.jit
  def heldout_loss(params):
    loss_sum, num_tokens = loss_fn(params, tokens, lengths)
    return loss_sum / num_tokens

  return heldout_loss


def count_params(params) -> int:
  return sum(x.size for x in jax.tree.leaves(params))


# ----------------------------------------------------------- collectives


def _counted(found: Sequence[testing.Collective]) -> collections.Counter:
  """Collectives counted by (kind, the mesh axes they span, joined by +)."""
  return collections.Counter((c.kind, c.axes.replace(',', '+')) for c in found)


def describe_collectives(
  report: testing.StepReport,
  k: int,
  closing_program: Optional[testing.StepReport] = None,
) -> str:
  """One line: the collectives per micro-step and per window of ``k``.

  ``report`` is ``optax_tokacc.testing.check`` of the compiled micro-step:
  an open micro-step runs its collectives outside the closing branch, and
  the window adds those of the branch that closes it. Where the host
  closes the window with a program of its own, ``closing_program`` is that
  program's report: the window adds what it runs beyond an open step.
  """
  every_call = _counted(report.on_open_step())
  if closing_program is None:
    closing = _counted(report.on_closing_step_only())
  else:
    closing = _counted(closing_program.collectives) - every_call
  window = collections.Counter({key: k * n for key, n in every_call.items()})
  window.update(closing)

  def listed(counter):
    total = sum(counter.values())
    parts = ', '.join(
      f'{n} {kind} over {axes}' for (kind, axes), n in sorted(counter.items())
    )
    return f'{total} ({parts})' if total else '0'

  return (
    f'collectives: {listed(every_call)} per micro-step, {listed(window)} per '
    f'window of {k} micro-steps'
  )


# ------------------------------------------------------------- arguments


def add_data_args(parser: argparse.ArgumentParser, **defaults) -> None:
  """Flags shared by the examples: corpus, model size, output folder."""
  config = ModelConfig(**defaults.pop('model', {}))
  parser.add_argument(
    '--corpus',
    type=pathlib.Path,
    default=DEFAULT_CORPUS,
    help='plain-text training corpus; paragraphs are split into sentence '
    'chunks of at most --seq-len + 1 bytes (default: %(default)s, Jane '
    "Austen's Persuasion, public domain)",
  )
  parser.add_argument(
    '--seq-len',
    type=int,
    default=config.seq_len,
    help='longest sequence in bytes; shorter ones are padded',
  )
  parser.add_argument(
    '--d-model',
    type=int,
    default=config.d_model,
    help='transformer width',
  )
  parser.add_argument(
    '--layers',
    type=int,
    default=config.num_layers,
    help='transformer blocks',
  )
  parser.add_argument(
    '--seed', type=int, default=0, help='initialization and data seed'
  )
  parser.add_argument(
    '--out',
    type=pathlib.Path,
    default=defaults.pop('out'),
    help='output folder',
  )


def fail(parser: argparse.ArgumentParser, message: str) -> NoReturn:
  """Exits with status 2 and a one-line error (no usage, no traceback)."""
  parser.exit(2, f'{parser.prog}: error: {message}\n')


def check_positive(parser: argparse.ArgumentParser, **values: int) -> None:
  for name, value in values.items():
    if value < 1:
      flag = '--' + name.replace('_', '-')
      fail(parser, f'{flag} must be >= 1; got {value}.')


def load_data(
  parser: argparse.ArgumentParser, args: argparse.Namespace, sequences: int
) -> tuple[ModelConfig, Sequences, Sequences]:
  """Model config and (train, held-out) data; a one-line exit if unusable.

  Args:
    parser: reports bad flags.
    args: parsed flags of :func:`add_data_args`.
    sequences: how many distinct training sequences one optimizer step needs.
  """
  check_positive(
    parser, seq_len=args.seq_len, d_model=args.d_model, layers=args.layers
  )
  if args.seq_len < 2 or args.d_model % 4:
    fail(
      parser,
      f'--seq-len must be >= 2 and --d-model a multiple of 4 (4 heads); got '
      f'{args.seq_len} and {args.d_model}.',
    )
  try:
    text = read_corpus(args.corpus)
  except ValueError as e:
    fail(parser, str(e))
  train, heldout = split_heldout(make_sequences(text, args.seq_len))
  if len(train) < sequences:
    fail(
      parser,
      f'the corpus {args.corpus} has {len(train)} training sequences of at '
      f'most {args.seq_len + 1} bytes, but one step needs {sequences} '
      'distinct ones (k x devices x micro-batch size): lower '
      '--micro-batch-size or --k, or use a larger corpus.',
    )
  config = ModelConfig(
    seq_len=args.seq_len, d_model=args.d_model, num_layers=args.layers
  )
  return config, train, heldout
