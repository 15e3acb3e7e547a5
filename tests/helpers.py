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
"""Parts the tests share.

The tests run against whatever ``optax_tokacc`` Python imports: the
checkout (``pip install -e``), or an installed wheel with a copy of
``tests/`` beside it (the ``release`` session of ``noxfile.py`` runs them
from the unpacked sdist). Tests of the repository's other files (README,
docs, examples, benchmarks) skip there, naming what is missing
(:func:`needs_repository`), and processes that tests start import the same
``optax_tokacc`` as the test itself (:func:`subprocess_env`).
"""

import os
import pathlib

import pytest

import optax_tokacc

TESTS_DIR = pathlib.Path(__file__).resolve().parent
REPO = TESTS_DIR.parent  # the checkout, or the unpacked sdist


def needs_repository(*names: str) -> pytest.MarkDecorator:
  """A ``skipif`` marker for a test of the repository's files ``names``
  (relative to its root), which an installed package with a copy of
  ``tests/`` does not have."""
  missing = [name for name in names if not (REPO / name).exists()]
  return pytest.mark.skipif(
    bool(missing),
    reason=f"needs the repository's {', '.join(missing)}, absent beside "
    'this copy of tests/ (an installed optax_tokacc, or the sdist)',
  )


def subprocess_env(**variables: str) -> dict[str, str]:
  """The environment of a Python process started by a test: it imports the
  ``optax_tokacc`` this process imported (the checkout or the installed
  wheel, never a source tree beside the tests), and the tests' modules;
  ``variables`` are set too."""
  package_root = pathlib.Path(optax_tokacc.__file__).resolve().parents[1]
  env = dict(os.environ, **variables)
  paths = [str(package_root), str(TESTS_DIR), env.get('PYTHONPATH')]
  env['PYTHONPATH'] = os.pathsep.join(filter(None, paths))
  return env
