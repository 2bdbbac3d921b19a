"""Pipeline schedules side by side: per-device temp memory, bubble fraction and step time.

    python scripts/bench_pipeline.py                       # p=4, m in 4 8 16 32, all schedules
    python scripts/bench_pipeline.py --ms=4,8 --schedules=1f1b --out=runs/bench/pipe.json

The microbatch size is fixed, so the global batch grows with m. On a CPU-only machine it simulates
the devices it needs. Prints a markdown table and writes the rows as JSON.
"""

from __future__ import annotations

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from absl import app, flags  # noqa: E402

_P = flags.DEFINE_integer("p", 4, "Pipeline stages (mesh.pipeline).")
_DATA = flags.DEFINE_integer("data", 1, "Data-parallel replicas (mesh.data).")
_MS = flags.DEFINE_list("ms", ["4", "8", "16", "32"], "Microbatch counts.")
_SCHEDULES = flags.DEFINE_list("schedules", ["gpipe", "1f1b", "interleaved"], "Schedules.")
_V = flags.DEFINE_integer("virtual_stages", 2, "Virtual stages for interleaved.")
_MB = flags.DEFINE_integer("microbatch_size", 1, "Examples per microbatch per replica.")
_LAYERS = flags.DEFINE_integer("num_layers", 8, "GPT layers.")
_D = flags.DEFINE_integer("d_model", 64, "GPT width.")
_T = flags.DEFINE_integer("seq_len", 32, "Sequence length.")
_STEPS = flags.DEFINE_integer("steps", 3, "Timed steps per row (median).")
_OUT = flags.DEFINE_string("out", "runs/bench/pipeline.json", "JSON results file.")


def main(argv):
    del argv
    from jaxdist import mesh as mesh_lib

    if not mesh_lib.accelerator_present():
        mesh_lib.configure_cpu_devices(max(8, _P.value * _DATA.value))
    from jaxdist import pipeline

    rows = pipeline.pipeline_table(
        _P.value,
        [int(m) for m in _MS.value],
        _SCHEDULES.value,
        virtual_stages=_V.value,
        microbatch_size=_MB.value,
        num_layers=_LAYERS.value,
        d_model=_D.value,
        seq_len=_T.value,
        steps=_STEPS.value,
        data=_DATA.value,
    )
    print(pipeline.format_table(rows))
    os.makedirs(os.path.dirname(_OUT.value) or ".", exist_ok=True)
    with open(_OUT.value, "w") as f:
        json.dump(rows, f, indent=2)
    print(f"wrote {_OUT.value}")


if __name__ == "__main__":
    app.run(main)
