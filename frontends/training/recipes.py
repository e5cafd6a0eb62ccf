"""The MNIST recipes: the models (`MODELS`, `build_model`), PyTorch's default initialisation
reproduced bit for bit (`pytorch_init`), the optimizer factory (`make_optimizer`) and the named
recipes of `ember mnist --recipe` (`RECIPES`).

cnn and mlp are the models of the reference recipe (`../shared/reference/torch_mnist.py`);
speednet is the speedrun recipe's (docs/speedrun.md has the experiments that chose it).
"""
from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ember.frontends import functional as F
from ember.frontends import nn, optim

__all__ = ["ResNet8", "BasicBlock", "SpeedNet", "MODELS", "INITS", "OPTIMIZERS", "LR_SCHEDULES",
           "WARMUP_START_FACTOR", "LRSchedule", "Recipe", "RECIPES", "build_model", "pytorch_init", "make_optimizer"]


def _cnn() -> nn.Module:
    return nn.Sequential(nn.Conv2d(1, 16, 3), nn.ReLU(), nn.Conv2d(16, 32, 3), nn.ReLU(), nn.Flatten(),
                         nn.Linear(32 * 24 * 24, 10))


def _mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(784, 30), nn.Sigmoid(), nn.Linear(30, 10))


def _lenet5() -> nn.Module:
    """LeNet-5 with ReLU and max pooling (28x28 input padded to LeNet's 32x32 by the first conv)."""
    return nn.Sequential(nn.Conv2d(1, 6, 5, padding=2), nn.ReLU(), nn.MaxPool2d(2),
                         nn.Conv2d(6, 16, 5), nn.ReLU(), nn.MaxPool2d(2), nn.Flatten(),
                         nn.Linear(16 * 5 * 5, 120), nn.ReLU(), nn.Linear(120, 84), nn.ReLU(), nn.Linear(84, 10))


class BasicBlock(nn.Module):
    """ResNet's basic block: two 3x3 conv + BatchNorm, plus the input (through a 1x1 conv + BN
    where the shape changes); layers registered in torchvision's order (pytorch_init draws in it)."""

    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.relu = nn.ReLU()
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.downsample = (nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))
                           if stride != 1 or cin != cout else None)

    def forward(self, x: Any) -> Any:
        out = self.bn2(self.conv2(self.relu(self.bn1(self.conv1(x)))))
        return self.relu(out + (self.downsample(x) if self.downsample is not None else x))


class ResNet8(nn.Module):
    """ResNet-8 for 28x28 MNIST: a 3x3 stem, three one-block stages (16, 32, 64 channels; the
    last two halve the resolution), global average pooling and a linear head: 8 weighted layers."""

    def __init__(self, classes: int = 10) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 16, 3, 1, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(16)
        self.relu = nn.ReLU()
        self.layer1 = BasicBlock(16, 16, 1)
        self.layer2 = BasicBlock(16, 32, 2)
        self.layer3 = BasicBlock(32, 64, 2)
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(64, classes)

    def forward(self, x: Any) -> Any:
        x = self.layer3(self.layer2(self.layer1(self.relu(self.bn1(self.conv1(x))))))
        return self.fc(F.flatten(self.avgpool(x), 1))


class SpeedNet(nn.Module):
    """The speedrun recipe's model: random translation of the input (training only), two
    convolution blocks (conv, 2x2 max pooling, BatchNorm, ReLU: pooling before the normalisation
    is the same network as after a ReLU, on a quarter of the values) and a two-layer head.
    In the spirit of tuomaso/train_mnist_fast's network, with BatchNorm added; the widths and the
    first kernel were chosen by experiment (docs/speedrun.md)."""

    def __init__(self, classes: int = 10, max_shift: int = 1, widths: tuple[int, int] = (24, 32),
                 hidden: int = 256) -> None:
        super().__init__()
        c1, c2 = widths
        self.augment = nn.RandomTranslate(max_shift)  # no parameters: the state dict is the same for every shift
        self.conv1 = nn.Conv2d(1, c1, 5)
        self.bn1 = nn.BatchNorm2d(c1)
        self.conv2 = nn.Conv2d(c1, c2, 3)
        self.bn2 = nn.BatchNorm2d(c2)
        self.pool = nn.MaxPool2d(2)
        self.relu = nn.ReLU()
        self.fc1 = nn.Linear(c2 * 5 * 5, hidden)
        self.fc2 = nn.Linear(hidden, classes)

    def forward(self, x: Any) -> Any:
        x = self.relu(self.bn1(self.pool(self.conv1(self.augment(x)))))  # 28 -> 24 -> 12
        x = self.relu(self.bn2(self.pool(self.conv2(x))))  # 12 -> 10 -> 5
        return self.fc2(self.relu(self.fc1(F.flatten(x, 1))))


# name -> (builder, whether it takes flat 784-pixel rows). cnn and mlp are torch_mnist.py's models.
MODELS: dict[str, tuple[Callable[[], nn.Module], bool]] = {"cnn": (_cnn, False), "mlp": (_mlp, True),
                                                           "lenet5": (_lenet5, False), "resnet8": (ResNet8, False),
                                                           "speednet": (SpeedNet, False)}

def pytorch_init(model: nn.Module, seed: int = 0) -> nn.Module:
    """Sets `model`'s Linear and Conv2d parameters, in place, to exactly the values PyTorch's
    default initialisation gives on the CPU after `torch.manual_seed(seed)` when the same layers
    are constructed in the same order (as a Sequential is); PyTorch itself is not needed.

    PyTorch's CPU generator is the standard MT19937 (the one NumPy's legacy RandomState runs),
    and `uniform_(a, b)` turns each 32-bit draw r into a + (r mod 2**24) * 2**-24 * (b - a),
    computed in double from the float32 bounds. Each layer draws its weight (kaiming_uniform
    with a=sqrt(5), bound sqrt(3) * sqrt(1/3) / sqrt(fan_in)) and then its bias (bound
    1 / sqrt(fan_in)). Bit-for-bit equality with torch is tested where PyTorch is installed.
    """
    if not 0 <= seed < 2**32:
        raise ValueError(f"seed must be in [0, 2**32) for PyTorch's initialisation, got {seed}")
    rs = np.random.RandomState(seed)

    def uniform(p: Any, bound: float) -> None:
        raw = rs.randint(0, 2**32, size=p.data.size, dtype=np.uint32)  # full range: the raw MT19937 outputs
        x = (raw & np.uint32(0xFFFFFF)).astype(np.float64) * 2.0**-24
        lo, hi = float(np.float32(-bound)), float(np.float32(bound))
        p.data[...] = (x * (hi - lo) + lo).astype(np.float32).reshape(p.data.shape)

    for name, m in model.named_modules():
        if isinstance(m, (nn.Linear, nn.Conv2d)):
            fan_in = int(np.prod(m.weight.data.shape[1:]))
            uniform(m.weight, math.sqrt(3.0) * (math.sqrt(2.0 / (1 + 5)) / math.sqrt(fan_in)) if fan_in else 0.0)
            if m.bias is not None:
                uniform(m.bias, 1.0 / math.sqrt(fan_in) if fan_in else 0.0)
        elif isinstance(m, (nn.BatchNorm2d, nn.LayerNorm)):
            pass  # PyTorch initialises these to ones and zeros, drawing nothing from the generator
        elif m._parameters:
            raise NotImplementedError(f"pytorch_init: no PyTorch initialisation rule for {type(m).__name__} ({name!r})")
    return model


INITS = ("torch", "ember")


def build_model(name: str, seed: int = 0, init: str = "torch", translate: int | None = None) -> nn.Module:
    """The named MNIST model. init "torch": PyTorch's default initialisation for `seed`, bit for
    bit (what the reference recipe, torch_mnist.py, starts from); "ember": ember's own
    generator (`nn.manual_seed(seed)`), the same distributions but other values. translate: the
    largest shift of the model's random translation (models with an `augment` layer)."""
    if name not in MODELS:
        raise ValueError(f"unknown model {name!r}; expected one of {sorted(MODELS)}")
    if init not in INITS:
        raise ValueError(f"unknown init {init!r}; expected one of {INITS}")
    nn.manual_seed(seed)
    model = MODELS[name][0]()
    if translate is not None:
        augment = getattr(model, "augment", None)
        if translate and not isinstance(augment, nn.RandomTranslate):  # (0: no translation, any model's)
            raise ValueError(f"--translate {translate}: the {name} model has no random translation layer "
                             f"(an `augment` RandomTranslate, as speednet's)")
        if translate < 0:
            raise ValueError(f"--translate {translate}: expected a largest shift >= 0 (pixels)")
        if isinstance(augment, nn.RandomTranslate):
            augment.max_shift = int(translate)
    return pytorch_init(model, seed) if init == "torch" else model


def has_random_translation(name: str) -> bool:
    """Whether the named model has a random translation layer (`augment`, --translate's)."""
    return name in MODELS and isinstance(getattr(MODELS[name][0](), "augment", None), nn.RandomTranslate)


OPTIMIZERS = ("sgd", "adam", "adamw")
_NAMES = {"sgd": "SGD", "adam": "Adam", "adamw": "AdamW"}


def make_optimizer(name: str, lr: float, momentum: float = 0.0, weight_decay: float | None = None,
                   nesterov: bool = False, betas: tuple[float, float] | None = None) -> optim.Optimizer:
    """The named optimizer with torch.optim's semantics and checks. weight_decay None: torch's
    default (0 for SGD and Adam, 0.01 for AdamW's decoupled decay); betas None: torch's (0.9, 0.999)."""
    if name not in OPTIMIZERS:
        raise ValueError(f"unknown optimizer {name!r}; expected one of {', '.join(OPTIMIZERS)}")
    if name == "sgd":
        if nesterov and momentum <= 0:  # torch's words, and the flag that fixes it
            raise ValueError("Nesterov momentum requires a momentum and zero dampening (add --momentum M > 0)")
        if betas is not None:
            raise ValueError("--betas applies to Adam and AdamW; SGD's is --momentum")
        return optim.SGD(lr=lr, momentum=momentum, weight_decay=weight_decay or 0.0, nesterov=nesterov)
    if momentum:
        raise ValueError(f"--momentum applies to SGD; {_NAMES[name]}'s moment decay is its betas (0.9, 0.999)")
    if nesterov:
        raise ValueError(f"--nesterov applies to SGD with momentum, not {name}")
    cls = optim.Adam if name == "adam" else optim.AdamW
    return cls(lr=lr, weight_decay=weight_decay, **({"betas": tuple(betas)} if betas is not None else {}))


LR_SCHEDULES = ("constant", "cosine", "onecycle", "step", "linear")
#: a warm-up starts at this fraction of the learning rate (torch's LinearLR start_factor)
WARMUP_START_FACTOR = 0.1


@dataclass(frozen=True)
class LRSchedule:
    """A learning-rate schedule by name, as `ember mnist --lr-schedule` takes it; `attach` turns it
    into `optim.lr_scheduler` objects for a run of `total_steps` (the trainer knows that number:
    epochs x steps per epoch), so the rate is computed inside the compiled step.

    constant: lr throughout; cosine: CosineAnnealingLR down to 0 at the end of the run; linear:
    LinearLR from lr down to 0 at the end; step: StepLR(step_size, gamma); onecycle: OneCycleLR
    with max_lr = lr over the run (the rate only: cycle_momentum=False, so --momentum holds).
    With `warmup_steps` W: SequentialLR of LinearLR(WARMUP_START_FACTOR, 1, W) and the schedule
    (which then spans the remaining steps), milestone W; onecycle has its own rise, so W sets
    its pct_start (W / total) instead.
    """
    name: str = "constant"
    warmup_steps: int = 0
    step_size: int | None = None
    gamma: float = 0.1

    def __post_init__(self) -> None:
        if self.name not in LR_SCHEDULES:
            raise ValueError(f"unknown learning-rate schedule {self.name!r}; expected one of {', '.join(LR_SCHEDULES)}")
        if self.warmup_steps < 0:
            raise ValueError(f"--warmup-steps {self.warmup_steps}: expected an integer >= 0")
        if self.name == "step" and not self.step_size:
            raise ValueError("--lr-schedule step needs --lr-step-size N (the rate is multiplied by --lr-gamma "
                             "every N steps)")
        if self.step_size is not None and self.step_size < 1:
            raise ValueError(f"--lr-step-size {self.step_size}: expected an integer >= 1")
        if not (math.isfinite(self.gamma) and self.gamma > 0):
            raise ValueError(f"--lr-gamma {self.gamma}: expected a finite factor > 0")

    def check(self, total_steps: int) -> None:
        """Refuses a warm-up that leaves no steps for the schedule after it."""
        if self.warmup_steps and self.name != "constant" and self.warmup_steps >= total_steps:
            raise ValueError(f"--warmup-steps {self.warmup_steps}: the run has {total_steps} steps in all "
                             f"(epochs x steps per epoch); expected fewer warm-up steps than that")

    def attach(self, optimizer: optim.Optimizer, total_steps: int) -> Any:
        """Attaches the schedule to `optimizer` (its config); returns the scheduler, None for constant."""
        self.check(total_steps)
        S = optim.lr_scheduler
        w = self.warmup_steps
        if self.name == "onecycle":
            return S.OneCycleLR(optimizer, max_lr=optimizer.config.lr, total_steps=total_steps,
                                pct_start=w / total_steps if w else 0.3, cycle_momentum=False)
        warm = S.LinearLR(optimizer, start_factor=WARMUP_START_FACTOR, end_factor=1.0, total_iters=w) if w else None
        rest = total_steps - w
        if self.name == "constant":
            return warm  # LinearLR holds the rate once its warm-up is done
        if self.name == "cosine":
            main = S.CosineAnnealingLR(optimizer, T_max=rest)
        elif self.name == "linear":
            main = S.LinearLR(optimizer, start_factor=1.0, end_factor=0.0, total_iters=rest)
        else:
            main = S.StepLR(optimizer, step_size=int(self.step_size or 1), gamma=self.gamma)
        return S.SequentialLR(optimizer, [warm, main], milestones=[w]) if warm is not None else main

    def describe(self, lr: float, total_steps: int) -> str:
        """One line for the run's header."""
        w = self.warmup_steps
        if self.name == "onecycle":
            return (f"lr schedule: onecycle up to {lr:g} over {w or round(0.3 * total_steps)} steps, then down, "
                    f"{total_steps} steps in all")
        warm = f"warm-up from {lr * WARMUP_START_FACTOR:g} to {lr:g} over {w} steps, then " if w else ""
        main = {"constant": f"constant {lr:g}",
                "cosine": f"cosine from {lr:g} to 0 over {total_steps - w} steps",
                "linear": f"linear from {lr:g} to 0 over {total_steps - w} steps",
                "step": f"x{self.gamma:g} every {self.step_size} steps"}[self.name]
        return f"lr schedule: {warm}{main}"


@dataclass(frozen=True)
class Recipe:
    """A named set of `ember mnist` settings (`--recipe NAME`): option names as the command's
    (`batch_size` for --batch-size) with their values, and per device kind the values that
    differ there. Options given on the command line win over the recipe's."""
    description: str
    settings: dict[str, Any]
    per_device: dict[str, dict[str, Any]] = field(default_factory=dict)

    def settings_for(self, device: str) -> dict[str, Any]:
        """The settings for `device` ("cuda:1" is a cuda device)."""
        return {**self.settings, **self.per_device.get(device.partition(":")[0], {})}


RECIPES: dict[str, Recipe] = {
    "speedrun": Recipe(
        description="MNIST to 99% test accuracy as fast as possible (docs/speedrun.md): speednet, one epoch of "
                    "batch 512, Adam (betas 0.7, 0.9) on a one-cycle schedule peaking at 0.02, label smoothing 0.1, "
                    "random translation by up to 1 pixel, shuffled, float32",
        settings={"model": "speednet", "epochs": 1, "batch_size": 512, "optimizer": "adam", "lr": 0.02,
                  "betas": "0.7,0.9", "lr_schedule": "onecycle", "label_smoothing": 0.1, "translate": 1,
                  "shuffle": True, "eval_batch_size": 2000},
        # a GPU evaluates the 10k test images in one call; on a CPU 2000 at a time keep the
        # activations (110 MB for speednet) in reach of the caches' and memory's comfort
        per_device={"cuda": {"eval_batch_size": 10000}}),
}
