"""Test configuration: several fake CPU devices, set before any backend.

``OPTAX_TOKACC_TEST_PLATFORM`` (default ``cpu``) names another platform to
run on, e.g. ``cuda``: ``benchmarks/device_check.py`` runs the single-device
exactness tests on an accelerator so. The fake CPU devices are then not
made, and tests that need several devices are not meant to run there.
"""

import os
import pathlib

import jax
import pytest

NUM_DEVICES = 8
PLATFORM = os.environ.get('OPTAX_TOKACC_TEST_PLATFORM', 'cpu')

jax.config.update('jax_platforms', PLATFORM)
if PLATFORM == 'cpu':
  jax.config.update('jax_num_cpu_devices', NUM_DEVICES)


SLOW_TESTS = pathlib.Path(__file__).with_name('slow_tests.txt')


@pytest.hookimpl(tryfirst=True)  # before -m and -k deselect
def pytest_collection_modifyitems(config, items):
  """Marks ``slow`` the tests that ``slow_tests.txt`` names."""
  lines = SLOW_TESTS.read_text().splitlines()
  listed = {line for line in lines if line and not line.startswith('#')}
  collected = {item.nodeid for item in items}
  whole_modules = not any('::' in arg for arg in config.args)
  modules = {nodeid.split('::')[0] for nodeid in collected}
  stale = [n for n in listed - collected if n.split('::')[0] in modules]
  if whole_modules and stale:
    raise pytest.UsageError(
      f'tests/slow_tests.txt names tests that do not exist: {sorted(stale)}'
    )
  for item in items:
    if item.nodeid in listed:
      item.add_marker(pytest.mark.slow)
