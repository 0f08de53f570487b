"""The training loop and its parts: `trainer` (Trainer), `config` (TrainerConfig), `task` (the Task
interface), `train_data` (the run's datasets, batch order and loaders), `model_policies` (precision, mesh,
compile and the model-transform stage), `checkpointer` (save, resume, the run's final weights), `preemption`
(stop signals), `nonfinite` (skipped steps), `evaluation`, `accumulation`, `callbacks`, `ema` and the
`debug` aids."""
