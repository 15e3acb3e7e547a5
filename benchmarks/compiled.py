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
"""Figures per accelerator target, compiled here and not timed::

  JAX_PLATFORMS=cpu python -m benchmarks.compiled \\
    --targets h100,h200,'tpu v5e 1x1','tpu v6e 1x1' --models mlp,mlp_bf16 \\
    --k 4 --out benchmarks/results

Each method's programs (``compiled_programs.py``) are compiled for a
target's first device (``optax_tokacc.testing.target``) on abstract
arguments and read by ``optax_tokacc.testing.check``: per method, for an open micro-step, a
closing step and a window of k (``(k - 1)`` open steps and the closing
one), the kernels, the modelled traffic (bytes the entry computation's
kernels read and write, branches not taken left out) and its ratio to
the ideal's, the compiled temporaries against the ideal's, and the
collectives. A missing compiler is one line on stderr and exit status 2:
nothing is ever compiled for the CPU instead.
"""

import argparse
import importlib.metadata
import os
import re
import shlex
import subprocess
import sys

from benchmarks import common
from benchmarks import compiled_programs
from optax_tokacc import testing

TARGETS = ('h100', 'h200', 'tpu v5e 1x1', 'tpu v6e 1x1')
MODELS = ('mlp', 'mlp_bf16')
VERSIONS = ('jax', 'jaxlib', 'jax-cuda12-plugin', 'jax-cuda12-pjrt',
            'nvidia-cuda-nvcc-cu12', 'libtpu', 'optax')  # fmt: skip
# Part of a lent device's kind, in lower case -> the target compiled here.
TARGET_OF_KIND = {'h100': 'h100', 'h200': 'h200', 'tpu v5 lite': 'tpu v5e 1x1',
                  'tpu v6 lite': 'tpu v6e 1x1'}  # fmt: skip


def _mb(num_bytes: float, sign: str = '') -> str:
  return f'{num_bytes / 1e6:{sign},.1f}'


def summary_table(sections: list[dict]) -> list[str]:
  """Each method of ours and MultiSteps against the ideal, per target
  and model: traffic ratios, an open micro-step's kernels, temporaries."""
  lines = [
    '| target | model | method | open | closing | window | open kernels '
    '(ideal) | temporaries vs ideal |',
    '| --- | --- | --- | ---: | ---: | ---: | ---: | ---: |',
  ]
  for entry in sections:
    by_step = {(r['method'], r['step']): r for r in entry['rows']}
    ideal_kernels = by_step['ideal', 'open']['kernels']
    for method in compiled_programs.METHODS[1:]:
      ratios = [
        f'{by_step[method, s]["bytes_vs_ideal"]:.2f}x'
        for s in compiled_programs.STEPS
      ]
      window = by_step[method, 'window']
      lines.append(
        f'| {entry["target"]} | {entry["model"]} | {method} | '
        f'{" | ".join(ratios)} | {by_step[method, "open"]["kernels"]} '
        f'({ideal_kernels}) | {_mb(window["temp_vs_ideal_bytes"], "+")} MB '
        f'({window["temp_vs_ideal_params"]:+.2f} P) |'
      )
  return lines


def detail_table(entry: dict) -> list[str]:
  """Every method and step of one target and model."""
  lines = [
    f'### {entry["target"]} ({entry["device_kind"]}), {entry["model"]}',
    '',
    f'{entry["description"]}; P = {_mb(entry["param_bytes"])} MB of '
    f'parameters; k = {entry["k"]}.',
    '',
    '| method | step | kernels | traffic (MB) | vs ideal | temporaries '
    '(MB) | vs ideal (MB) | vs ideal (P) | collectives |',
    '| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |',
  ]
  for r in entry['rows']:
    lines.append(
      f'| {r["method"]} | {r["step"]} | {r["kernels"]} | {_mb(r["bytes"])} '
      f'| {r["bytes_vs_ideal"]:.2f}x | {_mb(r["temp_bytes"])} | '
      f'{_mb(r["temp_vs_ideal_bytes"], "+")} | '
      f'{r["temp_vs_ideal_params"]:+.2f} | {r["collectives"]} |'
    )
  programs = entry['programs']
  kept = ', '.join(f'{p} {v["conditionals"]}' for p, v in programs.items())
  found = sum(len(v['collectives']) for v in programs.values())
  verdict = 'none, as expected' if not found else f'{found}: NOT EXPECTED'
  work = [
    f'{p}: {" ".join(w)}'
    for p, w in entry['optimizer_on_open_step'].items()
    if w
  ]
  return [
    *lines,
    '',
    f'Collectives (one device): {verdict}. Conditionals kept: {kept}. '
    'Inner optimizer (ours, its name scope) on an open micro-step: '
    f'{", ".join(work) or "none"}.',
    '',
  ]


def markdown(results: dict) -> str:
  """The header, the summary and the detail tables."""
  head = results['header']
  versions = ', '.join(f'{n} {v}' for n, v in head['versions'].items())
  lines = [
    '# Compiled for the accelerators: compiled, not timed',
    '',
    f'- commit: {head["commit"]}'
    + (
      ' (optax_tokacc/ changed, uncommitted)'
      * head['library_changes_uncommitted']
    ),
    f'- command: `{head["command"]}`',
    f'- date: {head["date"]}; Python {head["python"]}; {versions}',
    '- open: a micro-step that does not close the window; closing: the '
    'step that does (the ideal: its micro-step and its window update); '
    'window: (k - 1) open steps and the closing one. Traffic: the bytes '
    "the entry computation's kernels read and write, branches not taken "
    "left out (a model, not a time). Temporaries: `memory_analysis()`'s, "
    "the most of a step's programs; P: the parameters' bytes.",
    '',
    '## Summary: traffic against the ideal of the same target',
    '',
    *summary_table(results['sections']),
    '',
    '## Every method and step',
    '',
  ]
  for entry in results['sections']:
    lines += detail_table(entry)
  return '\n'.join(lines)


def header(argv) -> dict:
  """Commit, date, command and the compilers' versions."""
  versions = {}
  for name in VERSIONS:
    try:
      versions[name] = importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
      versions[name] = None
  return {
    **common.machine(),  # the machine that compiled, commit, date
    'command': 'JAX_PLATFORMS=cpu python -m benchmarks.compiled '
    + shlex.join(sys.argv[1:] if argv is None else argv),
    'versions': versions,
  }


def write(folder: str, results: dict) -> str:
  """``compiled_<date>_<short commit>.json`` and ``.md`` in ``folder``;
  the path without its extension."""
  os.makedirs(folder, exist_ok=True)
  head = results['header']
  stem = f'compiled_{head["date"][:10]}_{head["commit"][:7] or "nocommit"}'
  path = os.path.join(folder, stem)
  common.write_json(path + '.json', results)
  with open(path + '.md', 'w') as f:
    f.write(markdown(results) + '\n')
  return path


def fail(message: str):
  """One line on stderr, exit status 2."""
  print(f'compiled: {message}', file=sys.stderr)
  sys.exit(2)


def parse_args(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--targets', default=','.join(TARGETS))
  parser.add_argument('--models', default=','.join(MODELS))
  parser.add_argument('--k', type=int, default=4)
  parser.add_argument('--out', help='folder for the JSON and the Markdown')
  parser.add_argument(
    '--quick', action='store_true', help='smoke-test sizes (CI)'
  )
  args = parser.parse_args(argv)
  try:
    args.targets = common.parse_names(
      args.targets, testing.known_targets(), 'target'
    )
    args.models = common.parse_names(args.models, MODELS, 'model')
  except ValueError as e:
    parser.error(str(e))
  if args.k < 2:
    parser.error(
      f'--k must be >= 2 (a window with an open step), got {args.k}.'
    )
  return args


def targets(names) -> list[testing.Target]:
  """The targets' compile-only devices; a missing compiler fails here,
  before anything is compiled."""
  found = []
  for name in names:
    try:
      found.append(testing.target(name))
    except Exception as e:  # noqa: BLE001 - one line, exit status 2
      fail(f'not compiled for {name!r}: {common.describe_error(e)}')
  return found


def main(argv=None) -> dict:
  args = parse_args(argv)
  chosen = targets(args.targets)
  results = {'header': header(argv), 'sections': []}
  setting = 'quick' if args.quick else 'full'
  for target in chosen:
    for name in args.models:
      print(f'{target.name}, {name}', file=sys.stderr, flush=True)
      results['sections'].append(
        compiled_programs.section(name, setting, args.k, target)
      )
      if args.out:
        path = write(args.out, results)
  print(markdown(results))
  if args.out:
    print(f'wrote {path}.json and {path}.md', file=sys.stderr)
  return results


def target_for(device_kind: str):
  """The target compiled here for a lent device of ``device_kind`` (None:
  none of its kind)."""
  kind = device_kind.lower()
  return next((t for p, t in TARGET_OF_KIND.items() if p in kind), None)


def compile_apart(device_kind: str, folder: str, limit_s: float) -> dict:
  """For ``device_check``: this module run in a process of its own on the
  CPU, for the target of a lent ``device_kind`` (the MLP, float32 and
  mixed, k = 4). ``{'target', 'markdown', 'folder'}`` (its headings a
  level down, below device_check's), else ``{'not_compiled': why}``."""
  target = target_for(device_kind)
  if target is None:
    return {'not_compiled': f'no compiled-here target of kind {device_kind!r}'}
  command = [sys.executable, '-m', 'benchmarks.compiled', '--targets', target]
  command += ['--models', ','.join(MODELS), '--k', '4', '--out', folder]
  env = dict(os.environ, JAX_PLATFORMS='cpu')
  try:
    done = subprocess.run(
      command,
      capture_output=True,
      text=True,
      env=env,
      cwd=os.path.dirname(common.HERE),
      timeout=limit_s,
    )
  except subprocess.TimeoutExpired:
    return {'not_compiled': f'{target}: not done in {limit_s:.0f} s'}
  if done.returncode != 0:
    line = (done.stderr.strip().splitlines() or ['no output'])[-1]
    line = line.removeprefix(f'compiled: not compiled for {target!r}: ')
    return {'not_compiled': f'{target}: {line}'}
  markdown = re.sub('^#', '##', done.stdout, flags=re.MULTILINE)
  return {'target': target, 'markdown': markdown, 'folder': folder}


if __name__ == '__main__':
  main()
