"""Training: the recipe a training artifact carries (`recipe`), the loop (`loop`), checkpoints
(`checkpoints`), data and vocabulary parallelism, and the multi-rank launcher and rank worker."""
