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
"""Time and memory of gradient accumulation methods, on the same data.

Every method trains the same model from the same parameters on the same
micro-batches with AdamW, as a user's jitted train step would (parameters and
optimizer state donated). One window is ``k`` micro-batches; the time of a
window is measured from its first call to the end of its last (blocking),
and windows of all methods are interleaved (round robin) so that load from
other processes spreads over all of them. Printed: the median time per
window after warm-up, its ratio to the ideal reference and to
``optax.MultiSteps``, and the compiled memory of each jitted function::

  python benchmarks/run.py --quick            # about 1 minute on 2 CPU cores
  python benchmarks/run.py --out results.json # the full run (17 min there)
  python benchmarks/run.py --models mlp_bf16 --methods ideal,multisteps,tokacc

Methods (``--methods``):

- ``plain``: one AdamW step per micro-batch (no accumulation).
- ``ideal``: the reference: a jitted micro-step ``acc + grad`` (accumulator
  donated) and, once per window, a jitted AdamW update of the token mean.
- ``multisteps``: ``optax.MultiSteps(adamw, k)`` on the mean loss, with
  ``optax.apply_updates``.
- ``tokacc``: ``token_weighted_multistep(adamw, k)`` with
  ``optax.apply_updates`` (since 0.2 also what ``tokacc.apply_if_updated``
  runs: the 0.1 row ``tokacc_aiu`` is gone).
- ``tokacc_chain``: ``optax.chain(token_weighted_multistep(adamw, k),
  optax.clip(1.0))`` with ``optax.apply_updates``: a transform chained after
  the accumulator (the clip never binds at this learning rate).
- ``tokacc_flax``: ``optax_tokacc.flax.TrainState.apply_gradients``.
- ``microbatched``: one jitted step per window on the whole window's batch,
  ``tokacc.microbatched_value_and_grad`` then AdamW.

Models (``--models``): ``mlp`` and ``transformer`` in float32, and
``mlp_bf16``, the mixed-precision configuration: the same MLP with bfloat16
parameters and activations, AdamW with ``mu_dtype=jnp.float32``; the
accumulators are float32 (``ideal``: by hand; ``tokacc``: the default
``accumulator_dtype=None`` promotes bfloat16 gradients to float32;
``multisteps`` accumulates in the parameters' bfloat16, as optax does).

Exact methods (all but ``plain`` and ``multisteps``) hold the same
parameters after the first window; the largest difference to ``ideal``
(``max|dp|``) is reported as a check.
"""

import argparse
import functools
import json
import os
import platform
import statistics
import subprocess
import sys
import time

# `python benchmarks/run.py` puts this folder first on sys.path.
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

METHODS = (
  'plain',
  'ideal',
  'multisteps',
  'tokacc',
  'tokacc_chain',
  'tokacc_flax',
  'microbatched',
)
MODEL_NAMES = ('mlp', 'transformer', 'mlp_bf16')
SETTINGS = {
  # windows timed, warm-up windows, k values, models
  'full': dict(windows=10, warmup=2, ks=(4, 8), models=MODEL_NAMES),
  'quick': dict(windows=4, warmup=1, ks=(4,), models=MODEL_NAMES),
  'tiny': dict(windows=1, warmup=1, ks=(2,), models=MODEL_NAMES),
}
_MEMORY_FIELDS = (
  'argument_size_in_bytes',
  'output_size_in_bytes',
  'temp_size_in_bytes',
  'alias_size_in_bytes',
)


def parse_names(text, valid, what):
  """Comma-separated names, each one of ``valid``."""
  names = tuple(name.strip() for name in text.split(',') if name.strip())
  unknown = [name for name in names if name not in valid]
  if unknown or not names:
    raise ValueError(
      f'Unknown {what} {", ".join(map(repr, unknown)) or "(none given)"}; '
      f'valid {what}s: {", ".join(valid)}.'
    )
  return names


def parse_ks(text):
  try:
    ks = tuple(int(k) for k in text.split(','))
  except ValueError:
    ks = ()
  if not ks or min(ks) < 1:
    raise ValueError(f'--k must be integers >= 1, e.g. 4,8; got {text!r}.')
  return ks


def memory(compiled, param_bytes):
  """The compiled function's memory analysis, and temp / parameter bytes."""
  analysis = compiled.memory_analysis()
  out = {field: int(getattr(analysis, field)) for field in _MEMORY_FIELDS}
  out['temp_over_params'] = out['temp_size_in_bytes'] / param_bytes
  return out


class Method:
  """A method set up on a model: ``run_window()``, compiled functions."""

  def __init__(self, name, model, k, adamw):
    import jax  # noqa: PLC0415

    self.name = name
    self.k = k
    self.model = model
    self.adamw = adamw
    self.compiled = {}  # label -> compiled function (memory analysis)
    self.windows_done = 0
    self.note = ''
    self._params = jax.tree.map(lambda x: x.copy(), model.params)
    getattr(self, '_setup_' + name)()

  def window(self):
    """The micro-batches of the next window (data is reused cyclically)."""
    windows = self.model.windows
    return windows[self.windows_done % len(windows)]

  def run_window(self):
    import jax  # noqa: PLC0415

    self._run_window(self.window())
    jax.block_until_ready(self.final_params())
    self.windows_done += 1

  def final_params(self):
    return self._params

  # A user's train step: gradient, optimizer update, apply; params and
  # optimizer state donated. The same compiled step serves micro-steps and
  # emitting steps (the state's mini_step picks the branch at run time).
  def _step_method(self, tx, apply, loss='sum'):
    import jax  # noqa: PLC0415

    model = self.model

    @functools.partial(jax.jit, donate_argnums=(0, 1))
    def step(params, opt_state, batch):
      if loss == 'sum':
        grads, num_tokens = jax.grad(model.loss_sum, has_aux=True)(
          params, batch
        )
        updates, opt_state = tx.update(
          grads, opt_state, params, num_tokens=num_tokens
        )
      else:
        grads = jax.grad(model.loss_mean)(params, batch)
        updates, opt_state = tx.update(grads, opt_state, params)
      return apply(params, updates, opt_state), opt_state

    @functools.partial(jax.jit, donate_argnums=(0, 1))
    def update(params, opt_state, grads, num_tokens):
      """The optimizer part alone, gradients given (and donated)."""
      if loss == 'sum':
        updates, opt_state = tx.update(
          grads, opt_state, params, num_tokens=num_tokens
        )
      else:
        updates, opt_state = tx.update(grads, opt_state, params)
      return apply(params, updates, opt_state), opt_state

    self._opt_state = tx.init(self._params)
    batch = self.window()[0]
    self.compiled['step'] = step.lower(
      self._params, self._opt_state, batch
    ).compile()
    num_tokens = jax.numpy.zeros([], jax.numpy.int32)
    self.compiled['update'] = update.lower(
      self._params, self._opt_state, self._params, num_tokens
    ).compile()

    def run(window):
      for batch in window:
        self._params, self._opt_state = step(
          self._params, self._opt_state, batch
        )

    self._run_window = run

  def _setup_plain(self):
    import optax  # noqa: PLC0415

    self._step_method(
      self.adamw, lambda p, u, s: optax.apply_updates(p, u), loss='mean'
    )

  def _setup_multisteps(self):
    import optax  # noqa: PLC0415

    self._step_method(
      optax.MultiSteps(self.adamw, self.k),
      lambda p, u, s: optax.apply_updates(p, u),
      loss='mean',
    )

  def _setup_tokacc(self):
    import optax  # noqa: PLC0415

    import optax_tokacc as tokacc  # noqa: PLC0415

    self._step_method(
      tokacc.token_weighted_multistep(self.adamw, self.k),
      lambda p, u, s: optax.apply_updates(p, u),
    )

  def _setup_tokacc_chain(self):
    import optax  # noqa: PLC0415

    import optax_tokacc as tokacc  # noqa: PLC0415

    self._step_method(
      optax.chain(
        tokacc.token_weighted_multistep(self.adamw, self.k), optax.clip(1.0)
      ),
      lambda p, u, s: optax.apply_updates(p, u),
    )

  def _setup_ideal(self):
    import jax  # noqa: PLC0415
    import jax.numpy as jnp  # noqa: PLC0415
    import optax  # noqa: PLC0415

    model, adamw = self.model, self.adamw

    @functools.partial(jax.jit, donate_argnums=(1, 2))
    def micro_step(params, acc, acc_tokens, batch):
      grads, num_tokens = jax.grad(model.loss_sum, has_aux=True)(params, batch)
      acc = jax.tree.map(lambda a, g: a + g.astype(a.dtype), acc, grads)
      return acc, acc_tokens + num_tokens

    @functools.partial(jax.jit, donate_argnums=(0, 1, 2, 3))
    def window_update(params, opt_state, acc, acc_tokens):
      # The token mean in the (float32) accumulator's dtype, handed to AdamW
      # in the gradients' dtype, as token_weighted_multistep does.
      mean = jax.tree.map(
        lambda g, p: (g / acc_tokens.astype(g.dtype)).astype(p.dtype),
        acc,
        params,
      )
      updates, opt_state = adamw.update(mean, opt_state, params)
      zeros = jax.tree.map(jnp.zeros_like, acc)
      params = optax.apply_updates(params, updates)
      return params, opt_state, zeros, jnp.zeros_like(acc_tokens)

    self._opt_state = adamw.init(self._params)
    self._acc = jax.tree.map(
      lambda p: jnp.zeros_like(p, jnp.promote_types(p.dtype, jnp.float32)),
      self._params,
    )
    self._acc_tokens = jnp.zeros([], jnp.int32)
    batch = self.window()[0]
    self.compiled['micro_step'] = micro_step.lower(
      self._params, self._acc, self._acc_tokens, batch
    ).compile()
    self.compiled['window_update'] = window_update.lower(
      self._params, self._opt_state, self._acc, self._acc_tokens
    ).compile()

    def run(window):
      for batch in window:
        self._acc, self._acc_tokens = micro_step(
          self._params, self._acc, self._acc_tokens, batch
        )
      self._params, self._opt_state, self._acc, self._acc_tokens = (
        window_update(
          self._params, self._opt_state, self._acc, self._acc_tokens
        )
      )

    self._run_window = run

  def _setup_tokacc_flax(self):
    import jax  # noqa: PLC0415

    import optax_tokacc as tokacc  # noqa: PLC0415
    from optax_tokacc.flax import TrainState  # noqa: PLC0415

    model = self.model

    @functools.partial(jax.jit, donate_argnums=(0,))
    def step(state, batch):
      grads, num_tokens = jax.grad(model.loss_sum, has_aux=True)(
        state.params, batch
      )
      return state.apply_gradients(grads=grads, num_tokens=num_tokens)

    self._state = TrainState.create(
      apply_fn=None,
      params=self._params,
      tx=tokacc.token_weighted_multistep(self.adamw, self.k),
    )
    self.compiled['step'] = step.lower(self._state, self.window()[0]).compile()

    def run(window):
      for batch in window:
        self._state = step(self._state, batch)

    self._run_window = run
    self.final_params = lambda: self._state.params

  def _setup_microbatched(self):
    import jax  # noqa: PLC0415
    import jax.numpy as jnp  # noqa: PLC0415
    import optax  # noqa: PLC0415

    import optax_tokacc as tokacc  # noqa: PLC0415

    model, adamw = self.model, self.adamw
    micro_size = jax.tree.leaves(self.window()[0])[0].shape[0]
    value_and_grad = tokacc.microbatched_value_and_grad(
      model.loss_sum, micro_size
    )

    @functools.partial(jax.jit, donate_argnums=(0, 1))
    def step(params, opt_state, batch):
      (_, num_tokens), grads = value_and_grad(params, batch)
      mean = jax.tree.map(lambda g: g / num_tokens.astype(g.dtype), grads)
      updates, opt_state = adamw.update(mean, opt_state, params)
      return optax.apply_updates(params, updates), opt_state

    def concatenate(window):
      return jax.tree.map(lambda *xs: jnp.concatenate(xs), *window)

    self._windows = [concatenate(w) for w in self.model.windows]
    self._opt_state = adamw.init(self._params)
    self.compiled['window_step'] = step.lower(
      self._params, self._opt_state, self._windows[0]
    ).compile()

    def run(window):
      del window
      index = self.windows_done % len(self._windows)
      self._params, self._opt_state = step(
        self._params, self._opt_state, self._windows[index]
      )

    self._run_window = run


def max_difference(params, reference):
  """The largest absolute difference between two parameter trees."""
  import jax  # noqa: PLC0415
  import jax.numpy as jnp  # noqa: PLC0415

  differences = jax.tree.map(
    lambda a, b: float(jnp.max(jnp.abs(a - b))), params, reference
  )
  return max(jax.tree.leaves(differences))


def bench_model(model_name, setting, k, method_names, windows, warmup):
  """Rows of one model and k: time per window, ratios, memory, check."""
  import _models  # noqa: PLC0415
  import jax.numpy as jnp  # noqa: PLC0415
  import optax  # noqa: PLC0415

  model = _models.build(model_name, setting, k)
  adamw = optax.adamw(1e-4, mu_dtype=model.mu_dtype)
  methods = {}
  for name in method_names:
    try:
      methods[name] = Method(name, model, k, adamw)
    except ImportError as e:
      print(f'  skipped {name}: {e}', file=sys.stderr)
  times = {name: [] for name in methods}
  differences = {}
  for window in range(warmup + windows):
    for name, method in methods.items():
      start = time.perf_counter()
      method.run_window()
      times[name].append(time.perf_counter() - start)
    if window == 0 and 'ideal' in methods:
      # After one window all exact methods hold the same parameters up to
      # rounding. (Later, AdamW's normalization of near-zero gradient
      # entries lets rounding differences grow to ~lr.)
      reference = methods['ideal'].final_params()
      differences = {
        name: max_difference(method.final_params(), reference)
        for name, method in methods.items()
        if name not in ('plain', 'multisteps')
      }
  medians = {name: statistics.median(t[warmup:]) for name, t in times.items()}
  rows = []
  for name, method in methods.items():
    row = {
      'model': model_name,
      'model_description': model.description,
      'param_dtype': model.param_dtype,
      'mu_dtype': model.mu_dtype and jnp.dtype(model.mu_dtype).name,
      'num_params': model.num_params,
      'param_bytes': model.param_bytes,
      'k': k,
      'method': name,
      'median_window_s': medians[name],
      'window_times_s': times[name][warmup:],
      'ratio_to_ideal': (
        medians[name] / medians['ideal'] if 'ideal' in medians else None
      ),
      'ratio_to_multisteps': (
        medians[name] / medians['multisteps']
        if 'multisteps' in medians
        else None
      ),
      'memory': {
        label: memory(compiled, model.param_bytes)
        for label, compiled in method.compiled.items()
      },
      'max_abs_diff_to_ideal_after_one_window': differences.get(name),
    }
    rows.append(row)
  return rows


def count_collectives(devices, ks):
  """Rows of benchmarks/collectives.py on fake devices, or None without it."""
  try:
    import collectives  # noqa: PLC0415
  except ImportError:
    return None
  return collectives.run(devices, ks)


def _ratio(value):
  return '' if value is None else f'{value:.2f}x'


def print_table(rows):
  print(
    f'{"model":<12}{"k":>2} {"method":<13}{"ms/window":>10}{"/ideal":>8}'
    f'{"/MultiSteps":>12}  {"compiled temp / param bytes":<34}'
    f'{"max|dp|":>9}'
  )
  for row in rows:
    temps = ' '.join(
      f'{label}={m["temp_over_params"]:.3f}'
      for label, m in row['memory'].items()
    )
    diff = row['max_abs_diff_to_ideal_after_one_window']
    print(
      f'{row["model"]:<12}{row["k"]:>2} {row["method"]:<13}'
      f'{1e3 * row["median_window_s"]:>10.1f}'
      f'{_ratio(row["ratio_to_ideal"]):>8}'
      f'{_ratio(row["ratio_to_multisteps"]):>12}  {temps:<34}'
      f'{"" if diff is None else f"{diff:.1e}":>9}'
    )


def print_collectives(rows):
  import collectives  # noqa: PLC0415

  print(f'\ncollectives on {rows[0]["devices"]} fake CPU devices:')
  collectives.print_table(rows)


def _git(*args):
  """The output of a git command in this repository ('' if it fails)."""
  try:
    return subprocess.run(
      ['git', *args],
      capture_output=True,
      text=True,
      cwd=os.path.dirname(os.path.abspath(__file__)),
      timeout=10,
    ).stdout.strip()
  except (OSError, subprocess.SubprocessError):
    return ''


def machine():
  import jax  # noqa: PLC0415
  import optax  # noqa: PLC0415

  device = jax.devices()[0]
  return {
    'date': time.strftime('%Y-%m-%d %H:%M %Z'),
    'commit': _git('rev-parse', 'HEAD'),
    'library_changes_uncommitted': bool(
      _git('status', '--porcelain', '--', '../optax_tokacc')
    ),
    'optax': optax.__version__,
    'platform': platform.platform(),
    'processor': platform.processor(),
    'cpu_count': os.cpu_count(),
    'device': f'{device.platform}: {device.device_kind}',
    'jax': jax.__version__,
    'python': platform.python_version(),
  }


def parse_args(argv=None):
  """The command line, with the setting's defaults filled in."""
  parser = argparse.ArgumentParser(
    description=__doc__.splitlines()[0],
    formatter_class=argparse.RawDescriptionHelpFormatter,
  )
  parser.add_argument('--quick', action='store_true', help='< 2 min, 2 cores')
  parser.add_argument('--tiny', action='store_true', help='smoke-test sizes')
  parser.add_argument('--models', default=None, help=','.join(MODEL_NAMES))
  parser.add_argument('--methods', default=','.join(METHODS))
  parser.add_argument('--k', default=None, help='e.g. 4,8')
  parser.add_argument('--windows', type=int, default=None)
  parser.add_argument('--warmup', type=int, default=None)
  parser.add_argument(
    '--devices',
    type=int,
    default=8,
    help='fake CPU devices for the collective counts (0: skip them)',
  )
  parser.add_argument('--out', help='write the results as JSON to this file')
  args = parser.parse_args(argv)
  args.setting = 'tiny' if args.tiny else 'quick' if args.quick else 'full'
  defaults = SETTINGS[args.setting]
  try:
    args.methods = parse_names(args.methods, METHODS, 'method')
    args.models = parse_names(
      args.models or ','.join(defaults['models']), MODEL_NAMES, 'model'
    )
    args.ks = parse_ks(args.k) if args.k else defaults['ks']
  except ValueError as e:
    parser.error(str(e))
  for name in ('windows', 'warmup'):
    if getattr(args, name) is None:
      setattr(args, name, defaults[name])
  if args.windows < 1 or args.warmup < 0:
    parser.error('--windows must be >= 1 and --warmup >= 0.')
  return args


def main(argv=None):
  args = parse_args(argv)
  import jax  # noqa: PLC0415

  if args.devices:
    try:
      jax.config.update('jax_num_cpu_devices', args.devices)
    except RuntimeError:
      pass  # A backend already runs (e.g. under pytest): use its devices.
  info = machine()
  print(f'{info["device"]}, {info["cpu_count"]} CPUs, jax {info["jax"]}')
  rows = []
  for model_name in args.models:
    for k in args.ks:
      print(
        f'  {model_name}, k={k}: {", ".join(args.methods)}', file=sys.stderr
      )
      rows += bench_model(
        model_name, args.setting, k, args.methods, args.windows, args.warmup
      )
  print_table(rows)
  collective_rows = None
  if args.devices and len(jax.devices('cpu')) >= args.devices:
    collective_rows = count_collectives(args.devices, args.ks)
    if collective_rows is not None:
      print_collectives(collective_rows)
  if args.out:
    results = {
      'setting': args.setting,
      'command': ' '.join(
        ['python', 'benchmarks/run.py'] + list(argv or sys.argv[1:])
      ),
      'machine': info,
      'windows': args.windows,
      'warmup': args.warmup,
      'rows': rows,
      'collectives': collective_rows,
    }
    with open(args.out, 'w') as f:
      json.dump(results, f, indent=2)
  return rows


if __name__ == '__main__':
  main()
