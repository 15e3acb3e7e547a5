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
"""The examples run as scripts with tiny settings, so they cannot rot."""

import json
import os
import pathlib
import re
import subprocess
import sys

import chex
import numpy as np
import pytest

REPO = pathlib.Path(__file__).resolve().parents[1]
EXAMPLES = REPO / 'examples'
EXAMPLE_SCRIPTS = sorted(
  path.name for path in EXAMPLES.glob('*.py') if not path.name.startswith('_')
)
# Tiny model and data: a few seconds per run, most of it compilation.
TINY = ('--seq-len', '32', '--d-model', '16', '--layers', '1')

pytestmark = pytest.mark.slow  # each test starts Python processes


def run_example(script: str, *args: str, timeout: float = 120, env=None):
  env = dict(os.environ, **(env or {}))
  env['PYTHONPATH'] = os.pathsep.join(
    [str(REPO)] + ([env['PYTHONPATH']] if env.get('PYTHONPATH') else [])
  )
  env['JAX_PLATFORMS'] = 'cpu'
  return subprocess.run(
    [sys.executable, str(EXAMPLES / script), *map(str, args)],
    capture_output=True,
    text=True,
    env=env,
    cwd=REPO,
    timeout=timeout,
  )


def assert_ok(result) -> None:
  assert result.returncode == 0, result.stdout + result.stderr


def without_escapes(text: str) -> str:
  """Terminal output without ANSI escape sequences."""
  return re.sub(r'\x1b\[[0-9;?]*[A-Za-z]', '', text)


def restore(checkpoint: pathlib.Path):
  import orbax.checkpoint as ocp

  with ocp.StandardCheckpointer() as checkpointer:
    return checkpointer.restore(checkpoint)


# rich draws its live progress bar only on a terminal.
TERMINAL = {'FORCE_COLOR': '1', 'TERM': 'xterm', 'COLUMNS': '160'}


@pytest.fixture(scope='module')
def train_lm_runs(tmp_path_factory):
  """The same global batches on 2 devices and on 1 device."""
  runs = {}
  for devices, micro_batch_size in ((2, 2), (1, 4)):
    out = tmp_path_factory.mktemp(f'train_lm_{devices}')
    result = run_example(
      'train_lm.py',
      *TINY,
      '--steps', 3, '--k', 2,
      '--devices', devices, '--micro-batch-size', micro_batch_size,
      '--out', out,
      env=TERMINAL if devices == 2 else None,
    )  # fmt: skip
    runs[devices] = (result, out)
  return runs


def test_train_lm_writes_checkpoint_plot_and_summary(train_lm_runs):
  result, out = train_lm_runs[2]
  assert_ok(result)
  stdout = without_escapes(result.stdout)
  assert '2 cpu devices' in stdout
  assert re.search(
    r'^Summary: 3 updates on [\d,]+ counted tokens', stdout, re.M
  )
  assert f'Summary JSON: {out.resolve() / "summary.json"}' in stdout
  assert sorted(path.name for path in out.iterdir()) == [
    'checkpoint',
    'loss.png',
    'summary.json',
  ]
  assert (out / 'loss.png').stat().st_size > 0
  summary = json.loads((out / 'summary.json').read_text())
  assert summary['updates'] == 3
  assert np.isfinite(summary['last_window_loss'])
  restored = restore(out / 'checkpoint')
  assert int(restored['step']) == 3
  assert set(restored) == {'step', 'params', 'opt_state'}


def test_train_lm_progress_bar_says_compiling_before_the_first_window(
  train_lm_runs,
):
  result, _ = train_lm_runs[2]
  assert_ok(result)
  frames = without_escapes(result.stdout).replace('\r', '\n')
  first_frame = re.search(r'^training .*$', frames, re.M)
  assert first_frame and 'compiling…' in first_frame.group(), frames
  assert 'loss nan' not in frames, frames
  assert not re.search(r'\s0 tok/s', frames), frames
  assert re.search(r'3/3 loss \d+\.\d{3}  [\d,]+ tok/s', frames), frames


def test_train_lm_data_parallel_matches_one_device(train_lm_runs):
  """2 devices x 2 sequences == 1 device x 4 sequences, per micro-step.

  Each device holds different numbers of tokens; only a token-weighted sum
  over the devices gives the one-device gradient.
  """
  for result, _ in train_lm_runs.values():
    assert_ok(result)
  two = restore(train_lm_runs[2][1] / 'checkpoint')['params']
  one = restore(train_lm_runs[1][1] / 'checkpoint')['params']
  chex.assert_trees_all_close(two, one, rtol=1e-5, atol=1e-6)


def test_accumulation_bug_table(tmp_path):
  result = run_example(
    'accumulation_bug.py',
    *TINY,
    '--updates', 4, '--k', 4, '--micro-batch-size', 2, '--lr', 1e-2,
    '--eval-every', 2, '--table-every', 2, '--out', tmp_path,
  )  # fmt: skip
  assert_ok(result)
  assert (tmp_path / 'accumulation_bug.png').stat().st_size > 0
  table = (tmp_path / 'accumulation_bug.md').read_text()
  rows = [
    line.split('|')[1:-1]
    for line in table.splitlines()
    if re.match(r'\| \d+ \|', line)
  ]
  assert [int(row[0]) for row in rows] == [2, 4]
  # columns: update, reference loss, MultiSteps param/loss, ours param/loss
  multisteps_diff, ours_diff = float(rows[-1][2]), float(rows[-1][4])
  assert ours_diff < 1e-5, table
  assert multisteps_diff > 100 * ours_diff, table
  assert 'Summary: after 4 updates' in result.stdout


def test_nnx_quickstart():
  result = run_example('nnx_quickstart.py', '--k', 2, '--windows', 2)
  assert_ok(result)
  assert re.search(r'^\s+2\s+\d+\s+\d', result.stdout, re.M), result.stdout


def help_entries(text: str) -> dict[str, str]:
  """``{'--flag': 'its help, on one line'}`` from an argparse ``--help``."""
  entries, flag = {}, None
  for line in text.splitlines():
    match = re.match(r'  (-[-\w]+)', line)
    if match:
      flag = match.group(1)
      entries[flag] = line
    elif flag and line.startswith('   '):
      entries[flag] += line
    else:
      flag = None
  return {flag: ' '.join(entry.split()) for flag, entry in entries.items()}


@pytest.mark.parametrize('script', EXAMPLE_SCRIPTS)
def test_help_shows_every_default(script):
  result = run_example(script, '--help')
  assert_ok(result)
  entries = help_entries(result.stdout)
  assert '--k' in entries, result.stdout
  entries.pop('-h')
  for flag, entry in entries.items():
    assert re.search(r'\(default: [^)]+\)', entry), (flag, result.stdout)


@pytest.mark.parametrize('script', ['train_lm.py', 'accumulation_bug.py'])
def test_help(script):
  result = run_example(script, '--help')
  assert_ok(result)
  for flag in ('--k', '--micro-batch-size', '--out', '--corpus'):
    assert flag in result.stdout


@pytest.mark.parametrize('script', ['train_lm.py', 'accumulation_bug.py'])
@pytest.mark.parametrize(
  'args, message',
  [
    (('--corpus', 'no/such/corpus.txt'), '--corpus no/such/corpus.txt: no such file'),
    (('--corpus', 'examples'), '--corpus examples: not a regular file'),
    (('--k', '0'), '--k must be >= 1; got 0'),
    (('--micro-batch-size', '100000'), 'lower --micro-batch-size'),
  ],
)  # fmt: skip
def test_bad_input_is_one_line_error(script, args, message):
  result = run_example(script, *TINY, *args)
  assert result.returncode != 0
  lines = result.stderr.strip().splitlines()
  assert len(lines) == 1, result.stderr
  assert lines[0].startswith(f'{script}: error: ')
  assert message in lines[0]


def test_empty_corpus_is_one_line_error(tmp_path):
  corpus = tmp_path / 'empty.txt'
  corpus.write_text('\n\n')
  result = run_example('train_lm.py', '--corpus', corpus)
  assert result.returncode != 0
  assert result.stderr.strip().splitlines() == [
    f'train_lm.py: error: --corpus {corpus}: the file is empty.'
  ]
