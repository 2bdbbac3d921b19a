"""Data-parallel gradient synchronization as optax transforms, optionally compressed (a package).

Every compressor here is an `optax.GradientTransformation` whose `init` and `update` run *inside*
`jax.shard_map` with the data-parallel mesh axes (`axis_name`) manual. `update` takes this
replica's local gradient, communicates, and returns the mean gradient over replicas, identical on
every replica (typed invariant over `axis_name`, so it can leave the shard_map with `P()`).

State layout. Error-feedback residuals and PowerSGD factors belong to one replica each. Outside the
shard_map every state leaf has a leading replica axis of size R (the product of the data axes'
sizes) sharded over the data axes, `P(data_axes, *rest)`; inside, each replica sees its `[1, ...]`
slice. `init` returns leaves of that `[1, ...]` shape, `update` takes and returns them.
`init_global` builds the global state with a shard_map over the data axes and
`state_partition_spec` gives its PartitionSpecs.

Wire formats (per tensor; s = per-replica shard length, R * s >= size, cut into chunks of c):
  none      f32 all-reduce.
  fp16      f16 all-reduce of every tensor in one buffer (summed in f16: DDP's fp16 hook).
  bf16      all-to-all of bf16 [R, s], then all-gather of bf16 [s] (f32 sum in between).
  int8      all-to-all of int8 [R, s] + f32 scale per chunk, then all-gather of int8 [s] + scales.
  topk      all-gather of k f32 values + k int32 indices; `two_phase`: all-to-all of ceil(k / R)
            pairs per row, then all-gather of the reduced row's ceil(k / R) largest pairs.
  powersgd  all-reduce of P [n, r] and Q [m, r] (f32) per compressed matrix, else f32 all-reduce.
  sign      all-to-all of sign bits packed 8 per uint8 [R, s/8] + an f32 scale per chunk, then
            all-gather of packed bits [s/8] + scales.
  onebit_adam  as sign after its Adam warm-up (f32 all-reduce before).
  twobit_adam  as onebit_adam with 2 bits per element packed 4 per uint8 [R, s/4] (+ scales).
  topk_adam    as topk `two_phase` after its Adam warm-up.
  randk     all-reduce of k f32 values (the same random coordinates on every replica).

Files: replica.py (the replica collectives other modules share), tensors.py (cutting tensors into
rows, state buffers), spec.py (`CompressorSpec`), one file per method family (casts.py: none,
fp16, bf16, int8; topk.py; powersgd.py; sign.py: ef_sign; onebit.py: 1-bit Adam and its variants;
randk.py), registry.py (`COMPRESSORS`, `check`, `from_config`), state.py (global state layout),
elastic.py (resizing the state onto another replica count). See docs/COMPRESSION.md for when to
use which, and docs/ARCHITECTURE.md for how to add one.
"""

from jaxdist.compression.casts import (
    INT8_BLOCK,
    Int8State,
    bf16,
    bf16_bits,
    dequantize_int8,
    fp16,
    from_bf16_bits,
    int8,
    none,
    quantize_int8,
)
from jaxdist.compression.elastic import residual_norm, resize_replicas
from jaxdist.compression.onebit import (
    FrozenAdamState,
    OneBitAdamState,
    frozen_variance_adam,
    onebit_adam,
)
from jaxdist.compression.powersgd import PowerSGDState, powersgd, powersgd_shape
from jaxdist.compression.randk import RandKState, randk
from jaxdist.compression.registry import (
    COMPRESSORS,
    FIELD_RULES,
    check,
    deprecated,
    from_config,
    preconditioner,
    spec_of,
)
from jaxdist.compression.replica import AxisName, num_replicas, replica_local
from jaxdist.compression.sign import (
    QUANTIZERS,
    TWOBIT_LEVELS,
    TWOBIT_THRESHOLD,
    SignState,
    ef_sign,
    sign,
)
from jaxdist.compression.spec import Codec, CompressorSpec, TrainFields, total_wire_bytes
from jaxdist.compression.state import init_global, sharded_state, state_partition_spec
from jaxdist.compression.tensors import shard_layout
from jaxdist.compression.topk import (
    TopKState,
    topk,
    topk_densities,
    topk_k,
    topk_wire_ratio,
)
from jaxdist.compression_fields import TOPK_EXCHANGES

__all__ = [
    "COMPRESSORS", "FIELD_RULES", "INT8_BLOCK", "QUANTIZERS", "TOPK_EXCHANGES", "TWOBIT_LEVELS",
    "TWOBIT_THRESHOLD", "AxisName", "Codec", "CompressorSpec", "FrozenAdamState", "Int8State",
    "OneBitAdamState", "PowerSGDState", "RandKState", "SignState", "TopKState", "TrainFields",
    "bf16", "bf16_bits", "check", "deprecated", "dequantize_int8", "ef_sign", "fp16",
    "from_bf16_bits", "from_config", "frozen_variance_adam", "init_global", "int8", "none",
    "num_replicas", "onebit_adam", "powersgd", "powersgd_shape", "preconditioner", "quantize_int8",
    "randk", "replica_local", "resize_replicas", "residual_norm", "shard_layout", "sharded_state",
    "sign", "spec_of", "state_partition_spec", "topk", "topk_densities", "topk_k",
    "topk_wire_ratio", "total_wire_bytes",
]  # fmt: skip
