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
"""Flax integration: a linen ``TrainState`` for token-weighted accumulation.

Import it explicitly (Flax is an optional dependency)::

  from optax_tokacc.flax import TrainState

With ``flax.nnx`` nothing extra is needed: ``nnx.Optimizer(model, tx,
wrt=nnx.Param).update(model, grads, num_tokens=n, loss=l)`` forwards the
keyword arguments to the transform, and micro-steps add zero updates.
"""

from typing import Any, Optional

from flax.training import train_state
import jax
import jax.numpy as jnp
import optax

from optax_tokacc import _multistep

# The key of flax.linen.fp8_ops.OVERWRITE_WITH_GRADIENT.
_OVERWRITE_WITH_GRADIENT = '_overwrite_with_gradient'


def _find_state(
  opt_state: optax.OptState,
) -> _multistep.TokenWeightedMultiStepState:
  try:
    return _multistep.find_state(opt_state)
  except ValueError as e:
    raise ValueError(
      'optax_tokacc.flax.TrainState needs tx to be '
      'optax_tokacc.token_weighted_multistep(...) or a transformation that '
      f'contains it once (e.g. optax.chain); {e} For a plain optimizer use '
      'flax.training.train_state.TrainState.'
    ) from e


class TrainState(train_state.TrainState):
  r"""A linen ``TrainState`` whose ``step`` counts optimizer updates.

  ``tx`` is :func:`optax_tokacc.token_weighted_multistep` (or a chain that
  contains it). Each call of :meth:`apply_gradients` feeds one micro-batch:

  .. math::

    \text{step} \leftarrow \text{step} + [\text{window emitted}], \qquad
    \text{micro\_step} \leftarrow \text{micro\_step} + 1,

  so ``step`` matches a run without accumulation at the same point of
  training (for logs, schedules on ``step`` and checkpoints), and the
  parameters are only rewritten when a window emits.

  Attributes:
    micro_step: micro-batches fed to :meth:`apply_gradients` so far (int32).

  Example:
    >>> import jax, jax.numpy as jnp, optax
    >>> import flax.linen as nn
    >>> import optax_tokacc as tokacc
    >>> from optax_tokacc.flax import TrainState
    >>> model = nn.Dense(1)
    >>> x = jnp.ones((4, 2))
    >>> params = model.init(jax.random.key(0), x)['params']
    >>> tx = tokacc.token_weighted_multistep(optax.sgd(0.1), every_k_schedule=2)
    >>> state = TrainState.create(apply_fn=model.apply, params=params, tx=tx)
    >>> def loss_fn(params, x, mask):  # summed over the counted rows
    ...   squares = model.apply({'params': params}, x)[:, 0] ** 2
    ...   return jnp.sum(squares * mask), mask.sum()
    >>> @jax.jit
    ... def train_step(state, x, mask):
    ...   (loss, num_tokens), grads = jax.value_and_grad(loss_fn, has_aux=True)(
    ...       state.params, x, mask)
    ...   return state.apply_gradients(grads=grads, num_tokens=num_tokens,
    ...                                loss=loss)
    >>> state = train_step(state, x, jnp.array([1, 1, 1, 0]))
    >>> int(state.step), int(state.micro_step)
    (0, 1)
    >>> state = train_step(state, x, jnp.array([1, 0, 0, 0]))
    >>> int(state.step), int(state.micro_step)
    (1, 2)
  """

  micro_step: jax.typing.ArrayLike = 0

  @classmethod
  def create(cls, *, apply_fn, params, tx, **kwargs) -> 'TrainState':
    """Creates a state with ``step=0``, ``micro_step=0`` and ``tx``'s state.

    Args:
      apply_fn: usually ``model.apply``.
      params: the parameters.
      tx: :func:`optax_tokacc.token_weighted_multistep`, or a transformation
        containing it.
      **kwargs: further dataclass fields of a subclass.

    Returns:
      The new state.

    Raises:
      ValueError: if ``tx``'s state holds no
        :class:`optax_tokacc.TokenWeightedMultiStepState`.
    """
    state = super().create(apply_fn=apply_fn, params=params, tx=tx, **kwargs)
    _find_state(state.opt_state)
    return state.replace(
      step=jnp.zeros([], jnp.int32), micro_step=jnp.zeros([], jnp.int32)
    )

  def apply_gradients(
    self,
    *,
    grads: optax.Updates,
    num_tokens: jax.typing.ArrayLike,
    loss: Optional[jax.typing.ArrayLike] = None,
    **kwargs: Any,
  ) -> 'TrainState':
    """Feeds one micro-batch's gradients to ``tx``.

    Unlike the parent class, ``kwargs`` go to ``tx.update`` (e.g.
    ``emit_now``), not to ``replace``. On micro-steps the parameters are not
    rewritten (:func:`optax_tokacc.apply_if_updated`) and ``step`` stays.

    Args:
      grads: gradients of the micro-batch's token-summed loss (or mean loss
        with ``loss_reduction='mean'``), with the structure of ``params``.
      num_tokens: counted tokens of the micro-batch (scalar).
      loss: optional micro-batch loss with the same reduction, for
        :attr:`window_loss`.
      **kwargs: further keyword arguments of ``tx.update``.

    Returns:
      The new state: ``step`` advanced by one if a window emitted,
      ``micro_step`` by one, ``params`` and ``opt_state`` updated.
    """
    if isinstance(grads, dict) and _OVERWRITE_WITH_GRADIENT in grads:
      raise ValueError(
        'optax_tokacc.flax.TrainState does not support fp8 '
        f'{_OVERWRITE_WITH_GRADIENT!r} collections: accumulating them over '
        'micro-steps is not defined. Use flax.training.train_state.TrainState.'
      )
    updates, new_opt_state = self.tx.update(
      grads,
      self.opt_state,
      self.params,
      num_tokens=num_tokens,
      loss=loss,
      **kwargs,
    )
    updated = _find_state(new_opt_state).emitted
    step = jnp.asarray(self.step)
    return self.replace(
      step=jnp.where(updated, optax.safe_increment(step), step),
      micro_step=optax.safe_increment(jnp.asarray(self.micro_step)),
      params=_multistep.apply_if_updated(self.params, updates, new_opt_state),
      opt_state=new_opt_state,
    )

  @property
  def has_updated(self) -> jax.Array:
    """Whether the last :meth:`apply_gradients` emitted an update."""
    return _multistep.has_updated(self.opt_state)

  @property
  def window_loss(self) -> jax.Array:
    """Token-mean loss of the last emitted window (see ``window_loss``)."""
    return _find_state(self.opt_state).last_loss
