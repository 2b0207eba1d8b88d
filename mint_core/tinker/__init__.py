"""Tinker's training API on the resident base: the routes of the `tinker` SDK, served by `mint serve`.

`service.py` holds the state (sessions, training models in pinned engine slots, their optimizers, futures, the
batching window that runs forward_backward calls of many clients as one step), `losses.py` the loss functions
as the SDK documents them, `wire.py` the protobuf bodies (the SDK's own generated classes), `routes.py` the
HTTP routes. Nothing here re-declares a message of the SDK: requests parse into `tinker.types`.
"""
