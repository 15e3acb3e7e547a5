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
"""Interleaved timing of ``run.py``'s methods: per micro-step and per window.

Windows of all methods are interleaved round robin, so that load from other
processes spreads over all of them. A window is timed in two parts, each
ended by blocking on everything the method carries: its first ``k - 1``
calls (the micro-steps, which do not close the window; their mean is the
window's micro-step time) and its closing call (for the ideal, its last
micro-step and the window's update). The window's time is the sum: from its
first call to the end of its last. The one block between the two parts is
the only difference from timing the window alone, the same for every method.
"""

import statistics
import time
from typing import NamedTuple


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
  ``index`` of ``trainer`` (a ``_methods.Trainer``)."""
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
  trainers, k, windows, warmup, after_first_window=None, deadline=None
):
  """Times ``warmup + windows`` windows of every trainer, round robin.

  Args:
    trainers: name -> ``_methods.Trainer``.
    k: micro-batches per window.
    windows: windows timed (after warm-up), at most.
    warmup: windows run first and not kept (the first call of a jitted
      function compiles it).
    after_first_window: called once every trainer has run one window.
    deadline: a ``time.perf_counter()`` value: no round of windows starts
      after it once 2 windows are timed (``device_check.py``
      fits its windows into a time budget). None: no deadline.

  Returns:
    name -> :class:`Times` of the timed windows.
  """
  times = {name: Times([], [], []) for name in trainers}
  for index in range(warmup + windows):
    timed = index - warmup
    if deadline is not None and timed >= 2 and time.perf_counter() > deadline:
      break
    for name, trainer in trainers.items():
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


def median(values):
  """The median of ``values``, None if there are none."""
  return statistics.median(values) if values else None


def ratio(value, reference):
  """``value / reference``, None if either is missing."""
  if value is None or not reference:
    return None
  return value / reference
