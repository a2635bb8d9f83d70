"""Other tools' file formats, each read and written in one module: onnxruntime-genai's config
(`genai_config`), FastDeploy's checkpoint (`fastdeploy`: the tensor names and layouts FastDeploy
reads, config.json and its `quantization_config` written from the quantization the passes
recorded, and reading such a folder back) and paddleformers' LoRA adapter folder
(`paddleformers_adapter`). A format takes a target's facts as data, never from `targets`."""
