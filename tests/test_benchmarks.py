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
"""benchmarks/run.py runs end to end at tiny sizes (figures: its README)."""

import json
import os
import pathlib
import subprocess
import sys

import pytest

REPO = pathlib.Path(__file__).resolve().parents[1]
ALL_METHODS = (
  'plain',
  'ideal',
  'multisteps',
  'tokacc',
  'tokacc_chain',
  'tokacc_flax',
  'microbatched',
)
EXACT_METHODS = ('tokacc', 'tokacc_chain', 'tokacc_flax', 'microbatched')
MODELS = ('mlp', 'transformer', 'mlp_bf16')
PATTERNS = (
  'DDP',
  'FSDP (GSPMD)',
  'HSDP partial-manual',
  'HSDP fully manual',
  'pmean + MultiSteps',
  'sharded jit',
)

pytestmark = pytest.mark.slow  # starts a Python process


def run_benchmarks(*args):
  env = dict(os.environ, JAX_PLATFORMS='cpu')
  return subprocess.run(
    [sys.executable, str(REPO / 'benchmarks' / 'run.py'), *map(str, args)],
    capture_output=True,
    text=True,
    env=env,
    cwd=REPO,
    timeout=300,
  )


def test_tiny_run_writes_every_method_and_figure(tmp_path):
  out = tmp_path / 'results.json'
  result = run_benchmarks('--tiny', '--devices', 4, '--out', out)
  assert result.returncode == 0, result.stdout + result.stderr
  results = json.loads(out.read_text())
  rows = results['rows']
  assert {(row['model'], row['method']) for row in rows} == {
    (model, method) for model in MODELS for method in ALL_METHODS
  }
  for row in rows:
    assert row['median_window_s'] > 0
    for analysis in row['memory'].values():
      assert analysis['argument_size_in_bytes'] > 0
      assert analysis['temp_size_in_bytes'] >= 0
    if row['method'] in EXACT_METHODS:
      # Same parameters as the ideal reference after one window (in the
      # same dtypes: bf16 parameters, f32 accumulator, f32 first moment).
      assert row['max_abs_diff_to_ideal_after_one_window'] < 1e-5, row
    if row['model'] == 'mlp_bf16':
      assert row['param_dtype'] == 'bfloat16' and row['mu_dtype'] == 'float32'
  check_collectives(results['collectives'])


def window_by_axes(row):
  return {
    axes: entry['collectives']
    for axes, entry in row['summary']['window_by_axes'].items()
  }


def check_collectives(rows):
  """What the compiled steps on 4 devices (k = 2) must show."""
  rows = {row['pattern']: row for row in rows}
  assert set(rows) == set(PATTERNS)
  for name in PATTERNS:
    row = rows[name]
    assert row['summary']['other_branch'] == 0, row
    if row['exact']:
      assert row['max_abs_diff_to_full_batch'] < 1e-5, row
  # DDP: no collective on micro-steps, one all-reduce per window.
  ddp = rows['DDP']['summary']
  assert ddp['micro_step']['collectives'] == 0
  assert ddp['window']['collectives'] == 1
  # pmean + MultiSteps: one all-reduce per micro-step.
  assert rows['pmean + MultiSteps']['summary']['window']['collectives'] == 2
  # HSDP: the inter-replica gradient all-reduce once per window, on the
  # closing step, over the gradient shard (1/2 of the parameters here).
  for name in ('HSDP partial-manual', 'HSDP fully manual'):
    row = rows[name]
    replica = [r for r in row['collectives'] if 'replica' in r['axes']]
    assert all(r['where'] == 'closing step' for r in replica), row
    assert window_by_axes(row)['replica'] == 1
    assert row['accumulator_bytes_per_device'] == row['param_bytes'] // 2
  assert rows['FSDP (GSPMD)']['accumulator_bytes_per_device'] == (
    rows['FSDP (GSPMD)']['param_bytes'] // 4
  )


@pytest.mark.parametrize(
  'args, message',
  [
    (('--methods', 'ideal,adam'), "Unknown method 'adam'; valid methods: "),
    (('--models', 'resnet'), "Unknown model 'resnet'; valid models: "),
    (('--k', '0'), '--k must be integers >= 1'),
  ],
)
def test_bad_names_list_the_valid_ones(args, message):
  result = run_benchmarks('--tiny', *args)
  assert result.returncode == 2
  assert message in result.stderr
  if 'valid' in message:
    valid = ALL_METHODS if 'method' in message else ('mlp', 'transformer')
    assert ', '.join(valid) in result.stderr
