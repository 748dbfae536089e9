"""`python -m stride <command> ...`: the `stride` command (stride/commands.py); `python -m stride --config my.yaml`
trains.

The entry point for a project folder that holds only a task module and its YAML, locally or in a Ray job (results
to an absolute path: the job runs in Ray's temporary copy of the upload):
    ray job submit --address http://127.0.0.1:8265 --working-dir . -- python -m stride --config my.yaml \\
        run.storage_path=/mnt/shared/runs
"""

from stride.commands import run

run()
