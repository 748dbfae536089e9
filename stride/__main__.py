"""`python -m stride <command> ...`: the `stride` command (stride/commands.py); `python -m stride --config my.yaml`
trains.

The entry point for a project folder that holds only a task module and its YAML, locally or in a Ray job:
    ray job submit --address http://127.0.0.1:8265 --working-dir . -- python -m stride --config my.yaml
"""

from stride.commands import run

run()
