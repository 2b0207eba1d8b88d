"""Prefect flows over the tasks: the lifecycle of a policy, waves of many, promotion, rollback, reconcile, prefetch."""
