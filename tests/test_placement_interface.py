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
"""The placements are abstract-or-final (issue 56): every method of the
interface is abstract, or written once in it and never overridden, so
that what a placement does is read in its own class; each placement is
final, and none asks which placement it is."""

import ast
import inspect
import pathlib

import jax
import jax.numpy as jnp
import optax
import placements
import pytest

import optax_tokacc as tokacc
from optax_tokacc import _layouts
from optax_tokacc import _manual
from optax_tokacc import _partial_sums
from optax_tokacc import _placement
from optax_tokacc import _single

PLACEMENTS = (_single.Single, _manual.Manual, _partial_sums.PartialSums)
LAYOUTS = (_layouts.Slots, _layouts.Pmap, _layouts.Typed)
INTERFACES = {
  'placement': (_placement.Placement, PLACEMENTS),
  'layout': (_layouts.Layout, LAYOUTS),
}


def interface_methods(interface) -> dict:
  return {
    name: value
    for name, value in vars(interface).items()
    if inspect.isfunction(value) or isinstance(value, (property, classmethod))
  }


@pytest.mark.parametrize('kind', INTERFACES)
def test_every_method_is_abstract_or_never_overridden(kind):
  interface, implementations = INTERFACES[kind]
  abstract = interface.__abstractmethods__
  for name in interface_methods(interface):
    if name in abstract:
      continue
    overriding = [p.__name__ for p in implementations if name in vars(p)]
    assert not overriding, (
      f'{name}: concrete in {interface.__name__}, overridden in {overriding}'
    )


@pytest.mark.parametrize(
  'implementation, interface',
  [(i, kind[0]) for kind in INTERFACES.values() for i in kind[1]],
  ids=lambda x: x.__name__,
)
def test_each_implementation_is_final_and_complete(implementation, interface):
  assert getattr(implementation, '__final__', False), implementation
  assert not implementation.__abstractmethods__
  assert implementation.__bases__ == (interface,)


def test_no_method_asks_which_placement_it_is():
  """No predicate of the placement's kind in the interface (``shares_typed``
  was one: the norms' form is each placement's own ``squares`` and
  ``norms``)."""
  names = interface_methods(_placement.Placement)
  kinds = [n for n in names if n.startswith(('is_', 'shares_'))]
  assert not kinds, kinds


PARAMS = {'w': jnp.arange(8.0).reshape(4, 2), 'v': jnp.ones(2)}


def layout_read(state):
  return type(_layouts.of_state(state))


def test_a_bare_state_tells_its_placements_layout():
  """Issue 56: each placement owns its layout, and a state without its
  placement (a checkpoint's) tells that layout by the form of its fields
  alone: the saved format records nothing else."""
  tx = tokacc.token_weighted_multistep(optax.adam(0.1), 3)
  assert layout_read(tx.init(PARAMS)) is type(_single.Single().layout)

  tx = tokacc.token_weighted_multistep(optax.adam(0.1), 3, axis_name='data')
  sharded = tokacc.init_sharded(
    tx, PARAMS, placements.data_mesh(4), axis_name='data'
  )
  assert layout_read(sharded) is type(_manual.Manual(('data',)).layout)
  # pmap stacks every field of that layout once more
  stacked = jax.pmap(tx.init, axis_name='data')(
    jax.tree.map(lambda x: placements.replicate(x, 4), PARAMS)
  )
  assert _layouts.of_state(stacked) == _layouts.Pmap(4)


@placements.needs_typed_sharding
def test_a_bare_typed_state_tells_partial_sums_layout():
  layout = placements.EXPLICIT_LAYOUTS['ddp']
  mesh = layout.mesh()
  tx = tokacc.token_weighted_multistep(optax.adam(0.1), 3)
  with jax.set_mesh(mesh):
    state = jax.jit(tx.init)(
      placements.place_params(PARAMS, mesh, layout.specs)
    )
  assert placements.type_strings(state.acc_tokens) != placements.type_strings(
    state.mini_step
  )
  place = _partial_sums.PartialSums(frozenset({'data'}), mesh)
  assert layout_read(state) is type(place.layout)


def test_a_placement_is_chosen_in_one_place():
  """Regression (issue 56): no code asks which placement it holds.
  ``_multistep.call`` asked ``isinstance(place, _single.Single)`` before
  it let ``update_and_apply`` add the updates from the buffer; the
  placement now says so itself (``buffer_is_the_updates``). Outside the
  placements' own modules, a concrete placement is named only where
  ``_multistep.placement`` chooses it."""
  package = pathlib.Path(_placement.__file__).parent
  own = {f'{p.__module__.rsplit(".", 1)[1]}.py' for p in PLACEMENTS}
  names = {p.__name__ for p in PLACEMENTS}
  found = []
  for path in sorted(package.rglob('*.py')):
    if path.name in own:
      continue
    tree = ast.parse(path.read_text())
    choosers = [
      node
      for node in ast.walk(tree)
      if isinstance(node, ast.FunctionDef) and node.name == 'placement'
    ]
    allowed = {id(n) for c in choosers for n in ast.walk(c)}
    found += [
      f'{path.name}:{node.lineno}'
      for node in ast.walk(tree)
      if isinstance(node, ast.Attribute)
      and node.attr in names
      and id(node) not in allowed
    ]
  assert not found, found
