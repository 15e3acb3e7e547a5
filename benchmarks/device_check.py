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
"""All the work a lent accelerator does, in one call of one command
(``benchmarks/README.md`` has the device call, what it measures and where
its files go)::

  python3 -m benchmarks.device_check --out $OUT  # from the repository root
  python -m benchmarks.device_check --cpu --quick --out /tmp/check  # CI

Within ``--budget-s`` seconds (windows are cut to fit, never the model):
the single-device exactness tests on the accelerator (:func:`run_tests`),
then the table of ``METHODS`` on the memory-bound MLP and GPT-2 small,
float32 and mixed, with each program's compiled conditionals, one open
micro-step of each method profiled, and the dispatch check
(:func:`run_benchmarks`); issue 46's targets judged on an accelerator
(:func:`targets`), printed first (after the tests' verdict where they
failed); last, the figures compiled here for the device's kind
(``compiled.py``, not timed: an H100's, an H200's, a TPU v5e's or v6e's)
or a line that says why there are none. ``results.json``, ``results.md`` and ``tests.log`` are written
to ``--out`` after each part, so a run cut short keeps what it measured.
A missing package or no accelerator: one line on stderr and exit status
2. ``--cpu`` runs on the CPU (no tests: CI runs them there); ``--quick``
at smoke-test sizes, 2 windows, k = 2 and one test (``QUICK_TESTS``);
``--short`` with GPT-2's micro-batches of 2 x 64 tokens.

Tests that do not all pass are loud (:func:`tests_verdict`): the first
line of stdout and of ``results.md`` says so (``FAILED: 60 of 237
exactness tests failed (tests.log)``), the targets and the failed tests
follow it, the benchmarks still run, the line is printed again last, and
the exit status is 1 (the targets do not change it). ``--tests`` runs
other tests (a rerun of the failed ones) and ``--skip-benchmarks`` only
the tests.
"""

import argparse
import gc
import importlib
import json
import os
import signal
import subprocess
import sys
import time

from benchmarks import common
from benchmarks import targets as gpu_targets

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)

METHODS = (
  'ideal',
  'tokacc_device',
  'tokacc_host',
  'multisteps',
  'tokacc_chain',
  'tokacc_flax',
)
# The memory-bound MLP (33.6M parameters, a micro-batch of MLP_BATCH rows
# but at --quick) and GPT-2 small, each in float32 and mixed precision.
MODELS = ('mlp', 'mlp_bf16', 'gpt2', 'gpt2_bf16')
MLP_BATCH = 64
# k of each model (--k: the same k for all). GPT-2 small at k = 8 does not
# fit in the budget beside the rest: a second call (README).
KS = {'mlp': (4, 8), 'mlp_bf16': (4, 8), 'gpt2': (4,), 'gpt2_bf16': (4,)}
# Windows timed at most (after WARMUP), per family (--quick: 2); a window
# of the MLP takes ~2 ms on an H200, GPT-2 small's ~250 ms.
WINDOWS = {'mlp': 40, 'gpt2': 10}
WARMUP = 1
# Seconds a section takes on an H200 (set-up, most of it compiling), until
# one of its family is measured: how the budget is shared out.
EXPECTED_S = {'mlp': 20.0, 'gpt2': 110.0}
DISPATCH_METHODS = ('ideal', 'tokacc_device', 'tokacc_host')
# Exactness on one device: the tests that need no mesh of several devices
# and read no CPU-specific compiled program (a test on several devices names
# its placement or "devices"; checked on a CPU of one device: 255 tests).
TEST_FILES = (
  'tests/test_multistep.py',
  'tests/test_dtypes.py',
  'tests/test_compensated.py',
  'tests/test_microbatch.py',
  'tests/test_losses.py',
  'tests/test_composition.py',
  'tests/test_boundaries.py',
  'tests/test_reduction_modes.py',
  'tests/test_long_run.py',
  'tests/test_host_close.py',
  'tests/test_precision.py',  # at the platform's default matmul precision
)
TEST_SELECT = (
  'not devices and not axis_name and not shard_map and not pmap and not '
  'explicit and not zero1 and not programs and not untouched'
)
QUICK_TESTS = (
  'tests/test_multistep.py::'
  'test_mean_reduction_equals_full_batch_with_unequal_tokens',
)
PACKAGES = ('numpy', 'jax', 'optax', 'flax', 'optax_tokacc')
# Seconds kept, of the budget, for the figures compiled here for the
# device's kind (benchmarks.compiled, in a process of its own on the CPU).
COMPILED_S = 90.0


def fail(message):
  """One line on stderr, exit status 2: never a traceback."""
  print(f'device_check: {message}', file=sys.stderr)
  sys.exit(2)


def parse_args(argv=None):
  parser = argparse.ArgumentParser(
    description=__doc__.splitlines()[0],
    formatter_class=argparse.RawDescriptionHelpFormatter,
  )
  parser.add_argument('--out', required=True, help='folder for the results')
  parser.add_argument(
    '--budget-s',
    type=float,
    default=420.0,
    help='wall-clock seconds for all of it (default 420); windows are '
    'cut to fit, the models never',
  )
  parser.add_argument('--cpu', action='store_true', help='run on the CPU')
  parser.add_argument(
    '--quick', action='store_true', help='smoke-test sizes (CI)'
  )
  parser.add_argument(
    '--short',
    action='store_true',
    help="GPT-2 small's parameters, micro-batches of 2 x 64 tokens (a CPU)",
  )
  parser.add_argument(
    '--models', default=','.join(MODELS), help='a rerun of some: gpt2_bf16'
  )
  parser.add_argument(
    '--k',
    default=None,
    help='for every model (default: the MLP 4,8, GPT-2 small 4; --quick: 2)',
  )
  parser.add_argument('--skip-tests', action='store_true')
  parser.add_argument(
    '--tests',
    nargs='+',
    metavar='TEST',
    help='pytest node ids or files to run instead of the exactness tests '
    '(a rerun of failed ones), relative to the repository root',
  )
  parser.add_argument(
    '--skip-benchmarks', action='store_true', help='run only the tests'
  )
  parser.add_argument(
    '--test-workers', type=int, default=4, help='pytest-xdist workers'
  )
  args = parser.parse_args(argv)
  if args.budget_s <= 0 or args.test_workers < 0:
    parser.error('--budget-s must be > 0 and --test-workers >= 0.')
  args.setting = 'quick' if args.quick else 'short' if args.short else 'full'
  try:
    args.models = common.parse_names(args.models, MODELS, 'model')
    ks = common.parse_ks(args.k) if args.k else (2,) * args.quick
  except ValueError as e:
    parser.error(str(e))
  args.sections = sections(args.models, ks)
  return args


def sections(model_names, ks=()):
  """``(model, k)`` in the order they run: every model's first k before
  any model's second (the budget cuts the last), each k in ``MODELS``'
  order; ``ks``, else each model's ``KS``."""
  chosen = [(m, k) for m in model_names for k in ks or KS[m]]
  return sorted(chosen, key=lambda pair: pair[1])


def _first_line(error):
  text = str(error).strip()
  return text.splitlines()[0] if text else type(error).__name__


def preflight(args):
  """The packages and the device, else a one-line error."""
  if args.cpu:
    os.environ['JAX_PLATFORMS'] = 'cpu'
  # Tests and benchmark share the GPU: each allocates what it uses.
  os.environ.setdefault('XLA_PYTHON_CLIENT_PREALLOCATE', 'false')
  for name in PACKAGES:
    try:
      importlib.import_module(name)
    except ImportError as e:
      hint = ' (run python -m benchmarks.device_check from the repository root)'
      fail(f'missing package {name}: {_first_line(e)}{hint * (name[0] == "o")}')
  import jax  # noqa: PLC0415

  try:
    device = jax.devices()[0]
  except Exception as e:  # noqa: BLE001 - RuntimeError, or an assertion
    platforms = os.environ.get('JAX_PLATFORMS', '(unset)')
    fail(f'no JAX device (JAX_PLATFORMS={platforms}): {_first_line(e)}')
  if not args.cpu and device.platform == 'cpu':
    fail(
      'no accelerator found: jax.devices() lists only CPUs (JAX '
      f'{jax.__version__}); pass --cpu to check on the CPU.'
    )
  return device


def _test_platform(device):
  """What ``JAX_PLATFORMS`` names the device's platform."""
  if device.platform != 'gpu':
    return device.platform
  version = getattr(device.client, 'platform_version', '').lower()
  return 'rocm' if 'rocm' in version else 'cuda'


def _kill_group(process):
  try:
    os.killpg(process.pid, signal.SIGKILL)
  except OSError:
    pass


def _test_summary(output):
  """The counts of pytest's last line (``3 failed, 10 passed in 4.2s``),
  and its lines that name a failed test (pytest's ``-r fE``, its default)."""
  counts = {}
  lines = [line for line in output.splitlines() if line.strip()]
  last = lines[-1] if lines else ''
  for part in last.strip('= ').split(','):
    words = part.split()
    if len(words) >= 2 and words[0].isdigit():
      counts[words[1]] = int(words[0])
  failed = [line for line in lines if line.startswith(('FAILED', 'ERROR'))]
  return {'summary': last, 'counts': counts, 'failed': failed[:50]}


def run_tests(args, device, seconds):
  """The exactness tests in a pytest subprocess on the device's platform,
  stopped (with its workers) after ``seconds``."""
  platform = _test_platform(device)
  if args.tests:
    tests = args.tests
  elif args.quick:
    tests = list(QUICK_TESTS)
  else:
    tests = [*TEST_FILES, '-k', TEST_SELECT]
  workers = 0 if args.quick else args.test_workers
  command = [
    sys.executable,
    '-m',
    'pytest',
    '-q',
    '-p',
    'no:cacheprovider',
    '-n',
    str(workers),
    *tests,  # each with the tests' own limit (tests/conftest.py)
  ]
  env = dict(
    os.environ,
    JAX_PLATFORMS=platform,
    OPTAX_TOKACC_TEST_PLATFORM=platform,
    PYTHONPATH=os.pathsep.join(
      filter(None, [REPO, os.environ.get('PYTHONPATH')])
    ),
  )
  start = time.perf_counter()
  process = subprocess.Popen(
    command,
    cwd=REPO,
    env=env,
    stdout=subprocess.PIPE,
    stderr=subprocess.STDOUT,
    text=True,
    start_new_session=True,  # its xdist workers are stopped with it
  )
  try:
    output, _ = process.communicate(timeout=seconds)
    timed_out = False
  except subprocess.TimeoutExpired:
    _kill_group(process)
    output, _ = process.communicate()
    timed_out = True
  with open(os.path.join(args.out, 'tests.log'), 'w') as f:
    f.write(output)
  return {
    'platform': platform,
    'command': ' '.join(command[1:]),
    'returncode': process.returncode,
    'timed_out': timed_out,
    'seconds': time.perf_counter() - start,
    **_test_summary(output),
  }


def tests_verdict(tests):
  """A line that says the tests did not all pass, or None when they did
  (or did not run: ``--skip-tests``). Failed: a test failed or erred, none
  passed (nothing collected, or a bad selection), pytest's exit status is
  not 0, or the run was stopped at its time limit."""
  if 'returncode' not in tests:
    return None
  counts = tests['counts']
  passed = counts.get('passed', 0)
  failed = counts.get('failed', 0) + counts.get('error', 0)
  failed += counts.get('errors', 0)
  where = '(tests.log)'
  if tests['timed_out']:
    summary = f'{failed} failed, {passed} passed'
    return (
      f'FAILED: the exactness tests were stopped after '
      f'{tests["seconds"]:.0f} s, {summary} by then {where}'
    )
  if failed:
    return (
      f'FAILED: {failed} of {failed + passed} exactness tests failed {where}'
    )
  if not passed:
    summary = tests['summary'] or f'pytest exit status {tests["returncode"]}'
    return f'FAILED: no exactness test passed: {summary} {where}'
  if tests['returncode'] != 0:
    return f'FAILED: pytest exit status {tests["returncode"]} {where}'
  return None


def header(args, device, argv):
  """The device, versions and command of the results."""
  import jax  # noqa: PLC0415 - after preflight

  stats = getattr(device, 'memory_stats', lambda: None)() or {}
  return {
    'command': common.command('device_check', argv),
    'machine': common.machine(),
    'device_count': jax.device_count(),
    'device_memory_bytes': stats.get('bytes_limit'),
    'xla_flags': os.environ.get('XLA_FLAGS', ''),
    'budget_s': args.budget_s,
    'setting': args.setting,
    'platform': device.platform,
    'rows': [],
    'open_micro_steps': [],
    'errors': [],
  }


def write(folder, results):
  """``results.json`` and ``results.md`` in ``folder``: the tests'
  verdict first where they failed, then the targets (once the benchmarks
  have started), then the tables."""
  from benchmarks import report  # noqa: PLC0415 - after preflight

  if 'sections' in results:
    results['targets'] = gpu_targets.targets(results)
  with open(os.path.join(folder, 'results.json'), 'w') as f:
    json.dump(results, f, indent=1)
  verdict = tests_verdict(results.get('tests', {}))
  with open(os.path.join(folder, 'results.md'), 'w') as f:
    if verdict:  # the first line
      f.write(f'{verdict}\n\n')
    if 'targets' in results:
      f.write('\n'.join(results['targets']['lines']) + '\n\n')
    f.write(report.markdown(results, DISPATCH_METHODS))
    f.write(compiled_here(results))


def compiled_here(results):
  """The figures compiled here for the device's kind (not timed), or
  the line that says why there are none ('' before they are asked for)."""
  here = results.get('compiled_here')
  if here is None:
    return ''
  if 'not_compiled' in here:
    return f'\nnot compiled: {here["not_compiled"]}\n'
  return f'\n{here["markdown"]}'


def print_summary(results, verdict):
  """On stdout, after the tests' verdict (printed as they ended): the
  targets, the failed tests, the tables."""
  from benchmarks import report  # noqa: PLC0415 - after preflight

  for line in results.get('targets', {}).get('lines', []):
    print(line)
  for line in results['tests'].get('failed', []) if verdict else ():
    print(line)
  if results['rows']:
    print()
    print('\n'.join(report.markdown_tables(results, DISPATCH_METHODS)))
  for error in results['errors']:
    print(f'Error: {error}')
  print(compiled_here(results), end='')
  sys.stdout.flush()


def build_model(model_name, setting, k):
  """The model at the sizes of ``setting`` (``models.SIZES``), the MLP
  with micro-batches of ``MLP_BATCH`` rows but at smoke-test sizes."""
  from benchmarks import models  # noqa: PLC0415 - after preflight

  sizes = dict(models.SIZES[setting][model_name])
  if gpu_targets.family(model_name) == 'mlp' and setting != 'quick':
    sizes['batch_size'] = MLP_BATCH
  return models.MODELS[model_name](k=k, **sizes)


def conditionals(compiled):
  """label -> the conditionals of that compiled program (its HLO read by
  ``optax_tokacc.testing.hlo``), or why it could not be read."""
  from optax_tokacc.testing import hlo  # noqa: PLC0415 - after preflight

  out = {}
  for label, program in compiled.items():
    try:
      out[label] = hlo.compiled_opcodes(program.as_text())['conditional']
    except Exception as e:  # noqa: BLE001 - reported in its row
      out[label] = f'not read: {_first_line(e)[:100]}'
  return out


def section(model_name, k, setting, deadline, profile=False):
  """Rows of one model and k, its trainers (still holding their state,
  for the dispatch check), and with ``profile`` the device's events of
  one open micro-step of each method (else None)."""
  from benchmarks import timing  # noqa: PLC0415 - after preflight
  from benchmarks import trainers  # noqa: PLC0415

  case = trainers.make_case(build_model(model_name, setting, k), k)
  windows = 2 if setting == 'quick' else WINDOWS[gpu_targets.family(model_name)]
  rows, built = timing.measure(case, METHODS, windows, WARMUP, deadline)
  for row in rows:
    trainer = built[row['method']]
    row['setup_s'] = trainer.setup_s
    row['windows_timed'] = len(row['window_times_s'])
    row['conditionals'] = conditionals(trainer.compiled)
  open_steps = None
  if profile:
    index = windows + WARMUP  # a window after the timed ones
    open_steps = timing.profile_open_micro_steps(
      built, index, case.model.params
    )
  return rows, built, open_steps


def dispatch_check(built, k, index):
  """The dispatch times of the ideal and of the device's and the host's
  programs, and a profile of the device-decided window."""
  from benchmarks import timing  # noqa: PLC0415 - after preflight

  out = {
    name: timing.dispatch(built[name], k, 2, index)
    for name in DISPATCH_METHODS
    if name in built
  }
  out['profile_tokacc_device'] = timing.profile(
    built['tokacc_device'], index + 2
  )
  return out


def _share(left, todo, took):
  """Seconds of ``left`` for the first section of ``todo``, in proportion
  to what each section of its family took (``took``), else is expected
  to take (``EXPECTED_S``)."""
  costs = [
    took.get(gpu_targets.family(m), EXPECTED_S[gpu_targets.family(m)])
    for m, _ in todo
  ]
  return left * costs[0] / sum(costs)


def run_section(args, results, pair, deadline, dispatch):
  """One section's rows, conditionals, open micro-step profile (the
  first section of each model) and dispatch check (when ``dispatch``)."""
  model_name, k = pair
  profile = all(e['model'] != model_name for e in results['open_micro_steps'])
  rows, built, open_steps = section(
    model_name, k, args.setting, deadline, profile
  )
  results['rows'] += rows
  if open_steps is not None:
    entry = {'model': model_name, 'k': k, 'methods': open_steps}
    results['open_micro_steps'].append(entry)
  if dispatch:
    results['dispatch'] = dispatch_check(built, k, 1)
  return sum(row['setup_s'] for row in rows)


def _skip(results, error):
  results['errors'].append(error)
  print(f'device_check: {error}', flush=True, file=sys.stderr)


def run_benchmarks(args, results, deadline):
  """Every section, its windows fitted to ``deadline``; a section whose
  family's set-up would not fit any more is skipped (never at --quick);
  results written after each section."""
  todo = list(args.sections)
  results['sections'] = [list(pair) for pair in todo]
  # The dispatch check: with GPT-2 small's first section, else the first.
  dispatch_at = next(
    (p for p in todo if gpu_targets.family(p[0]) == 'gpt2'), todo[0]
  )
  reserve = min(60.0, 0.1 * args.budget_s)  # the dispatch check
  took, setup = {}, {}  # family -> seconds of its last section, set-up
  while todo:
    pair = todo.pop(0)
    name, now = gpu_targets.family(pair[0]), time.perf_counter()
    left = deadline - reserve - now
    share = _share(left, [pair, *todo], took)
    if left < 1.2 * setup.get(name, 0.0) and not args.quick:
      _skip(results, f'{pair[0]}, k={pair[1]}: skipped, {left:.0f} s left')
      continue
    print(f'{pair[0]}, k={pair[1]}: {share:.0f} s', flush=True, file=sys.stderr)
    try:
      setup[name] = run_section(
        args, results, pair, now + share, pair == dispatch_at
      )
    except Exception as e:  # noqa: BLE001 - reported, the next section runs
      _skip(results, f'{pair[0]}, k={pair[1]}: {common.describe_error(e)}')
    if pair == dispatch_at:
      reserve = 0.0
    took[name] = time.perf_counter() - now
    gc.collect()
    write(args.out, results)


def main(argv=None):
  args = parse_args(argv)
  start = time.perf_counter()
  deadline = start + args.budget_s
  os.makedirs(args.out, exist_ok=True)
  device = preflight(args)
  results = header(args, device, argv)
  write(args.out, results)
  if args.skip_tests or (args.cpu and not args.quick and not args.tests):
    why = '--skip-tests' if args.skip_tests else '--cpu (CI runs them)'
    results['tests'] = {'skipped': why}
  else:
    seconds = min(180.0, 0.4 * args.budget_s)
    # on stderr: stdout's first line is the tests' verdict, or the targets
    print(
      f'tests on {device.platform}, at most {seconds:.0f} s',
      flush=True,
      file=sys.stderr,
    )
    results['tests'] = run_tests(args, device, seconds)
    verdict = results['tests']['verdict'] = tests_verdict(results['tests'])
    if verdict:  # stdout's first line
      print(verdict, flush=True)
    else:
      print(results['tests']['summary'], flush=True, file=sys.stderr)
  write(args.out, results)
  if not args.skip_benchmarks:
    from benchmarks import compiled  # noqa: PLC0415 - after preflight

    kind = device.device_kind
    reserve = COMPILED_S if compiled.target_for(kind) else 0.0
    run_benchmarks(args, results, deadline - reserve)
    left = max(deadline - time.perf_counter(), 30.0)
    folder = os.path.join(args.out, 'compiled')
    results['compiled_here'] = compiled.compile_apart(kind, folder, left)
  results['wall_s'] = time.perf_counter() - start
  write(args.out, results)
  print_summary(results, tests_verdict(results['tests']))
  print(f'wrote {args.out}/results.json and results.md', flush=True)
  return results


if __name__ == '__main__':
  verdict = tests_verdict(main()['tests'])
  if verdict:
    print(verdict, flush=True)  # again, last: where a log's tail shows it
    sys.exit(1)
