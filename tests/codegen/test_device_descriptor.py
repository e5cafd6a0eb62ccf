"""The device descriptor (codegen/device.py) the CUDA planners read, without a GPU: the default
(H200) plans what an explicit H200 plans, another device gets plans from its own numbers, the
known descriptors by name, `ember kernels --gpu`, and `device_from_cupy` on a fake CuPy."""
from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import numpy as np
import pytest

from ember.codegen import cuda_direct, cuda_kernels, cuda_skinny, cuda_small_conv
from ember.codegen import device as devices
from ember.codegen.device import H200, L4, Device, using
from ember.frontends import nn, plan
from ember.frontends.cli import main as ember_main
from ember.frontends.training.recipes import MODELS, build_model, make_optimizer
from ember.runtime import cuda as runtime_cuda
from ember.runtime import target

KIB = 1024


def _step_sources(model_name: str, batch: int) -> dict[str, str]:
    nn.manual_seed(0)
    shape = (batch, 784) if MODELS[model_name][1] else (batch, 1, 28, 28)
    example = (np.zeros(shape, np.float32), np.zeros(batch, np.int64))
    graphs = plan(build_model(model_name), nn.CrossEntropyLoss(), make_optimizer("sgd", 0.05), example, device="cuda")
    return {step.split("-")[0]: target("cuda").source(g) for step, g in graphs.items()}  # train-64x784: train


@pytest.fixture
def no_gpu(monkeypatch):
    """The cuda target as on a machine without a GPU (its kernels planned for the default)."""
    def missing():
        raise RuntimeError("device 'cuda' found no NVIDIA GPU")
    monkeypatch.setattr(runtime_cuda, "_cupy", missing)


@pytest.mark.parametrize("model_name,batch", [("cnn", 64), ("cnn", 1024), ("mlp", 64), ("mlp", 1024)])
def test_default_sources_are_the_h200s(model_name, batch, no_gpu):
    default = _step_sources(model_name, batch)
    with using(H200):
        explicit = _step_sources(model_name, batch)
    assert default.keys() == explicit.keys() == {"train", "inference"}
    for step in default:
        assert default[step] == explicit[step], f"{model_name} {step} at batch {batch}"
    if (model_name, batch) == ("cnn", 1024):  # and the descriptor is read: an L4 is planned otherwise
        with using(L4):
            assert _step_sources(model_name, batch)["train"] != default["train"]


def _made_up(**facts) -> Device:
    return dataclasses.replace(H200, name="made-up GPU", **facts)


def test_fewer_multiprocessors_split_a_long_gemm_less():
    """M = N = 64 is one tile of the chosen plans, K = 2**16 long: the split count fills the GPU,
    so it follows the number of multiprocessors (a few waves of them); a GEMM with thousands of
    tiles fills any GPU unsplit."""
    long_k = dict(M=64, N=64, K=1 << 16, a_kfast=True, b_kfast=True)
    wide = dict(M=4096, N=4096, K=256, a_kfast=True, b_kfast=True)
    with using(H200):
        many, wide_many = cuda_kernels.plan_gemm(**long_k), cuda_kernels.plan_gemm(**wide)
    with using(_made_up(multiprocessors=10)):
        few, wide_few = cuda_kernels.plan_gemm(**long_k), cuda_kernels.plan_gemm(**wide)
    assert (few.BM, few.BN) == (64, 64) and many.splits > few.splits > 1
    assert few.splits % 10 == 0  # whole waves of the device's 10 multiprocessors (no power of two)
    assert wide_many.splits == wide_few.splits == 1


def test_other_planners_follow_the_device():
    """Block targets scale with the multiprocessors, shared-memory stages with the per-block
    limit, and the small grad-weight's residency with the registers."""
    small = _made_up(multiprocessors=8, shared_per_block=24 * KIB, registers_per_multiprocessor=32768)
    with using(H200):
        narrow_h, short_h = cuda_skinny.narrow_plan(1024, 10, 18432), cuda_skinny.short_m_plan(10, 18432, 1024)
        cc_h = cuda_direct.direct_channels_per_step(16, 8, 24, 3, 3, 32)
        gw_h = cuda_direct.direct_grad_weight_plan(1024, 16, 32, 3, 3, 24, 24)
        thin_h = cuda_direct.thin_rows(64, 18432)
    with using(small):
        narrow_s, short_s = cuda_skinny.narrow_plan(1024, 10, 18432), cuda_skinny.short_m_plan(10, 18432, 1024)
        cc_s = cuda_direct.direct_channels_per_step(16, 8, 24, 3, 3, 32)
        gw_s = cuda_direct.direct_grad_weight_plan(1024, 16, 32, 3, 3, 24, 24)
        thin_s = cuda_direct.thin_rows(64, 18432)
        gw_kernel = cuda_direct.render_direct_grad_weight("gw", N=1024, C=16, H=26, W=26, O=32, KH=3, KW=3)
        assert cuda_small_conv.gw_threads_per_sm(small) == 384
    with using(_made_up(multiprocessors=8)):
        short_few = cuda_skinny.short_m_plan(10, 18432, 1024)
    assert narrow_s.S < narrow_h.S and short_few.KC > short_h.KC  # fewer splits: longer k chunks
    assert short_s.KC < short_h.KC  # a's staged chunk shrinks with the shared memory
    assert cc_s < cc_h  # fewer input channels staged a step in 20 KiB
    assert gw_s[2] == 4 * 8 < gw_h[2] and gw_s[1] < gw_h[1]  # blocks, and rows a unit that fit two buffers
    assert gw_kernel.launches[0].shared_bytes <= 24 * KIB
    assert thin_s > thin_h
    assert cuda_small_conv.gw_threads_per_sm(H200) == 768


def test_known_descriptors_by_name():
    assert devices.named("h200") is devices.named("NVIDIA H200") is devices.named(" H200 ") is H200
    assert devices.named("a100").multiprocessors == 108
    assert devices.named("A100").shared_per_block_optin == 163 * KIB
    assert devices.named("nvidia l4") is L4 and L4.shared_per_multiprocessor == 100 * KIB
    assert devices.find("v100") is None
    with pytest.raises(ValueError, match=r"^unknown GPU 'v100'; known: h200, h100, a100, l4$"):
        devices.named("v100")


def test_using_nests_and_restores():
    assert devices.current() is H200 and devices.active() is None
    with using(L4):
        with using(H200):
            assert devices.current() is H200 and devices.active() is H200
        assert devices.current() is L4
    assert devices.active() is None
    with pytest.raises(TypeError):
        with using("h200"):
            pass


def test_kernels_command_plans_for_a_named_gpu(tmp_path, capsys, no_gpu):
    args = ["kernels", "--model", "cnn", "--device", "cuda", "--batch-size", "1024"]
    assert ember_main(args + ["--out", str(tmp_path / "h200")]) == 0
    assert ember_main(args + ["--out", str(tmp_path / "a100"), "--gpu", "A100"]) == 0
    name = "cnn-train-1024x1x28x28.cu"
    assert (tmp_path / "h200" / name).read_text() != (tmp_path / "a100" / name).read_text()
    assert devices.active() is None  # the block ended with the command


def test_kernels_command_refuses_an_unknown_gpu(tmp_path, capsys):
    out = tmp_path / "out"
    assert ember_main(["kernels", "--device", "cuda", "--gpu", "v100", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err == "ember kernels: error: --gpu: unknown GPU 'v100'; known: h200, h100, a100, l4\n"
    assert not out.exists()
    assert ember_main(["kernels", "--device", "cpu", "--gpu", "h200", "--out", str(out)]) == 2
    assert "--gpu plans CUDA kernels; it needs --device cuda, not 'cpu'" in capsys.readouterr().err


H200_ATTRIBUTES = {  # as CuPy 14.2 reads them on the lent H200
    "MultiProcessorCount": 132, "MaxSharedMemoryPerBlock": 49152, "MaxSharedMemoryPerBlockOptin": 232448,
    "MaxSharedMemoryPerMultiprocessor": 233472, "MaxRegistersPerMultiprocessor": 65536,
    "MaxThreadsPerMultiProcessor": 2048, "MaxBlocksPerMultiprocessor": 32, "WarpSize": 32,
    "ClockRate": 1980000, "MemoryClockRate": 3201000, "GlobalMemoryBusWidth": 6016, "L2CacheSize": 62914560,
    "ComputeCapabilityMajor": 9, "ComputeCapabilityMinor": 0}


def fake_cupy(name: bytes, attributes: dict[str, int], current: int = 0, cc: str | None = None) -> SimpleNamespace:
    """What device_from_cupy reads of CuPy: Device(index).id / .attributes / .compute_capability
    (where `cc` is given: else the attributes' major and minor) and the device name."""
    class FakeDevice:
        def __init__(self, index: int | None = None) -> None:
            self.id = current if index is None else index
            self.attributes = dict(attributes)
            if cc is not None:
                self.compute_capability = cc
    runtime = SimpleNamespace(getDeviceProperties=lambda i: {"name": name, "multiProcessorCount": 0})
    return SimpleNamespace(cuda=SimpleNamespace(Device=FakeDevice, runtime=runtime))


def test_device_from_cupy_describes_a_known_gpu_by_its_descriptor():
    assert runtime_cuda.device_from_cupy(fake_cupy(b"NVIDIA H200", H200_ATTRIBUTES)) == H200
    # CuPy's compute capability string, the attributes without theirs: the same descriptor (an H100's
    # once read as compute capability 0 and lost its descriptor, and warpgroup MMA with it)
    bare = {k: v for k, v in H200_ATTRIBUTES.items() if not k.startswith("ComputeCapability")}
    assert runtime_cuda.device_from_cupy(fake_cupy(b"NVIDIA H200", bare, cc="90")) is H200
    # a MIG slice: the same name, fewer multiprocessors: read, with the clock and bandwidth estimated
    mig = runtime_cuda.device_from_cupy(fake_cupy(b"NVIDIA H200", {**H200_ATTRIBUTES, "MultiProcessorCount": 16}), 0)
    assert mig != H200 and mig.multiprocessors == 16 and mig.name == "NVIDIA H200"
    assert mig.clock_hz == pytest.approx(1.755e9)
    assert mig.memory_bytes_per_s == pytest.approx(3201e6 * 2 * 6016 / 8 * 4.0 / 4.8)


def test_device_from_cupy_reads_an_unknown_gpu():
    attrs = {**H200_ATTRIBUTES, "MultiProcessorCount": 40, "MaxSharedMemoryPerBlockOptin": 101376,
             "MaxSharedMemoryPerMultiprocessor": 102400, "MaxThreadsPerMultiProcessor": 1536,
             "MaxBlocksPerMultiprocessor": 24, "ClockRate": 2000000, "ComputeCapabilityMinor": 9}
    got = runtime_cuda.device_from_cupy(fake_cupy("Some GPU", attrs), 1)
    assert got == Device(name="Some GPU", multiprocessors=40, shared_per_block=49152, shared_per_block_optin=101376,
                         shared_per_multiprocessor=102400, registers_per_multiprocessor=65536,
                         max_threads_per_multiprocessor=1536, max_blocks_per_multiprocessor=24,
                         clock_hz=2e9 * devices.CLOCK_UNDER_LOAD,
                         memory_bytes_per_s=3201e6 * 2 * 6016 / 8 * devices.REACHABLE_BANDWIDTH, warp_size=32,
                         compute_capability=99)
    assert not got.wgmma and H200.wgmma and not L4.wgmma  # warpgroup MMA: sm_90a only


def test_compile_device_is_the_gpu_at_hand_unless_chosen(monkeypatch):
    fake = fake_cupy(b"Some GPU", {**H200_ATTRIBUTES, "MultiProcessorCount": 40})
    monkeypatch.setattr(runtime_cuda, "_cupy", lambda: fake)
    monkeypatch.setattr(runtime_cuda, "_AT_HAND", {})
    at_hand = runtime_cuda.compile_device()
    assert at_hand.name == "Some GPU" and at_hand.multiprocessors == 40
    assert runtime_cuda.compile_device() is at_hand  # read once
    with using(L4):
        assert runtime_cuda.compile_device() is L4


def test_compile_device_without_a_gpu_is_the_h200(no_gpu):
    assert runtime_cuda.compile_device() is H200
