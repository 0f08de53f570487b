"""The training loop and its parts: `trainer` (Trainer), `config` (TrainerConfig), `task` (the Task
interface), `checkpointer` (save, resume, the run's final weights), `preemption` (stop signals),
`nonfinite` (skipped steps), `evaluation`, `accumulation`, `callbacks`, `ema` and the `debug` aids."""
