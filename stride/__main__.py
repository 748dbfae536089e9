"""`python -m stride --config my.yaml [section.field=value ...]`: the training driver (trainers/main.py).

The entry point for a project folder that holds only a task module and its YAML, locally or in a Ray job:
    ray job submit --address http://127.0.0.1:8265 --working-dir . -- python -m stride --config my.yaml
"""

import sys

from stride.trainers.main import main

sys.exit(main())
