"""Test configuration: several fake CPU devices, set before any backend.

``OPTAX_TOKACC_TEST_PLATFORM`` (default ``cpu``) names another platform to
run on, e.g. ``cuda``: ``benchmarks/device_check.py`` runs the single-device
exactness tests on an accelerator so. The fake CPU devices are then not
made, and tests that need several devices are not meant to run there.
"""

import os

import jax

NUM_DEVICES = 8
PLATFORM = os.environ.get('OPTAX_TOKACC_TEST_PLATFORM', 'cpu')

jax.config.update('jax_platforms', PLATFORM)
if PLATFORM == 'cpu':
  jax.config.update('jax_num_cpu_devices', NUM_DEVICES)
