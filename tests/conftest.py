"""Test configuration: several fake CPU devices, set before any backend."""

import jax

NUM_DEVICES = 8

jax.config.update('jax_platforms', 'cpu')
jax.config.update('jax_num_cpu_devices', NUM_DEVICES)
