"""Multi-host training: 2 local processes x 2 CPU devices each.

Each test starts two ``jax.distributed`` processes on loopback (gloo CPU
collectives), each running ``multihost_worker.py`` (``python -m children
multihost``) over the global mesh of 4 devices, and compares their result
with single-process full-batch training: data parallelism over all 4
devices, and HSDP on a ``('replica', 'fsdp') = (2, 2)`` mesh where each
process is one replica; explicit sharding, also with the optimizer state
sharded over the data axis (ZeRO-1).
"""

import socket
import subprocess

import chex
import children
import helpers
import multihost_worker as worker
import numpy as np
import pytest

from optax_tokacc import _typed_sharding

NUM_PROCESSES = 2
LOCAL_DEVICES = 2
NUM_DEVICES = NUM_PROCESSES * LOCAL_DEVICES
# Per worker process: 83 s on 2 loaded cores (load 17), 58 s CPU for the
# module; 600 s is 7x (issue 33).
TIMEOUT_S = 600

pytestmark = [
  pytest.mark.slow,  # each test starts Python processes
  # run_workers waits on each process in turn
  pytest.mark.waits_on_processes(NUM_PROCESSES * TIMEOUT_S),
]


def free_port():
  with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
    sock.bind(('127.0.0.1', 0))
    return sock.getsockname()[1]


def run_workers(tmp_path, mode='ddp'):
  """Runs the worker processes to completion (kills them all on failure);
  returns the arrays they saved."""
  out = tmp_path / 'result.npz'
  port = free_port()
  env = helpers.subprocess_env()
  env.pop('XLA_FLAGS', None)
  processes = [
    subprocess.Popen(
      children.command(
        'multihost',
        f'--process_id={i}',
        f'--num_processes={NUM_PROCESSES}',
        f'--port={port}',
        f'--local_devices={LOCAL_DEVICES}',
        f'--out={out}',
        f'--mode={mode}',
      ),
      env=env,
      cwd=helpers.TESTS_DIR,
      stdout=subprocess.PIPE,
      stderr=subprocess.STDOUT,
      text=True,
    )
    for i in range(NUM_PROCESSES)
  ]
  outputs = []
  try:
    for process in processes:
      output, _ = process.communicate(timeout=TIMEOUT_S)
      outputs.append(output)
  except subprocess.TimeoutExpired:
    outputs.append(f'timed out after {TIMEOUT_S} s')
  finally:
    for process in processes:
      if process.poll() is None:
        process.kill()
        process.wait()
  failed = [p.returncode for p in processes if p.returncode != 0]
  if failed or len(outputs) < NUM_PROCESSES:
    codes = [p.returncode for p in processes]
    pytest.fail(
      f'multi-host workers failed (exit codes {codes}):\n'
      + '\n----\n'.join(output[-3000:] for output in outputs)
    )
  return dict(np.load(out))


def test_two_processes_equal_full_batch(tmp_path):
  result = run_workers(tmp_path)
  assert int(result['num_devices']) == NUM_DEVICES

  windows = helpers.make_windows(worker.MULTIHOST_WINDOW_SIZES, NUM_DEVICES)
  expected = adamw_full_batch(windows)
  for prefix in ('shard_map', 'jit'):
    assert_equals_full_batch(result, prefix, expected)


def test_two_processes_hsdp_equal_full_batch(tmp_path):
  """HSDP, each process one replica: partial-manual (``axis_name='replica'``,
  ``fsdp`` by GSPMD) and fully manual (``axis_name=('replica', 'fsdp')``)."""
  result = run_workers(tmp_path, mode='hsdp')
  assert int(result['num_devices']) == NUM_DEVICES

  windows = helpers.make_windows(worker.MULTIHOST_WINDOW_SIZES, NUM_DEVICES)
  expected = adamw_full_batch(windows)
  for layout in worker.MULTIHOST_HSDP_LAYOUTS:
    assert_equals_full_batch(result, layout, expected)


def test_two_processes_explicit_ddp_equal_full_batch(tmp_path):
  """Explicit sharding under plain ``jax.jit``, parameters typed reduced
  over the data axis of both processes' devices."""
  if not _typed_sharding.SUPPORTED:
    pytest.skip('reduced/unreduced types need jax >= 0.10')
  result = run_workers(tmp_path, mode='explicit')
  windows = helpers.make_windows(worker.MULTIHOST_WINDOW_SIZES, NUM_DEVICES)
  assert_equals_full_batch(result, 'explicit', adamw_full_batch(windows))


def adamw_full_batch(windows):
  """``helpers.full_batch`` of the workers' AdamW."""
  return helpers.full_batch(helpers.adamw(), helpers.init_params(), windows)


def assert_equals_full_batch(result, prefix, expected, with_loss=True):
  """The ``result``'s parameters (and loss) named ``prefix`` are
  ``expected`` up to its round-off bounds."""
  params = {name: result[f'{prefix}_{name}'] for name in expected.params}
  chex.assert_trees_all_close(
    params, expected.params, rtol=0, atol=expected.atol
  )
  if with_loss:
    np.testing.assert_allclose(
      result[f'{prefix}_loss'], expected.loss, rtol=0, atol=expected.loss_atol
    )


def test_two_processes_zero1_equal_full_batch(tmp_path):
  """The distributed-optimizer layout across processes: parameters typed
  reduced over 'data' (both processes' 4 devices), AdamW's moments sharded
  over it by ``init_sharded(..., shard_optimizer_over=('data',))``, so that
  each device holds a quarter of them; training equals full-batch AdamW.
  A hang in a collective fails the test after ``TIMEOUT_S``."""
  if not _typed_sharding.SUPPORTED:
    pytest.skip('reduced/unreduced types need jax >= 0.10')
  result = run_workers(tmp_path, mode='zero1')
  assert int(result['num_devices']) == NUM_DEVICES
  features = helpers.FEATURES
  assert tuple(result['zero1_mu_shard_w']) == (
    features // NUM_DEVICES,
    features,
  )
  assert tuple(result['zero1_mu_shard_v']) == (features // NUM_DEVICES,)
  windows = helpers.make_windows(worker.MULTIHOST_WINDOW_SIZES, NUM_DEVICES)
  assert_equals_full_batch(result, 'zero1', adamw_full_batch(windows))


def test_two_processes_token_budget_equal_full_batch(tmp_path):
  """``tokens_per_update`` counts the tokens of both processes' devices:
  the windows close where the global counts say, as in full-batch
  training on those windows."""
  result = run_workers(tmp_path, mode='budget')
  windows = helpers.make_windows(worker.MULTIHOST_WINDOW_SIZES, NUM_DEVICES)
  stream = [batch for window in windows for batch in window]
  counts = [int(np.sum(batch['mask'])) for batch in stream]
  sizes = helpers.budget_window_sizes(
    counts, worker.MULTIHOST_BUDGET, worker.MULTIHOST_K
  )
  assert len(set(sizes)) > 1, sizes  # the budget decides some windows
  budget_windows, start = [], 0
  for size in sizes:
    budget_windows.append(stream[start : start + size])
    start += size
  assert int(result['budget_updates']) == len(sizes)
  expected = adamw_full_batch(budget_windows)
  assert_equals_full_batch(result, 'budget', expected, with_loss=False)
