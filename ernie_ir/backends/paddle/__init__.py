"""The Paddle backend: rank graphs as Paddle Layers (`layer`), the Paddle Inference KV-cache decoder
and its session (`decoder`; `emit`: a logits-only program of a plain graph),
running one rank here (`session`) or several as paddle.distributed processes (`launch`,
`rank_worker`, `pipeline`), and the device probes (`devices`)."""
