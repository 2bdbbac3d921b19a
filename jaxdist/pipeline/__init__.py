"""Pipeline parallelism for any model with `Stages` (moved whole into gradients.py; split next)."""

from jaxdist.pipeline import gradients as _gradients

globals().update({k: v for k, v in vars(_gradients).items() if not k.startswith("__")})
