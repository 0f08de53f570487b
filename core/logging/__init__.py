"""What a run reports: `messages` (the one channel for what torchkiln tells the user), the `processor` that
owns the logging window the loop's rows come from, `sinks` (metrics.jsonl, TensorBoard, CSV), `trackers`
(W&B, MLflow), the `progress` bar, and `throughput` (tokens/s, model FLOPs, MFU, peak memory)."""
