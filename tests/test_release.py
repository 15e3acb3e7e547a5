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
"""The release as installed: one version, the one the distribution carries,
with its dated CHANGELOG section (CITATION.cff and the README's BibTeX:
``tests/test_readme.py``; the artifacts and the tag: ``noxfile.py``'s
``release`` session)."""

import importlib
import importlib.metadata
import importlib.resources
import inspect
import pkgutil
import re
import types
import typing

import helpers
import pytest

import optax_tokacc


def test_the_installed_distribution_is_the_package_version():
  """The version pip installed (from ``pyproject.toml``'s dynamic version,
  read from ``__version__`` when the package was built) is the imported
  package's: an editable install made before a version bump fails here
  until it is installed again."""
  assert importlib.metadata.version('optax_tokacc') == optax_tokacc.__version__


def test_the_version_is_a_release_number():
  assert re.fullmatch(r'\d+\.\d+\.\d+', optax_tokacc.__version__)


def test_the_package_says_it_is_typed():
  assert (
    importlib.resources.files('optax_tokacc').joinpath('py.typed').is_file()
  )


def package_modules() -> list[str]:
  """Every module of the package, private ones included."""
  found = pkgutil.walk_packages(optax_tokacc.__path__, 'optax_tokacc.')
  return ['optax_tokacc', *sorted(module.name for module in found)]


def written_in(value, module) -> bool:
  """Whether ``value`` is a function whose code is in ``module``'s file."""
  code = getattr(value, '__code__', None)
  return code is not None and code.co_filename == module.__file__


def annotated(module) -> list:
  """What ``module`` defines that carries annotations: its functions, and its
  classes and their methods.

  A class stands for its own annotations (``typing.get_type_hints`` of a
  class reads its bases' too, and Flax's ``TrainState``, the base of
  ``optax_tokacc.flax.TrainState``, fails by itself on ``opt_state:
  optax.OptState``: Flax's to fix). Each base of this package's is tested
  in its own module.
  """
  found = []
  for value in vars(module).values():
    if getattr(value, '__module__', None) != module.__name__:
      continue
    if inspect.isclass(value):
      found.append(
        types.SimpleNamespace(
          __annotations__=inspect.get_annotations(value),
          __globals__=vars(module),
          __qualname__=value.__qualname__,
        )
      )
      found += [v for v in vars(value).values() if written_in(v, module)]
    elif inspect.isfunction(value):
      found.append(value)
  return found


@pytest.mark.parametrize('name', package_modules())
def test_every_annotation_resolves(name):
  """``typing.get_type_hints`` works on every module, function, class and
  method, as type checkers' and documentation tools' readers call it (a
  recursive alias such as optax's ``Params`` names itself in a string,
  which must resolve where it was written, not where it is used:
  ``optax_tokacc._typing``)."""
  module = importlib.import_module(name)
  typing.get_type_hints(module)
  for value in annotated(module):
    try:
      typing.get_type_hints(value)
    except NameError as e:
      raise AssertionError(f'{name}.{value.__qualname__}: {e}') from e


@helpers.needs_repository('CHANGELOG.md')
def test_the_changelog_has_a_dated_section_for_the_version():
  changelog = (helpers.REPO / 'CHANGELOG.md').read_text()
  version = re.escape(optax_tokacc.__version__)
  heading = re.search(
    rf'^## \[{version}\] - (\d{{4}}-\d{{2}}-\d{{2}})$', changelog, re.M
  )
  assert heading, f'CHANGELOG.md has no dated section for {version}'
  sections = re.findall(r'^## \[(.+?)\]', changelog, re.M)
  assert sections[:2] == ['Unreleased', optax_tokacc.__version__], sections
