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
"""Does a step's ``lax.cond`` make the host wait? (``device_check.py``)

JAX dispatches asynchronously: a call returns once its program is queued,
so a host that queues ``n`` calls without blocking spends a small part of
their device time. A conditional whose predicate the host must read (XLA
copies it to the host unless the device runs the branch itself) makes each
call wait for the work before it: the time to queue the calls then nears
the time to run them. :func:`dispatch` measures both for whole windows of
a ``_methods.Trainer``; :func:`profile` traces one window with
``jax.profiler`` and summarizes the trace's events per plane (device to
host copies among them) where JAX can read the trace back.
"""

import collections
import glob
import os
import tempfile
import time

import jax


def dispatch(trainer, k, windows, first_index=0):
  """Seconds per micro-batch to queue ``windows`` windows of ``trainer``
  without blocking, and to run them (queued until done)."""
  trainer.block()
  start = time.perf_counter()
  for index in range(first_index, first_index + windows):
    trainer.run_micro_steps(index)
    trainer.run_closing_step(index)
  queued = time.perf_counter() - start
  trainer.block()
  done = time.perf_counter() - start
  calls = windows * k
  return {
    'windows': windows,
    'dispatch_s_per_micro_batch': queued / calls,
    'device_s_per_micro_batch': done / calls,
    'dispatch_over_device': queued / done,
  }


def _is_copy_to_host(name):
  name = name.lower()
  return 'memcpy' in name and any(
    tag in name for tag in ('dtoh', 'd2h', 'devicetohost', 'device to host')
  )


def _plane_summary(plane, top):
  """A trace plane's event count, its longest events by total time, and
  its device-to-host copies."""
  totals = collections.Counter()
  counts = collections.Counter()
  for line in plane.lines:
    for event in line.events:
      totals[event.name] += event.duration_ns
      counts[event.name] += 1
  return {
    'plane': plane.name,
    'events': sum(counts.values()),
    'device_to_host_copies': sum(
      n for name, n in counts.items() if _is_copy_to_host(name)
    ),
    'longest': [
      {'name': name[:120], 'count': counts[name], 'ms': total / 1e6}
      for name, total in totals.most_common(top)
    ],
  }


def profile(trainer, index, top=8):
  """One window of ``trainer`` under ``jax.profiler.trace``, summarized
  per plane; ``{'error': ...}`` where the trace cannot be read back."""
  trainer.block()
  folder = tempfile.mkdtemp(prefix='device_check_profile_')
  try:
    with jax.profiler.trace(folder):
      trainer.run_micro_steps(index)
      trainer.run_closing_step(index)
      trainer.block()
    paths = glob.glob(os.path.join(folder, '**', '*.xplane.pb'), recursive=True)
    from jax.profiler import ProfileData  # noqa: PLC0415 - newer JAX only

    data = ProfileData.from_file(paths[0])
    planes = [_plane_summary(plane, top) for plane in data.planes]
  except Exception as e:  # noqa: BLE001 - a profile is a bonus
    return {'error': f'{type(e).__name__}: {str(e)[:200]}'}
  return {'planes': [plane for plane in planes if plane['events']]}
