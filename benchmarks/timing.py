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
work before it.
"""

import collections
import glob
import os
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
    paths = glob.glob(os.path.join(folder, '**', '*.xplane.pb'), recursive=True)
    from jax.profiler import ProfileData  # noqa: PLC0415 - newer JAX only

    data = ProfileData.from_file(paths[0])
    planes = [_plane_summary(plane, top) for plane in data.planes]
  except Exception as e:  # noqa: BLE001 - a profile is a bonus
    return {'error': f'{type(e).__name__}: {str(e)[:200]}'}
  return {'planes': [plane for plane in planes if plane['events']]}
