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
"""Resume anywhere (issue 40): a checkpoint saved on N devices restores, with
orbax, onto M devices, at a window boundary and mid-window, in every layout,
and training then equals full-batch training within round-off (the order of
summation changes); on the same number of devices, bit for bit. What cannot
be exact is refused, never silently wrong.

The global micro-batch is the same whatever the number of devices (8
sequences, split over the devices of the data axes), so the windows are the
same full batches on N and on M devices; the reference is plain optax on one
device, with the round-off bound of ``helpers.full_batch``.

Also, on the explicit DDP and HSDP layouts (moved from ``test_explicit``,
issue 47): a checkpoint taken mid-window resumes bit for bit on as many
devices, in this process and in new ones. And (issue 53) the count's rows
merged near the top of int32 and of float32: exact where they fit, never
wrapped.
"""

import contextlib
import functools
import warnings

import chex
import children
import helpers
import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
import numpy as np
import optax
import orbax.checkpoint as ocp
import placements
import pytest

import optax_tokacc as tokacc
from optax_tokacc import _layouts

K = 4
WINDOW_SIZES = (K, K, K)
DEVICES_PER_BATCH = 4  # the global micro-batch: 4 x SEQS sequences
BOUNDARY, MID_WINDOW = K, K + 2  # micro-steps before the checkpoint


def make_tx(variant='plain', axis_name=None):
  """The transform checkpointed: plain, or with every field of the state
  (``compensated_skip``)."""
  options = {}
  if variant == 'compensated_skip':
    options = dict(
      compensated=True, should_skip_update_fn=tokacc.skip_not_finite
    )
  return tokacc.token_weighted_multistep(
    helpers.sgd(), K, axis_name=axis_name, **options
  )


def micro_batches():
  windows = helpers.make_windows(WINDOW_SIZES, DEVICES_PER_BATCH)
  return [batch for window in windows for batch in window], windows


def build(layout, n, variant='plain'):
  """``layout`` of ``placements.PLACEMENTS`` on ``n`` devices."""
  return placements.PLACEMENTS[layout](n, functools.partial(make_tx, variant))


def _skip_unsupported(layout, n):
  if not placements.supported(layout):
    pytest.skip('explicit sharding needs jax >= 0.10')
  if layout == 'zero1' and n == 1:
    pytest.skip('no data devices to shard the optimizer over')


def save(path, tree):
  checkpointer = ocp.StandardCheckpointer()
  checkpointer.save(path, tokacc.to_checkpoint(tree))
  checkpointer.wait_until_finished()


def restore(path, run, strict=True):
  """The documented flow: a target from the checkpoint's metadata and the
  state made on the devices at hand."""
  checkpointer = ocp.StandardCheckpointer()
  like = (run.unstack(run.params), run.state)
  with placements.mesh_context(run.mesh):
    target = tokacc.checkpoint_target(like, checkpointer.metadata(path))
    restored = checkpointer.restore(path, target)
    return tokacc.from_checkpoint(restored, like)


@functools.cache
def reference():
  """Plain optax on one device, on the windows' full batches."""
  _, windows = micro_batches()
  return helpers.full_batch(helpers.sgd(), helpers.init_params(), windows)


def _saved(
  tmp_path, layout='explicit_ddp', n=4, variant='plain', stop=MID_WINDOW
):
  """A checkpoint of ``layout`` trained ``stop`` micro-steps on ``n``
  devices: its path."""
  _skip_unsupported(layout, n)
  batches, _ = micro_batches()
  run = build(layout, n, variant)
  params, state = placements.train(run, run.params, run.state, batches[:stop])
  save(tmp_path / 'ckpt', (run.unstack(params), state))
  return tmp_path / 'ckpt'


def resume(tmp_path, layout, saved_on, restored_on, stop, variant='plain'):
  """Trains ``stop`` micro-steps on ``saved_on`` devices, checkpoints, and
  finishes on ``restored_on``: the final host parameters and state."""
  _skip_unsupported(layout, restored_on)
  path = _saved(tmp_path, layout, saved_on, variant, stop)
  batches, _ = micro_batches()
  second = build(layout, restored_on, variant)
  params, state = restore(path, second)
  params = second.stack(params)
  params, state = placements.train(second, params, state, batches[stop:])
  return second.host(params), state


PAIRS = [(4, 2), (4, 1), (2, 4), (1, 4)]
FAST = {
  ('explicit_ddp', (4, 2), MID_WINDOW),
  ('shard_map_summed', (4, 2), MID_WINDOW),
}


def _cases():
  for layout in placements.PLACEMENTS:
    for pair in PAIRS:
      for stop in (BOUNDARY, MID_WINDOW):
        marks = () if (layout, pair, stop) in FAST else (pytest.mark.slow,)
        name = (
          f'{layout}-{pair[0]}to{pair[1]}-{"mid" if stop != K else "boundary"}'
        )
        yield pytest.param(layout, pair, stop, marks=marks, id=name)


@pytest.mark.parametrize('layout, pair, stop', list(_cases()))
def test_resumed_on_another_device_count_equals_full_batch(
  tmp_path, layout, pair, stop
):
  if layout == 'shard_map_summed':
    context = pytest.warns(UserWarning, match='already summed')
  else:
    context = contextlib.nullcontext()
  with context:
    params, state = resume(tmp_path, layout, *pair, stop)
  expected = reference()
  chex.assert_trees_all_close(
    params,
    jax.tree.map(np.asarray, expected.params),
    rtol=0,
    atol=expected.atol,
  )
  assert int(np.ravel(np.asarray(state.gradient_step))[0]) == len(WINDOW_SIZES)


def uninterrupted(layout, n, variant='plain'):
  batches, _ = micro_batches()
  run = build(layout, n, variant)
  return run, placements.train(run, run.params, run.state, batches)


def host_state(run, train_state):
  """Host copies of parameters and state, bit for bit (the window's
  shares as rows)."""
  params, state = train_state
  with placements.mesh_context(run.mesh):
    return run.host(params), helpers.fetch(tokacc.to_checkpoint(state))


SAME_N_FAST = ('explicit_ddp', 'shard_map')


@pytest.mark.parametrize(
  'layout',
  [
    layout
    if layout in SAME_N_FAST
    else pytest.param(layout, marks=pytest.mark.slow)
    for layout in placements.PLACEMENTS
  ],
)
def test_resumed_on_as_many_devices_is_bit_identical(tmp_path, layout):
  """Through the same flow (checkpoint_target, from_checkpoint), on as many
  devices each device gets its own share back: bit for bit."""
  _skip_unsupported(layout, 4)
  batches, _ = micro_batches()
  with warnings.catch_warnings():
    warnings.filterwarnings('ignore', 'token_weighted_multistep: gradients')
    run, expected = uninterrupted(layout, 4, 'compensated_skip')
    params, state = placements.train(
      run, run.params, run.state, batches[:MID_WINDOW]
    )
    assert 0 < int(np.ravel(np.asarray(state.mini_step))[0]) < K
    save(tmp_path / 'ckpt', (run.unstack(params), state))
    second = build(layout, 4, 'compensated_skip')
    params, state = restore(tmp_path / 'ckpt', second)
    resumed = placements.train(
      second, second.stack(params), state, batches[MID_WINDOW:]
    )
  chex.assert_trees_all_equal(
    host_state(second, resumed), host_state(run, expected)
  )


@pytest.mark.parametrize('layout', ['explicit_ddp', 'shard_map'])
def test_orbax_strict_false_padding_or_truncation_is_refused(tmp_path, layout):
  """Orbax's hint on a shape mismatch (``strict=False``) pads or truncates
  the window's rows to a target of another number of devices: 4 -> 2 lost
  half of the window's shares, silently, in 0.5.0. Refused, naming both
  device counts and the fix."""
  path = _saved(tmp_path, layout)
  for n in (2, 8):  # truncated, padded
    run = build(layout, n, 'plain')
    like = (run.params, run.state)
    with placements.mesh_context(run.mesh):
      target = jax.tree.map(
        ocp.utils.to_shape_dtype_struct, tokacc.to_checkpoint(like)
      )
      restored = ocp.StandardCheckpointer().restore(path, target, strict=False)
      with pytest.raises(
        ValueError, match=rf'shares of 4 device.*{n} rows.*checkpoint_target'
      ):
        tokacc.from_checkpoint(restored, like)


def test_another_configuration_is_refused(tmp_path):
  """A checkpoint of another accumulator dtype, compensation or inner
  optimizer is refused by checkpoint_target, naming what differs, before
  orbax would cast or drop what it reads."""
  path = _saved(tmp_path, 'shard_map')
  mesh = placements.data_mesh(2)
  params = jax.tree.map(
    lambda x: helpers.put(x, NamedSharding(mesh, P())), helpers.init_params()
  )
  metadata = ocp.StandardCheckpointer().metadata(path)
  others = {
    r'grad_sums/\w+ was saved as float32.*bfloat16': dict(
      accumulator_dtype=jnp.bfloat16
    ),
    'acc_compensation': dict(compensated=True),
  }
  for match, options in others.items():
    tx = tokacc.token_weighted_multistep(
      helpers.sgd(), K, axis_name='data', **options
    )
    like = (params, tokacc.init_sharded(tx, params, mesh, axis_name='data'))
    with pytest.raises(ValueError, match=f'checkpoint_target.*{match}'):
      tokacc.checkpoint_target(like, metadata)
  tx = tokacc.token_weighted_multistep(optax.adam(0.1), K, axis_name='data')
  like = (params, tokacc.init_sharded(tx, params, mesh, axis_name='data'))
  with pytest.raises(ValueError, match='another optimizer'):
    tokacc.checkpoint_target(like, metadata)


def test_from_checkpoint_refuses_another_dtype():
  """Without orbax (a pickled tree), the dtypes are checked by
  from_checkpoint itself."""
  tx = make_tx()
  params = jax.tree.map(jnp.asarray, helpers.init_params())
  saved = tokacc.to_checkpoint(tx.init(params))
  other = tokacc.token_weighted_multistep(
    helpers.sgd(), K, accumulator_dtype=jnp.bfloat16
  )
  with pytest.raises(ValueError, match=r'grad_sums/\w+ was saved as float32'):
    tokacc.from_checkpoint(saved, other.init(params))


def test_abstract_values_are_refused_naming_what_to_call():
  """Regression (issue 54, item 4): ``to_checkpoint`` of abstract values
  names ``jax.eval_shape``, which it works under; ``from_checkpoint``
  needs the restored arrays (it reads their recorded rows) and names
  ``checkpoint_target``, for abstract and traced trees alike. They raised
  a float() TypeError and a TracerArrayConversionError."""
  tx = make_tx()
  params = jax.tree.map(jnp.asarray, helpers.init_params())
  like = (params, tx.init(params))
  abstract = jax.eval_shape(lambda: like)
  with pytest.raises(TypeError, match=r'eval_shape\(tokacc.to_checkpoint'):
    tokacc.to_checkpoint(abstract)
  saved = jax.eval_shape(tokacc.to_checkpoint, abstract)
  chex.assert_trees_all_equal_shapes_and_dtypes(
    saved, tokacc.to_checkpoint(like)
  )
  with pytest.raises(TypeError, match='ShapeDtypeStruct.*checkpoint_target'):
    tokacc.from_checkpoint(saved, like)
  with pytest.raises(TypeError, match='traced.*checkpoint_target'):
    jax.jit(tokacc.from_checkpoint)(tokacc.to_checkpoint(like), like)


def test_an_invalid_window_stays_invalid(tmp_path):
  """A window whose count is invalid on one device (negative: -1 in its
  slot) is dropped after a resume on 2 devices, as it is on 4: the merged
  count is invalid too."""
  batches, _ = micro_batches()
  batches = [dict(b) for b in batches]
  mask = batches[K + 1]['mask'].copy()
  mask[2 * helpers.SEQS, 0] = -helpers.LOCAL_TOKENS - 1  # device 2: < 0
  batches[K + 1]['mask'] = mask
  results = []
  for resumed_on in (None, 2):
    run = build('shard_map', 4, 'plain')
    params, state = placements.train(
      run, run.params, run.state, batches[:MID_WINDOW]
    )
    if resumed_on is not None:
      assert helpers.fetch(state.acc_tokens)[2] == -1
      save(tmp_path / 'ckpt', (params, state))
      run = build('shard_map', resumed_on, 'plain')
      params, state = restore(tmp_path / 'ckpt', run)
      assert helpers.fetch(state.acc_tokens).tolist() == [-1, 0]
    params, state = placements.train(run, params, state, batches[MID_WINDOW:])
    results.append((run.host(params), int(state.dropped_windows)))
  assert [dropped for _, dropped in results] == [1, 1]
  expected = reference()
  chex.assert_trees_all_close(
    results[1][0], results[0][0], rtol=0, atol=expected.atol
  )


def test_skip_states_merge_as_explicit_sharding_keeps_them(tmp_path):
  """A skip state is this device's last decision: merged, its booleans
  are any device's and its numbers their sum, on every device."""
  batches, _ = micro_batches()
  batches = [dict(b) for b in batches]
  x = batches[MID_WINDOW - 1]['x'].copy()
  x[helpers.SEQS, 0, 0] = np.nan  # device 1 rejects the last micro-batch
  batches[MID_WINDOW - 1]['x'] = x
  run = build('shard_map', 4, 'compensated_skip')
  params, state = placements.train(
    run, run.params, run.state, batches[:MID_WINDOW]
  )
  skipped = helpers.fetch(state.skip_state)
  assert skipped['should_skip'].tolist() == [False, True, False, False]
  save(tmp_path / 'ckpt', (params, state))
  second = build('shard_map', 2, 'compensated_skip')
  _, state = restore(tmp_path / 'ckpt', second)
  merged = helpers.fetch(state.skip_state)
  assert merged['should_skip'].tolist() == [True, True]
  total = int(np.sum(skipped['num_not_finite']))
  assert total >= 1 and merged['num_not_finite'].tolist() == [total] * 2


# The merge of a window's count near the top of its dtype (issue 53): the
# rows of 4 devices summed onto one device never wrap.

MERGE_GRADS = np.array([[1.0, -2.0], [3.0, 0.5], [-1.0, 4.0], [2.0, 2.0]])
# name: (token_dtype, each device's count, the merged count; None: invalid)
MERGE_CASES = {
  'int32_max': ('int32', [2**31 - 4, 1, 1, 1], 2**31 - 1),
  # 2**32: a plain int32 sum wraps to 0, an empty window
  'int32_beyond': ('int32', [2**31 - 1, 2**31 - 1, 1, 1], None),
  'float32_range_end': ('float32', [2.0**124] * 4, 2.0**126),
  # finite when merged, above the range: dropped when the window closes
  'float32_above': ('float32', [2.0**126, 2.0**126, 0.0, 0.0], 2.0**127),
  'float32_overflows': ('float32', [2.0**126] * 4, None),  # 2**128: inf
}


def counted_on_4_devices(tx, counts):
  """``tx``'s state after one micro-step on 4 devices under ``shard_map``,
  device ``d`` giving ``MERGE_GRADS[d]`` and the count ``counts[d]`` (an
  array in the transform's ``token_dtype``)."""
  mesh = placements.data_mesh(4)
  params = {'w': np.zeros(2, np.float32)}
  state = placements.shard_map_state(tx, params, mesh, 'data')
  specs = tokacc.state_partition_specs(tx, params, axis_name='data')

  def local(state, grads, counts):
    return tx.update({'w': grads[0]}, state, params, num_tokens=counts[0])[1]

  step = jax.jit(
    jax.shard_map(
      local,
      mesh=mesh,
      in_specs=(specs, P('data'), P('data')),
      out_specs=specs,
    )
  )
  data = NamedSharding(mesh, P('data'))
  return step(
    state,
    helpers.put(MERGE_GRADS.astype(np.float32), data),
    helpers.put(counts, data),
  )


@pytest.mark.parametrize('case', list(MERGE_CASES))
def test_counts_near_the_top_merge_without_wrapping(case):
  """The count's rows of 4 devices merged onto one (``from_checkpoint``):
  a total that fits is exact, and the window closed on one device is SGD(1)
  on it; one beyond int32 or overflowing float32 is invalid (-1), never
  wrapped to a small count; one above the range (2**126) stays, and
  the window is dropped when it closes. A dropped window is counted."""
  token_dtype, counts, merged = MERGE_CASES[case]

  def make(axis_name):
    return tokacc.token_weighted_multistep(
      optax.sgd(1.0), 2, axis_name=axis_name, token_dtype=token_dtype
    )

  rows = np.asarray(counts, token_dtype)
  saved = jax.device_get(
    tokacc.to_checkpoint(counted_on_4_devices(make('data'), rows))
  )
  one = make(None)
  params = {'w': jnp.zeros(2)}
  state = tokacc.from_checkpoint(saved, one.init(params))
  assert state.acc_tokens.item() == (-1 if merged is None else merged)
  zero = jnp.zeros([], token_dtype)
  updates, state = one.update(
    {'w': jnp.zeros(2)}, state, params, num_tokens=zero
  )
  honoured = merged is not None and merged <= 2.0**126
  assert int(state.gradient_step) == honoured
  assert int(state.dropped_windows) == (not honoured)
  if honoured:
    weights = np.asarray(counts, np.float64)
    assert state.last_tokens.item() == merged
    np.testing.assert_allclose(
      updates['w'],
      -MERGE_GRADS.sum(axis=0) / weights.sum(),
      rtol=helpers.DIVISION_RTOL,
    )
  else:
    assert not np.any(updates['w'])


def finish_on_one_device(path, out):
  """In a process with one device (``python -m children
  checkpoint_on_one_device``), as a user evaluating a checkpoint:
  loads the parameters and state of a 4-device checkpoint into plain
  arrays, finishes training, and saves the parameters to ``out``."""
  assert jax.device_count() == 1
  run = build('gspmd', 1, 'plain')
  params, state = restore(path, run)
  assert int(state.mini_step) == MID_WINDOW - K
  batches, _ = micro_batches()
  params, state = placements.train(run, params, state, batches[MID_WINDOW:])
  np.savez(out, **run.host(params))


ONE_DEVICE_LIMIT_S = 240  # about 10 s on a quiet 2-core machine


@pytest.mark.slow  # starts a Python process
@pytest.mark.waits_on_processes(ONE_DEVICE_LIMIT_S)
@pytest.mark.parametrize('layout', ['explicit_ddp', 'shard_map', 'zero1'])
def test_a_one_device_process_loads_any_checkpoint(tmp_path, layout):
  path = _saved(tmp_path, layout)
  out = tmp_path / 'params.npz'
  result = children.run(
    'checkpoint_on_one_device', path, out, limit_s=ONE_DEVICE_LIMIT_S
  )
  assert result.returncode == 0, result.stderr[-3000:]
  expected = reference()
  chex.assert_trees_all_close(
    dict(np.load(out)),
    jax.tree.map(np.asarray, expected.params),
    rtol=0,
    atol=expected.atol,
  )


def as_saved_by_0_5(tree):
  """What 0.5's ``to_checkpoint`` saved: every unreduced leaf as its rows
  of partial sums (this function is still the leaf rule of 0.6.0), the state
  otherwise as it is, and no record of the rows."""
  return jax.tree.map(_layouts.leaf_rows, tree)


@pytest.mark.parametrize('layout', ['explicit_ddp', 'shard_map'])
def test_a_checkpoint_of_0_5_resumes_on_its_own_devices(tmp_path, layout):
  """Restored on as many devices through the documented flow: bit for bit;
  on another number: refused, saying how to convert it."""
  _skip_unsupported(layout, 4)
  batches, _ = micro_batches()
  run, expected = uninterrupted(layout, 4)
  params, state = placements.train(
    run, run.params, run.state, batches[:MID_WINDOW]
  )
  with placements.mesh_context(run.mesh):  # 0.5's typed rows, on the mesh
    saved = as_saved_by_0_5((params, state))
  # Saved outside the mesh's context, as ``save`` saves: orbax 0.11 (the
  # floor) slices replicated leaves eagerly, which jax 0.8.2 refuses under
  # a context mesh.
  checkpointer = ocp.StandardCheckpointer()
  checkpointer.save(tmp_path / 'ckpt', saved)
  checkpointer.wait_until_finished()
  second = build(layout, 4, 'plain')
  params, state = restore(tmp_path / 'ckpt', second)
  resumed = placements.train(second, params, state, batches[MID_WINDOW:])
  chex.assert_trees_all_equal(
    host_state(second, resumed), host_state(run, expected)
  )
  other = build(layout, 2, 'plain')
  with pytest.raises(ValueError, match=r'0\.5 with the window of 4 .* onto 2'):
    restore(tmp_path / 'ckpt', other)
  # Ahead of time (``like`` abstract): the same refusal, not a leaked tracer.
  like = jax.eval_shape(lambda: (other.unstack(other.params), other.state))
  metadata = checkpointer.metadata(tmp_path / 'ckpt')
  with placements.mesh_context(other.mesh):
    with pytest.raises(
      ValueError, match=r'0\.5 with the window of 4 .* onto 2'
    ):
      tokacc.checkpoint_target(like, metadata)


def test_a_state_restored_for_another_k_closes_its_window_at_that_k(tmp_path):
  """``k`` is not part of the state (as in ``optax.MultiSteps``): the open
  window of a state restored into a transform of another
  ``every_k_schedule`` closes once ``mini_step`` reaches the new ``k``, as
  a schedule that changes ``k`` closes it: here after 3 micro-steps (2
  before the checkpoint, 1 after) where the new ``k`` is 2."""
  batches, _ = micro_batches()
  run = build('gspmd', 1, 'plain')
  params, state = placements.train(run, run.params, run.state, batches[: K + 2])
  save(tmp_path / 'ckpt', (params, state))
  tx = tokacc.token_weighted_multistep(helpers.sgd(), 2)
  like = (run.params, tx.init(run.params))
  checkpointer = ocp.StandardCheckpointer()
  target = tokacc.checkpoint_target(
    like, checkpointer.metadata(tmp_path / 'ckpt')
  )
  params, state = tokacc.from_checkpoint(
    checkpointer.restore(tmp_path / 'ckpt', target), like
  )
  step = placements.explicit_step(tx)
  params, state = step(params, state, batches[K + 2], jnp.asarray(False))
  assert int(state.gradient_step) == 2 and int(state.mini_step) == 0


# Checkpoints in the middle of a window, with orbax.
# The explicit DDP and HSDP layouts of test_explicit, bit for bit on as
# many devices, in this process and in new ones (issue 47 moved them here).

EXPLICIT_K = 3
EXPLICIT_WINDOW_SIZES = (3, 3, 2)  # the last window is closed by emit_now


CHECKPOINT_VARIANTS = {
  'ddp': (
    'ddp',
    lambda: tokacc.token_weighted_multistep(helpers.adamw(), EXPLICIT_K),
  ),
  'hsdp_compensated_skip': (
    'hsdp',
    lambda: tokacc.token_weighted_multistep(
      helpers.adamw(),
      EXPLICIT_K,
      compensated=True,
      should_skip_update_fn=tokacc.skip_not_finite,
    ),
  ),
}


def checkpoint_training(variant, start, stop, train_state=None):
  """Trains micro-steps ``[start, stop)`` of the windows from the placed
  initial parameters, or from ``train_state``; returns (params, state)."""
  layout, make_tx = CHECKPOINT_VARIANTS[variant]
  tx = make_tx()
  windows = helpers.make_windows(EXPLICIT_WINDOW_SIZES, 4)
  sequence = list(placements.micro_batches(windows))
  mesh = placements.EXPLICIT_LAYOUTS[layout].mesh()
  data = NamedSharding(mesh, P(placements.batch_axes(mesh)))
  step = _checkpoint_step(variant)
  if train_state is None:
    params = placements.place_params(
      helpers.init_params(), mesh, placements.EXPLICIT_LAYOUTS[layout].specs
    )
    train_state = (params, tx.init(params))
  for batch, emit_now in sequence[start:stop]:
    batch = jax.tree.map(lambda x: jax.device_put(x, data), batch)
    train_state = step(*train_state, batch, jnp.asarray(emit_now))
  return train_state


_STEPS = {}


def _checkpoint_step(variant):
  if variant not in _STEPS:
    _STEPS[variant] = placements.explicit_step(
      CHECKPOINT_VARIANTS[variant][1]()
    )
  return _STEPS[variant]


def save_split(path, train_state):
  import orbax.checkpoint as ocp  # noqa: PLC0415

  checkpointer = ocp.StandardCheckpointer()
  checkpointer.save(path, tokacc.to_checkpoint(train_state))
  checkpointer.wait_until_finished()


def restore_merged(path, variant):
  """Restores into ``tx.init`` of freshly placed parameters."""
  import orbax.checkpoint as ocp  # noqa: PLC0415

  layout, make_tx = CHECKPOINT_VARIANTS[variant]
  mesh = placements.EXPLICIT_LAYOUTS[layout].mesh()
  params = placements.place_params(
    helpers.init_params(), mesh, placements.EXPLICIT_LAYOUTS[layout].specs
  )
  like = (params, make_tx().init(params))
  target = jax.tree.map(
    ocp.utils.to_shape_dtype_struct, tokacc.to_checkpoint(like)
  )
  restored = ocp.StandardCheckpointer().restore(path, target)
  return tokacc.from_checkpoint(restored, like)


STOP_AT = 4  # one micro-step into the second window


def host(train_state):
  """Host copies, comparable bit for bit (partial sums split per device)."""
  return jax.tree.map(np.asarray, tokacc.to_checkpoint(train_state))


@placements.needs_typed_sharding
@pytest.mark.slow
@pytest.mark.parametrize('variant', sorted(CHECKPOINT_VARIANTS))
def test_resume_mid_window_is_bit_identical(tmp_path, variant):
  layout = CHECKPOINT_VARIANTS[variant][0]
  with jax.set_mesh(placements.EXPLICIT_LAYOUTS[layout].mesh()):
    expected = checkpoint_training(variant, 0, sum(EXPLICIT_WINDOW_SIZES))
    train_state = checkpoint_training(variant, 0, STOP_AT)
    state = train_state[1]
    assert int(state.mini_step) == 1  # really mid-window
    assert str(jax.typeof(state.grad_sums['w'])).endswith(
      f'{{U:{"data" if layout == "ddp" else "replica"}}}'
    )
    with pytest.raises(Exception, match='unreduced'):
      np.asarray(state.grad_sums['w'])  # why the helper exists
    save_split(tmp_path / 'ckpt', train_state)
    restored = restore_merged(tmp_path / 'ckpt', variant)
    assert placements.type_strings(restored) == placements.type_strings(
      train_state
    )
    chex.assert_trees_all_equal(host(restored), host(train_state))
    resumed = checkpoint_training(
      variant, STOP_AT, sum(EXPLICIT_WINDOW_SIZES), restored
    )
    chex.assert_trees_all_equal(host(resumed), host(expected))


# Per process; loaded 2 cores (issue 33).
CHILD_LIMIT_S = 600


def save_or_resume(role, path, variant):
  """In a new process (``python -m children explicit_checkpoint``): `save`
  trains to STOP_AT and checkpoints; `resume` restores, finishes training
  and checkpoints the result."""
  layout = CHECKPOINT_VARIANTS[variant][0]
  with jax.set_mesh(placements.EXPLICIT_LAYOUTS[layout].mesh()):
    if role == 'save':
      save_split(path, checkpoint_training(variant, 0, STOP_AT))
    else:
      restored = restore_merged(path, variant)
      final = checkpoint_training(
        variant, STOP_AT, sum(EXPLICIT_WINDOW_SIZES), restored
      )
      save_split(path + '_final', final)


@placements.needs_typed_sharding
@pytest.mark.waits_on_processes(2 * CHILD_LIMIT_S)  # one after the other
@pytest.mark.slow  # starts Python processes
def test_resume_mid_window_in_new_processes(tmp_path):
  variant = 'hsdp_compensated_skip'
  path = str(tmp_path / 'ckpt')
  for role in ('save', 'resume'):
    result = children.run(
      'explicit_checkpoint', role, path, variant, limit_s=CHILD_LIMIT_S
    )
    assert result.returncode == 0, result.stderr[-3000:]
  with jax.set_mesh(placements.EXPLICIT_LAYOUTS['hsdp'].mesh()):
    final = restore_merged(path + '_final', variant)
    expected = checkpoint_training(variant, 0, sum(EXPLICIT_WINDOW_SIZES))
    chex.assert_trees_all_equal(host(final), at_boundary(host(expected)))


def at_boundary(saved):
  """Host copies of a saved ``(params, state)`` as ``from_checkpoint``
  restores them: at a window boundary (``mini_step`` 0) the window's sums
  are scratch (the state's docstring: the updates the close emitted, on a
  GPU or CPU), and zeros once restored."""
  params, saved_state = saved
  state = saved_state.state
  assert not np.any(state.mini_step)  # the run ends where a window closes
  sums = (state.grad_sums, state.acc_compensation)
  grad_sums, acc_compensation = jax.tree.map(np.zeros_like, sums)
  state = state._replace(grad_sums=grad_sums, acc_compensation=acc_compensation)
  return params, saved_state._replace(state=state)
