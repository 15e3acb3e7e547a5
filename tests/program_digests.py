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
"""Digests of the compiled programs the tests read: the proof that a change
of the code's form leaves every program as it was.

Recording: ``python -m pytest ... --program-digests=DIR`` (the option is
``tests/conftest.py``'s) keeps, for every program a test reads through
``optax_tokacc.testing.hlo.parse_hlo`` (the one reader of compiled text:
``testing.check``, ``testing.collectives`` and the tests' own), a digest of
its text under the test's node id, in the order read. Each pytest process
writes ``DIR/<worker>.json``. The text is read without what moves with
the code but is not the program: the source locations (``metadata``, the
stack-frame tables) and the names of instructions and computations
(numbered in the order they appear, the module's unnamed).

Comparing: ``python tests/program_digests.py BEFORE AFTER`` prints every
node id whose programs differ or that one side lacks, and exits 1 when a
program differs. Record both sides with the same JAX and the same test
selection, e.g. the tests that read programs on the CPU and the accelerator
tier (``CONTRIBUTING.md``)::

  python -m pytest tests -m 'not slow' --program-digests=/tmp/before
  OPTAX_TOKACC_ACCELERATORS=1 JAX_PLATFORMS=cpu python -m pytest \\
    tests/accelerators --program-digests=/tmp/before
"""

import collections
import hashlib
import json
import os
import pathlib
import re
import sys

import pytest

from optax_tokacc.testing import hlo

# The sections of compiled text that map stack frames to source lines.
_FRAME_SECTIONS = ('FileNames', 'FunctionNames', 'FileLocations', 'StackFrames')
# ``, metadata={...}``, whose quoted strings may hold braces.
_METADATA = re.compile(r',? metadata=\{(?:[^{}"]|"(?:[^"\\]|\\.)*")*\}')
_NAME = re.compile(r'%[\w.\-]+')
_MODULE = re.compile(r'^HloModule [^,\s]+')  # the jitted function's name
_HEADER = re.compile(r'^(?:ENTRY )?%\S+ \(')  # a computation's, with its
_PARAMETER = re.compile(r'([(,] ?)([\w.\-]+):')  # parameters' bare names


def canonical(text: str) -> str:
  """``text`` (compiled HLO) without source locations, its names numbered
  in the order they first appear."""
  lines, in_frames = [], False
  for line in text.splitlines():
    if line in _FRAME_SECTIONS:
      in_frames = True
    elif not line.strip():
      in_frames = False
    elif not in_frames:
      if _HEADER.match(line):
        line = _PARAMETER.sub(r'\1%\2:', line)
      lines.append(_METADATA.sub('', _MODULE.sub('HloModule', line)))
  names = {}
  return _NAME.sub(
    lambda m: names.setdefault(m.group(0), f'%n{len(names)}'), '\n'.join(lines)
  )


def digest(text: str) -> str:
  return hashlib.sha256(canonical(text).encode()).hexdigest()[:16]


class Recorder:
  """A pytest plugin: the digest of every text ``hlo.parse_hlo`` reads,
  under the running test's node id."""

  def __init__(self, directory: pathlib.Path):
    self.directory = directory
    self.found = collections.defaultdict(list)
    self.node = None
    self._parse = hlo.parse_hlo

  def _recording_parse(self, text: str) -> hlo.HloModule:
    self.found[self.node or '<collection>'].append(digest(text))
    return self._parse(text)

  def pytest_configure(self, config):
    hlo.parse_hlo = self._recording_parse

  def pytest_unconfigure(self, config):
    hlo.parse_hlo = self._parse
    if not self.found:  # xdist's controller, which runs no test
      return
    self.directory.mkdir(parents=True, exist_ok=True)
    worker = os.environ.get('PYTEST_XDIST_WORKER', 'main')
    path = self.directory / f'{worker}.json'
    path.write_text(json.dumps(self.found, indent=0, sort_keys=True))

  @pytest.hookimpl(tryfirst=True)
  def pytest_runtest_setup(self, item):
    self.node = item.nodeid  # before the fixtures, which may compile

  @pytest.hookimpl(trylast=True)
  def pytest_runtest_teardown(self, item):
    self.node = None


def load(directory: str) -> dict[str, list[str]]:
  """Node id -> digests, from every worker's file in ``directory``."""
  found = {}
  for path in sorted(pathlib.Path(directory).glob('*.json')):
    found.update(json.loads(path.read_text()))
  if not found:
    raise SystemExit(f'{directory}: no recorded programs (*.json).')
  return found


def compare(before: dict, after: dict) -> list[str]:
  """One line per node id whose programs differ; the node ids one side
  lacks are counted, not judged (a renamed or new test)."""
  lines = []
  for node in sorted(before.keys() & after.keys()):
    if before[node] != after[node]:
      changed = sum(a != b for a, b in zip(before[node], after[node]))
      counts = f'{len(before[node])} -> {len(after[node])} programs'
      lines.append(f'DIFFERENT {node}: {changed} differ, {counts}')
  for side, nodes in (('before', before.keys() - after.keys()),
                      ('after', after.keys() - before.keys())):  # fmt: skip
    if nodes:
      print(f'only {side}: {len(nodes)} node ids, e.g. {sorted(nodes)[:3]}')
  return lines


def unmatched(before: dict, after: dict) -> tuple[int, int]:
  """How many distinct programs of each side the other side compiled
  nowhere: a module's fixture compiles under the first of its tests to run
  in each process, which xdist may change, so a program is looked for
  under every node id, and counted once."""
  found = [{d for v in side.values() for d in v} for side in (before, after)]
  return len(found[0] - found[1]), len(found[1] - found[0])


def main(argv: list[str]) -> int:
  if len(argv) != 2:
    raise SystemExit(__doc__)
  before, after = (load(directory) for directory in argv)
  different = compare(before, after)
  print('\n'.join(different))
  programs = sum(len(v) for k, v in after.items() if k in before)
  print(
    f'{len(before.keys() & after.keys())} node ids, {programs} programs '
    f'on both sides: {len(different)} node ids with a different program'
  )
  gone, new = unmatched(before, after)
  print(
    f'programs compiled nowhere on the other side: {gone} before, {new} '
    'after (a changed program, or a test only one side has)'
  )
  return 1 if different else 0


if __name__ == '__main__':
  sys.exit(main(sys.argv[1:]))
