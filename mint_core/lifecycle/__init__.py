"""What the lifecycle flows need from the library beyond single component calls, one job per module: where
everything is (`workspace`), which prompts a run trains on (`prompts`), the revisions it looks up (`revisions`),
its training curves as a figure (`figures`), the served smoke check (`smoke`), the leases of promotions and runs
(`leases`), serving brought in line with the registry (`reconcile`), prefetching (`prefetch`) and the fault
points tests can fail a step at (`faults`). Training itself is the one recipe in `mint_core.rl.recipe`, as for
`mint train`.

Nothing here knows about Prefect: `tasks/` wraps these calls one step each, `flows/` strings them together.
"""
