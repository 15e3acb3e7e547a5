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
"""Checkpoints that resume anywhere: on any number of devices, exactly.

:func:`to_checkpoint` saves each state's window as rows of its devices'
shares, with their count (a :class:`~optax_tokacc.SavedState`, laid out
by ``_shares``). :func:`checkpoint_target` gives orbax the target to
restore into, on the devices at hand, with as many rows as were saved, and
refuses a checkpoint of another configuration; :func:`from_checkpoint`
puts the rows back where they were saved on as many devices (bit for bit),
and otherwise merges them into the window's totals (sums are linear:
exact, in another order of summation), on the first device of the new
layout.
"""

from typing import Any, Optional

import jax
import jax.numpy as jnp
import numpy as np

from optax_tokacc import _base
from optax_tokacc import _checkpoint_0_5
from optax_tokacc import _checkpoint_target
from optax_tokacc import _errors
from optax_tokacc import _layouts
from optax_tokacc import _shares
from optax_tokacc import _state
from optax_tokacc import _typing


def _abstract_leaf(tree: Any, traced: bool = False) -> Optional[str]:
  """The kind of the first leaf of ``tree`` that is a
  ``jax.ShapeDtypeStruct`` (with ``traced``, or a tracer of ``jax.jit`` or
  ``jax.eval_shape``), None where there is none."""
  for leaf in jax.tree.leaves(tree):
    if isinstance(leaf, jax.ShapeDtypeStruct):
      return 'a jax.ShapeDtypeStruct'
    if traced and isinstance(leaf, jax.core.Tracer):
      return 'a traced value (inside jax.jit or jax.eval_shape)'
  return None


def _is_saved(x: Any) -> bool:
  return isinstance(x, _base.SavedState)


def to_checkpoint(tree: Any) -> Any:
  """``tree`` in a form that orbax saves and restores on any devices.

  Every :class:`~optax_tokacc.TokenWeightedMultiStepState` in ``tree``
  becomes a :class:`SavedState`: its window's per-device shares as rows
  of ordinary arrays (the devices' slots under ``axis_name``, their
  partial sums under explicit sharding, one row on one device), with the
  number of rows recorded. Other leaves typed *reduced* are typed
  replicated (orbax cannot write their metadata), and other *unreduced*
  leaves get a leading axis of their devices' partial sums; the rest is
  returned as it is. Nothing is summed or rounded and no data moves:
  :func:`from_checkpoint` restores the same state bit for bit on as many
  devices, and merges the shares exactly on any other number.

  Args:
    tree: a pytree of arrays, e.g. ``(params, opt_state)``.

  Returns:
    The tree to save, e.g. with ``orbax.checkpoint``.

  Example:
    >>> import jax, jax.numpy as jnp, optax
    >>> import optax_tokacc as tokacc
    >>> mesh = jax.make_mesh((2,), ('data',), devices=jax.devices()[:2])
    >>> tx = tokacc.token_weighted_multistep(optax.sgd(0.1), 2)
    >>> with jax.set_mesh(mesh):
    ...   params = jax.device_put(
    ...       {'w': jnp.ones(3)}, jax.P(None, reduced={'data'}))
    ...   state = tx.init(params)
    ...   saved = tokacc.to_checkpoint(state)  # what orbax saves
    ...   restored = tokacc.from_checkpoint(saved, like=state)
    >>> print(jax.typeof(state.grad_sums['w']))  # partial sums
    float32[3]{U:data}
    >>> print(jax.typeof(saved.state.grad_sums['w']))  # one row per device
    float32[2@data,3]
    >>> print(jax.typeof(restored.grad_sums['w']))
    float32[3]{U:data}

    With orbax, restore into :func:`checkpoint_target`, built from the
    checkpoint's metadata and a state made on the devices at hand::

      ckptr.save(path, tokacc.to_checkpoint((params, opt_state)))
      like = (params0, tx.init(params0))  # or tokacc.init_sharded(...)
      target = tokacc.checkpoint_target(like, ckptr.metadata(path))
      params, opt_state = tokacc.from_checkpoint(
          ckptr.restore(path, target), like)
  """
  try:
    with _checkpoint_target.on_its_mesh(tree):
      return jax.tree.map(
        lambda x: (
          _shares.save_state(x) if _state.is_state(x) else _layouts.leaf_rows(x)
        ),
        tree,
        is_leaf=_state.is_state,
      )
  except Exception as error:
    # Abstract values pass where nothing reads them (a window's slots under
    # axis_name: 0.5's restore flow); elsewhere, say what works.
    abstract = _abstract_leaf(tree)
    if abstract is None:
      raise
    raise _errors.refuse(
      'tree',
      'arrays',
      f'{abstract} (abstract)',
      ' Ahead of time, call jax.eval_shape(tokacc.to_checkpoint, tree).',
    ) from error


def from_checkpoint(tree: Any, like: Any) -> Any:
  """The inverse of :func:`to_checkpoint`, on the devices of ``like``.

  Each saved state's window is put back as it was where it was saved on
  as many devices (bit for bit: each device gets its own share back).
  Saved on another number of devices (its rows are not ``like``'s), the
  window's shares are merged exactly into its totals: the gradient sums
  (with Kahan compensation, their error terms too), the token count (an
  invalid count, -1 on any device, keeps the window invalid) and the
  loss; the first device of ``like``'s layout holds the totals, the others
  zeros, and training resumes as full-batch training would, in another
  order of summation. At a window boundary there is nothing to merge. A
  skip state (``should_skip_update_fn``'s) is the last micro-step's
  decision on each device: merged, its booleans are any device's and its
  numbers their sum (as under explicit sharding), held by every device;
  the next micro-step replaces it.

  Merging runs eagerly (call this outside ``jax.jit``), with a collective
  of the window's size. ``k`` is not part of the state (as in
  ``optax.MultiSteps``): a transform of another ``every_k_schedule``
  closes the open window once ``mini_step`` reaches its ``k``, as a
  schedule that changes ``k`` would.

  Args:
    tree: what :func:`to_checkpoint` gave, e.g. restored by orbax into
      :func:`checkpoint_target`.
    like: a tree with the target types, as given to
      :func:`checkpoint_target`: e.g. ``(params, tx.init(params))`` for
      parameters placed as in training (``tokacc.init_sharded`` with
      ``axis_name``), or its ``jax.eval_shape``.

  Returns:
    ``tree`` typed and laid out like ``like``.

  Raises:
    ValueError: if ``tree`` is not the form :func:`to_checkpoint` gives
      for ``like``: rows padded or truncated by a restore (orbax's
      ``strict=False`` with a target of another number of devices, which
      the recorded rows show), a leaf of another dtype or structure
      (another ``accumulator_dtype``, ``compensated``, ``inner``).

  Example:
    A window opened on 2 devices (explicit sharding), resumed on one:

    >>> import jax, jax.numpy as jnp, numpy as np, optax
    >>> import optax_tokacc as tokacc
    >>> tx = tokacc.token_weighted_multistep(optax.sgd(1.0), 2)
    >>> mesh = jax.make_mesh((2,), ('data',), devices=jax.devices()[:2])
    >>> with jax.set_mesh(mesh):
    ...   params = jax.device_put({'w': jnp.zeros(2)}, jax.P(reduced={'data'}))
    ...   grads = jax.jit(lambda: {'w': jnp.ones(2, out_sharding=jax.P(
    ...       unreduced={'data'}))})()  # each device's partial sum: 1
    ...   state = tx.init(params)
    ...   _, state = tx.update(grads, state, params, num_tokens=4)
    ...   saved = jax.device_get(tokacc.to_checkpoint(state))
    >>> saved.rows, saved.state.grad_sums['w']  # the shares of 2 devices
    (array([2, 2, 2], dtype=int32), array([[1., 1.],
           [1., 1.]], dtype=float32))
    >>> one = {'w': jnp.zeros(2)}  # one device: the window's totals
    >>> restored = tokacc.from_checkpoint(saved, like=tx.init(one))
    >>> restored.grad_sums['w'], restored.acc_tokens
    (Array([2., 2.], dtype=float32), Array(4, dtype=int32))
    >>> updates, _ = tx.update({'w': jnp.zeros(2)}, restored, one, num_tokens=0)
    >>> updates['w']  # -(1 + 1) / 4
    Array([-0.5, -0.5], dtype=float32)
  """

  abstract = _abstract_leaf(tree, traced=True)
  if abstract is not None:  # it reads the rows recorded in the arrays
    raise _errors.refuse(
      'from_checkpoint(tree, like): tree',
      'the restored arrays (their recorded rows are read)',
      f'{abstract}',
      ' Ahead of time, tokacc.checkpoint_target(like, metadata) gives what'
      ' orbax restores, and the result is laid out as like is.',
    )

  def restore(saved, ref):
    if _state.is_state(ref):
      if _is_saved(saved):
        saved = saved._replace(state=_without_scratch(saved.state))
        return _restore_state(saved, ref)
      return _checkpoint_0_5.restore(_without_scratch(saved), ref)
    return _layouts.restore_leaf(saved, ref)

  with _checkpoint_target.on_its_mesh(like):
    return jax.tree.map(restore, tree, like, is_leaf=_is_state_form)


def _is_state_form(x: Any) -> bool:
  return _is_saved(x) or _state.is_state(x)


def _without_scratch(state: _typing.ArrayTree) -> _typing.ArrayTree:
  """``state`` with zero sums at a window boundary (``mini_step`` 0 on
  every device). A GPU's or CPU's close leaves scratch there (the emitted
  updates, or the closed window's sums, which the next micro-step there
  restarts), as 0.5.0's did; a TPU's next micro-step only adds."""
  if not _state.is_state(state) or np.any(np.asarray(state.mini_step)):
    return state
  window = (state.grad_sums, state.acc_compensation)
  grad_sums, acc_compensation = jax.tree.map(jnp.zeros_like, window)
  return state._replace(grad_sums=grad_sums, acc_compensation=acc_compensation)


def _restore_state(
  saved: _base.SavedState, ref: _base.TokenWeightedMultiStepState
) -> _base.TokenWeightedMultiStepState:
  """``saved`` (a :class:`SavedState`) laid out like the state ``ref``."""
  state = saved.state
  _check_like(state, ref)
  counts = _shares.saved_rows(state)
  recorded = [int(n) for n in np.asarray(saved.rows)]
  now = _shares.row_counts(ref)
  if counts != recorded:
    raise ValueError(
      f'from_checkpoint: the window was saved with the shares of '
      f'{max(recorded)} device(s), but {max(counts)} rows were restored: '
      "padded or truncated (orbax's strict=False). Restore into "
      'tokacc.checkpoint_target(like, ckptr.metadata(path)).'
    )
  if counts == now:  # as many devices: each gets its own share back
    return _shares.put_back(state, ref)
  return _shares.merged(state, ref)


def _check_like(
  state: _base.TokenWeightedMultiStepState,
  ref: _base.TokenWeightedMultiStepState,
) -> None:
  """``state`` must be a saved state of ``ref``'s configuration."""
  per_device = _checkpoint_target.paths(_base.per_device(state))
  targets = _checkpoint_target.paths(_base.per_device(ref))
  same_tree = jax.tree.structure(state) == jax.tree.structure(ref)
  if not same_tree or set(per_device) != set(targets):
    raise ValueError(
      'from_checkpoint: the saved state has another structure than like '
      f'(saved {jax.tree.structure(state)}, like {jax.tree.structure(ref)}):'
      ' another inner optimizer or configuration (compensated, '
      'should_skip_update_fn).'
    )
  saved_leaves = _checkpoint_target.paths(state)
  for path, x in _checkpoint_target.paths(ref).items():
    dtype = jnp.result_type(saved_leaves[path])
    if dtype != jnp.result_type(x):
      raise ValueError(
        f'from_checkpoint: {_checkpoint_target.where(path)} was saved as {dtype} and is '
        f'{jnp.result_type(x)} here: another accumulator_dtype or '
        'token_dtype, or another optimizer.'
      )
