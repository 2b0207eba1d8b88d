"""The main job (`mint run`, `make run`): its steps (main.py), settings (config.py), DVC step (build.py), what it
prints (report.py) and its progress bars (progress.py)."""
