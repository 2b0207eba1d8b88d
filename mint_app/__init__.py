"""The mint application: the `mint` CLI, the main job (`mint run`) and the service supervisor (`mint up`).

It sits above `flows/` and `tasks/` and is the only package that knows every part; `mint_core` (the library)
never imports it.
"""
