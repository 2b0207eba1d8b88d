"""mint's local services (`mint up/down/status`): starting, stopping and checking them (control.py), their
settings and names (config.py), each one's command line (commands.py), the Prefect deployments the worker runs
(deployments.py), pid files, records and logs (processes.py), a service's supervisor (supervise.py), the MLflow
webhook receiver (webhooks.py), the Prefect server's logging (prefect_logging.py) and the stack a workspace's
`mint up` started (stack.py)."""
