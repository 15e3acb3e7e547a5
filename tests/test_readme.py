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
"""Every ```python block of README.md runs as written.

Each block is a program of its own: it runs in a fresh Python process from
the repository root, with nothing defined beforehand. Blocks that use
several devices (``shard_map``, ``pmap``, ``axis_name``, a mesh) get fake CPU
devices, as the rest of the test suite does.
"""

import os
import pathlib
import re
import subprocess
import sys

import pytest

REPO = pathlib.Path(__file__).resolve().parents[1]
README = REPO / 'README.md'
NUM_DEVICES = 8
TIMEOUT_S = 180
_NEEDS_DEVICES = re.compile(r'shard_map|pmap|axis_name|make_mesh|devices\(')


def python_blocks(markdown: str) -> list[tuple[str, str]]:
  """``(id, code)`` of each ```python block; the id names the section.

  The id is the block's index among the Python blocks and the nearest
  heading above it, e.g. ``'0-quickstart'``.
  """
  blocks, heading, fence, code = [], 'top', None, []
  for line in markdown.splitlines():
    if fence is None:
      match = re.match(r'#{1,6} (.+)', line)
      if match:
        heading = re.sub(r'[^a-z0-9]+', '-', match.group(1).lower()).strip('-')
      if line.startswith('```'):
        fence, code = line[3:].strip(), []
    elif line.startswith('```'):
      if fence == 'python':
        blocks.append((f'{len(blocks)}-{heading}', '\n'.join(code) + '\n'))
      fence = None
    else:
      code.append(line)
  return blocks


BLOCKS = python_blocks(README.read_text())


def test_readme_has_a_quickstart_program():
  names = [name for name, _ in BLOCKS]
  assert any(name.endswith('-quickstart') for name in names), names


@pytest.mark.parametrize(
  'code', [code for _, code in BLOCKS], ids=[name for name, _ in BLOCKS]
)
def test_readme_block_runs(code, tmp_path):
  script = tmp_path / 'block.py'
  script.write_text(code)
  env = dict(os.environ, JAX_PLATFORMS='cpu')
  env['PYTHONPATH'] = os.pathsep.join(
    [str(REPO)] + ([env['PYTHONPATH']] if env.get('PYTHONPATH') else [])
  )
  if _NEEDS_DEVICES.search(code):
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
      f'this README block fails:\n{code}\n{result.stdout}'
      f'{result.stderr[-3000:]}',
      pytrace=False,
    )
