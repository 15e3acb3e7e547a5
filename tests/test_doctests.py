"""Runs the docstring examples of the public modules."""

import doctest
import importlib

import pytest

MODULES = [
  'optax_tokacc._multistep',
  'optax_tokacc._state',
  'optax_tokacc._sharding',
  'optax_tokacc._losses',
  'optax_tokacc._microbatch',
  'optax_tokacc._checks',
  'optax_tokacc.flax',
]


@pytest.mark.parametrize('name', MODULES)
def test_docstring_examples(name):
  module = importlib.import_module(name)
  result = doctest.testmod(module, optionflags=doctest.NORMALIZE_WHITESPACE)
  assert result.attempted > 0, f'{name} has no docstring example'
  assert result.failed == 0
