"""The transform and the values that the bad-input tests share.

``test_bad_config`` (constructor arguments), ``test_bad_call`` (arguments
of ``update``) and ``test_bad_values`` (values that exist only at run
time) build their transform with :func:`build`, over :data:`PARAMS` and
:data:`GRADS`. Not in ``helpers``: these are arrays, made when the module
is imported, and ``helpers`` must start no JAX backend (a child process
imports it before it sets its number of devices: ``children.py``).
"""

import jax.numpy as jnp
import optax

import optax_tokacc as tokacc

PARAMS = {'w': jnp.ones((2, 3)), 'b': jnp.zeros(3)}
GRADS = {'w': jnp.full((2, 3), 0.5), 'b': jnp.ones(3)}


def build(**kwargs):
  """``token_weighted_multistep(**kwargs)``, by default of
  ``optax.sgd(0.1)`` over windows of two."""
  kwargs.setdefault('inner', optax.sgd(0.1))
  kwargs.setdefault('every_k_schedule', 2)
  return tokacc.token_weighted_multistep(**kwargs)
