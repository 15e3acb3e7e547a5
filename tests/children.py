"""The Python processes that tests start, each an entry point of this module.

    python -m children NAME ARGS...

A test starts one with :func:`run` (or, for several at once, builds the
command with :func:`command`): from this folder, in the environment of
``helpers.subprocess_env``, which puts this folder and the ``optax_tokacc``
of the test (the checkout or the installed wheel) on ``PYTHONPATH``, so that
no process edits ``sys.path``, and the release session's run from the
unpacked sdist tests the wheel in its children too.

Each entry point sets up JAX for its process (the platform, the number of
CPU devices) before anything starts a backend, then runs the work that the
test's file defines beside the test that checks it, importing that file in
this process only:

- ``checkpoint``: ``test_checkpoint.save_or_resume`` (8 devices);
- ``checkpoint_on_one_device``: ``test_checkpoint_anywhere.
  finish_on_one_device`` (1 device);
- ``explicit_checkpoint``: ``test_checkpoint_anywhere.save_or_resume`` (8
  devices);
- ``rejected_micro_batches``: ``test_data_parallel.rejected_micro_batches``
  (8 devices);
- ``mixed_runs_bit_for_bit``: the runs of ``test_host_close.mixed_runs``
  bit for bit (started without FMA: ``XLA_FLAGS``);
- ``multihost``: one process of ``multihost_worker``'s ``jax.distributed``
  job (it joins the job and sets its devices itself);
- ``devices``: sets its number of CPU devices and prints it (what
  ``test_checkpoint`` runs to show that importing this module, and so
  ``helpers``, starts no backend).
"""

from collections.abc import Callable
import subprocess
import sys

import helpers
import jax


def command(name: str, *args: object) -> list[str]:
  """The command line of entry point ``name`` with ``args``."""
  return [sys.executable, '-m', 'children', name, *map(str, args)]


def run(
  name: str,
  *args: object,
  limit_s: float,
  env: dict[str, str] | None = None,
) -> subprocess.CompletedProcess:
  """Runs entry point ``name`` to completion, or raises
  ``subprocess.TimeoutExpired`` after ``limit_s`` (a hang guard); ``env``
  is ``helpers.subprocess_env()`` unless given (built by it)."""
  return subprocess.run(
    command(name, *args),
    capture_output=True,
    text=True,
    env=helpers.subprocess_env() if env is None else env,
    cwd=helpers.TESTS_DIR,
    timeout=limit_s,
  )


def _use_cpu(num_devices: int | None = None) -> None:
  jax.config.update('jax_platforms', 'cpu')
  if num_devices is not None:
    jax.config.update('jax_num_cpu_devices', num_devices)


# The entry points. Each imports its test's file after JAX is set up.


def checkpoint(role: str, path: str, variant: str, stop_at: str) -> None:
  _use_cpu(8)
  import test_checkpoint

  test_checkpoint.save_or_resume(role, path, variant, stop_at)


def checkpoint_on_one_device(path: str, out: str) -> None:
  _use_cpu(1)
  import test_checkpoint_anywhere

  test_checkpoint_anywhere.finish_on_one_device(path, out)


def explicit_checkpoint(role: str, path: str, variant: str) -> None:
  _use_cpu(8)
  import test_checkpoint_anywhere

  test_checkpoint_anywhere.save_or_resume(role, path, variant)


def rejected_micro_batches(mode: str) -> None:
  _use_cpu(8)
  import test_data_parallel

  test_data_parallel.rejected_micro_batches(mode)
  print('data-parallel skip run equals full-batch training')


def mixed_runs_bit_for_bit(name: str) -> None:
  _use_cpu()
  import test_host_close

  for _, actual, expected in test_host_close.mixed_runs(name):
    test_host_close.assert_same_run(actual, expected)


def devices(count: str) -> None:
  _use_cpu(int(count))
  print(jax.device_count())


def multihost(*args: str) -> None:
  import multihost_worker

  multihost_worker.main(args)


ENTRY_POINTS: dict[str, Callable[..., None]] = {
  'checkpoint': checkpoint,
  'checkpoint_on_one_device': checkpoint_on_one_device,
  'explicit_checkpoint': explicit_checkpoint,
  'rejected_micro_batches': rejected_micro_batches,
  'mixed_runs_bit_for_bit': mixed_runs_bit_for_bit,
  'multihost': multihost,
  'devices': devices,
}


if __name__ == '__main__':
  entry_point, *arguments = sys.argv[1:]
  ENTRY_POINTS[entry_point](*arguments)
