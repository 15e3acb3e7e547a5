"""Multi-host training: 2 local processes x 2 CPU devices each.

Each test starts two ``jax.distributed`` processes on loopback (gloo CPU
collectives), each running ``multihost_worker.py`` over the global mesh of 4
devices, and compares their result with single-process full-batch training:
data parallelism over all 4 devices, and HSDP on a ``('replica', 'fsdp') =
(2, 2)`` mesh where each process is one replica; explicit sharding, also
with the optimizer state sharded over the data axis (ZeRO-1).
"""

import os
import pathlib
import socket
import subprocess
import sys

import chex
import jax
import jax.numpy as jnp
import multihost_worker as worker
import numpy as np
import optax
import pytest

NUM_PROCESSES = 2
LOCAL_DEVICES = 2
TIMEOUT_S = 120


def free_port():
  with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
    sock.bind(('127.0.0.1', 0))
    return sock.getsockname()[1]


def run_workers(out, mode='ddp'):
  """Runs the worker processes to completion; kills them all on failure."""
  port = free_port()
  repo = pathlib.Path(__file__).resolve().parents[1]
  env = dict(os.environ)
  env['PYTHONPATH'] = os.pathsep.join(
    filter(None, [str(repo), env.get('PYTHONPATH')])
  )
  env.pop('XLA_FLAGS', None)
  processes = [
    subprocess.Popen(
      [
        sys.executable,
        worker.__file__,
        f'--process_id={i}',
        f'--num_processes={NUM_PROCESSES}',
        f'--port={port}',
        f'--local_devices={LOCAL_DEVICES}',
        f'--out={out}',
        f'--mode={mode}',
      ],
      env=env,
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


def test_two_processes_equal_full_batch(tmp_path):
  out = tmp_path / 'result.npz'
  run_workers(out)
  result = dict(np.load(out))
  num_devices = NUM_PROCESSES * LOCAL_DEVICES
  assert int(result['num_devices']) == num_devices

  windows = worker.make_windows(worker.MULTIHOST_WINDOW_SIZES, num_devices)
  expected_params, expected_losses = worker.train_full_batch(
    worker.adamw(), worker.init_params(), windows
  )
  for prefix in ('shard_map', 'jit'):
    params = {name: result[f'{prefix}_{name}'] for name in expected_params}
    chex.assert_trees_all_close(params, expected_params, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(
      result[f'{prefix}_loss'], expected_losses[-1], rtol=1e-5
    )


def test_two_processes_hsdp_equal_full_batch(tmp_path):
  """HSDP, each process one replica: partial-manual (``axis_name='replica'``,
  ``fsdp`` by GSPMD) and fully manual (``axis_name=('replica', 'fsdp')``)."""
  out = tmp_path / 'result.npz'
  run_workers(out, mode='hsdp')
  result = dict(np.load(out))
  num_devices = NUM_PROCESSES * LOCAL_DEVICES
  assert int(result['num_devices']) == num_devices

  windows = worker.make_windows(worker.MULTIHOST_WINDOW_SIZES, num_devices)
  expected_params, expected_losses = worker.train_full_batch(
    worker.adamw(), worker.init_params(), windows
  )
  for layout in worker.MULTIHOST_HSDP_LAYOUTS:
    params = {name: result[f'{layout}_{name}'] for name in expected_params}
    chex.assert_trees_all_close(params, expected_params, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(
      result[f'{layout}_loss'], expected_losses[-1], rtol=1e-5
    )


def test_two_processes_explicit_ddp_equal_full_batch(tmp_path):
  """Explicit sharding under plain ``jax.jit``, parameters typed reduced
  over the data axis of both processes' devices."""
  if not worker.tokacc._explicit.SUPPORTED:
    pytest.skip('reduced/unreduced types need jax >= 0.10')
  out = tmp_path / 'result.npz'
  run_workers(out, mode='explicit')
  result = dict(np.load(out))
  num_devices = NUM_PROCESSES * LOCAL_DEVICES
  windows = worker.make_windows(worker.MULTIHOST_WINDOW_SIZES, num_devices)
  expected_params, expected_losses = worker.train_full_batch(
    worker.adamw(), worker.init_params(), windows
  )
  params = {name: result[f'explicit_{name}'] for name in expected_params}
  chex.assert_trees_all_close(params, expected_params, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(
    result['explicit_loss'], expected_losses[-1], rtol=1e-5
  )


UNIT_ROUND_OFF = 2.0**-24  # float32
# The roundings on one token's path to its gradient term, as
# test_multistep.TERM_ROUNDINGS counts them for this model's FEATURES.
TERM_ROUNDINGS = 2 * worker.FEATURES + 16


def full_batch_with_bounds(windows):
  """``worker.train_full_batch`` with AdamW, and how far float32 round-off
  can take a run of the same windows from it: ``(params, loss, atol,
  loss_atol)`` (``loss``: the last window's token-mean loss).

  ``atol`` is ``test_multistep.round_off_atol`` (its docstring derives it),
  with this model's ``TERM_ROUNDINGS``: per window 2 (n + m) u of the
  gradient, doubled by Adam, relative to the window's largest update, plus
  a rounding of each parameter in each run. The last window's loss is a
  sum of n one-signed terms (within 2 (n + m) u of it, relative), taken at
  parameters that may differ by the windows' ``atol`` before it: that
  moves it by at most the 1-norm of its gradient times that ``atol``, and
  a second-order term below it (twice the first covers both).
  """
  optimizer = worker.adamw()
  params = jax.tree.map(jnp.asarray, worker.init_params())
  opt_state = optimizer.init(params)
  n = max(sum(int(np.sum(b['mask'])) for b in w) for w in windows)
  relative = 2 * 2 * (n + TERM_ROUNDINGS) * UNIT_ROUND_OFF
  atol = 0.0
  for window in windows:
    batch = jax.tree.map(lambda *xs: np.concatenate(xs), *window)
    tokens = np.sum(batch['mask'])
    loss, grads = jax.value_and_grad(
      lambda p, batch=batch, tokens=tokens: worker.loss_sum(p, batch) / tokens
    )(params)
    gradient_norm = sum(float(jnp.sum(jnp.abs(g))) for g in grads.values())
    loss_atol = 2 * (
      2 * (n + TERM_ROUNDINGS) * UNIT_ROUND_OFF * float(loss)
      + gradient_norm * atol
    )
    updates, opt_state = optimizer.update(grads, opt_state, params)
    params = optax.apply_updates(params, updates)
    largest_update = max(float(jnp.max(jnp.abs(u))) for u in updates.values())
    largest_param = max(float(jnp.max(jnp.abs(p))) for p in params.values())
    atol += relative * largest_update + 2 * UNIT_ROUND_OFF * largest_param
  return params, loss, atol, loss_atol


def test_two_processes_zero1_equal_full_batch(tmp_path):
  """The distributed-optimizer layout across processes: parameters typed
  reduced over 'data' (both processes' 4 devices), AdamW's moments sharded
  over it by ``init_sharded(..., shard_optimizer_over=('data',))``, so that
  each device holds a quarter of them; training equals full-batch AdamW.
  A hang in a collective fails the test after ``TIMEOUT_S``."""
  if not worker.tokacc._explicit.SUPPORTED:
    pytest.skip('reduced/unreduced types need jax >= 0.10')
  out = tmp_path / 'result.npz'
  run_workers(out, mode='zero1')
  result = dict(np.load(out))
  num_devices = NUM_PROCESSES * LOCAL_DEVICES
  assert int(result['num_devices']) == num_devices
  features = worker.FEATURES
  assert tuple(result['zero1_mu_shard_w']) == (
    features // num_devices,
    features,
  )
  assert tuple(result['zero1_mu_shard_v']) == (features // num_devices,)
  windows = worker.make_windows(worker.MULTIHOST_WINDOW_SIZES, num_devices)
  expected, loss, atol, loss_atol = full_batch_with_bounds(windows)
  params = {name: result[f'zero1_{name}'] for name in expected}
  chex.assert_trees_all_close(params, expected, rtol=0, atol=atol)
  np.testing.assert_allclose(result['zero1_loss'], loss, rtol=0, atol=loss_atol)


def test_two_processes_token_budget_equal_full_batch(tmp_path):
  """``tokens_per_update`` counts the tokens of both processes' devices:
  the windows close where the global counts say, as in full-batch
  training on those windows."""
  from test_window_rules import window_sizes  # noqa: PLC0415

  out = tmp_path / 'result.npz'
  run_workers(out, mode='budget')
  result = dict(np.load(out))
  num_devices = NUM_PROCESSES * LOCAL_DEVICES
  windows = worker.make_windows(worker.MULTIHOST_WINDOW_SIZES, num_devices)
  stream = [batch for window in windows for batch in window]
  counts = [int(np.sum(batch['mask'])) for batch in stream]
  sizes = window_sizes(counts, worker.MULTIHOST_BUDGET, worker.MULTIHOST_K)
  assert len(set(sizes)) > 1, sizes  # the budget decides some windows
  budget_windows, start = [], 0
  for size in sizes:
    budget_windows.append(stream[start : start + size])
    start += size
  expected_params, _ = worker.train_full_batch(
    worker.adamw(), worker.init_params(), budget_windows
  )
  assert int(result['budget_updates']) == len(sizes)
  params = {name: result[f'budget_{name}'] for name in expected_params}
  chex.assert_trees_all_close(params, expected_params, rtol=1e-5, atol=1e-5)
