"""Test configuration: several fake CPU devices, set before any backend.

``OPTAX_TOKACC_TEST_PLATFORM`` (default ``cpu``) names another platform to
run on, e.g. ``cuda``: ``benchmarks/device_check.py`` runs the single-device
exactness tests on an accelerator so. The fake CPU devices are then not
made, and tests that need several devices are not meant to run there.

Every test has a wall-clock limit (:func:`limit_s`), kept by
:func:`pytest_runtest_protocol`.
"""

import faulthandler
import os
import sys

import jax
import pytest

NUM_DEVICES = 8
PLATFORM = os.environ.get('OPTAX_TOKACC_TEST_PLATFORM', 'cpu')

jax.config.update('jax_platforms', PLATFORM)
if PLATFORM == 'cpu':
  jax.config.update('jax_num_cpu_devices', NUM_DEVICES)


# Every test's wall-clock limit, setup and teardown included. A test past
# it is taken for a hang: devices in different branches of a collective
# wait for each other inside XLA's C++, possibly holding the interpreter
# lock, where neither a signal handler nor a Python thread (pytest-timeout's
# two methods) runs. XLA on CPU aborts a collective stuck for 60 s itself
# (measured on jax 0.10.2 and 0.12); this limit is for the waits it does
# not end. The longest test took 37.8 s on a quiet 2-core run
# (CONTRIBUTING.md, "Wall-clock limits"): 300 s is 7.9x that, room for a
# loaded CI machine.
LIMIT_S = 300
WATCHDOG_FD = pytest.StashKey[int]()


def limit_s(item: pytest.Item) -> float:
  """:data:`LIMIT_S`, plus the limits of the processes the test waits on
  (its ``waits_on_processes`` marker): theirs fire first, and report the
  process's output."""
  marker = item.get_closest_marker('waits_on_processes')
  if marker is None:
    return LIMIT_S
  return LIMIT_S + marker.args[0]


def pytest_configure(config):
  # stderr as it is now: pytest captures fd 2 around each test
  config.stash[WATCHDOG_FD] = os.dup(sys.stderr.fileno())


def pytest_unconfigure(config):
  os.close(config.stash[WATCHDOG_FD])


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item):
  """Ends the test process when the test runs past :func:`limit_s`.

  faulthandler's watchdog is a C thread, which needs no interpreter lock:
  at the limit it prints every Python thread's stack (the test's function
  and line among them) and calls ``_exit(1)``. Under xdist the worker
  dies, xdist reports the test it was running as failed, naming it, and
  ``--max-worker-restart=0`` (``pyproject.toml``) starts no replacement:
  the run ends when the other workers finish what they were sent, instead
  of running the test again into the same hang.
  """
  fd = item.config.stash[WATCHDOG_FD]
  faulthandler.dump_traceback_later(limit_s(item), exit=True, file=fd)
  try:
    return (yield)
  finally:
    faulthandler.cancel_dump_traceback_later()
