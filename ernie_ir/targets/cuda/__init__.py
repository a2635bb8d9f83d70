"""NVIDIA GPUs through Paddle's CUDA kernels; weights in Paddle's arch-permuted layout."""

from ernie_ir.targets.capabilities import REFERENCE, ArchOption, FusedMoE, HardwareTarget, WeightOnlyKernel
from ernie_ir.targets.cuda.legalize import RULES
from ernie_ir.targets.cuda.packing import CUDA_ARCHS, DEFAULT_CUDA_ARCH, pack, packable, unpack

FP8_ARCHS = (89, 90)

CUDA = HardwareTarget(
    name="cuda",
    description="NVIDIA GPU (Paddle GPU build, CUTLASS weight-only GEMMs)",
    dtypes=("f32", "f16", "bf16", "f8e4m3"),
    weight_only=WeightOnlyKernel(
        kernel="weight_only_linear", bits=(8, 4), group_sizes=(-1, 64, 128),
        source="paddle/phi/kernels/gpu/weight_only_linear_kernel.cu (SM70-100); " + REFERENCE),
    fused_moe=FusedMoE(kernel="fused_moe", bits=(8, 4), confirmed=True,
                       source="Paddle incubate fused_moe / FastDeploy moe_ffn; " + REFERENCE),
    fp8=True,
    fp8_note="Hopper/Ada only (--cuda-arch 89 or 90)",
    collective_backend="nccl",
    launch_flag="--gpus",
    visible_devices_env="CUDA_VISIBLE_DEVICES",
    paddle_device="gpu:0",
    inference_config="config.enable_use_gpu(memory_pool_init_size_mb, 0)",
    onnx_runtime="CUDA EP (MatMulNBits, int4 DequantizeLinear)",
    packing="Paddle weight_quantize layout for --cuda-arch (bytes checked against Paddle's CPU kernel)",
    sources=("paddle/phi/kernels/gpu/weight_only_linear_kernel.cu",
             "paddle/phi/kernels/cpu/weight_quantize_kernel.cc", REFERENCE),
    rules=RULES,
    arch_option=ArchOption(name="cuda_arch", flag="--cuda-arch", choices=CUDA_ARCHS,
                           default=DEFAULT_CUDA_ARCH, fp8=FP8_ARCHS, fp8_hint="Hopper/Ada"),
    executables=("paddle", "fastdeploy", "onnx", "paddle-inference"),
    default_emit={"inference": ("paddle", "fastdeploy"), "training": ("paddle",)},
)

__all__ = ["CUDA", "CUDA_ARCHS", "DEFAULT_CUDA_ARCH", "FP8_ARCHS", "pack", "packable", "unpack"]
