"""Other tools' file formats, each read and written in one module: onnxruntime-genai's config
(`genai_config`)."""
