"""Prefect flows over the tasks: the lifecycle of a policy, waves of many, promotion, rollback, reconcile, prefetch."""

from mint_core.process import freeze_at_exit

freeze_at_exit()  # a flow run's process (the worker starts one per run) exits a second sooner
