"""The FastDeploy executable: a cuda inference artifact of ERNIE 4.5 written as a folder
FastDeploy serves (`emit`), in the formats of `ernie_ir.formats.fastdeploy`: pre-quantized and
pre-sharded over the rank bytes, or bf16 on our quantization grid for weight-only MoE experts.
ernie-ir does not run FastDeploy; FastDeploy serves the folder."""

from ernie_ir.backends.fastdeploy.emit import NOT_A_CHECKPOINT, fastdeploy_emitters, fastdeploy_refusal_for

__all__ = ["NOT_A_CHECKPOINT", "fastdeploy_emitters", "fastdeploy_refusal_for"]
