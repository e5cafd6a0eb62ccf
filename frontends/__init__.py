"""ember.frontends: what a user touches: traced tensors, `nn`, `trace()`, `compile()` and the CLI."""
from . import functional, nn, optim
from .compile import TrainStep, compile
from .from_torch import TorchImportError, from_torch
from .nn import manual_seed
from .tensor import Parameter, Tensor, spec
from .tracing import trace

__all__ = ["compile", "TrainStep", "functional", "nn", "optim", "manual_seed", "Parameter", "Tensor", "spec", "trace", "from_torch", "TorchImportError"]
