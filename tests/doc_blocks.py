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
"""The ```python blocks of the repository's Markdown pages (docs/ and the
README), and how a test runs one (``tests/test_docs.py``,
``tests/test_readme.py``).

Each block is a complete program: it runs in a fresh Python process from the
repository root, with nothing defined beforehand. Blocks that use several
devices (``shard_map``, ``pmap``, ``axis_name``, a mesh) get fake CPU
devices, as the rest of the test suite does.

An HTML comment on the line before a fence tells the test more (MyST does
not render it):

- ``<!-- docs-test: output -->`` before a ```text block: the block is what
  the previous ```python block prints, line by line. Numbers may differ by
  one unit of their last printed digit (rounding across JAX versions).
- ``<!-- docs-test: skip REASON -->`` before a ```python block: a deliberate
  fragment (PyTorch code, say); it is reported as skipped with REASON. Keep
  these few (``MAX_FRAGMENTS``).
- ``<!-- docs-test: requires NAME>=VERSION -->``: the block runs only with
  that version of the distribution NAME (e.g. ``jax>=0.9``) installed;
  several, separated by commas, must all be (the compilers of the
  ``accelerators`` extra: ``jax-cuda12-plugin>=0.12.0.1, libtpu>=0.0.51``).

A block that imports a module that is not installed (``equinox``, which only
the ``docs`` extra installs) is skipped, naming it.
"""

import dataclasses
import importlib.metadata
import importlib.util
import pathlib
import re
import subprocess
import sys
from typing import Optional

import helpers
import pytest

REPO = helpers.REPO
DOCS = REPO / 'docs'
NUM_DEVICES = 8
TIMEOUT_S = 900  # per block; 5x a loaded 2-core run (issue 33)
_NEEDS_DEVICES = re.compile(r'shard_map|pmap|axis_name|make_mesh|devices\(')
_MARKER = re.compile(r'<!--\s*docs-test:\s*([\w-]+)\s*(.*?)\s*-->\s*$')
_PYTHON_FENCES = ('python', '{code-block} python', '{code} python')


@dataclasses.dataclass
class Block:
  """A ```python block of a Markdown page."""

  page: str  # relative to the repository root
  index: int  # among the page's Python blocks
  heading: str  # slug of the nearest heading above it
  code: str
  skip: Optional[str] = None  # why it does not run (a fragment)
  requires: Optional[str] = None  # 'name>=version'
  output: Optional[str] = None  # what it prints, from a marked ```text block

  @property
  def id(self) -> str:
    return f'{self.page}:{self.index}-{self.heading}'


def _slug(heading: str) -> str:
  return re.sub(r'[^a-z0-9]+', '-', heading.lower()).strip('-')


def python_blocks(markdown: str, page: str = 'page') -> list[Block]:
  """The ```python blocks of a page, with what their markers say."""
  blocks, heading, fence, code, marker = [], 'top', None, [], None
  for number, line in enumerate(markdown.splitlines(), 1):
    if fence is not None:
      if line.startswith('```'):
        _close(blocks, fence, marker, '\n'.join(code) + '\n', page, heading)
        fence, marker = None, None
      else:
        code.append(line)
      continue
    match = re.match(r'#{1,6} (.+)', line)
    if match:
      heading = _slug(match.group(1))
    if _MARKER.match(line):
      marker = _MARKER.match(line).groups() + (number,)
    elif line.startswith('```'):
      fence, code = line[3:].strip(), []
    elif line.strip() and marker is not None:
      raise ValueError(
        f'{page}:{marker[2]}: a docs-test marker must stand '
        'right before a fence'
      )
  return blocks


def _close(blocks, fence, marker, code, page, heading):
  """Records a finished fence: a Python block, or the output of the last."""
  kind, argument, number = marker or (None, None, None)
  where = f'{page}:{number}'
  if kind == 'output':
    if fence != 'text' or not blocks:
      raise ValueError(
        f'{where}: "output" marks a ```text block that '
        'follows a ```python block'
      )
    blocks[-1].output = code
    return
  if fence not in _PYTHON_FENCES:
    if kind is not None:
      raise ValueError(f'{where}: "{kind}" marks a ```python block')
    return
  block = Block(page, len(blocks), heading, code)
  if kind == 'skip':
    if not argument:
      raise ValueError(f'{where}: say why the block is skipped')
    block.skip = argument
  elif kind == 'requires':
    block.requires = argument
  elif kind is not None:
    raise ValueError(f'{where}: unknown docs-test marker {kind!r}')
  blocks.append(block)


def pages() -> list[pathlib.Path]:
  """The Markdown pages of the site (not its build output)."""
  return sorted(
    path for path in DOCS.rglob('*.md') if '_build' not in path.parts
  )


def _version(text: str) -> tuple[int, ...]:
  return tuple(int(part) for part in re.findall(r'\d+', text)[:3])


def missing_requirement(block: Block) -> Optional[str]:
  """Why ``block`` cannot run here (a module or version missing), or None."""
  imported = re.findall(r'^(?:from|import) (\w+)', block.code, re.M)
  for module in dict.fromkeys(imported):
    if importlib.util.find_spec(module) is None:
      return f"needs {module}: pip install -e '.[docs]'"
  for requirement in (block.requires or '').split(','):
    if requirement.strip():
      reason = _missing_distribution(requirement.strip())
      if reason:
        return reason
  return None


def _missing_distribution(requirement: str) -> Optional[str]:
  """Why ``requirement`` (``name>=version``) is not met here, or None."""
  name, floor = re.fullmatch(r'([\w.-]+)\s*>=\s*(\S+)', requirement).groups()
  try:
    installed = importlib.metadata.version(name)
  except importlib.metadata.PackageNotFoundError:
    return f'needs {name}>={floor}: not installed'
  if _version(installed) < _version(floor):
    return f'needs {name}>={floor}: {installed} is installed'
  return None


def _unit(number: str) -> float:
  """One unit of the last printed digit of ``number``; 0 for an integer
  (counts and steps are exact)."""
  mantissa, _, exponent = number.lower().partition('e')
  if '.' not in mantissa and not exponent:
    return 0.0
  decimals = len(mantissa.partition('.')[2])
  return 10.0 ** (int(exponent or 0) - decimals)


_NUMBER = re.compile(r'[-+]?(?:\d+\.\d*|\.\d+|\d+)(?:[eE][-+]?\d+)?')


def same_output(printed: str, expected: str) -> bool:
  """Whether ``printed`` is ``expected``, up to a unit of each number's last
  printed digit and trailing whitespace."""
  printed_lines = [line.rstrip() for line in printed.rstrip().splitlines()]
  expected_lines = [line.rstrip() for line in expected.rstrip().splitlines()]
  if len(printed_lines) != len(expected_lines):
    return False
  for got, want in zip(printed_lines, expected_lines):
    if _NUMBER.split(got) != _NUMBER.split(want):
      return False
    for a, b in zip(_NUMBER.findall(got), _NUMBER.findall(want)):
      if abs(float(a) - float(b)) > 1.01 * _unit(b):
        return False
  return True


def run_block(block: Block, tmp_path: pathlib.Path) -> None:
  """Runs ``block`` as a program; fails the test if it fails or prints
  something else than its marked output."""
  if block.skip:
    pytest.skip(f'a fragment: {block.skip}')
  reason = missing_requirement(block)
  if reason:
    pytest.skip(reason)
  script = tmp_path / 'block.py'
  script.write_text(block.code)
  env = helpers.subprocess_env(JAX_PLATFORMS='cpu')
  if _NEEDS_DEVICES.search(block.code):
    env['JAX_NUM_CPU_DEVICES'] = str(NUM_DEVICES)
  result = subprocess.run(
    [sys.executable, str(script)],
    capture_output=True,
    text=True,
    env=env,
    cwd=REPO,
    timeout=TIMEOUT_S,
  )
  if result.returncode != 0:
    pytest.fail(
      f'this block of {block.page} fails:\n{block.code}\n{result.stdout}'
      f'{result.stderr[-3000:]}',
      pytrace=False,
    )
  if block.output is not None and not same_output(result.stdout, block.output):
    pytest.fail(
      f'this block of {block.page} prints\n{result.stdout}\nwhile the page '
      f'shows\n{block.output}',
      pytrace=False,
    )
