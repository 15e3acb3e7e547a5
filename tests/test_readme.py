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
"""README.md: every ```python block runs as written, and the page keeps its
shape (the two commands first, at most 250 lines, a link to every page of
the documentation, the measured table of docs/, the citation of
CITATION.cff).

Each block is a program of its own, run as ``tests/doc_blocks.py`` runs the
blocks of the documentation (same markers, same fake devices).
"""

import pathlib
import re
import tomllib

import doc_blocks
import helpers
import pytest

import optax_tokacc

REPO = helpers.REPO
README = REPO / 'README.md'
TEXT = README.read_text() if README.exists() else ''
pytestmark = helpers.needs_repository('README.md', 'CITATION.cff')
needs_docs = helpers.needs_repository('docs')
BLOCKS = doc_blocks.python_blocks(TEXT, 'README.md')
MAX_LINES = 250
COMMANDS = (
  "pip install -e '.[examples]' && python examples/train_lm.py",
  "pip install -e '.[test]' && python -m pytest -m 'not slow'",  # noxfile.py reads this line
)


def test_readme_has_a_quickstart_program():
  names = [block.id for block in BLOCKS]
  assert any(name.endswith('-quickstart') for name in names), names


@pytest.mark.slow  # each block runs in a Python process
@pytest.mark.waits_on_processes(doc_blocks.TIMEOUT_S)
@pytest.mark.parametrize('block', BLOCKS, ids=[block.id for block in BLOCKS])
def test_readme_block_runs(block, tmp_path):
  assert not block.skip, 'every block of the README is a complete program'
  doc_blocks.run_block(block, tmp_path)


def test_readme_starts_with_the_two_commands():
  first_fence = re.search(r'^```(\w*)\n(.*?)^```', TEXT, re.M | re.S)
  assert first_fence.group(1) == 'bash'
  assert tuple(first_fence.group(2).splitlines()) == COMMANDS
  before = TEXT[: first_fence.start()].strip().splitlines()
  assert before[0] == '# optax_tokacc' and len(before) <= 3, before


def test_readme_is_short():
  assert len(TEXT.splitlines()) <= MAX_LINES


def _source_url() -> str:
  """The repository's address: ``pyproject.toml``'s ``Source`` URL."""
  pyproject = tomllib.loads((REPO / 'pyproject.toml').read_text())
  return pyproject['project']['urls']['Source']


def _linked_files() -> set[pathlib.Path]:
  """The repository files the README links to. Its links are absolute
  (it is the package page too): ``<Source>/blob/main/<path>``, and the
  image's ``raw.githubusercontent.com`` address."""
  source = _source_url()
  raw = source.replace(
    'https://github.com/', 'https://raw.githubusercontent.com/'
  )
  prefixes = (f'{source}/blob/main/', f'{raw}/main/')
  targets = re.findall(r'\]\(([^)\s]+)\)', TEXT)
  targets += re.findall(r'^\[[^\]]+\]: (\S+)$', TEXT, re.M)
  files = set()
  for target in targets:
    relative = [target[len(p) :] for p in prefixes if target.startswith(p)]
    assert relative or not target.startswith(source), target
    assert re.match(r'[a-z]+:', target), f'a relative link: {target}'
    if relative:
      files.add((REPO / relative[0].split('#')[0]).resolve())
  return files


@helpers.needs_repository('docs', 'examples', 'benchmarks')
def test_readme_links_resolve():
  missing = [path for path in _linked_files() if not path.exists()]
  assert not missing, missing


def _toctree_pages() -> list[str]:
  """The pages of the site's tables of contents, as docs/index.md lists."""
  index = (doc_blocks.DOCS / 'index.md').read_text()
  pages = []
  for body in re.findall(r'```\{toctree\}\n(.*?)```', index, re.S):
    pages += [
      line.strip()
      for line in body.splitlines()
      if line.strip() and not line.startswith(':')
    ]
  return pages


def _page_file(page: str) -> pathlib.Path:
  """The file a README link to ``page`` may name: the page itself, or the
  repository file it includes (CHANGELOG.md, CONTRIBUTING.md)."""
  for suffix in ('.md', '.rst'):
    path = doc_blocks.DOCS / (page + suffix)
    if path.exists():
      included = re.fullmatch(r'```\{include\} (\S+)\n```\n', path.read_text())
      if included:
        return (path.parent / included.group(1)).resolve()
      return path.resolve()
  raise AssertionError(f'docs/index.md lists {page!r}, which does not exist')


@needs_docs
def test_readme_links_every_page_of_the_docs():
  pages = _toctree_pages()
  assert len(pages) >= 10, pages
  linked = _linked_files()
  unlinked = [page for page in pages if _page_file(page) not in linked]
  assert not unlinked, f'link these pages from the README: {unlinked}'


def _table(text: str) -> list[str]:
  return [line for line in text.splitlines() if line.startswith('|')]


@needs_docs
def test_readme_shows_the_measured_table_of_the_docs():
  measured = (doc_blocks.DOCS / 'accumulation_bug.md').read_text()
  rows = _table(measured)
  assert len(rows) >= 3
  start = TEXT.index(rows[0])
  assert _table(TEXT[start:])[: len(rows)] == rows, (
    'copy docs/accumulation_bug.md (written by examples/accumulation_bug.py '
    '--out docs) into the README'
  )


def _cff_field(name: str) -> str:
  text = (REPO / 'CITATION.cff').read_text()
  match = re.search(rf'^{name}: "?(.*?)"?$', text, re.M)
  assert match, name
  return match.group(1)


def _bibtex_field(name: str) -> str:
  bibtex = re.search(r'```bibtex\n(.*?)```', TEXT, re.S).group(1)
  match = re.search(rf'^\s*{name} = \{{(.*)\}},?$', bibtex, re.M)
  assert match, name
  return match.group(1)


def test_readme_citation_matches_citation_cff():
  assert _bibtex_field('title').replace('\\_', '_') == _cff_field('title')
  assert _bibtex_field('version') == _cff_field('version')
  assert _bibtex_field('license') == _cff_field('license')
  assert _bibtex_field('year') == _cff_field('date-released')[:4]
  assert _bibtex_field('author') == '{' + _cff_field('  - name') + '}'
  assert _bibtex_field('url') == _cff_field('repository-code') == _source_url()


def test_citation_version_is_the_package_version():
  assert _cff_field('version') == optax_tokacc.__version__
