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
"""The window's per-device shares, as rows of ordinary arrays.

Every device's share is a share of a sum (``_manual.Manual.share_of``),
so the shares of any number of devices merge by summing.
:func:`save_state` lays a state's shares out as rows (a
:class:`~optax_tokacc.SavedState`); :func:`put_back` returns each row to
its device, on as many devices; :func:`merged` sums the rows into the
window's totals and gives them to the first device of another layout.
Where a state keeps its shares is its placement's layout
(``_layouts``), read once per state: the functions here ask the layout,
never which it is.
"""

import functools

import jax
import jax.numpy as jnp

from optax_tokacc import _base
from optax_tokacc import _compensated
from optax_tokacc import _layouts
from optax_tokacc import _tokens
from optax_tokacc import _typed_sharding
from optax_tokacc import _typing

PER_DEVICE = _base.PER_DEVICE_FIELDS
State = _layouts.State
Tree = _typing.ArrayTree


def save_state(state: State) -> _base.SavedState:
  """``state`` as :func:`optax_tokacc.to_checkpoint` saves it."""
  saved = _layouts.of_state(state).save(state)
  return _base.SavedState(saved, jnp.asarray(saved_rows(saved), jnp.int32))


def saved_rows(saved: State) -> list[int]:
  """The rows each per-device leaf of a saved state holds (its leading
  axis), as :func:`save_state` records them."""
  return [_layouts.leading(x) for x in jax.tree.leaves(_base.per_device(saved))]


def row_counts(state: State) -> list[int]:
  """The rows :func:`save_state` gives each per-device leaf of
  ``state`` (arrays or their shapes, ``like``'s)."""
  layout = _layouts.of_state(state)
  return [layout.rows(x) for x in jax.tree.leaves(_base.per_device(state))]


def put_back(
  state: State,
  ref: State,
) -> State:
  """Each device's share where it was saved, typed like ``ref``."""
  layout = _layouts.of_state(ref)
  shares = layout.put_back(_base.per_device(state), _base.per_device(ref))
  return _whole_fields(layout, state, ref)._replace(**shares)


def _whole_fields(
  layout: _layouts.Layout,
  state: State,
  ref: State,
) -> State:
  """``state`` with its fields other than the per-device ones laid out
  like ``ref``'s (the per-device ones left as they are)."""
  fields = {
    name: layout.whole_field(getattr(state, name), getattr(ref, name))
    for name in state._fields
    if name not in PER_DEVICE
  }
  return state._replace(**fields)


def merged(
  state: State,
  ref: State,
) -> State:
  """The window of ``state``'s rows (the shares of another number of
  devices) merged into its totals, held by the first device of ``ref``'s
  layout."""
  if any(isinstance(x, jax.core.Tracer) for x in jax.tree.leaves(state)):
    raise ValueError(
      'from_checkpoint merges a window saved on another number of devices '
      'eagerly: call it outside jax.jit.'
    )
  rows = jax.tree.map(_gathered, _base.per_device(state))
  layout = _layouts.of_state(ref)
  refs = _base.per_device(ref)

  def merge(rows):
    totals = _window_totals(rows)
    return {
      name: jax.tree.map(
        functools.partial(layout.spread, everywhere=name == 'skip_state'),
        totals[name],
        refs[name],
      )
      for name in PER_DEVICE
    }

  shares = layout.merge(merge, rows, refs)
  return _whole_fields(layout, state, ref)._replace(**shares)


def _gathered(x: jax.typing.ArrayLike) -> jax.typing.ArrayLike:
  """``x`` with its row axis whole on each of its devices (its other
  dimensions split as they are): the rows' sums then need no collective."""
  sharding = getattr(x, 'sharding', None)
  if not isinstance(sharding, jax.NamedSharding):
    return x
  spec = _typed_sharding.partitions(sharding.spec)
  if not spec or spec[0] is None:
    return x
  return jax.device_put(
    x, jax.NamedSharding(sharding.mesh, jax.P(None, *spec[1:]))
  )


def _window_totals(
  rows: dict[str, Tree],
) -> dict[str, Tree]:
  """The window's totals from the rows of its devices' shares: gradient
  sums with their compensation, the count (invalid if any share is), the
  loss, and the skip state (any device's booleans, the sum of its
  numbers)."""
  grads, errors = rows['grad_sums'], rows['acc_compensation']
  compensated = bool(jax.tree.leaves(errors))
  if compensated:
    merged = jax.tree.map(_compensated.merge_rows, grads, errors)
    structure = jax.tree.structure(grads)
    grad_totals, error_totals = jax.tree.transpose(structure, None, merged)
  else:
    grad_totals = jax.tree.map(
      lambda g: _compensated.merge_rows(g, None)[0], grads
    )
    error_totals = errors
  counts = rows['acc_tokens']
  tokens = functools.reduce(
    _tokens.add, [counts[i] for i in range(_layouts.leading(counts))]
  )
  return {
    'grad_sums': grad_totals,
    'acc_compensation': error_totals,
    'acc_tokens': tokens,
    'acc_loss': jnp.sum(rows['acc_loss'], axis=0),
    'skip_state': jax.tree.map(_combined, rows['skip_state']),
  }


def _combined(rows: jax.Array) -> jax.Array:
  """A skip state's rows as one: any device's booleans, the sum of their
  numbers (as explicit sharding keeps it)."""
  if jnp.result_type(rows) == jnp.bool_:
    return jnp.any(rows, axis=0)
  return jnp.sum(rows, axis=0, dtype=jnp.result_type(rows))
