"""Kunlunxin XPUs (P800) through Paddle's XPU kernels; int8 weights in the XPU kernel's [N, K] layout."""

from ernie_ir.targets.capabilities import REFERENCE, FusedMoE, HardwareTarget, WeightOnlyKernel
from ernie_ir.targets.kunlun.legalize import RULES

KUNLUN = HardwareTarget(
    name="kunlun",
    description="Kunlunxin XPU P800 (Paddle XPU build)",
    dtypes=("f32", "f16", "bf16"),
    weight_only=WeightOnlyKernel(
        kernel="weight_only_linear_xpu", bits=(8,), group_sizes=(-1,),
        source="paddle/phi/kernels/xpu/weight_only_linear_kernel.cc (int8, channel-wise, fp32 "
               'scale; int4 raises "unsupported weight_dtype=int4"); ' + REFERENCE),
    fused_moe=FusedMoE(kernel="moe_expert_ffn", bits=(8, 4), confirmed=True,
                       source="FastDeploy custom_ops/xpu_ops/src/ops/moe_expert_ffn.cc; " + REFERENCE),
    fp8=False,
    fp8_note="no FP8 kernels",
    collective_backend="bkcl",
    launch_flag="--xpus",
    visible_devices_env="XPU_VISIBLE_DEVICES",
    paddle_device="xpu:0",
    inference_config="config.enable_xpu()",
    onnx_runtime="none",
    packing="int8: <layer>.quant_weight int8 [N, K] (transposed, signed) + <layer>.weight_scale "
            "float32 [N], experts one pair each (weight_only_linear_kernel.cc, moe_expert_ffn.cc); "
            "int4 experts: logical [K, N] (the XPU int4 packing is not confirmed)",
    sources=("paddle/phi/kernels/xpu/weight_only_linear_kernel.cc",
             "FastDeploy custom_ops/xpu_ops/src/ops/moe_expert_ffn.cc",
             "ERNIE docs/devices/README_XPU.md", REFERENCE),
    rules=RULES,
)

__all__ = ["KUNLUN"]
