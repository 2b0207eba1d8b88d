"""The `mint` command line: the app and its commands (app.py), one module per command group (base, registry,
eval, task, services), and help text that reads its defaults from the settings models (help.py)."""
