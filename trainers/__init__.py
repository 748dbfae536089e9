"""stride.trainers: the driver (main.py, driver.py), the config, the Task API (task.py, tasks/), the per-worker
Trainer (loop.py) with its policies and sinks, the plain-PyTorch core (step.py, fsdp.py, checkpointing.py), and the
two launcher edges (ray_worker.py for Ray Train, torchrun.py)."""
