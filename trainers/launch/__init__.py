"""A run's start and finish. The two launchers side by side, not chained: ray.py (a TorchTrainer for a run or a
job, on an embedded local Ray or a cluster) with ray_worker.py (what Ray Train runs on each worker), and torchrun.py
(the same loop under torchrun, no Ray). Both open a run the same way (lifecycle.py), after the same pre-flight
checks (checks.py) and scaling (scaling.py); jobs.py runs a command's job (eval, predict) on whichever started it."""
