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
"""What a micro-step of explicit DDP costs in steady state, and of what.

``run.py``'s micro-step column is the mean of a window's first ``k - 1``
calls: it holds the window's restart (zeros written into the accumulator),
which the ideal does in its window update instead. This script times
micro-steps that neither restart nor close a window (``every_k_schedule``
larger than the calls), interleaved call by call, each call blocked on:

- ``ideal``: ``ideal_explicit_ddp``'s micro-step (``acc + grad``);
- ``tokacc``: ``tokacc_explicit_ddp``'s step as a user writes it;
- ``tokacc_without_apply``: the same step with the updates dropped instead
  of added by ``optax.apply_updates`` (not a way to train: it shows what
  the user's ``apply_updates`` of the -0.0 updates costs).

The difference between the last two is the one pass over the parameters
that a one-program step runs on every micro-step and the ideal's
micro-step does not. ``--calls`` calls of each are timed after 2 warm-up
calls; the table gives the median and the minimum.

  python -m benchmarks.steady_micro_step --models mlp,mlp_bf16 --devices 4
"""

import argparse
import functools
import statistics
import sys
import time

import jax
import optax

from benchmarks import common
from benchmarks import ideals
from benchmarks import models
from benchmarks import trainers
import optax_tokacc as tokacc

METHODS = ('ideal', 'tokacc', 'tokacc_without_apply')


def _steps(case, layout):
  """name -> ``(call, carry)``: one micro-step of each method, and the
  micro-batch they take."""
  model = case.model
  tx = tokacc.token_weighted_multistep(case.adamw, 2**30)

  def tokacc_step(apply):
    @functools.partial(jax.jit, donate_argnums=(0, 1))
    def step(params, opt_state, batch):
      grads, num_tokens = jax.grad(model.loss_sum, has_aux=True)(params, batch)
      updates, opt_state = tx.update(
        grads, opt_state, params, num_tokens=num_tokens
      )
      if apply:
        params = optax.apply_updates(params, updates)
      return params, opt_state

    return lambda carry, batch: step(*carry, batch)

  add = ideals.micro_step(model)

  def ideal(carry, batch):
    params, acc, tokens = carry
    return (params, *add(params, acc, tokens, batch))

  params, windows = layout.place(model)
  zeros = jax.jit(lambda p: jax.tree.map(layout.sum_zeros, p))
  carry = (params, zeros(params), layout.scalar_zero())
  steps = {'ideal': (ideal, carry)}
  for name, apply in (('tokacc', True), ('tokacc_without_apply', False)):
    own = trainers.copy(params)
    steps[name] = (tokacc_step(apply), (own, tx.init(own)))
  return steps, windows[0].micro_batches[0]


def measure(model_name, devices, calls):
  """name -> seconds of each timed call, interleaved."""
  model = models.build(model_name, 'full', 2)
  case = trainers.make_case(model, 2, jax.devices()[:devices])
  layout = trainers.explicit_data(case)
  times = {name: [] for name in METHODS}
  with layout.context():
    steps, batch = _steps(case, layout)
    carries = {name: carry for name, (_, carry) in steps.items()}
    for index in range(2 + calls):
      for name, (call, _) in steps.items():
        start = time.perf_counter()
        carries[name] = jax.block_until_ready(call(carries[name], batch))
        if index >= 2:
          times[name].append(time.perf_counter() - start)
  return times


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--models', default='mlp,mlp_bf16')
  parser.add_argument('--devices', type=int, default=4)
  parser.add_argument('--calls', type=int, default=40)
  args = parser.parse_args(argv)
  common.use_cpu_devices(args.devices)
  info = common.machine()
  print(f'{info["device"]}, {info["cpu_count"]} CPUs, jax {info["jax"]}')
  print(f'explicit DDP on {args.devices} devices, {args.calls} calls each')
  print(
    f'{"model":10} {"method":22} {"median ms":>9} {"/ideal":>7} '
    f'{"min ms":>8} {"/ideal":>7}'
  )
  for model_name in args.models.split(','):
    times = measure(model_name, args.devices, args.calls)
    ideal = times['ideal']
    for name in METHODS:
      median, fastest = statistics.median(times[name]), min(times[name])
      print(
        f'{model_name:10} {name:22} {median * 1e3:9.1f} '
        f'{median / statistics.median(ideal):6.2f}x {fastest * 1e3:8.1f} '
        f'{fastest / min(ideal):6.2f}x'
      )


if __name__ == '__main__':
  sys.exit(main())
