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
"""Check a training step from its compiled program, for any accelerator.

:func:`check` compiles a jitted step (or takes its ``Lowered`` or
``Compiled``) and reports what an open micro-step and a closing step run:
collectives with their payloads and the mesh axes they cross (TPU
transfers between slices included), the conditionals kept, the inner
optimizer's work on an open micro-step, and a modelled cost.
:func:`target` gives compile-only devices of an H100, an H200 or a TPU
slice, so that the check runs from a laptop for hardware that is not
there (the ``accelerators`` extra installs the compilers).

The submodules :mod:`optax_tokacc.testing.hlo` and
:mod:`optax_tokacc.testing.collectives` are the reader underneath, for
checks of your own.
"""

from optax_tokacc.testing import collectives
from optax_tokacc.testing import hlo
from optax_tokacc.testing._report import Collective
from optax_tokacc.testing._report import Cost
from optax_tokacc.testing._report import StepReport
from optax_tokacc.testing._report import check
from optax_tokacc.testing._report import step_cost
from optax_tokacc.testing._targets import Target
from optax_tokacc.testing._targets import known_targets
from optax_tokacc.testing._targets import target

__all__ = (
  'Collective',
  'Cost',
  'StepReport',
  'Target',
  'check',
  'collectives',
  'hlo',
  'known_targets',
  'step_cost',
  'target',
)
