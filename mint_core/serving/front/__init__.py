"""The vLLM front's parts (serving/gateway.py assembles them into its app):

- `backends`: what serves behind it, one vLLM or a fleet of replicas it routes over, behind one protocol
- `state`: what its routes share (the store and catalog, what vLLM serves, the swap locks, the golden probe)
- `completions`, `models`, `health`, `extensions`: its routes, one APIRouter each, as mint serve's `routes/`,
  with the same checks (serving/admin.py) and error answers (serving/http_errors.py)
"""
