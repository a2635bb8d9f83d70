"""Huawei Ascend NPUs through PaddleCustomDevice ("npu"); int8 [K, N], the NPU binding's layout."""

from ernie_ir.targets.ascend.legalize import RULES
from ernie_ir.targets.capabilities import REFERENCE, FusedMoE, HardwareTarget, WeightOnlyKernel

ASCEND = HardwareTarget(
    name="ascend",
    description="Huawei Ascend NPU (PaddleCustomDevice npu backend)",
    dtypes=("f32", "f16", "bf16"),
    weight_only=WeightOnlyKernel(
        kernel="weight_only_linear_npu", bits=(8,), group_sizes=(-1,),
        source="PaddleCustomDevice backends/npu/custom_op/llama_infer/fused_weight_only_linear.cc "
               "(per-channel int8; the CANN kernel takes int4 but no Paddle binding was found); "
               + REFERENCE),
    fused_moe=FusedMoE(kernel="sparse_moe", bits=(8, 4), confirmed=False,
                       source="paddlenlp_ops sparse_moe (unconfirmed); " + REFERENCE),
    fp8=False,
    fp8_note="no FP8 kernels",
    collective_backend="xccl (HCCL)",
    launch_flag="--npus",
    visible_devices_env="ASCEND_RT_VISIBLE_DEVICES",
    extra_env={"PADDLE_XCCL_BACKEND": "npu"},
    paddle_device="npu:0",
    inference_config='config.enable_custom_device("npu", 0)',
    onnx_runtime="CANN EP (small op set, no contrib ops)",
    packing="int8 [K, N] (= the logical layout) + per-channel scales [N] in the activation dtype, "
            "as weight_only_linear_npu passes them to aclnnWeightQuantBatchMatmulV2 (ND format; "
            "the FRACTAL_NZ variant is not produced)",
    sources=("PaddleCustomDevice backends/npu/custom_op/llama_infer/fused_weight_only_linear.cc",
             "ERNIE docs/devices/README_NPU.md", REFERENCE),
    rules=RULES,
)

__all__ = ["ASCEND"]
