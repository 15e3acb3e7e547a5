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
"""Checkpoints that optax_tokacc 0.5 wrote: the one place that knows their
form, removed in 0.8.0 (``CHANGELOG.md``).

0.5's ``to_checkpoint`` saved a state as it was, each per-device leaf with
one row per device, and did not record the rows (no ``SavedState``): such
a state restores only on as many devices as it was saved on.
"""

import jax

from optax_tokacc import _base
from optax_tokacc import _layouts
from optax_tokacc import _state
from optax_tokacc import _typing


def saved_by_0_5(prefix: tuple[str, ...], saved: dict) -> bool:
  """Whether the state at ``prefix`` of the saved leaves' paths is in 0.5's
  form (a state's fields, not a ``SavedState``'s ``state``)."""
  return prefix + ('state', 'mini_step') not in saved


def target(state: _base.TokenWeightedMultiStepState) -> _typing.ArrayTree:
  """What orbax restores such a state into: its leaves, as 0.5 saved them
  on the devices at hand."""
  return jax.tree.map(_layouts.leaf_rows, state)


def refusal(
  prefix: tuple[str, ...], now: tuple[int, ...], saved: dict, where: str
) -> ValueError:
  """The error for such a state at ``prefix`` (named ``where``) whose window
  was saved on another number of devices than its :func:`target` holds
  (``now``: the shape of the target's ``acc_tokens``)."""
  before = saved[prefix + ('acc_tokens',)].shape
  return ValueError(
    f'checkpoint_target: {where} was saved by optax_tokacc 0.5 '
    f'with the window of {before[0] if before else 1} device(s), and is '
    f'restored onto {now[0] if now else 1}: 0.5 did not record how to '
    'merge its shares. Restore it on the devices it was saved on, then '
    'save it again with this version: it then moves to any number.'
  )


def restore(
  saved: _typing.ArrayTree, ref: _base.TokenWeightedMultiStepState
) -> _base.TokenWeightedMultiStepState:
  """A state in 0.5's form, restored on as many devices as it was saved
  on, laid out like the state ``ref``."""
  if not _state.is_state(saved):
    raise ValueError(
      f'from_checkpoint: got {type(saved).__name__} where like holds a '
      'TokenWeightedMultiStepState: restore into tokacc.checkpoint_target.'
    )
  return jax.tree.map(_layouts.restore_leaf, saved, ref)
