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
"""Prints ``test_one_device.FLOORS`` from the programs compiled now:

    JAX_PLATFORMS=cpu python tests/accelerators/floors.py

(with the ``accelerators`` extra installed), to tighten the floors after a
change that lowers them; each figure rounded up at its last digit.
"""

import math
import os
import pathlib
import sys

if __name__ == '__main__':
  here = pathlib.Path(__file__).resolve().parent
  sys.path[:0] = [str(here.parent), str(here)]
  os.environ.setdefault('JAX_PLATFORMS', 'cpu')
  import conftest  # noqa: F401 - JAX's devices, as the tests have them
  import test_one_device

  def up(value, digits=3):
    return math.ceil(value * 10**digits) / 10**digits

  for target in test_one_device.TARGETS:
    for dtype in test_one_device.DTYPES:
      for mode in test_one_device.OURS:
        traffic, kernels, temp, window = test_one_device.figures(
          target, dtype, mode
        )
        print(
          f'  ({target!r}, {dtype!r}, {mode!r}): '
          f'({up(traffic)}, {kernels}, {up(temp)}, {up(window)}),'
        )
