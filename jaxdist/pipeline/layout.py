"""Where the stacked layers are stored: interleaved's looped row order and the reorder to [L].

The stacked layers are stored split over `pipeline` in contiguous blocks; for the looped
(interleaved) schedule the rows are stored in looped order so each device holds its own chunks
(`layer_order`); the engine reorders state trees between that and the user's [L] order at init,
save and restore (`reorder_layers`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxdist import sharding
from jaxdist.pipeline.schedules import AXIS
from jaxdist.pipeline.spec import schedule_spec


def layer_order(config, mesh_shape: Mapping[str, int]) -> np.ndarray | None:
    """Which layer each stored row of the stacked layers holds, or None for the identity.

    The stacked layers are stored split over `pipeline` in contiguous blocks. For the looped
    (interleaved) schedule device d runs chunks d, p + d, 2p + d, ...; storing the rows in that
    order (like MaxText's `circular_repeats`: [p, v, Lc] = device, lap, layer within the chunk)
    gives each device its own chunks with no per-step exchange. Row r of the store holds layer
    `order[r]`; checkpoints, exports and `train.init_from` keep the user's [L] order (the engine
    reorders at init, save and restore: `reorder_layers`).
    """
    p = int(mesh_shape.get(AXIS, 1))
    spec = schedule_spec(config.pipeline.schedule)
    v = int(config.pipeline.virtual_stages) if spec.virtual else 1
    if p <= 1 or v <= 1:
        return None
    lc = int(config.model.num_layers) // (p * v)
    chunks = np.arange(p * v).reshape(v, p).T  # [p, v]: chunk s·p + d on device d, lap s
    return (chunks[..., None] * lc + np.arange(lc)).reshape(-1)


def reorder_layers(tree: Any, shardings: Any, order: np.ndarray | None, *, to_user: bool) -> Any:
    """Stacked-layer leaves of `tree` (any state tree: params, optimizer moments, per-replica
    copies) between the stored order and the user's [L] order (`layer_order`).

    A leaf is a stacked-layer leaf when its storage sharding puts `pipeline` on an axis of length
    `len(order)` (the logical `layers` axis, see sharding.STORAGE_RULES); that axis is permuted.
    """
    if order is None:
        return tree
    index = np.argsort(order) if to_user else order  # user[l] = stored[r] where order[r] = l

    def one(x, sh):
        spec = tuple(sh.spec) + (None,) * (x.ndim - len(sh.spec))
        for axis, entry in enumerate(spec):
            names = entry if isinstance(entry, tuple) else (entry,)
            if AXIS in names and x.shape[axis] == len(order):
                return sharding.constrain_to(jnp.take(x, jnp.asarray(index), axis=axis), sh)
        return x

    return jax.tree.map(one, tree, shardings)
