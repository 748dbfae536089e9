"""The commands after training, over one opener of a trained run (trained.py): `stride eval` (evaluate.py),
`stride predict` (predict.py), `stride export` (export.py) and `stride generate` (generate.py). Each is a module's
`main(argv)`, dispatched by `stride <command>` (stride/commands.py) or `python -m stride <command>`: a module here that
declares NAME and HELP (and ORDER, its place in `stride --help`) is a command, found without a list to edit."""
