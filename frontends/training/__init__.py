"""ember.frontends.training: training with the compiler API, as an application of it.

- `trainer`: `Trainer` (compile once, loop, evaluate, log, checkpoint), `NonFiniteError`;
- `recipes`: the MNIST models (`MODELS`, `build_model`), `pytorch_init`, `make_optimizer`;
- `checkpoint`, `metrics`, `trackers` (TensorBoard), `plotting` (matplotlib curves);
- `datasets`: fetching the MNIST files (mirrors, md5 checks); reading them is `ember.runtime.data`.

This layer uses the compiler only through `ember.frontends`' public names and never imports
the commands (`ember.frontends.cli`), which stand above it.
"""
from .recipes import MODELS, build_model, make_optimizer, pytorch_init
from .trainer import NonFiniteError, Trainer

__all__ = ["Trainer", "NonFiniteError", "MODELS", "build_model", "pytorch_init", "make_optimizer"]
