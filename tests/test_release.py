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

import importlib.metadata
import importlib.resources
import re

import helpers

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
