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
"""The benchmark models: an MLP, a small transformer LM and GPT-2 small
(``run.py``), and the small MLP of ``collectives.py``.

Each model's loss is summed over the counted tokens (rows of the MLP, target
positions of the LM) and returned with their count, as
``token_weighted_multistep`` expects; micro-batches hold different numbers of
counted tokens.
"""

from collections.abc import Callable
import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

import optax_tokacc as tokacc


@dataclasses.dataclass(frozen=True)
class Model:
  """A model, its data, and its token-summed loss.

  Attributes:
    name: the model's name in the table.
    params: initial parameters (float32).
    loss_sum: ``loss_sum(params, batch) -> (loss summed over counted tokens,
      number of counted tokens)``.
    windows: ``num_windows`` lists of ``k`` micro-batches each.
    description: sizes, for the table and the JSON.
    mu_dtype: AdamW's ``mu_dtype`` for this model (None: the parameters').
    explicit: whether ``loss_sum`` takes parameters typed reduced over the
      data axis of an explicit mesh (explicit DDP).
  """

  name: str
  params: Any
  loss_sum: Callable[[Any, Any], tuple[jax.Array, jax.Array]]
  windows: list[list[Any]]
  description: str
  mu_dtype: Any = None
  explicit: bool = False

  @property
  def num_params(self) -> int:
    return sum(x.size for x in jax.tree.leaves(self.params))

  @property
  def param_bytes(self) -> int:
    return sum(x.nbytes for x in jax.tree.leaves(self.params))

  @property
  def param_dtype(self) -> str:
    return str(jax.tree.leaves(self.params)[0].dtype)

  def loss_mean(self, params, batch):
    """The micro-batch's token-mean loss (what ``optax.MultiSteps`` takes)."""
    loss, num_tokens = self.loss_sum(params, batch)
    return loss / jnp.maximum(num_tokens, 1).astype(loss.dtype)


def add_bias(hidden, bias):
  """``hidden + bias``. A bias typed reduced (explicit data parallelism)
  is broadcast to the rows and resharded like them first: a reduced array
  cannot meet a sharded one, and ``jax.reshard(bias, P())`` would
  all-reduce its gradient on every micro-step."""
  sharding = jax.typeof(bias).sharding
  if not sharding.spec.reduced:
    return hidden + bias
  bias = jnp.broadcast_to(bias, hidden.shape)
  return hidden + jax.reshard(bias, jax.typeof(hidden).sharding.spec)


def _mask(rng, shape, keep):
  """A 0/1 float mask counting about ``keep`` of the positions, at least 1."""
  mask = rng.random(shape) < keep
  mask.flat[0] = True
  return mask.astype(np.float32)


def mlp(
  *, width, depth, batch_size, k, num_windows=2, seed=0, dtype=jnp.float32
):
  """A ReLU MLP classifier: ``depth`` dense layers of ``width`` x ``width``.

  Rows are the tokens; about 10% of the rows of each micro-batch are padding.
  Parameters and activations in ``dtype``; with bfloat16 (mixed precision)
  AdamW keeps its first moment in float32 (``mu_dtype``).
  """
  keys = jax.random.split(jax.random.key(seed), depth)
  params = {
    f'layer_{i}': {
      'w': (jax.random.normal(keys[i], (width, width)) / np.sqrt(width)).astype(
        dtype
      ),
      'b': jnp.zeros((width,), dtype),
    }
    for i in range(depth)
  }

  def loss_sum(params, batch):
    hidden = batch['x'].astype(dtype)
    for i in range(depth):
      layer = params[f'layer_{i}']
      hidden = add_bias(hidden @ layer['w'], layer['b'])
      if i < depth - 1:
        hidden = jax.nn.relu(hidden)
    return tokacc.token_cross_entropy(
      hidden, batch['y'], where=batch['mask'] > 0
    )

  rng = np.random.default_rng(seed)

  def micro_batch():
    return {
      'x': jnp.asarray(rng.normal(size=(batch_size, width)), jnp.float32),
      'y': jnp.asarray(rng.integers(0, width, batch_size), jnp.int32),
      'mask': jnp.asarray(_mask(rng, (batch_size,), 0.9)),
    }

  windows = [[micro_batch() for _ in range(k)] for _ in range(num_windows)]
  mixed = jnp.dtype(dtype) != jnp.float32
  return Model(
    name='mlp_bf16' if mixed else 'mlp',
    params=params,
    loss_sum=loss_sum,
    windows=windows,
    description=(
      f'MLP {depth} x ({width} x {width}), micro-batch {batch_size}, '
      f'{jnp.dtype(dtype).name} parameters'
    ),
    mu_dtype=jnp.float32 if mixed else None,
    explicit=True,
  )


def _transformer_params(seed, vocab, d_model, num_layers, context):
  d_ff = 4 * d_model
  keys = iter(jax.random.split(jax.random.key(seed), 4 + 4 * num_layers))

  def dense(shape):
    return jax.random.normal(next(keys), shape) / np.sqrt(shape[0])

  return {
    'embed': jax.random.normal(next(keys), (vocab, d_model)) * 0.02,
    'position': jax.random.normal(next(keys), (context, d_model)) * 0.02,
    'final_norm': jnp.ones((d_model,)),
    'layers': [
      {
        'norm_1': jnp.ones((d_model,)),
        'qkv': dense((d_model, 3 * d_model)),
        'out': dense((d_model, d_model)),
        'norm_2': jnp.ones((d_model,)),
        'ff_in': dense((d_model, d_ff)),
        'ff_out': dense((d_ff, d_model)),
      }
      for _ in range(num_layers)
    ],
  }


def _norm(x, scale):
  """Layer norm, its statistics in float32 (bfloat16 activations too)."""
  y = x.astype(jnp.float32)
  y = y - y.mean(-1, keepdims=True)
  y = y * jax.lax.rsqrt((y * y).mean(-1, keepdims=True) + 1e-6)
  return y.astype(x.dtype) * scale


def transformer(
  *,
  vocab,
  d_model,
  num_layers,
  num_heads,
  seq_len,
  k,
  batch_size=8,
  context=None,
  num_windows=2,
  seed=0,
  dtype=jnp.float32,
  name='transformer',
  label=None,
):
  """A pre-LayerNorm causal transformer LM with learned positions and the
  output projection tied to the embedding (GPT-2's layout, without biases).

  Sequences have random lengths (the padding after them is not counted), so
  micro-batches hold different numbers of counted tokens. ``context``: the
  positions the model holds (default ``seq_len``); a micro-batch may use
  fewer. Parameters and activations in ``dtype``; with bfloat16 (mixed
  precision) AdamW keeps its first moment in float32 (``mu_dtype``).
  """
  context = context or seq_len
  params = _transformer_params(seed, vocab, d_model, num_layers, context)
  params = jax.tree.map(lambda x: x.astype(dtype), params)

  def attention(x, layer):
    batch, length, _ = x.shape
    q, k_, v = jnp.split(x @ layer['qkv'], 3, axis=-1)

    def heads(t):
      return t.reshape(batch, length, num_heads, d_model // num_heads)

    out = jax.nn.dot_product_attention(
      heads(q), heads(k_), heads(v), is_causal=True
    )
    return out.reshape(batch, length, d_model) @ layer['out']

  def loss_sum(params, batch):
    tokens = batch['tokens']
    x = params['embed'][tokens[:, :-1]] + params['position'][: seq_len - 1]
    for layer in params['layers']:
      x = x + attention(_norm(x, layer['norm_1']), layer)
      hidden = jax.nn.gelu(_norm(x, layer['norm_2']) @ layer['ff_in'])
      x = x + hidden @ layer['ff_out']
    logits = _norm(x, params['final_norm']) @ params['embed'].T
    return tokacc.token_cross_entropy(
      logits, tokens[:, 1:], where=batch['mask'][:, 1:] > 0
    )

  rng = np.random.default_rng(seed)

  def micro_batch():
    lengths = rng.integers(2, seq_len + 1, batch_size)
    mask = (np.arange(seq_len)[None, :] < lengths[:, None]).astype(np.float32)
    tokens = rng.integers(0, vocab, (batch_size, seq_len)) * mask
    return {
      'tokens': jnp.asarray(tokens, jnp.int32),
      'mask': jnp.asarray(mask),
    }

  windows = [[micro_batch() for _ in range(k)] for _ in range(num_windows)]
  mixed = jnp.dtype(dtype) != jnp.float32
  return Model(
    name=f'{name}_bf16' if mixed else name,
    params=params,
    loss_sum=loss_sum,
    windows=windows,
    description=(
      f'{label or "LM"}: {num_layers} layers, d_model {d_model}, '
      f'{num_heads} heads, vocab {vocab}, context {context}, '
      f'{batch_size} x {seq_len} tokens per micro-batch, '
      f'{jnp.dtype(dtype).name} parameters'
    ),
    mu_dtype=jnp.float32 if mixed else None,
  )


# GPT-2 small (124M parameters): the size nanoGPT reproduces.
GPT2_SMALL = dict(
  vocab=50257, d_model=768, num_layers=12, num_heads=12, context=1024
)


# Sizes per setting: `full` and `short` use the 33M-parameter MLP of the
# targets and GPT-2 small's 124M parameters (`short`: micro-batches of
# 2 x 64 tokens, so that a CPU runs it in minutes; `full`: 8 x 1024, the
# accelerator's); `quick` is for the smoke test (CI).
_MLP = dict(width=2048, depth=8, batch_size=32)
SIZES = {
  'full': {
    'mlp': _MLP,
    'transformer': dict(
      vocab=8192, d_model=512, num_layers=4, num_heads=8, seq_len=128
    ),
    'gpt2': dict(GPT2_SMALL, seq_len=1024, label='GPT-2 small (124M)'),
  },
  'short': {
    'mlp': _MLP,
    'transformer': dict(
      vocab=4096, d_model=256, num_layers=2, num_heads=4, seq_len=64
    ),
    'gpt2': dict(
      GPT2_SMALL,
      seq_len=64,
      batch_size=2,
      label='GPT-2 small (124M), micro-batches cut for the CPU',
    ),
  },
  'quick': {
    'mlp': dict(width=32, depth=2, batch_size=4),
    'transformer': dict(
      vocab=64, d_model=16, num_layers=1, num_heads=2, seq_len=8, batch_size=2
    ),
    'gpt2': dict(
      vocab=64,
      d_model=16,
      num_layers=2,
      num_heads=2,
      seq_len=8,
      batch_size=2,
      label='GPT-2 layout at smoke-test sizes (not GPT-2 small)',
    ),
  },
}
for _sizes in SIZES.values():
  _sizes['mlp_bf16'] = _sizes['mlp']
  _sizes['gpt2_bf16'] = _sizes['gpt2']
_gpt2 = functools.partial(transformer, name='gpt2')
MODELS = {
  'mlp': mlp,
  'transformer': transformer,
  'mlp_bf16': functools.partial(mlp, dtype=jnp.bfloat16),
  'gpt2': _gpt2,
  'gpt2_bf16': functools.partial(_gpt2, dtype=jnp.bfloat16),
}


def build(name: str, setting: str, k: int) -> Model:
  """The model ``name`` at the sizes of ``setting``, with windows of ``k``."""
  return MODELS[name](k=k, **SIZES[setting][name])


# The MLP of collectives.py: small enough to compile every pattern quickly.
SMALL_WIDTH = 64
SMALL_OUTPUTS = 8
ROWS_PER_DEVICE = 4


def small_params(seed=0):
  rng = np.random.default_rng(seed)
  return {
    'w1': rng.normal(size=(SMALL_WIDTH, SMALL_WIDTH)).astype(np.float32) / 8,
    'b1': np.zeros((SMALL_WIDTH,), np.float32),
    'w2': rng.normal(size=(SMALL_WIDTH, SMALL_OUTPUTS)).astype(np.float32) / 8,
  }


def small_windows(num_devices, k, num_windows=2, seed=1):
  """Windows of ``k`` micro-batches, ``ROWS_PER_DEVICE`` rows per device,
  about 80% of the rows counted (at least one per micro-batch)."""
  rng = np.random.default_rng(seed)
  rows = ROWS_PER_DEVICE * num_devices

  def micro_batch():
    mask = (rng.random(rows) < 0.8).astype(np.float32)
    mask[0] = 1.0
    return {
      'x': rng.normal(size=(rows, SMALL_WIDTH)).astype(np.float32),
      'y': rng.normal(size=(rows, SMALL_OUTPUTS)).astype(np.float32),
      'mask': mask,
    }

  return [[micro_batch() for _ in range(k)] for _ in range(num_windows)]


def small_loss_sum(params, batch, constrain=lambda x: x):
  """Squared error summed over the counted rows, and their count;
  ``constrain`` is applied to the activations (FSDP's row sharding)."""
  hidden = jnp.tanh(constrain(batch['x'] @ params['w1'] + params['b1']))
  error = constrain(hidden @ params['w2']) - batch['y']
  loss = jnp.sum(jnp.sum(error**2, axis=-1) * batch['mask'])
  return loss, jnp.sum(batch['mask']).astype(jnp.int32)


def small_loss_mean(params, batch):
  loss, num_tokens = small_loss_sum(params, batch)
  return loss / jnp.maximum(num_tokens, 1)
