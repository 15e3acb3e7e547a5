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
"""``tests/program_digests.py``, the tool that proves a change of form
leaves the compiled programs as they were: a program's digest ignores
where its code lives and what it is named, and sees any other change."""

import jax
import jax.numpy as jnp
import program_digests

from optax_tokacc.testing import hlo


def moved(x):
  with jax.named_scope('elsewhere'):
    return jnp.sin(x) * 2.0


def original(y):  # another argument name, scope and source line
  return jnp.sin(y) * 2.0


def changed(x):
  return jnp.sin(x) * 3.0


def test_a_program_moved_or_renamed_has_the_same_digest():
  x = jnp.ones(8)
  texts = [hlo.compiled_text(jax.jit(f), x) for f in (original, moved)]
  assert texts[0] != texts[1]  # the source locations and names differ
  assert program_digests.digest(texts[0]) == program_digests.digest(texts[1])
  assert 'metadata' not in program_digests.canonical(texts[1])
  assert 'FileNames' not in program_digests.canonical(texts[1])


def test_a_changed_program_has_another_digest():
  x = jnp.ones(8)
  texts = [hlo.compiled_text(jax.jit(f), x) for f in (original, changed)]
  assert program_digests.digest(texts[0]) != program_digests.digest(texts[1])


def test_compare_names_the_tests_whose_programs_differ():
  before = {'t::a': ['1', '2'], 't::b': ['3'], 't::gone': ['4']}
  after = {'t::a': ['1', '2'], 't::b': ['5'], 't::new': ['6']}
  lines = program_digests.compare(before, after)
  assert lines == ['DIFFERENT t::b: 1 differ, 1 -> 1 programs']
  assert program_digests.compare(before, before) == []


def test_a_program_attributed_to_another_test_is_matched():
  """A fixture's programs are recorded under the first test that runs: a
  program found under another node id on the other side is no change."""
  before = {'t::a': ['1'], 't::b': []}
  after = {'t::a': [], 't::b': ['1', '2'], 't::c': ['1']}  # '1' twice
  assert program_digests.unmatched(before, after) == (0, 1)
