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
"""Every ```python block of every page of docs/ runs as written (the
blocks, their markers and how one runs: ``tests/doc_blocks.py``), the
guides have programs, and the API reference documents every public name."""

import importlib.metadata
import importlib.util
import re

import doc_blocks
import helpers
import pytest

REPO = helpers.REPO
needs_docs = helpers.needs_repository('docs')
MAX_FRAGMENTS = 3


def docs_blocks() -> list[doc_blocks.Block]:
  blocks = []
  for path in doc_blocks.pages():
    page = str(path.relative_to(REPO))
    blocks += doc_blocks.python_blocks(path.read_text(), page)
  return blocks


BLOCKS = docs_blocks() if doc_blocks.DOCS.exists() else []


@needs_docs
@pytest.mark.slow  # each block runs in a Python process
@pytest.mark.waits_on_processes(doc_blocks.TIMEOUT_S)
@pytest.mark.parametrize('block', BLOCKS, ids=[block.id for block in BLOCKS])
def test_docs_block_runs(block, tmp_path):
  doc_blocks.run_block(block, tmp_path)


@needs_docs
def test_docs_have_few_fragments():
  fragments = [block.id for block in BLOCKS if block.skip]
  assert len(fragments) <= MAX_FRAGMENTS, fragments


@needs_docs
def test_every_guide_has_a_program():
  with_code = {block.page for block in BLOCKS if not block.skip}
  guides = {
    'docs/getting_started.md',
    'docs/migrate_multisteps.md',
    'docs/migrate_pytorch.md',
    'docs/sharded_training.md',
    'docs/flax.md',
    'docs/equinox.md',
    'docs/losses.md',
    'docs/reliability.md',
  }
  assert guides <= with_code, sorted(guides - with_code)


def documented_names() -> set[str]:
  """Full names documented by an autodoc directive of docs/api/."""
  names = set()
  for path in (doc_blocks.DOCS / 'api').glob('*.rst'):
    module = ''
    for line in path.read_text().splitlines():
      match = re.match(r'\.\. (currentmodule|auto\w+):: ([\w.]+)', line)
      if not match:
        continue
      directive, name = match.groups()
      if directive == 'currentmodule':
        module = name
      elif directive in ('autofunction', 'autoclass', 'autodata'):
        full = name if name.startswith('optax_tokacc') else f'{module}.{name}'
        names.add(full)
      elif directive == 'automodule':  # a public submodule, with its members
        names.add(name)
  return names


def public_names() -> set[str]:
  import optax_tokacc
  from optax_tokacc import testing

  names = {f'optax_tokacc.{name}' for name in optax_tokacc.__all__}
  names.update(f'optax_tokacc.testing.{name}' for name in testing.__all__)
  if importlib.util.find_spec('flax') is not None:
    from optax_tokacc import flax as tokacc_flax

    names.update(
      f'optax_tokacc.flax.{name}'
      for name in getattr(tokacc_flax, '__all__', ('TrainState', 'Optimizer'))
    )
  return names


@needs_docs
def test_api_reference_documents_every_public_name():
  missing = public_names() - documented_names()
  assert not missing, (
    f'add {sorted(missing)} to a page of docs/api/ (autofunction or autoclass)'
  )


@pytest.mark.parametrize(
  'text, expected, same',
  [
    ('loss 2.785\n', 'loss 2.785', True),
    ('loss 2.786\n', 'loss 2.785', True),  # the last digit's rounding
    ('loss 2.787\n', 'loss 2.785', False),
    ('loss 2.785 more\n', 'loss 2.785', False),
    ('0 False nan\n1 True 3.2105\n', '0 False nan\n1 True 3.2105', True),
    ('[ 0.1047 -0.6149]', '[ 0.1047 -0.6148]', True),
    ('1.29e-06', '1.30e-06', True),
    ('7', '8', False),
    ('6e-05', '7e-05', True),
    ('one\ntwo', 'one', False),
  ],
)
def test_same_output(text, expected, same):
  assert doc_blocks.same_output(text, expected) == same


def test_markers():
  page = '\n'.join([
    '# Title',
    '```python',
    "print('a')",
    '```',
    '<!-- docs-test: output -->',
    '```text',
    'a',
    '```',
    '## Torch',
    '<!-- docs-test: skip needs torch -->',
    '```python',
    'import torch',
    '```',
  ])  # fmt: skip
  first, second = doc_blocks.python_blocks(page)
  assert (first.id, first.output, first.skip) == ('page:0-title', 'a\n', None)
  assert (second.id, second.skip) == ('page:1-torch', 'needs torch')
  with pytest.raises(ValueError, match='right before a fence'):
    doc_blocks.python_blocks(
      '<!-- docs-test: output -->\ntext\n```text\na\n```'
    )


@pytest.mark.parametrize(
  'requires, reason',
  [
    ('pytest>=1', None),
    ('pytest>=1, not-a-distribution>=1', 'needs not-a-distribution>=1'),
    ('not-a-distribution>=1, pytest>=1', 'needs not-a-distribution>=1'),
    ('pytest>=1, pytest>=999', 'needs pytest>=999'),
  ],
)
def test_requires_every_distribution(requires, reason):
  """A block that requires several distributions (the accelerator compilers
  of docs/checking_steps.md) runs only where every one is installed."""
  (block,) = doc_blocks.python_blocks(
    f'<!-- docs-test: requires {requires} -->\n```python\nprint(1)\n```'
  )
  missing = doc_blocks.missing_requirement(block)
  if reason is None:
    assert missing is None, missing
  else:
    assert missing is not None and missing.startswith(reason), missing
