"""The training loop and what it drives: `trainer` (Trainer, TrainerConfig), `task` (the Task interface),
`checkpointer` (saving, resuming and the run's final weights), `evaluation`, `accumulation`, `callbacks`,
`ema` and the `debug` aids."""
