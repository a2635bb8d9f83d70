"""Parallelism: `split` (tensor/expert/sequence parallel, the global graph into rank graphs),
`pipeline-stages` (every rank graph into pipeline stages) and the `rank_varying` analysis."""
