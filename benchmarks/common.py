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
"""What ``run.py`` and ``collectives.py`` share: the command line's names,
fake CPU devices, the machine measured, JSON, parameter differences.

Modules here import JAX only inside functions, so that a script can set the
number of fake CPU devices before any backend starts.
"""

import json
import os
import platform
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))


def parse_names(text, valid, what):
  """Comma-separated names, each one of ``valid``, else a ValueError that
  lists the valid ones."""
  names = tuple(name.strip() for name in text.split(',') if name.strip())
  unknown = [name for name in names if name not in valid]
  if unknown or not names:
    raise ValueError(
      f'Unknown {what} {", ".join(map(repr, unknown)) or "(none given)"}; '
      f'valid {what}s: {", ".join(valid)}.'
    )
  return names


def parse_ks(text):
  """Window sizes ``'4,8'`` as ``(4, 8)``, else a ValueError."""
  try:
    ks = tuple(int(k) for k in text.split(','))
  except ValueError:
    ks = ()
  if not ks or min(ks) < 1:
    raise ValueError(f'--k must be integers >= 1, e.g. 4,8; got {text!r}.')
  return ks


def use_cpu_devices(num_devices):
  """Asks for ``num_devices`` fake CPU devices (kept as they are if a
  backend already runs, e.g. under pytest). Collectives are counted on
  these whatever the accelerator."""
  import jax  # noqa: PLC0415

  try:
    jax.config.update('jax_num_cpu_devices', num_devices)
  except RuntimeError:
    pass


def _git(*args):
  """The output of a git command in this repository ('' if it fails)."""
  try:
    return subprocess.run(
      ['git', *args],
      capture_output=True,
      text=True,
      cwd=HERE,
      timeout=10,
    ).stdout.strip()
  except (OSError, subprocess.SubprocessError):
    return ''


def machine():
  """The machine, versions, date and git commit of a measurement."""
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


def command(name, argv):
  """The command line that produced a result, for its JSON."""
  args = sys.argv[1:] if argv is None else list(argv)
  return ' '.join(['python -m', f'benchmarks.{name}', *map(str, args)])


def write_json(path, results):
  with open(path, 'w') as f:
    json.dump(results, f, indent=2)


def max_difference(params, reference):
  """The largest absolute difference between two parameter trees (host
  copies: sharded, reduced and bfloat16 arrays alike)."""
  import jax  # noqa: PLC0415
  import numpy as np  # noqa: PLC0415

  def difference(a, b):
    a = np.asarray(a, np.float64)
    return float(np.max(np.abs(a - np.asarray(b, np.float64))))

  return max(jax.tree.leaves(jax.tree.map(difference, params, reference)))


def bytes_per_device(tree):
  """The most bytes of ``tree``'s arrays that one device holds (its
  addressable shards; the whole array where it is not sharded)."""
  import collections  # noqa: PLC0415

  import jax  # noqa: PLC0415

  held = collections.Counter()
  for leaf in jax.tree.leaves(tree):
    for shard in getattr(leaf, 'addressable_shards', ()):
      held[shard.device] += shard.data.nbytes
  return max(held.values(), default=0)


def describe_error(error):
  """One line for a pattern or method that failed: type and message."""
  first_line = str(error).strip().splitlines()[0] if str(error) else ''
  return f'{type(error).__name__}: {first_line}'[:300]
