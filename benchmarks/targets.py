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
"""Issue 46's targets on a GPU, judged from ``device_check``'s results:
per window over the ideal for every method of ours (GPT-2 small and the
memory-bound MLP, float32 and mixed), ``optax.MultiSteps`` slower than
all of them, and an open micro-step's kernels (:func:`targets`). On a CPU
the same figures are given, not judged."""


def family(model_name):
  """``'mlp'`` or ``'gpt2'``."""
  return model_name.split('_')[0]


# Ours: every method judged against the targets (not the ideal, not optax's).
OURS = ('tokacc_device', 'tokacc_host', 'tokacc_chain', 'tokacc_flax')
# Issue 46's targets on a GPU: per window over the ideal, every method of
# ours, each model (float32 and mixed); an open micro-step's kernels.
WINDOW_TARGETS = (
  ('gpt2', 1.01, 'GPT-2 small float32'),
  ('gpt2_bf16', 1.01, 'GPT-2 small bf16'),
  ('mlp', 1.05, 'MLP float32'),
  ('mlp_bf16', 1.05, 'MLP mixed (bf16 parameters, f32 accumulator)'),
)
OPEN_STEP_TARGET = 1.05


def _window_check(rows, model_name, limit, title):
  """``(met, line)``: whether every method of ours takes at most ``limit``
  times the ideal per window on ``model_name`` (any k); met is None where
  none was measured."""
  text = f'{title}: every method of ours <= {limit:.2f}x the ideal per window'
  ours = [
    row
    for row in rows
    if row['model'] == model_name
    and row['method'] in OURS
    and row['ratio_to_ideal'] is not None
  ]
  if not ours:
    return None, f'{text}: not measured'
  worst = max(ours, key=lambda row: row['ratio_to_ideal'])
  ks = ','.join(str(k) for k in sorted({row['k'] for row in ours}))
  return worst['ratio_to_ideal'] <= limit, (
    f'{text}: worst {worst["method"]} {worst["ratio_to_ideal"]:.3f}x '
    f'(k={worst["k"]}; k measured: {ks})'
  )


def _multisteps_check(rows):
  """``(met, line)``: whether ``optax.MultiSteps`` takes longer per window
  than every method of ours on the MLP (float32 and mixed, any k)."""
  text = (
    'MLP float32 and mixed: optax.MultiSteps slower per window than every '
    'method of ours'
  )
  ours = [
    row
    for row in rows
    if family(row['model']) == 'mlp'
    and row['method'] in OURS
    and row['ratio_to_multisteps'] is not None
  ]
  if not ours:
    return None, f'{text}: not measured'
  worst = max(ours, key=lambda row: row['ratio_to_multisteps'])
  return worst['ratio_to_multisteps'] < 1, (
    f'{text}: slowest of ours {worst["method"]} '
    f'{worst["ratio_to_multisteps"]:.3f}x MultiSteps ({worst["model"]}, '
    f'k={worst["k"]})'
  )


def _open_step_check(entries):
  """``(met, line)``: whether one open micro-step of every method of ours
  runs at most ``OPEN_STEP_TARGET`` times the ideal's kernel time with no
  memory copy of a parameter-sized buffer, on every model profiled."""
  text = (
    f'open micro-step: every method of ours <= {OPEN_STEP_TARGET:.2f}x the '
    "ideal's kernel time, no memcpy of a parameter-sized buffer"
  )
  found = [
    (entry['model'], name, summary)
    for entry in entries
    for name, summary in entry['methods'].items()
    if name in OURS and summary.get('ratio_to_ideal') is not None
  ]
  if not found:
    notes = {
      summary.get('note') or summary.get('error') or 'no figure'
      for entry in entries
      for summary in entry['methods'].values()
    }
    return None, f'{text}: not measured: {"; ".join(sorted(notes)) or "-"}'
  model, name, worst = max(found, key=lambda f: f[2]['ratio_to_ideal'])
  sized = [summary['memcpy_parameter_sized'] for _, _, summary in found]
  unknown = sum(summary.get('memcpy_size_unknown', 0) for *_, summary in found)
  copies = (
    'memcpy sizes not readable'
    if None in sized
    else f'{sum(sized)} parameter-sized memcpy'
    + (f' ({unknown} more of unknown size)' if unknown else '')
  )
  no_copies = all(n == 0 for n in sized)  # None: no size readable
  met = worst['ratio_to_ideal'] <= OPEN_STEP_TARGET and no_copies
  return met, (
    f'{text}: worst {name} {worst["ratio_to_ideal"]:.3f}x ({model}); {copies}'
  )


def targets(results):
  """Issue 46's targets, one line each under a heading line: judged on
  an accelerator (PASS, FAIL, NOT MEASURED); on a CPU, the same figures,
  not judged."""
  rows = results['rows']
  checks = [_window_check(rows, *target) for target in WINDOW_TARGETS]
  checks.append(_multisteps_check(rows))
  checks.append(_open_step_check(results['open_micro_steps']))
  met = [check for check, _ in checks]
  judged = results['platform'] != 'cpu'
  if judged:
    head = (
      f'TARGETS: {met.count(True)} met, {met.count(False)} missed, '
      f'{met.count(None)} not measured, of {len(met)} (issue 46, on '
      f'{results["machine"]["device"]})'
    )
    marks = {True: 'PASS', False: 'FAIL', None: 'NOT MEASURED'}
  else:
    head = 'TARGETS: CPU run: targets are for a GPU, not judged (issue 46)'
    marks = dict.fromkeys((True, False, None), 'not judged')
  lines = [f'- {marks[check]}: {text}' for check, text in checks]
  return {'judged': judged, 'met': met, 'lines': [head, *lines]}
