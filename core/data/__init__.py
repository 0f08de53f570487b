"""Data for the loop: resumable `samplers`, the `loaders` over a task's datasets, the per-sample `seeded`
wrappers that make workers and resume deterministic, `workers` that report the sample they died on, and the
`bad_samples` policy every domain's reader follows."""
