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
"""The rows of ``run.py`` (its JSON) and its printed table.

A row holds one method on one model and k: the median time per micro-step
and per window with their ratios to the method's reference ideal (and per
window to ``optax.MultiSteps``), every timed window, the compiled memory of
its jitted functions, and the largest parameter difference to its reference
after one window. A method that could not be set up has a row with
``error`` instead.
"""

import jax.numpy as jnp

from benchmarks import _common
from benchmarks import _timing


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
  median = _timing.median
  micro_step = median(times[name].micro_step)
  window = median(times[name].window)
  reference_times = times.get(reference)
  multisteps = times.get('multisteps')
  return {
    'reference': reference,
    'median_micro_step_s': micro_step,
    'median_closing_step_s': median(times[name].closing_step),
    'median_window_s': window,
    'micro_step_ratio_to_ideal': _timing.ratio(
      micro_step, reference_times and median(reference_times.micro_step)
    ),
    'ratio_to_ideal': _timing.ratio(
      window, reference_times and median(reference_times.window)
    ),
    'ratio_to_multisteps': _timing.ratio(
      window, multisteps and median(multisteps.window)
    ),
    'micro_step_times_s': times[name].micro_step,
    'closing_step_times_s': times[name].closing_step,
    'window_times_s': times[name].window,
  }


def rows(case, trainers, times, differences, errors):
  """The rows of one model and k.

  Args:
    case: the ``_methods.Case`` measured.
    trainers: name -> ``_methods.Trainer`` (set up and timed).
    times: name -> ``_timing.Times``.
    differences: name -> largest parameter difference to the reference.
    errors: name -> why the method could not be set up.

  Returns:
    One dict per method, in the order of ``trainers`` then ``errors``.
  """
  out = []
  for name, trainer in trainers.items():
    row = _model_fields(case)
    row['method'] = name
    row.update(_time_fields(name, trainer.reference, times))
    row['memory'] = {
      label: _common.memory(compiled, case.model.param_bytes)
      for label, compiled in trainer.compiled.items()
    }
    row['accessed_per_window_over_params'] = _common.accessed_per_window(
      row['memory'], case.k
    )
    row['compile_s'] = dict(trainer.compile_s)
    if trainer.optimizer_state_of is not None:
      state = trainer.optimizer_state_of(trainer.carry)
      row['optimizer_bytes_per_device'] = _common.bytes_per_device(state)
    row['max_abs_diff_to_ideal_after_one_window'] = differences.get(name)
    out.append(row)
  for name, error in errors.items():
    out.append({**_model_fields(case), 'method': name, 'error': error})
  accessed = {
    r['method']: r.get('accessed_per_window_over_params') for r in out
  }
  for row in out:
    reference = accessed.get(row.get('reference'))
    mine = row.get('accessed_per_window_over_params')
    row['accessed_ratio_to_ideal'] = (
      mine / reference if mine and reference else None
    )
  return out


def _ratio(value):
  return '' if value is None else f'{value:.2f}x'


def _ms(seconds):
  return '' if seconds is None else f'{1e3 * seconds:.1f}'


_HEADER = (
  f'{"model":<12}{"k":>2} {"method":<24}{"ms/micro":>9}{"/ideal":>7}'
  f'{"ms/window":>10}{"/ideal":>7}{"/MultiSteps":>12}  '
  f'{"compiled temp / param bytes":<38}{"max|dp|":>8}'
)


def _line(row):
  """One measured row of the table."""
  temps = ' '.join(
    f'{label}={m["temp_over_params"]:.3f}' for label, m in row['memory'].items()
  )
  diff = row['max_abs_diff_to_ideal_after_one_window']
  return (
    f'{row["model"]:<12}{row["k"]:>2} {row["method"]:<24}'
    f'{_ms(row["median_micro_step_s"]):>9}'
    f'{_ratio(row["micro_step_ratio_to_ideal"]):>7}'
    f'{_ms(row["median_window_s"]):>10}'
    f'{_ratio(row["ratio_to_ideal"]):>7}'
    f'{_ratio(row["ratio_to_multisteps"]):>12}  {temps:<38}'
    f'{"" if diff is None else f"{diff:.1e}":>8}'
  )


def _print_memory_per_device(rows, file):
  """Bytes per device over the parameter bytes, for the rows that report
  their optimizer state's: the arguments of each compiled function
  (``memory_analysis()``: parameters, optimizer state, accumulator,
  batch) and the optimizer state alone (from its arrays' shards)."""
  placed = [row for row in rows if 'optimizer_bytes_per_device' in row]
  if not placed:
    return
  print(
    'per device / param bytes: arguments (memory_analysis), optimizer',
    file=file,
  )
  for row in placed:
    arguments = ' '.join(
      f'{label}={m["argument_size_in_bytes"] / row["param_bytes"]:.3f}'
      for label, m in row['memory'].items()
    )
    optimizer = row['optimizer_bytes_per_device'] / row['param_bytes']
    print(
      f'memory: {row["model"]:<12}{row["k"]:>2} {row["method"]:<22}'
      f'arguments {arguments:<38} optimizer={optimizer:.3f}',
      file=file,
    )


def _print_accessed(rows, file):
  """XLA's estimate of the bytes each window accesses (``cost_analysis()``),
  over the parameter bytes and over the reference's: deterministic for a
  given XLA, where times on a shared CPU are not."""
  known = [row for row in rows if row.get('accessed_per_window_over_params')]
  if known:
    print('bytes accessed per window (XLA estimate) / param bytes', file=file)
  for row in known:
    print(
      f'accessed: {row["model"]:<12}{row["k"]:>2} {row["method"]:<24}'
      f'{row["accessed_per_window_over_params"]:8.2f}'
      f'{_ratio(row["accessed_ratio_to_ideal"]):>8}',
      file=file,
    )


def print_table(rows, file=None):
  """Times, ratios, compiled memory and the check, one line per row."""
  print(_HEADER, file=file)
  for row in rows:
    if 'error' in row:
      start = f'{row["model"]:<12}{row["k"]:>2} {row["method"]:<24}'
      print(f'{start}not measured: {row["error"]}', file=file)
    else:
      print(_line(row), file=file)
  _print_memory_per_device(rows, file)
  _print_accessed(rows, file)
  timed = [row for row in rows if row.get('compile_s')]
  for row in timed:
    seconds = ' '.join(f'{k}={v:.2f}' for k, v in row['compile_s'].items())
    print(
      f'compile s: {row["model"]:<12}{row["k"]:>2} {row["method"]:<22}'
      f'{seconds}',
      file=file,
    )
