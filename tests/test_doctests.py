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
"""The docstring examples of every module with a public name run.

The modules are those that define a name of ``optax_tokacc.__all__``, and
``optax_tokacc.flax``: a new public module is picked up by itself, and must
bring a runnable example (``>>>``) or be listed in ``WITHOUT_EXAMPLES``
with the reason.
"""

import doctest
import importlib

import pytest

import optax_tokacc
from optax_tokacc import _typed_sharding

# Modules whose public names have no runnable docstring example yet: a gap
# to close, listed so that it is not forgotten.
WITHOUT_EXAMPLES = {}
# Modules whose examples need a newer JAX than the declared floor.
NEEDS_EXPLICIT_SHARDING = {'optax_tokacc._checkpoint'}


def public_modules() -> list[str]:
  modules = {
    getattr(optax_tokacc, name).__module__ for name in optax_tokacc.__all__
  }
  # names re-exported from optax (skip_not_finite) are optax's to test
  modules = {m for m in modules if m.startswith('optax_tokacc')}
  return sorted(modules | {'optax_tokacc.flax'})


MODULES = public_modules()
# the longest (5 s or more of a core, --durations=0)
SLOW_MODULES = (
  'optax_tokacc._losses',
  'optax_tokacc._state',
  'optax_tokacc.flax',
)


@pytest.mark.parametrize(
  'name',
  [
    pytest.param(name, marks=pytest.mark.slow if name in SLOW_MODULES else ())
    for name in MODULES
  ],
)
def test_docstring_examples(name):
  if name == 'optax_tokacc.flax':
    pytest.importorskip('flax')
  if name in NEEDS_EXPLICIT_SHARDING and not _typed_sharding.SUPPORTED:
    pytest.skip('explicit sharding with reduced types needs jax >= 0.10')
  module = importlib.import_module(name)
  result = doctest.testmod(module, optionflags=doctest.NORMALIZE_WHITESPACE)
  assert result.failed == 0
  if name not in WITHOUT_EXAMPLES:
    assert result.attempted > 0, f'{name} has no docstring example'


def test_modules_without_examples_are_public():
  assert set(WITHOUT_EXAMPLES) <= set(MODULES), WITHOUT_EXAMPLES
  assert NEEDS_EXPLICIT_SHARDING <= set(MODULES), NEEDS_EXPLICIT_SHARDING


def test_every_module_opens_with_a_docstring():
  missing = [
    name
    for name in MODULES + ['optax_tokacc']
    if not (importlib.import_module(name).__doc__ or '').strip()
  ]
  assert not missing, missing
