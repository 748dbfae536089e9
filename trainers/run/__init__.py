"""The run folder as storage, the lowest floor of trainers/: its files and how they are written and read back
(folder.py, schema.py), the lock one run at a time holds (lock.py), checkpoints (checkpointing.py) and which of them
are kept (retention.py). Nothing here knows how a run is launched or what a command does with it."""
