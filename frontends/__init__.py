"""ember.frontends: what a user touches: traced tensors, `nn`, `trace()`, `compile()` and the CLI."""
from . import functional, nn
from .nn import manual_seed
from .tensor import Parameter, Tensor, spec
from .tracing import trace

__all__ = ["functional", "nn", "manual_seed", "Parameter", "Tensor", "spec", "trace"]
