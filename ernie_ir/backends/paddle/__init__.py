"""The Paddle backend: rank graphs as Paddle Layers (`layer`), the inference executable (`emit`),
running one rank here (`session`) or several as paddle.distributed processes (`launch`,
`rank_worker`, `pipeline`), and the device probes (`devices`)."""
