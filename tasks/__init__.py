"""Prefect tasks, one lifecycle step each: typed inputs, one call into mint_core, typed outputs."""
