"""jaxdist: JAX-native SPMD training. Size the mesh axes; the model names only logical axes."""

from jaxdist.errors import ConfigError

__all__ = ["ConfigError"]
