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
"""Flax integration: a linen ``TrainState`` and an ``nnx.Optimizer``.

Import it explicitly (Flax is an optional dependency)::

  from optax_tokacc.flax import Optimizer, TrainState

Both count ``step`` in optimizer updates (one per window of micro-batches),
so that logs, schedules and checkpoints line up with a run without
accumulation, and count the micro-batches fed in ``micro_step``.
"""

from collections.abc import Mapping
from typing import Any, Optional

try:
  from flax import nnx
  from flax.training import train_state
except ModuleNotFoundError as e:  # flax is optional
  if e.name != 'flax' and not str(e.name).startswith('flax.'):
    raise
  raise ModuleNotFoundError(
    "optax_tokacc.flax needs Flax: pip install 'optax_tokacc[flax]'.",
    name=e.name,
  ) from e
import jax
import jax.numpy as jnp
import optax

import optax_tokacc
from optax_tokacc import _typing
from optax_tokacc import _update_and_apply

# The key of flax.linen.fp8_ops.OVERWRITE_WITH_GRADIENT.
_OVERWRITE_WITH_GRADIENT = '_overwrite_with_gradient'


class _Accumulating:
  """What both classes read from the accumulator's state in ``opt_state``.

  A subclass names in ``_PLAIN`` the Flax class to use for a plain optimizer.
  ``jnp.asarray`` reads an array and an ``nnx.Variable`` alike.
  """

  def _acc_state(self) -> optax_tokacc.TokenWeightedMultiStepState:
    """The accumulator's state, or an error naming the fix."""
    try:
      return optax_tokacc.find_state(self.opt_state)
    except ValueError as e:
      raise ValueError(
        f'{type(self).__module__}.{type(self).__qualname__} needs tx to be '
        'optax_tokacc.token_weighted_multistep(...) or a chain containing it '
        f'once; {e} For a plain optimizer use {self._PLAIN}.'
      ) from e

  def _counters(self, before: jax.Array, step: jax.typing.ArrayLike) -> tuple:
    """``(step, micro_step, emitted)`` after one micro-batch.

    ``before`` is the accumulator's ``gradient_step`` (its count of
    optimizer updates) before the micro-batch and ``step`` the count before
    it; ``step`` advances (saturating) if ``gradient_step`` did, and
    ``micro_step`` by one. Unlike the state's ``emitted`` flag, whether it
    advanced cannot go stale when a wrapper such as ``optax.apply_if_finite``
    returns the previous state.
    """
    emitted = jnp.asarray(self._acc_state().gradient_step) != before
    step = jnp.where(emitted, optax.safe_increment(step), step)
    return step, optax.safe_increment(jnp.asarray(self.micro_step)), emitted

  @property
  def window_loss(self) -> jax.Array:
    """Token-mean loss of the last emitted window.

    Returns:
      A floating scalar: NaN before the first window and when ``loss`` was
      never passed (see :func:`optax_tokacc.window_loss`).
    """
    return jnp.asarray(self._acc_state().last_loss)

  @property
  def window_metrics(self) -> optax_tokacc.WindowMetrics:
    """The last emitted window's loss, tokens and norms
    (:func:`optax_tokacc.window_metrics`)."""
    return optax_tokacc.window_metrics(self._acc_state())


class TrainState(train_state.TrainState, _Accumulating):
  r"""A linen ``TrainState`` whose ``step`` counts optimizer updates.

  ``tx`` is :func:`optax_tokacc.token_weighted_multistep` (or a transformation
  that contains it). Each call of :meth:`apply_gradients` feeds one
  micro-batch:

  .. math::

    \text{step} \leftarrow \text{step} + [\text{gradient\_step advanced}],
    \qquad \text{micro\_step} \leftarrow \text{micro\_step} + 1,

  so ``step`` equals the step of a run without accumulation at the same
  point of training, also under wrappers that reject micro-batches (such as
  ``optax.apply_if_finite``). Micro-steps add zero updates, so the
  parameters keep their values.

  Attributes:
    micro_step: micro-batches fed to :meth:`apply_gradients` so far (int32).
    has_updated: whether the last :meth:`apply_gradients` emitted an optimizer
      update (boolean scalar).

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
    >>> int(state.step), int(state.micro_step), bool(state.has_updated)
    (0, 1, False)
    >>> state = train_step(state, x, jnp.array([1, 0, 0, 0]))
    >>> int(state.step), int(state.micro_step), bool(state.has_updated)
    (1, 2, True)
  """

  micro_step: jax.typing.ArrayLike = 0
  has_updated: jax.typing.ArrayLike = False
  _PLAIN = 'flax.training.train_state.TrainState'

  @classmethod
  def create(
    cls,
    *,
    apply_fn: Any,
    params: Any,
    tx: optax.GradientTransformation,
    **kwargs: Any,
  ) -> 'TrainState':
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
    kwargs.update(micro_step=jnp.int32(0), has_updated=jnp.bool_(False))
    state = super().create(apply_fn=apply_fn, params=params, tx=tx, **kwargs)
    state._acc_state()
    return state.replace(step=jnp.int32(0))

  def apply_gradients(
    self,
    *,
    grads: _typing.Updates,
    num_tokens: jax.typing.ArrayLike,
    loss: Optional[jax.typing.ArrayLike] = None,
    **kwargs: Any,
  ) -> 'TrainState':
    """Feeds one micro-batch's gradients to ``tx`` and applies its updates.

    Unlike the parent class, ``kwargs`` go to ``tx.update`` (e.g.
    ``emit_now``), not to ``replace``. The updates are applied on every
    call, so that transformations beside the accumulator (e.g. in
    ``optax.multi_transform``) keep theirs, by
    :func:`optax_tokacc.update_and_apply`: an open micro-step of the bare
    transform reads and writes nothing of the parameters there.

    Args:
      grads: gradients of the micro-batch's token-summed loss (or mean loss
        with ``loss_reduction='mean'``), with the structure of ``params``.
      num_tokens: counted tokens of the micro-batch (scalar).
      loss: optional micro-batch loss with the same reduction, for
        :attr:`window_loss`.
      **kwargs: further keyword arguments of ``tx.update``.

    Returns:
      The new state: ``step`` advanced by one if the accumulator emitted an
      optimizer update, ``micro_step`` by one, ``params`` and ``opt_state``
      updated.

    Raises:
      ValueError: if ``grads`` holds fp8 ``'_overwrite_with_gradient'``
        collections.
    """
    if isinstance(grads, Mapping) and _OVERWRITE_WITH_GRADIENT in grads:
      raise ValueError(
        f'grads holds an fp8 {_OVERWRITE_WITH_GRADIENT!r} collection, which '
        'cannot be accumulated; use flax.training.train_state.TrainState.'
      )
    kwargs.update(num_tokens=num_tokens, loss=loss)
    args = (self.tx, grads, self.opt_state, self.params)
    params, opt_state = optax_tokacc.update_and_apply(*args, **kwargs)
    new = self.replace(params=params, opt_state=opt_state)
    before = self._acc_state().gradient_step
    step, micro_step, emitted = new._counters(before, self.step)
    return new.replace(step=step, micro_step=micro_step, has_updated=emitted)


class Optimizer(nnx.Optimizer, _Accumulating):
  r"""An ``nnx.Optimizer`` whose ``step`` counts optimizer updates.

  ``tx`` is :func:`optax_tokacc.token_weighted_multistep` (or a transformation
  that contains it). Each call of :meth:`update` feeds one micro-batch:

  .. math::

    \text{step} \leftarrow \text{step} + [\text{gradient\_step advanced}],
    \qquad \text{micro\_step} \leftarrow \text{micro\_step} + 1,

  where ``nnx.Optimizer`` would count every call in ``step``. Micro-steps
  add zero updates, so the model's parameters keep their values.

  Attributes:
    step: optimizer updates so far (an ``nnx.OptState``, uint32).
    micro_step: micro-batches fed to :meth:`update` so far (an
      ``nnx.OptState``, uint32): what ``nnx.Optimizer`` counts in ``step``.
    emitted: whether the last :meth:`update` emitted an optimizer update (an
      ``nnx.OptState``; read it as an array with :attr:`has_updated`).
    tx: the transformation.
    opt_state: its state.

  Example:
    >>> import jax, jax.numpy as jnp, optax
    >>> from flax import nnx
    >>> import optax_tokacc as tokacc
    >>> from optax_tokacc.flax import Optimizer
    >>> model = nnx.Linear(2, 1, rngs=nnx.Rngs(0))
    >>> tx = tokacc.token_weighted_multistep(optax.sgd(0.1), every_k_schedule=2)
    >>> optimizer = Optimizer(model, tx, wrt=nnx.Param)
    >>> def loss_fn(model, x, mask):  # summed over the counted rows
    ...   return jnp.sum(model(x)[:, 0] ** 2 * mask), mask.sum()
    >>> @nnx.jit
    ... def train_step(model, optimizer, x, mask):
    ...   (loss, num_tokens), grads = nnx.value_and_grad(
    ...       loss_fn, has_aux=True)(model, x, mask)
    ...   optimizer.update(model, grads, num_tokens=num_tokens, loss=loss)
    >>> x = jnp.ones((4, 2))
    >>> train_step(model, optimizer, x, jnp.array([1, 1, 1, 0]))
    >>> int(optimizer.step[...]), int(optimizer.micro_step[...])
    (0, 1)
    >>> train_step(model, optimizer, x, jnp.array([1, 0, 0, 0]))
    >>> int(optimizer.step[...]), int(optimizer.micro_step[...])
    (1, 2)
    >>> bool(optimizer.has_updated)
    True
  """

  _PLAIN = 'flax.nnx.Optimizer'

  def __init__(
    self,
    model: nnx.Module,
    tx: optax.GradientTransformation,
    *,
    wrt: Any,
    **kwargs: Any,
  ):
    """Creates the optimizer state of ``model``'s ``wrt`` variables.

    Args:
      model: the model.
      tx: :func:`optax_tokacc.token_weighted_multistep`, or a transformation
        containing it.
      wrt: filter of the variables to train (usually ``nnx.Param``), as for
        ``nnx.Optimizer``.
      **kwargs: further keyword arguments of ``nnx.Optimizer``.

    Raises:
      ValueError: if ``tx``'s state holds no
        :class:`optax_tokacc.TokenWeightedMultiStepState`.
    """
    super().__init__(model, tx, wrt=wrt, **kwargs)
    self._acc_state()
    self.micro_step = nnx.OptState(jnp.zeros([], jnp.uint32))
    self.emitted = nnx.OptState(jnp.zeros([], jnp.bool_))

  def update(
    self,
    model: nnx.Module,
    grads: Any,
    /,
    *,
    num_tokens: jax.typing.ArrayLike,
    loss: Optional[jax.typing.ArrayLike] = None,
    **kwargs: Any,
  ) -> Any:
    """Feeds one micro-batch's gradients to ``tx`` and updates ``model``.

    Args:
      model: the model, as passed to the constructor.
      grads: gradients of the micro-batch's token-summed loss (or mean loss
        with ``loss_reduction='mean'``), e.g. from ``nnx.grad``.
      num_tokens: counted tokens of the micro-batch (scalar).
      loss: optional micro-batch loss with the same reduction, for
        :attr:`window_loss`.
      **kwargs: further keyword arguments of ``tx.update`` (e.g.
        ``emit_now``).

    Returns:
      The updates the call applied, as ``nnx.Optimizer.update`` returns
      them from Flax 0.12.8 (applied by
      :func:`optax_tokacc.update_and_apply`).
    """
    step, before = self.step[...], self._acc_state().gradient_step[...]
    kwargs.update(num_tokens=num_tokens, loss=loss)
    updates = self._applied(model, grads, kwargs)
    counters = self._counters(before, step)
    self.step[...], self.micro_step[...], self.emitted[...] = counters
    return updates

  def _applied(self, model: nnx.Module, grads: Any, kwargs: dict) -> Any:
    """``nnx.Optimizer.update``'s body with
    :func:`optax_tokacc.update_and_apply` for its ``tx.update`` and
    ``optax.apply_updates``: the model's parameters and the optimizer's
    state updated, the updates returned. Flax spells it two ways within the
    supported range: ``nnx.as_pure`` and a ``graph`` mode (0.12.8), or
    ``nnx.pure`` (0.12.2)."""
    pure = getattr(nnx, 'as_pure', None) or nnx.pure
    graph = {'graph': self.graph} if hasattr(self, 'graph') else {}
    params = pure(nnx.state(model, self.wrt, **graph))
    grads = pure(nnx.state(grads, self.wrt, **graph))
    args = (self.tx, grads, pure(self.opt_state), params)
    params, opt_state, updates = _update_and_apply.applied_with_updates(
      *args, **pure(kwargs)
    )
    nnx.update(model, params)
    nnx.update(self.opt_state, nnx.state(opt_state, **graph))
    return updates

  @property
  def has_updated(self) -> jax.Array:
    """Whether the last :meth:`update` emitted an optimizer update.

    Returns:
      A boolean scalar.
    """
    return jnp.asarray(self.emitted)
