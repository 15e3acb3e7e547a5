"""Test configuration: several fake CPU devices, set before any backend.

``OPTAX_TOKACC_TEST_PLATFORM`` (default ``cpu``) names another platform to
run on, e.g. ``cuda``: ``benchmarks/device_check.py`` runs the single-device
exactness tests on an accelerator so. The fake CPU devices are then not
made, and tests that need several devices are not meant to run there.

The matmul precision a test assumes (DESIGN.md: "Exactness is stated at
the platform's matmul precision"): float32, unless it says otherwise.
Every test that compares with a reference within float32 round-off
(``helpers.UNIT_ROUND_OFF``, ``helpers.round_off_atol``) assumes float32
matmuls, which a CPU does by default and an accelerator does not (NVIDIA
GPUs multiply float32 in TF32, TPUs in bfloat16). So on a platform other
than the CPU, JAX's default matmul precision is ``'highest'`` for the whole
session (:data:`ASSUMED_MATMUL_PRECISION`, set once here, before any test
or fixture traces); on the CPU nothing is set, and results are the same
bits as without this rule. A test about what a user gets at the platform's
default precision says so with ``@pytest.mark.platform_precision``: it runs
with the default precision unset (:func:`matmul_precision`), and takes its
bounds from ``helpers.default_matmul_unit_round_off()``
(``tests/test_precision.py``).

Every test has a wall-clock limit (:func:`limit_s`), kept by
:func:`pytest_runtest_protocol`.
"""

import faulthandler
import os
import pathlib
import sys

import jax
import pytest

NUM_DEVICES = 8
PLATFORM = os.environ.get('OPTAX_TOKACC_TEST_PLATFORM', 'cpu')
# The accelerator tier (tests/accelerators/: programs compiled for GPUs and
# TPUs on this CPU) needs the compilers of the ``accelerators`` extra, and
# runs in its own session (``nox -s accelerators``), which sets this: there
# a missing compiler fails its tests; elsewhere the tier is not collected.
ACCELERATORS = os.environ.get('OPTAX_TOKACC_ACCELERATORS') == '1'
collect_ignore = [] if ACCELERATORS else ['accelerators']

jax.config.update('jax_platforms', PLATFORM)
if PLATFORM == 'cpu':
  jax.config.update('jax_num_cpu_devices', NUM_DEVICES)

# float32 matmuls: the CPU's default; an accelerator's on request.
ASSUMED_MATMUL_PRECISION = None if PLATFORM == 'cpu' else 'highest'
if ASSUMED_MATMUL_PRECISION is not None:
  jax.config.update('jax_default_matmul_precision', ASSUMED_MATMUL_PRECISION)


def pytest_report_header():
  assumed = ASSUMED_MATMUL_PRECISION or "the platform's default (float32)"
  tier = 'collected' if ACCELERATORS else 'not collected (nox -s accelerators)'
  return (
    f'optax_tokacc tests on {PLATFORM}, matmul precision: {assumed}; '
    "tests marked platform_precision: the platform's default; "
    f'accelerator tier: {tier}'
  )


@pytest.fixture(autouse=True)
def matmul_precision(request):
  """A test marked ``platform_precision`` runs at the platform's default
  matmul precision (JAX's, unset: TF32 on NVIDIA GPUs), whatever the
  session or ``JAX_DEFAULT_MATMUL_PRECISION`` set (its fixtures of a
  wider scope run at the session's); any other test at the session's
  (:data:`ASSUMED_MATMUL_PRECISION`)."""
  if request.node.get_closest_marker('platform_precision') is None:
    yield
    return
  with jax.default_matmul_precision(None):
    yield


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


# The accelerator tier's tests compile for a target: the first of a
# target's group compiles its programs (7 of a 16.8 MB MLP) for every test
# of the group, 50 s for a TPU v6e on a 2-core machine shared with other
# work, the longest measured; with a worker lost at the limit, xdist gives
# its group to the other worker, which compiles it again. 900 s is 18x.
ACCELERATOR_LIMIT_S = 900


def limit_s(item: pytest.Item) -> float:
  """:data:`LIMIT_S` (:data:`ACCELERATOR_LIMIT_S` in the accelerator
  tier), plus the limits of the processes the test waits on (its
  ``waits_on_processes`` marker): theirs fire first, and report the
  process's output."""
  limit = LIMIT_S
  if 'accelerators' in item.path.parts:
    limit = ACCELERATOR_LIMIT_S
  marker = item.get_closest_marker('waits_on_processes')
  if marker is None:
    return limit
  return limit + marker.args[0]


def pytest_addoption(parser):
  parser.addoption(
    '--program-digests',
    metavar='DIR',
    help='record a digest of every compiled program the tests read, per '
    'test, in DIR (tests/program_digests.py compares two such records)',
  )


def pytest_configure(config):
  # stderr as it is now: pytest captures fd 2 around each test
  config.stash[WATCHDOG_FD] = os.dup(sys.stderr.fileno())
  directory = config.getoption('program_digests')
  if directory:
    import program_digests  # only when asked: it patches testing.hlo

    recorder = program_digests.Recorder(pathlib.Path(directory))
    config.pluginmanager.register(recorder, 'program_digests')


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
