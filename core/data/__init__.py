"""Data for the loop: resumable `samplers`, the `loaders` over a task's datasets, the per-sample `seeded`
wrappers that make workers and resume deterministic, `workers` that report the sample they died on, and the
`bad_samples` policy every domain's reader follows; `prepared`, the steps every prepared folder is written
by, `sample_shards`, samples in tar shards, and `jsonl`, the one reader of JSON Lines files."""
