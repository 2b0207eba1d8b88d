"""Tinker's training API on the resident base: the routes of the `tinker` SDK, served by `mint serve`.

`service.py` holds the service (sessions, training models in pinned engine slots, the queue and the batching
window that runs forward_backward calls of many clients as one step), `records.py` what it keeps, `checkpoints.py`
its saves, loads, snapshots and training-run records, `optim.py` the fused AdamW step, `losses.py` the loss
functions as the SDK documents them, `wire.py` the protobuf bodies (the SDK's own generated classes), `routes.py`
the HTTP routes, `mount.py` serving's app with these routes mounted. Nothing here re-declares a message of the SDK:
requests parse into `tinker.types`.
"""
