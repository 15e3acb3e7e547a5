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

import inspect

import pytest

from optax_tokacc import _manual
from optax_tokacc import _partial_sums
from optax_tokacc import _placement
from optax_tokacc import _single

PLACEMENTS = (_single.Single, _manual.Manual, _partial_sums.PartialSums)


def interface_methods() -> dict:
  return {
    name: value
    for name, value in vars(_placement.Placement).items()
    if inspect.isfunction(value)
  }


def test_every_method_is_abstract_or_never_overridden():
  abstract = _placement.Placement.__abstractmethods__
  for name in interface_methods():
    if name in abstract:
      continue
    overriding = [p.__name__ for p in PLACEMENTS if name in vars(p)]
    assert not overriding, (
      f'{name}: concrete in Placement, overridden in {overriding}'
    )


@pytest.mark.parametrize('placement', PLACEMENTS, ids=lambda p: p.__name__)
def test_each_placement_is_final_and_complete(placement):
  assert getattr(placement, '__final__', False), placement
  assert not placement.__abstractmethods__
  assert placement.__bases__ == (_placement.Placement,)


def test_no_method_asks_which_placement_it_is():
  """No predicate of the placement's kind in the interface (``shares_typed``
  was one: the norms' form is each placement's own ``squares`` and
  ``norms``)."""
  kinds = [n for n in interface_methods() if n.startswith(('is_', 'shares_'))]
  assert not kinds, kinds
