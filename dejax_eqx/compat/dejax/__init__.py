"""The functional API of [dejax](https://github.com/hr0nix/dejax) 0.1.3, on dejax_eqx's modules.

Replace `import dejax` by

```python
import dejax_eqx.compat.dejax as dejax
```

and code written for dejax runs unchanged on current JAX: `uniform_replay`, `clustered_replay`
(objects with `init_fn`, `size_fn`, `add_fn`, `add_batch_fn`, `sample_fn`, `update_fn`), the
`circular_buffer` functions and `utils` keep dejax's signatures, arguments and results.

A state has dejax's fields, read-only (`state.storage.head`, `state.cluster_state_batch`, ...),
and holds one dejax_eqx module, `state.module` (a `dx.UniformReplay`, `dx.ClusteredReplay` or
`dx.CircularBuffer`), whose arrays are the state's. So a state passes through `jax.jit`
(donated or not), `jax.lax.scan` and `jax.vmap` like dejax's did, and code can move to the
module methods one call at a time. `docs/migration-dejax.md` maps every call and lists where
the behaviour differs.
"""

from . import (
    base as base,
    circular_buffer as circular_buffer,
    clustered as clustered,
    uniform as uniform,
    utils as utils,
)
from .clustered import clustered_replay as clustered_replay
from .uniform import uniform_replay as uniform_replay
