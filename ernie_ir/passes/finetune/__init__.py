"""Fine-tuning without adapters: `full_param` (the `full-param` pass), which marks the float params
a full-parameter fine-tune updates (ERNIEKit's `fine_tuning: Full`)."""
