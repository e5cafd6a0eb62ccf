"""ember.frontends: the compiler API: traced tensors, `nn`, `optim`, `trace()`, `compile()`.

Its names below (`__all__`) are the public API. Above it stand two application layers that use
only those names: `ember.frontends.training` (the trainer, the MNIST recipes, checkpoints,
metrics, trackers, plotting, dataset download) and `ember.frontends.cli` (the `ember` commands).
"""
from . import checkpoint, functional, nn, optim
from .compile import InferenceStep, TrainStep, compile, compile_inference, plan
from .from_torch import TorchImportError, from_torch
from .nn import manual_seed
from .tensor import Parameter, Tensor, spec
from .tracing import trace

__all__ = ["compile", "compile_inference", "plan", "TrainStep", "InferenceStep", "checkpoint", "functional", "nn", "optim", "manual_seed", "Parameter", "Tensor", "spec", "trace",
           "from_torch", "TorchImportError"]
