"""Other tools' file formats, each read and written in one module: onnxruntime-genai's config
(`genai_config`), FastDeploy's checkpoint (`fastdeploy`: the tensor names and layouts FastDeploy
reads, config.json and its `quantization_config` written from the quantization the passes
recorded, and reading such a folder back), paddleformers' LoRA adapter folder
(`paddleformers_adapter`) and the -PT checkpoint layout transformers loads (`pt_checkpoint`).
A format takes a target's facts as data, never from `targets`."""
