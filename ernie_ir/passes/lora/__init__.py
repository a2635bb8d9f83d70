"""LoRA adapters: `insert` (the `lora` pass), `import_adapter` (`lora-import`), `merge` (`lora-merge`)."""
