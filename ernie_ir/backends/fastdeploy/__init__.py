"""The FastDeploy executable: a cuda inference artifact of ERNIE 4.5 written as a FastDeploy
pre-quantized, pre-sharded checkpoint over the rank bytes (`emit`), in the format of
`ernie_ir.formats.fastdeploy`. ernie-ir does not run FastDeploy; FastDeploy serves the folder."""

from ernie_ir.backends.fastdeploy.emit import NOT_A_CHECKPOINT, fastdeploy_emitters

__all__ = ["NOT_A_CHECKPOINT", "fastdeploy_emitters"]
