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
"""The programs of ``compiled.py``: each method's steps written on
abstract values placed on a target's first device, compiled for it, and
read by ``optax_tokacc.testing.check`` into figures per step.

A method's open micro-step, closing step and window (``(k - 1)`` open
steps and the closing one) run the programs of :data:`SCHEDULE`; each
figure is set against the ideal's of the same step and target.
"""

import time
from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax

from benchmarks import ideals
from benchmarks import methods
from benchmarks import models
from benchmarks import trainers
import optax_tokacc as tokacc
from optax_tokacc import testing

METHODS = (
  'ideal',
  'tokacc_host',
  'tokacc_device',
  'tokacc_update_and_apply',
  'multisteps',
)
# inner.update in a name scope
OURS = ('tokacc_host', 'tokacc_device', 'tokacc_update_and_apply')
STEPS = ('open', 'closing', 'window')
# The programs each step of a method runs, in order: (an open step's,
# the closing step's). The ideal closes with its micro-step and its window
# update, the host with its close=True program; one program (the device's,
# MultiSteps') runs its branch 0 on an open step, its branch 1 to close.
SCHEDULE = {
  'ideal': (('micro_step',), ('micro_step', 'window_update')),
  'tokacc_host': (('close=False',), ('close=True',)),
  'tokacc_device': (('close=None',), ('close=None',)),
  'tokacc_update_and_apply': (('close=None',), ('close=None',)),
  'multisteps': (('step',), ('step',)),
}


class Figures(NamedTuple):
  """What a step runs: kernels, modelled bytes, temporaries (the most of
  its programs'), collectives."""

  kernels: int
  bytes: int
  temp_bytes: int
  collectives: int

  def then(self, other: 'Figures', times: int = 1) -> 'Figures':
    """This step followed by ``times`` runs of ``other``."""
    return Figures(
      self.kernels + times * other.kernels,
      self.bytes + times * other.bytes,
      max(self.temp_bytes, other.temp_bytes),
      self.collectives + times * other.collectives,
    )


def _on(tree, target: testing.Target):
  """``tree``'s shapes as abstract values on ``target``'s first device."""
  sharding = target.sharding()
  return jax.tree.map(
    lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding), tree
  )


def _state(tx, params, target: testing.Target):
  return _on(jax.eval_shape(tx.init, params), target)


def programs(case: trainers.Case, target: testing.Target) -> dict:
  """method -> program label -> ``(jitted step, abstract arguments, static
  arguments)``: every program of :data:`METHODS` on ``target``'s first
  device, written as ``run.py`` writes them."""
  model, adamw, k = case.model, case.adamw, case.k
  params = _on(model.params, target)
  batch = _on(model.windows[0][0], target)
  sums = jax.tree.map(
    lambda p: jax.ShapeDtypeStruct(p.shape, jnp.promote_types(p.dtype, 'f4')),
    params,
  )
  sums, tokens = _on((sums, jax.ShapeDtypeStruct((), jnp.int32)), target)
  update = ideals.window_update(adamw, trainers.OneDevice())
  update_args = (params, _state(adamw, params, target), sums, tokens)
  tx = tokacc.token_weighted_multistep(adamw, k)
  ours = (
    methods.user_step(model, tx),
    (params, _state(tx, params, target), batch),
  )
  multi = optax.MultiSteps(adamw, k)
  multi_args = (params, _state(multi, params, target), batch)
  return {
    'ideal': {
      'micro_step': (
        ideals.micro_step(model),
        (params, sums, tokens, batch),
        {},
      ),
      'window_update': (update, update_args, {}),
    },
    'tokacc_host': {f'close={c}': (*ours, {'close': c}) for c in (False, True)},
    'tokacc_device': {'close=None': (*ours, {'close': None})},
    'tokacc_update_and_apply': {
      'close=None': (
        methods.user_step(model, tx, together=True),
        ours[1],
        {'close': None},
      )
    },
    'multisteps': {
      'step': (methods.user_step(model, multi, loss='mean'), multi_args, {})
    },
  }


def checked(
  target: testing.Target, step, args, static
) -> tuple[testing.StepReport, float]:
  """``testing.check`` of ``step`` for ``target``, with its seconds; an
  error if it was not compiled for ``target``'s devices."""
  start = time.perf_counter()
  report = testing.check(step, *args, **static)
  if report.device_kind != target.device_kind:
    raise RuntimeError(
      f'Compiled for {report.device_kind!r}, not for target {target.name!r} '
      f'({target.device_kind!r}).'
    )
  return report, time.perf_counter() - start


def step_figures(reports: dict, labels: tuple, closing: bool) -> Figures:
  """One step's figures: ``labels``' programs (their closing branches,
  with ``closing``), in order."""
  figures = Figures(0, 0, 0, 0)
  for label in labels:
    report = reports[label]
    cost = report.closing_step if closing else report.open_step
    found = report.collectives if closing else report.on_open_step()
    figures = figures.then(
      Figures(cost.kernels, cost.bytes, report.temp_bytes, len(found))
    )
  return figures


def rows_of(found: dict, k: int, param_bytes: int) -> list[dict]:
  """One row per method and step, against the ideal's same step."""
  figures = {}
  for method in METHODS:
    opening, closing = SCHEDULE[method]
    open_step = step_figures(found[method], opening, closing=False)
    closing_step = step_figures(found[method], closing, closing=True)
    window = closing_step.then(open_step, times=k - 1)
    figures[method] = dict(zip(STEPS, (open_step, closing_step, window)))
  rows = []
  for method in METHODS:
    for step in STEPS:
      mine, ideal = figures[method][step], figures['ideal'][step]
      extra = mine.temp_bytes - ideal.temp_bytes
      rows.append({
        'method': method,
        'step': step,
        **mine._asdict(),
        'bytes_vs_ideal': mine.bytes / ideal.bytes,
        'temp_vs_ideal_bytes': extra,
        'temp_vs_ideal_params': extra / param_bytes,
      })  # fmt: skip
  return rows


def program_record(report: testing.StepReport, seconds: float) -> dict:
  """What the JSON keeps of a program."""
  return {
    'open_step': report.open_step._asdict(),
    'closing_step': report.closing_step._asdict(),
    'temp_bytes': report.temp_bytes,
    'conditionals': report.conditionals,
    'collectives': [c.kind for c in report.collectives],
    'optimizer_on_open_step': list(report.optimizer_on_open_step),
    'compile_s': round(seconds, 2),
  }


def section(name: str, setting: str, k: int, target: testing.Target) -> dict:
  """The figures of model ``name`` compiled for ``target``."""
  case = trainers.make_case(models.build(name, setting, k), k)
  found, records = {}, {}
  for method, labelled in programs(case, target).items():
    found[method] = {}
    for label, program in labelled.items():
      report, seconds = checked(target, *program)
      found[method][label] = report
      records[f'{method} {label}'] = program_record(report, seconds)
  param_bytes = case.model.param_bytes
  open_work = {  # read from inner.update's name scope: ours only
    f'{m} {label}': list(found[m][label].optimizer_on_open_step)
    for m in OURS for label in SCHEDULE[m][0]
  }  # fmt: skip
  return {
    'target': target.name,
    'device_kind': target.device_kind,
    'model': name,
    'description': case.model.description,
    'param_bytes': param_bytes,
    'k': k,
    'rows': rows_of(found, k, param_bytes),
    'optimizer_on_open_step': open_work,
    'programs': records,
  }
