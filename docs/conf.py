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
"""Sphinx configuration of the optax_tokacc documentation.

Build it warning-free, as CI does (``.ci/run docs``)::

  pip install -e '.[docs]'
  sphinx-build -W -b html docs docs/_build/html

Pages are MyST Markdown; the API reference (``api/``) is generated from the
Google-style docstrings by autodoc and napoleon. Every ```python block of
every page is executed by ``tests/test_docs.py``.
"""

import importlib.metadata

project = 'optax_tokacc'
author = 'The optax_tokacc Authors'
copyright = '2026, The optax_tokacc Authors'  # noqa: A001
# The installed package's version: autodoc documents the installed package
# (`pip install -e '.[docs]'` installs this checkout).
release = importlib.metadata.version('optax_tokacc')
version = release

extensions = [
  'myst_parser',
  'sphinx.ext.autodoc',
  'sphinx.ext.autosummary',
  'sphinx.ext.mathjax',
  'sphinx.ext.napoleon',
  'sphinx.ext.viewcode',
  'sphinx_copybutton',
]

source_suffix = {'.rst': 'restructuredtext', '.md': 'markdown'}
root_doc = 'index'
# accumulation_bug.md is written by examples/accumulation_bug.py and included
# by the_bug.md; .gitignore and _build are not pages.
exclude_patterns = ['_build', 'accumulation_bug.md', '.gitignore']

# MyST: ```{directive} fences, $math$, and anchors for ## and ### headings
# (links such as getting_started.md#rules-of-the-window).
myst_enable_extensions = ['colon_fence', 'dollarmath']
myst_heading_anchors = 3

# autodoc + napoleon: Google-style docstrings, as optax.
autodoc_member_order = 'bysource'
autodoc_typehints = 'none'  # the Args sections say what each argument is
autodoc_preserve_defaults = True
autosummary_generate = False
napoleon_google_docstring = True
napoleon_numpy_docstring = False
napoleon_use_rtype = False

# The look of optax's site.
html_theme = 'sphinx_book_theme'
html_title = f'optax_tokacc {release}'
html_theme_options = {
  'show_toc_level': 2,
  'navigation_with_keys': False,
}
html_static_path = []

# Copy only the code of a block, not a '>>> ' or '... ' prompt.
copybutton_prompt_text = r'>>> |\.\.\. |\$ '
copybutton_prompt_is_regexp = True
