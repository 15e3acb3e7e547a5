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
"""The rows and tables of the benchmarks.

A row of ``run.py`` (and of ``device_check.py``) holds one method on one
model and k: the median time per micro-step and per window with their
ratios to the method's reference ideal (and per window to
``optax.MultiSteps``), every timed window, the compiled memory of its
jitted functions, and the largest parameter difference to its reference
after one window. A row of ``collectives.py`` holds one pattern and k.
"""

import statistics

import jax.numpy as jnp

from benchmarks import common

_MEMORY_FIELDS = (
  'argument_size_in_bytes',
  'output_size_in_bytes',
  'temp_size_in_bytes',
  'alias_size_in_bytes',
)


def median(values):
  """The median of ``values``, None if there are none."""
  return statistics.median(values) if values else None


def ratio(value, reference):
  """``value / reference``, None if either is missing."""
  if value is None or not reference:
    return None
  return value / reference


def memory(compiled, param_bytes):
  """A compiled function's memory analysis, and temp / parameter bytes."""
  analysis = compiled.memory_analysis()
  out = {field: int(getattr(analysis, field)) for field in _MEMORY_FIELDS}
  out['temp_over_params'] = out['temp_size_in_bytes'] / param_bytes
  cost = compiled.cost_analysis()  # a list of one dict on older JAX
  cost = (cost[0] if isinstance(cost, list) else cost) or {}
  if 'bytes accessed' in cost:  # XLA's estimate: deterministic, unlike time
    out['accessed_over_params'] = cost['bytes accessed'] / param_bytes
  return out


def accessed_per_window(memory, k):
  """XLA's estimate of the bytes a window accesses over the parameter
  bytes, from its programs' :func:`memory`: k calls of one program
  (``step``); k micro-steps and a window update (the ideals); or k - 1
  micro-steps and a closing one (closed by the host). None where unknown,
  as for a loop, which XLA counts once. XLA counts a conditional as its
  costliest branch (``HandleConditional``), as if the window closed on
  every call: a one-program step's figure is an upper bound."""
  accessed = {
    label: m.get('accessed_over_params') for label, m in memory.items()
  }
  if None in accessed.values():
    return None
  if 'step' in accessed:  # beside it: its optimizer part alone (``update``)
    return k * accessed['step']
  labels = {'micro_step': 'window_update', 'micro': 'close'}
  for micro, last in labels.items():
    if set(accessed) == {micro, last}:
      micro_steps = k if last == 'window_update' else k - 1
      return micro_steps * accessed[micro] + accessed[last]
  return None


def _model_fields(case):
  model = case.model
  return {
    'model': model.name,
    'model_description': model.description,
    'param_dtype': model.param_dtype,
    'mu_dtype': model.mu_dtype and jnp.dtype(model.mu_dtype).name,
    'num_params': model.num_params,
    'param_bytes': model.param_bytes,
    'k': case.k,
  }


def _time_fields(name, reference, times):
  """Medians, their ratios, and the times of every timed window."""
  micro_step = median(times[name].micro_step)
  window = median(times[name].window)
  reference_times = times.get(reference)
  multisteps = times.get('multisteps')
  return {
    'reference': reference,
    'median_micro_step_s': micro_step,
    'median_closing_step_s': median(times[name].closing_step),
    'median_window_s': window,
    'micro_step_ratio_to_ideal': ratio(
      micro_step, reference_times and median(reference_times.micro_step)
    ),
    'ratio_to_ideal': ratio(
      window, reference_times and median(reference_times.window)
    ),
    'ratio_to_multisteps': ratio(
      window, multisteps and median(multisteps.window)
    ),
    'micro_step_times_s': times[name].micro_step,
    'closing_step_times_s': times[name].closing_step,
    'window_times_s': times[name].window,
  }


def rows(case, built, times, differences):
  """The rows of one model and k, one per method of ``built`` (name ->
  ``trainers.Trainer``), with ``times`` (name -> ``timing.Times``) and
  ``differences`` (name -> largest parameter difference to the
  reference)."""
  out = []
  for name, trainer in built.items():
    row = _model_fields(case)
    row['method'] = name
    row.update(_time_fields(name, trainer.reference, times))
    row['memory'] = {
      label: memory(compiled, case.model.param_bytes)
      for label, compiled in trainer.compiled.items()
    }
    row['accessed_per_window_over_params'] = accessed_per_window(
      row['memory'], case.k
    )
    row['compile_s'] = dict(trainer.compile_s)
    if trainer.optimizer_state_of is not None:
      state = trainer.optimizer_state_of(trainer.carry)
      row['optimizer_bytes_per_device'] = common.bytes_per_device(state)
    row['max_abs_diff_to_ideal_after_one_window'] = differences.get(name)
    out.append(row)
  accessed = {r['method']: r['accessed_per_window_over_params'] for r in out}
  for row in out:
    row['accessed_ratio_to_ideal'] = ratio(
      row['accessed_per_window_over_params'], accessed.get(row['reference'])
    )
  return out


def _x(value):
  return '' if value is None else f'{value:.2f}x'


def _ms(seconds):
  return '' if seconds is None else f'{1e3 * seconds:.1f}'


def _diff(row):
  diff = row['max_abs_diff_to_ideal_after_one_window']
  return '' if diff is None else f'{diff:.1e}'


_HEADER = (
  f'{"model":<12}{"k":>2} {"method":<24}{"ms/micro":>9}{"/ideal":>7}'
  f'{"ms/window":>10}{"/ideal":>7}{"/MultiSteps":>12}  '
  f'{"compiled temp / param bytes":<38}{"max|dp|":>8}'
)


def _line(row):
  """One row of the printed table."""
  temps = ' '.join(
    f'{label}={m["temp_over_params"]:.3f}' for label, m in row['memory'].items()
  )
  return (
    f'{row["model"]:<12}{row["k"]:>2} {row["method"]:<24}'
    f'{_ms(row["median_micro_step_s"]):>9}'
    f'{_x(row["micro_step_ratio_to_ideal"]):>7}'
    f'{_ms(row["median_window_s"]):>10}'
    f'{_x(row["ratio_to_ideal"]):>7}'
    f'{_x(row["ratio_to_multisteps"]):>12}  {temps:<38}{_diff(row):>8}'
  )


def _memory_per_device(row):
  """Bytes per device over the parameter bytes: the arguments of each
  compiled function (``memory_analysis()``: parameters, optimizer state,
  accumulator, batch) and the optimizer state alone (its arrays' shards)."""
  arguments = ' '.join(
    f'{label}={m["argument_size_in_bytes"] / row["param_bytes"]:.3f}'
    for label, m in row['memory'].items()
  )
  optimizer = row['optimizer_bytes_per_device'] / row['param_bytes']
  return (
    f'memory: {row["model"]:<12}{row["k"]:>2} {row["method"]:<22}'
    f'arguments {arguments:<38} optimizer={optimizer:.3f}'
  )


def print_table(rows, file=None):
  """Times, ratios, compiled memory and the check, one line per row; then
  the memory per device of the rows that report it, XLA's estimate of the
  bytes each window accesses (``cost_analysis()``: deterministic for a
  given XLA, where times on a shared CPU are not), and compile times."""
  print(_HEADER, file=file)
  for row in rows:
    print(_line(row), file=file)
  placed = [row for row in rows if 'optimizer_bytes_per_device' in row]
  if placed:
    title = 'per device / param bytes: arguments (memory_analysis), optimizer'
    print(title, file=file)
  for row in placed:
    print(_memory_per_device(row), file=file)
  known = [row for row in rows if row['accessed_per_window_over_params']]
  if known:
    print('bytes accessed per window (XLA estimate) / param bytes', file=file)
  for row in known:
    print(
      f'accessed: {row["model"]:<12}{row["k"]:>2} {row["method"]:<24}'
      f'{row["accessed_per_window_over_params"]:8.2f}'
      f'{_x(row["accessed_ratio_to_ideal"]):>8}',
      file=file,
    )
  for row in rows:
    if row['compile_s']:
      seconds = ' '.join(f'{k}={v:.2f}' for k, v in row['compile_s'].items())
      print(
        f'compile s: {row["model"]:<12}{row["k"]:>2} {row["method"]:<22}'
        f'{seconds}',
        file=file,
      )


def _conditionals(row):
  """The compiled conditionals of each program of the row."""
  counts = row.get('conditionals', {})
  return ', '.join(f'{label} {n}' for label, n in counts.items())


def _markdown_rows(rows):
  """``device_check.py``'s per-window table."""
  lines = [
    '| model | k | method | ms / micro-step | / ideal | ms / window | '
    '/ ideal | / MultiSteps | conditionals | temp / param bytes | set-up s | '
    'compile s | windows | max\\|dp\\| |',
    '| --- | ---: | --- | ---: | ---: | ---: | ---: | ---: | --- | --- | ---: '
    '| --- | ---: | ---: |',
  ]
  for row in rows:
    temps = ', '.join(
      f'{label} {m["temp_over_params"]:.3f}'
      for label, m in row['memory'].items()
    )
    compile_s = ', '.join(f'{a} {s:.1f}' for a, s in row['compile_s'].items())
    lines.append(
      f'| {row["model"]} | {row["k"]} | {row["method"]} | '
      f'{_ms(row["median_micro_step_s"])} | '
      f'{_x(row["micro_step_ratio_to_ideal"])} | '
      f'{_ms(row["median_window_s"])} | {_x(row["ratio_to_ideal"])} | '
      f'{_x(row["ratio_to_multisteps"])} | {_conditionals(row)} | {temps} | '
      f'{row["setup_s"]:.1f} | {compile_s} | {row["windows_timed"]} | '
      f'{_diff(row)} |'
    )
  return lines


def _copies(summary):
  """A profile summary's memory copies, and how many are parameter-sized."""
  sized = summary['memcpy_parameter_sized']
  return f'{summary["memcpy"]}', '?' if sized is None else f'{sized}'


def _open_step_lines(entry):
  """One model's open micro-step, a row per method; one line where the
  profile gave no figures (a CPU: no device plane)."""
  methods = entry['methods']
  where = f'{entry["model"]}, k={entry["k"]}'
  if not any('device_us' in summary for summary in methods.values()):
    notes = sorted(
      {s.get('note') or s.get('error', 'no figure') for s in methods.values()}
    )
    return [f'- {where}: {"; ".join(notes)}']
  lines = []
  for name, summary in methods.items():
    if 'device_us' not in summary:
      reason = summary.get('note') or summary.get('error')
      lines.append(f'| {where} | {name} | {reason} | | | | | |')
      continue
    longest = '; '.join(
      f'{e["name"][:40]} x{e["count"]} {e["us"]:.0f}'
      for e in summary['longest'][:4]
    )
    copies, sized = _copies(summary)
    lines.append(
      f'| {where} | {name} | {summary["kernels"]} | '
      f'{summary["device_us"]:.1f} | {_x(summary.get("ratio_to_ideal"))} | '
      f'{copies} | {sized} | {longest} |'
    )
  return lines


def _markdown_open_steps(entries):
  """``device_check.py``'s open micro-step: each method's device events
  of one call that does not close the window, against the ideal's."""
  lines = [
    '| model | method | kernels | device us | / ideal | memcpy | '
    'parameter-sized memcpy | longest (us) |',
    '| --- | --- | ---: | ---: | ---: | ---: | ---: | --- |',
  ]
  body = [line for entry in entries for line in _open_step_lines(entry)]
  table = [line for line in body if line.startswith('|')]
  notes = [line for line in body if not line.startswith('|')]
  return (lines + table if table else []) + notes


def _markdown_dispatch(dispatch, names):
  lines = [
    '| method | ms to queue a micro-batch | ms to run it | queue / run |',
    '| --- | ---: | ---: | ---: |',
  ]
  for name in names:
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


def markdown_tables(results, dispatch_names):
  """``device_check.py``'s tables: per window, the open micro-step, the
  dispatch check of ``dispatch_names``."""
  lines = _markdown_rows(results['rows'])
  if results.get('open_micro_steps'):
    lines += ['', '## One open micro-step, its device events', '']
    lines += _markdown_open_steps(results['open_micro_steps'])
  if 'dispatch' in results:
    lines += ['', '## Dispatch (device-decided step)', '']
    lines += _markdown_dispatch(results['dispatch'], dispatch_names)
  return lines


def markdown(results, dispatch_names):
  """``device_check.py``'s results as Markdown: the run, the tests, the
  tables (:func:`markdown_tables`) and the errors."""
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
    *markdown_tables(results, dispatch_names),
  ]
  lines += [f'\nError: {error}' for error in results['errors']]
  return '\n'.join(lines) + '\n'


def _count(entry, param_bytes):
  return f'{entry["collectives"]} ({entry["bytes"] / param_bytes:.2f}P)'


def _pattern_line(row):
  """A row of ``collectives.py``'s table."""
  summary, size = row['summary'], row['param_bytes']
  axes = ', '.join(
    f'{name}: {_count(entry, size)}'
    for name, entry in summary['window_by_axes'].items()
  )
  flag = ' (other branch!)' if summary['other_branch'] else ''
  return (
    f'{row["pattern"]:<20} {row["mesh"]:<18} {row["k"]:>2} '
    f'{_count(summary["micro_step"], size):>12} '
    f'{_count(summary["closing_step_extra"], size):>11} '
    f'{_count(summary["window"], size):>13} '
    f'{row["accumulator_bytes_per_device"] / size:>6.3f}P '
    f'{row["optimizer_bytes_per_device"] / size:>6.3f}P '
    f'{row["max_abs_diff_to_full_batch"]:>8.1e}  {axes or "-"}{flag}'
  )


def print_collectives(rows, file=None):
  """Per pattern and k: collectives (payload in parameter bytes P)."""
  print(
    f'{"pattern":<20} {"mesh":<18} {"k":>2} {"micro-step":>12} '
    f'{"closing +":>11} {"window":>13} {"acc/dev":>7} {"opt/dev":>7} '
    f'{"max|dp|":>8}  window by mesh axes',
    file=file,
  )
  for row in rows:
    print(_pattern_line(row), file=file)


def print_collective_details(rows, file=None):
  """Every collective of each pattern's compiled step (of the last k)."""
  print(
    f'\n{"pattern":<20} {"runs on":<17} {"collective":<15} {"axes":<13} '
    f'{"group":>5} {"bytes":>8}',
    file=file,
  )
  for row in rows:
    if row['k'] != rows[-1]['k']:
      continue
    for record in row['collectives']:
      print(
        f'{row["pattern"]:<20} {record["where"]:<17} {record["kind"]:<15} '
        f'{record["axes"]:<13} {record["group_size"] or "?":>5} '
        f'{record["bytes"]:>8}',
        file=file,
      )
