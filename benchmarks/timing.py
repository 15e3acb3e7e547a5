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
"""Timing of trainers: interleaved windows, and whether the host waits.

Windows of all methods are interleaved round robin, so that load from other
processes spreads over all of them. A window is timed in two parts, each
ended by blocking on everything the method carries: its first ``k - 1``
calls (the micro-steps, which do not close the window; their mean is the
window's micro-step time) and its closing call (for the ideal, its last
micro-step and the window's update). The window's time is the sum: from its
first call to the end of its last. The one block between the two parts is
the only difference from timing the window alone, the same for every method.

:func:`dispatch` and :func:`profile` ask whether a step's ``lax.cond``
makes the host wait (``device_check.py``). JAX dispatches asynchronously: a
call returns once its program is queued, so a host that queues calls
without blocking spends a small part of their device time, unless a
conditional whose predicate the host must read (XLA copies it to the host
unless the device runs the branch itself) makes each call wait for the
work before it. :func:`profile_open_micro_step` reads the device's
events of one open (not closing) micro-step: its kernels, their time and
its memory copies.
"""

import collections
import glob
import os
import re
import shutil
import tempfile
import time
from typing import NamedTuple

import jax

from benchmarks import methods
from benchmarks import report


class Times(NamedTuple):
  """Seconds per timed window (after warm-up), one entry per window.

  Attributes:
    micro_step: mean time of the window's micro-steps (empty when there are
      none: ``k = 1``, or a method that takes the window in one call).
    closing_step: time of the call that closes the window.
    window: time of the whole window.
  """

  micro_step: list
  closing_step: list
  window: list


def time_window(trainer, index, k):
  """``(micro-step or None, closing step, window)`` seconds of window
  ``index`` of ``trainer`` (a ``trainers.Trainer``)."""
  start = time.perf_counter()
  trainer.run_micro_steps(index)
  trainer.block()
  middle = time.perf_counter()
  trainer.run_closing_step(index)
  trainer.block()
  end = time.perf_counter()
  micro_step = None
  if k > 1 and trainer.micro_step is not None:
    micro_step = (middle - start) / (k - 1)
  return micro_step, end - middle, end - start


def interleave(
  built, k, windows, warmup, after_first_window=None, deadline=None
):
  """Times ``warmup + windows`` windows of every trainer, round robin.

  Args:
    built: name -> ``trainers.Trainer``.
    k: micro-batches per window.
    windows: windows timed (after warm-up), at most.
    warmup: windows run first and not kept (the first call of a jitted
      function compiles it).
    after_first_window: called once every trainer has run one window.
    deadline: a ``time.perf_counter()`` value: no round of windows starts
      after it once 2 windows are timed (``device_check.py`` fits its
      windows into a time budget). None: no deadline.

  Returns:
    name -> :class:`Times` of the timed windows.
  """
  times = {name: Times([], [], []) for name in built}
  for index in range(warmup + windows):
    timed = index - warmup
    if deadline is not None and timed >= 2 and time.perf_counter() > deadline:
      break
    for name, trainer in built.items():
      micro_step, closing_step, window = time_window(trainer, index, k)
      if index < warmup:
        continue
      if micro_step is not None:
        times[name].micro_step.append(micro_step)
      times[name].closing_step.append(closing_step)
      times[name].window.append(window)
    if index == 0 and after_first_window is not None:
      after_first_window()
  return times


def measure(case, names, windows, warmup, deadline=None):
  """``(rows, trainers)``: the methods ``names`` built on ``case``, timed
  interleaved (:func:`interleave`), checked against their references after
  the first window; the rows of ``report.rows``."""
  built = methods.build_all(case, names)
  differences = {}

  def check():
    differences.update(methods.differences(built))

  times = interleave(built, case.k, windows, warmup, check, deadline)
  return report.rows(case, built, times, differences), built


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
    planes = [_plane_summary(plane, top) for plane in _read_planes(folder)]
  except Exception as e:  # noqa: BLE001 - a profile is a bonus
    return {'error': f'{type(e).__name__}: {str(e)[:200]}'}
  return {'planes': [plane for plane in planes if plane['events']]}


# Lines of a device plane that the profiler derives from its streams'
# events (each event again): not counted.
_DERIVED_LINES = (
  'XLA Modules',
  'XLA Ops',
  'XLA TraceMe',
  'Steps',
  'Framework Name Scope',
  'Framework Ops',
  'Source code',
  'Launch Stats',
)


def _read_planes(folder):
  """The planes of the one trace written under ``folder``."""
  paths = glob.glob(os.path.join(folder, '**', '*.xplane.pb'), recursive=True)
  from jax.profiler import ProfileData  # noqa: PLC0415 - newer JAX only

  return list(ProfileData.from_file(paths[0]).planes)


def _device_events(plane):
  """The events of a device plane's streams (kernels and copies)."""
  lines = [line for line in plane.lines if line.name not in _DERIVED_LINES]
  streams = [line for line in lines if line.name.lower().startswith('stream')]
  return [event for line in streams or lines for event in line.events]


def copy_bytes(event):
  """The bytes a memory copy moves, from its stats (CUPTI's
  ``memcpy_details``: ``... size:N ...``), or None where none says."""
  for name, value in event.stats:
    if isinstance(value, str) and 'size:' in value:
      found = re.search(r'size:\s*(\d+)', value)
      if found:
        return int(found.group(1))
    if name in ('bytes', 'size', 'num_bytes') and isinstance(value, int):
      return value
  return None


def kernel_summary(plane, sizes, top=12):
  """One device plane's events: kernels, their total time, the memory
  copies and how many of them move a buffer of a parameter's size
  (``sizes``: bytes), of those whose size is readable (None where none
  is: then nobody knows)."""
  events = _device_events(plane)
  copies = [e for e in events if 'memcpy' in e.name.lower()]
  moved = [n for n in map(copy_bytes, copies) if n is not None]
  totals = collections.Counter()
  counts = collections.Counter()
  for event in events:
    totals[event.name] += event.duration_ns
    counts[event.name] += 1
  readable = bool(moved) or not copies
  return {
    'plane': plane.name,
    'lines': sorted({line.name for line in plane.lines})[:20],
    'events': len(events),
    'kernels': len(events) - len(copies),
    'device_us': sum(totals.values()) / 1e3,
    'memcpy': len(copies),
    'memcpy_size_unknown': len(copies) - len(moved),
    'memcpy_bytes': sum(moved) if readable else None,
    'memcpy_parameter_sized': (
      sum(n in sizes for n in moved) if readable else None
    ),
    'longest': [
      {'name': name[:120], 'count': counts[name], 'us': total / 1e3}
      for name, total in totals.most_common(top)
    ],
  }


def parameter_sizes(params):
  """The bytes of each parameter large enough to matter (at least 1/1000
  of them all), in its dtype and in float32 (the accumulator's)."""
  leaves = jax.tree.leaves(params)
  least = sum(x.nbytes for x in leaves) / 1000
  sizes = {n for x in leaves for n in (x.nbytes, 4 * x.size) if n >= least}
  return sorted(sizes)


def _device_plane_summary(planes, sizes):
  device = [plane for plane in planes if plane.name.startswith('/device:')]
  if not device:
    names = ', '.join(plane.name for plane in planes) or 'none'
    return {'note': f'no device plane in the profile (planes: {names})'}
  return kernel_summary(device[0], sizes)


def profile_open_micro_step(trainer, index, sizes):
  """The device's events of one open micro-step of ``trainer``: window
  ``index``'s last micro-step that does not close it, run alone under
  ``jax.profiler.trace`` (the ones before it first, the closing step
  after it, so the window stays whole). :func:`kernel_summary` of the
  first device plane, ``{'note': ...}`` where the profile has none (a
  CPU), ``{'error': ...}`` where it cannot be read."""
  window = trainer.windows[index % len(trainer.windows)]
  *before, open_batch = window.micro_batches[:-1]
  for batch in before:
    trainer.carry = trainer.micro_step(trainer.carry, batch)
  trainer.block()
  folder = tempfile.mkdtemp(prefix='device_check_open_step_')
  try:
    with jax.profiler.trace(folder):
      trainer.carry = trainer.micro_step(trainer.carry, open_batch)
      trainer.block()
    summary = _device_plane_summary(_read_planes(folder), set(sizes))
  except Exception as e:  # noqa: BLE001 - reported in its row
    summary = {'error': f'{type(e).__name__}: {str(e)[:200]}'}
  finally:
    shutil.rmtree(folder, ignore_errors=True)
  trainer.run_closing_step(index)
  trainer.block()
  return summary


def profile_open_micro_steps(built, index, params):
  """:func:`profile_open_micro_step` of each trainer of ``built``, with
  each one's device time over the ideal's (``ratio_to_ideal``)."""
  sizes = parameter_sizes(params)
  out = {
    name: profile_open_micro_step(trainer, index, sizes)
    for name, trainer in built.items()
    if trainer.micro_step is not None
  }
  ideal = out.get('ideal', {}).get('device_us')
  for summary in out.values():
    if 'device_us' in summary:
      summary['ratio_to_ideal'] = report.ratio(summary['device_us'], ideal)
  return out
