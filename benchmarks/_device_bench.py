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
"""The benchmark part of ``device_check.py``: ``run.py``'s methods on
GPT-2 small, windows fitted to a time budget, the dispatch check, and the
results as JSON and Markdown."""

import gc
import json
import os
import time

import jax
import optax

from benchmarks import _common
from benchmarks import _dispatch
from benchmarks import _methods
from benchmarks import _models
from benchmarks import _report
from benchmarks import _timing
from benchmarks import device_check
from benchmarks import run as run_py

DISPATCH_METHODS = ('ideal', 'tokacc_device', 'tokacc_host')


def header(args, device, argv):
  """The device, versions and command of the results."""
  stats = getattr(device, 'memory_stats', lambda: None)() or {}
  return {
    'command': _common.command('device_check', argv),
    'machine': _common.machine(),
    'device_count': jax.device_count(),
    'device_memory_bytes': stats.get('bytes_limit'),
    'xla_flags': os.environ.get('XLA_FLAGS', ''),
    'budget_s': args.budget_s,
    'setting': _setting(args),
    'rows': [],
    'errors': [],
  }


def _setting(args):
  """The sizes of ``_models.SIZES`` that the command line asks for."""
  return 'quick' if args.quick else 'short' if args.short else 'full'


def _setup(case, setup_s):
  """name -> trainer of every method, each one's set-up seconds (tracing
  and compiling its programs) in ``setup_s``."""
  trainers = {}
  for name in device_check.METHODS:
    start = time.perf_counter()
    built, _ = run_py._build_all(case, (name,), ())
    setup_s[name] = time.perf_counter() - start
    trainers.update(built)
  return trainers


def section(model_name, k, setting, deadline, windows):
  """Rows of one model and k, and its trainers (still holding their
  state, for the dispatch check)."""
  model = _models.build(model_name, setting, k)
  case = _methods.Case(model, k, optax.adamw(1e-4, mu_dtype=model.mu_dtype))
  setup_s, differences = {}, {}
  trainers = _setup(case, setup_s)

  def check():
    differences.update(run_py._differences(trainers))

  times = _timing.interleave(
    trainers, k, windows, device_check.WARMUP, check, deadline
  )
  rows = _report.rows(case, trainers, times, differences, {})
  for row in rows:
    row['setup_s'] = setup_s[row['method']]
    row['windows_timed'] = len(row['window_times_s'])
  return rows, trainers


def _dispatch_check(trainers, k, index):
  """The dispatch times of the ideal and of the device's and the host's
  programs, and a profile of the device-decided window."""
  out = {
    name: _dispatch.dispatch(trainers[name], k, 2, index)
    for name in DISPATCH_METHODS
    if name in trainers
  }
  out['profile_tokacc_device'] = _dispatch.profile(
    trainers['tokacc_device'], index + 2
  )
  return out


def run(args, results, deadline):
  """Every section, windows fitted to ``deadline``; results written after
  each section."""
  setting = _setting(args)
  windows = 2 if args.quick else device_check.MAX_WINDOWS
  sections = [(m, k) for m in args.models for k in args.ks]
  dispatch_at = (args.models[0], args.ks[-1])
  reserve = min(60.0, 0.1 * args.budget_s)  # the dispatch check
  longest_setup = 0.0  # a section not expected to fit is skipped
  for done, (model_name, k) in enumerate(sections):
    now = time.perf_counter()
    share = (deadline - reserve - now) / (len(sections) - done)
    if share < 1.5 * longest_setup and not args.quick:  # CI runs it all
      error = f'{model_name}, k={k}: skipped, {share:.0f} s left of --budget-s'
      results['errors'].append(error)
      print(f'device_check: {error}', flush=True)
      continue
    print(f'{model_name}, k={k}: {share:.0f} s', flush=True)
    try:
      rows, trainers = section(model_name, k, setting, now + share, windows)
      longest_setup = max(longest_setup, sum(r['setup_s'] for r in rows))
      results['rows'] += rows
      if (model_name, k) == dispatch_at:
        index = windows + device_check.WARMUP
        results['dispatch'] = _dispatch_check(trainers, k, index)
        reserve = 0.0
    except Exception as e:  # noqa: BLE001 - reported, the next section runs
      error = f'{model_name}, k={k}: {_common.describe_error(e)}'
      results['errors'].append(error)
      print(f'device_check: {error}', flush=True)
    trainers = None
    gc.collect()
    write(args.out, results)


def _ms(seconds):
  return '' if seconds is None else f'{1e3 * seconds:.1f}'


def _x(value):
  return '' if value is None else f'{value:.2f}x'


def _table(rows):
  """The per-window table in Markdown."""
  lines = [
    '| model | k | method | ms / micro-step | / ideal | ms / window | '
    '/ ideal | / MultiSteps | temp / param bytes | set-up s | compile s | '
    'windows | max\\|dp\\| |',
    '| --- | ---: | --- | ---: | ---: | ---: | ---: | ---: | --- | ---: | '
    '--- | ---: | ---: |',
  ]
  for row in rows:
    temps = ', '.join(
      f'{label} {m["temp_over_params"]:.3f}'
      for label, m in row['memory'].items()
    )
    compile_s = ', '.join(f'{a} {s:.1f}' for a, s in row['compile_s'].items())
    diff = row['max_abs_diff_to_ideal_after_one_window']
    lines.append(
      f'| {row["model"]} | {row["k"]} | {row["method"]} | '
      f'{_ms(row["median_micro_step_s"])} | '
      f'{_x(row["micro_step_ratio_to_ideal"])} | '
      f'{_ms(row["median_window_s"])} | {_x(row["ratio_to_ideal"])} | '
      f'{_x(row["ratio_to_multisteps"])} | {temps} | '
      f'{row["setup_s"]:.1f} | {compile_s} | {row["windows_timed"]} | '
      f'{"" if diff is None else f"{diff:.1e}"} |'
    )
  return lines


def _dispatch_lines(dispatch):
  lines = [
    '| method | ms to queue a micro-batch | ms to run it | queue / run |',
    '| --- | ---: | ---: | ---: |',
  ]
  for name in DISPATCH_METHODS:
    if name in dispatch:
      d = dispatch[name]
      lines.append(
        f'| {name} | {_ms(d["dispatch_s_per_micro_batch"])} | '
        f'{_ms(d["device_s_per_micro_batch"])} | '
        f'{d["dispatch_over_device"]:.2f} |'
      )
  profile = dispatch.get('profile_tokacc_device', {})
  if 'error' in profile:
    lines.append(f'\nProfile: not read ({profile["error"]}).')
  for plane in profile.get('planes', []):
    longest = '; '.join(
      f'{e["name"][:60]} x{e["count"]} {e["ms"]:.1f} ms'
      for e in plane['longest'][:4]
    )
    lines.append(
      f'\n- `{plane["plane"]}`: {plane["events"]} events, '
      f'{plane["device_to_host_copies"]} device-to-host copies; {longest}'
    )
  return lines


def markdown(results):
  machine = results['machine']
  tests = results.get('tests', {})
  lines = [
    f'# device_check: {machine["device"]}',
    '',
    f'`{results["command"]}`, JAX {machine["jax"]}, optax '
    f'{machine["optax"]}, Python {machine["python"]}, commit '
    f'{machine["commit"][:7]}, {machine["date"]}, budget '
    f'{results["budget_s"]:.0f} s, wall {results.get("wall_s", 0):.0f} s.',
    '',
    f'Tests: {tests.get("skipped") or tests.get("summary", "not run")}',
    *[f'- {line}' for line in tests.get('failed', [])],
    '',
    *_table(results['rows']),
  ]
  if 'dispatch' in results:
    lines += ['', '## Dispatch (device-decided step)', '']
    lines += _dispatch_lines(results['dispatch'])
  lines += [f'\nError: {error}' for error in results['errors']]
  return '\n'.join(lines) + '\n'


def write(folder, results):
  """``results.json`` and ``results.md`` in ``folder``."""
  with open(os.path.join(folder, 'results.json'), 'w') as f:
    json.dump(results, f, indent=1)
  with open(os.path.join(folder, 'results.md'), 'w') as f:
    f.write(markdown(results))
