"""`mint catalog ...` and `mint registry ...`: look up addresses, review revisions, promote and roll back.

The read commands answer in well under a second: MLflow is read over its REST API (`RegistryReader`), so
nothing here imports `mlflow`, torch or transformers; only promote and rollback import the MLflow client.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich.table import Table

from mint_app.cli.help import default_of
from mint_app.console import make_console
from mint_app.services.config import ServicesConfig
from mint_app.services.stack import tracking_uri as resolve_tracking
from mint_core.errors import MintError
from mint_core.registry.reader import RegistryConfig, RegistryReader
from mint_core.registry.store import AdapterStore

if TYPE_CHECKING:
    from mint_core.registry.catalog import Catalog
    from mint_core.registry.catalog_schema import AliasMove
    from mint_core.registry.mlflow_registry import Registry

catalog_app = typer.Typer(help="The adapter catalog: every addressable revision.", no_args_is_help=True)
registry_app = typer.Typer(
    help="The MLflow registry: policies, their revisions, promotion and rollback.", no_args_is_help=True
)
console = make_console()  # a kept log's tables keep their width

CatalogOpt = Annotated[
    str,
    typer.Option(
        "--catalog", envvar="MINT_CATALOG_URL", help="SQLAlchemy URL of the catalog index.", show_default=True
    ),
]
StoreOpt = Annotated[
    str, typer.Option("--store", envvar="MINT_STORE", help="Adapter store root (a folder or fsspec URL).")
]
DEFAULT_TRACKING = f"http://{default_of(ServicesConfig, 'host')}:{default_of(ServicesConfig, 'mlflow_port')}"
"""The MLflow server `mint up` starts with its default settings."""
TrackingOpt = Annotated[
    str | None,
    typer.Option(
        "--tracking-uri",
        envvar="MLFLOW_TRACKING_URI",
        help="The MLflow tracking server \\[default: the one `mint up` runs for this workspace, else "
        f"{DEFAULT_TRACKING}].",
        show_default=False,
    ),
]
DEFAULT_CATALOG = "sqlite:///.mint/catalog.db"
DEFAULT_STORE = ".mint/store"


def _fail(e: Exception) -> typer.Exit:
    console.print(f"[red]error:[/red] {e}")
    return typer.Exit(1)


def _when(t: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t))


def _catalog(url: str) -> Catalog:
    # deferred: SQLAlchemy takes a third of a second to import, which `mint --help` should not pay
    from mint_core.registry.catalog import Catalog, CatalogConfig

    return Catalog(CatalogConfig(url=url))


def _reader(tracking_uri: str | None) -> RegistryReader:
    reader = RegistryReader(RegistryConfig(tracking_uri=resolve_tracking(tracking_uri, DEFAULT_TRACKING)))
    reader.check_reachable()
    return reader


def _registry(catalog: str, store: str, tracking_uri: str | None) -> Registry:
    # deferred: the MLflow client takes over a second to import; only the commands that write need it
    from mint_core.registry.mlflow_registry import Registry

    tracking = resolve_tracking(tracking_uri, DEFAULT_TRACKING)
    return Registry(AdapterStore(store), _catalog(catalog), RegistryConfig(tracking_uri=tracking))


# ---- catalog ----


@catalog_app.command("ls")
def catalog_ls(
    policy: Annotated[str | None, typer.Option(help="Only this policy's versions.")] = None,
    base: Annotated[str | None, typer.Option(help="Only revisions of this base fingerprint.")] = None,
    rank: Annotated[int | None, typer.Option(help="Only revisions of this rank.")] = None,
    tag: Annotated[str | None, typer.Option(help="`key` or `key=value`.")] = None,
    limit: int = 50,
    offset: int = 0,
    catalog: CatalogOpt = DEFAULT_CATALOG,
) -> None:
    """List catalog entries, oldest first."""
    try:
        with _catalog(catalog) as cat:
            rows = cat.list(policy=policy, base=base, rank=rank, tag=tag, limit=limit, offset=offset)
            total = cat.count(policy)
    except MintError as e:
        raise _fail(e) from e
    table = Table(title=f"catalog {catalog}: {len(rows)} of {total}", title_justify="left")
    for col in ("address", "digest", "base", "rank", "tags", "created"):
        table.add_column(col)
    for r in rows:
        address = f"{r.policy}/v{r.version}" if r.policy else "-"
        tags = ", ".join(f"{k}={v}" for k, v in sorted(r.tags.items()))
        table.add_row(address, r.digest[:16], r.base[:12], str(r.rank), tags, _when(r.created))
    console.print(table)


@catalog_app.command("resolve")
def catalog_resolve(
    address: Annotated[str, typer.Argument(help="policy, policy@alias, policy/vN or sha256:<hex>")],
    catalog: CatalogOpt = DEFAULT_CATALOG,
) -> None:
    """Print the digest and location an address names."""
    try:
        with _catalog(catalog) as cat:
            r = cat.resolve(address)
    except MintError as e:
        raise _fail(e) from e
    where = f"  ({r.policy}/v{r.version})" if r.policy else ""
    console.print(f"{r.digest.prefixed}  {r.location}{where}")


@catalog_app.command("show")
def catalog_show(
    address: Annotated[str, typer.Argument(help="policy, policy@alias, policy/vN or sha256:<hex>")],
    catalog: CatalogOpt = DEFAULT_CATALOG,
) -> None:
    """Everything the catalog knows about one address: revision, versions naming it, alias moves."""
    try:
        with _catalog(catalog) as cat:
            r = cat.resolve(address)
            entry = cat.entry(r.digest)
            moves = cat.alias_moves(r.policy, limit=10) if r.policy else []
    except MintError as e:
        raise _fail(e) from e
    table = Table(show_header=False, title=address, title_justify="left")
    table.add_column("field", style="bold")
    table.add_column("value")
    table.add_row("digest", r.digest.prefixed)
    table.add_row("location", r.location)
    if r.policy:
        table.add_row("version", f"{r.policy}/v{r.version}")
    table.add_row("base", entry.base)
    table.add_row("rank", str(entry.rank))
    table.add_row("tags", ", ".join(f"{k}={v}" for k, v in sorted(entry.tags.items())) or "-")
    table.add_row("created", _when(entry.created))
    console.print(table)
    if moves:
        _print_moves(moves, f"{r.policy}: latest alias moves")


@catalog_app.command("gc")
def catalog_gc(
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Only list what would be removed.")] = False,
    registry: Annotated[
        bool, typer.Option(help="Also keep every revision an MLflow version names (needs the server).")
    ] = True,
    catalog: CatalogOpt = DEFAULT_CATALOG,
    store: StoreOpt = DEFAULT_STORE,
    tracking_uri: TrackingOpt = None,
) -> None:
    """Remove store revisions no catalog entry, version or alias references (never a referenced one)."""
    try:
        with _catalog(catalog) as cat:
            keep = cat.referenced_digests()
            if registry:
                reader = _reader(tracking_uri)
                for policy in reader.policies():
                    keep |= {r.digest for r in reader.revisions(policy)}
        removed = AdapterStore(store).gc(set(keep), dry_run=dry_run)
    except MintError as e:
        raise _fail(e) from e
    verb = "would remove" if dry_run else "removed"
    console.print(f"{verb} {len(removed)} item(s); kept {len(keep)} referenced revision(s)")
    for item in removed[:50]:
        console.print(f"  {item}")
    if len(removed) > 50:
        console.print(f"  ... and {len(removed) - 50} more")


@catalog_app.command("rebuild")
def catalog_rebuild(
    policy: Annotated[
        list[str] | None, typer.Argument(help="Policies to rebuild; default: every policy.")
    ] = None,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Only report what would change.")] = False,
    catalog: CatalogOpt = DEFAULT_CATALOG,
    store: StoreOpt = DEFAULT_STORE,
    tracking_uri: TrackingOpt = None,
) -> None:
    """Rebuild the catalog's versions and aliases from MLflow (the truth) and the store; idempotent."""
    from mint_core.registry.index import rebuild_catalog  # deferred with the catalog (SQLAlchemy)

    try:
        reader = _reader(tracking_uri)
        with _catalog(catalog) as cat:
            report = rebuild_catalog(reader, cat, AdapterStore(store), policy or None, dry_run=dry_run)
    except MintError as e:
        raise _fail(e) from e
    verb = "would change" if dry_run else "changed"
    console.print(
        f"{report.policies} policies compared with {reader.uri}; {verb} {len(report.changes)} row(s)"
    )
    for line in report.changes:
        console.print(f"  {line}")
    for line in report.not_in_store:
        console.print(f"  [yellow]not in the store:[/yellow] {line} (indexed at its MLflow source)")


# ---- registry ----


def _print_moves(moves: list[AliasMove], title: str) -> None:
    table = Table(title=title, title_justify="left")
    for col in ("when", "alias", "from", "to", "by", "why"):
        table.add_column(col)
    for m in moves:
        v_from = f"v{m.from_version}" if m.from_version is not None else "-"
        v_to = f"v{m.to_version}" if m.to_version is not None else "-"
        table.add_row(_when(m.at), m.alias, v_from, v_to, m.actor, m.reason)
    console.print(table)


def _version(text: str) -> int:
    t = text.split("/")[-1]
    t = t[1:] if t.startswith("v") else t
    if not t.isdigit() or int(t) < 1:
        raise typer.BadParameter(f"a version is N or vN (N >= 1), not {text!r}")
    return int(t)


@registry_app.command("ls")
def registry_ls(
    policy: Annotated[str | None, typer.Argument(help="A policy; without it, list the policies.")] = None,
    tracking_uri: TrackingOpt = None,
) -> None:
    """List policies, or one policy's revisions with their aliases and gate decisions."""
    try:
        reg = _reader(tracking_uri)
        if policy is None:
            table = Table(title=f"policies in {reg.uri}", title_justify="left")
            for col in ("policy", "versions", "champion", "candidate"):
                table.add_column(col)
            for p in reg.policies():
                revs = reg.revisions(p)
                by_alias = {a: r.version for r in revs for a in r.aliases}
                table.add_row(
                    p,
                    str(len(revs)),
                    f"v{by_alias['champion']}" if "champion" in by_alias else "-",
                    f"v{by_alias['candidate']}" if "candidate" in by_alias else "-",
                )
            console.print(table)
            return
        revs = reg.revisions(policy)
    except MintError as e:
        raise _fail(e) from e
    table = Table(title=f"{policy} ({reg.uri}/#/models/{policy})", title_justify="left")
    for col in ("version", "aliases", "digest", "rank", "parent", "data_rev", "gate", "created"):
        table.add_column(col)
    for r in revs:
        gate = r.gate
        gate_text = "-" if gate is None else ("pass" if gate.get("passed") else "fail")
        table.add_row(
            f"v{r.version}",
            ", ".join(r.aliases) or "-",
            r.digest[:16],
            str(r.rank),
            r.parent or f"base ({r.base[:12]})",
            (r.data_rev or "-")[:12],
            gate_text,
            _when(r.created_ms / 1000),
        )
    console.print(table)


@registry_app.command("lineage")
def registry_lineage(
    address: Annotated[str, typer.Argument(help="policy/vN")],
    tracking_uri: TrackingOpt = None,
) -> None:
    """A revision and its ancestors through mint.parent, newest first, down to the bare base: revision 0 of
    every policy, what its first revision was trained from and gated against."""
    policy, _, version = address.partition("/")
    if not version:
        raise typer.BadParameter(f"expected policy/vN, got {address!r}")
    try:
        chain = _reader(tracking_uri).lineage(policy, _version(version))
    except MintError as e:
        raise _fail(e) from e
    table = Table(title=f"lineage of {address}", title_justify="left")
    for col in ("revision", "digest", "data_rev", "run"):
        table.add_column(col)
    for r in chain:
        table.add_row(r.address, r.digest[:16], (r.data_rev or "-")[:12], r.run_id or "-")
    root = chain[-1]
    if not root.parent:  # a first revision: its parent is the base it was trained on
        table.add_row(f"base (v0 of {root.policy})", f"{root.base[:16]} (fingerprint)", "-", "-")
    console.print(table)


@registry_app.command("history")
def registry_history(
    policy: str,
    alias: Annotated[str | None, typer.Option(help="Only this alias.")] = None,
    limit: int = 20,
    catalog: CatalogOpt = DEFAULT_CATALOG,
) -> None:
    """Alias moves of a policy (when, from, to, by whom, why), newest first."""
    try:
        with _catalog(catalog) as cat:
            moves = cat.alias_moves(policy, alias, limit)
    except MintError as e:
        raise _fail(e) from e
    _print_moves(moves, f"{policy}: alias moves")


def run_canary_cmd(policy: str, version: int, doc: dict[str, Any]) -> None:
    """Run the canary flow in this process and print its decision and evidence; exit 1 unless promoted."""
    share = doc.get("canary", {}).get("share")
    if share is not None and not 0.0 < share < 1.0:
        raise typer.BadParameter(
            f"--share/--canary {share:g}: a canary answers a share strictly between 0 and 1"
        )
    from flows.canary import canary_flow
    from mint_app.services.stack import flow_run_url, flow_workspace, on_stack

    doc.update(policy=policy, version=version)
    with on_stack(console.print) as stack:
        doc["workspace"] = flow_workspace(stack, doc.get("workspace"))
        try:
            state = canary_flow(**doc, return_state=True)
            console.print(f"flow run: {flow_run_url(stack, state.state_details.flow_run_id)}")
            out = state.result()
        except (MintError, ValueError) as e:
            console.print(f"[red]error:[/] {e}")
            raise typer.Exit(2) from None
    assert out is not None
    colour = {"promoted": "green", "rolled back": "red"}.get(out.decision, "yellow")
    console.print(
        f"{policy}/v{version}: [{colour}]{out.decision}[/] after {out.scored:,} scored of {out.requests:,} "
        f"requests ({out.seconds:.0f} s): {out.reason}"
    )
    if out.decision != "promoted":
        raise typer.Exit(1)


@registry_app.command("promote")
def registry_promote(
    policy: str,
    version: Annotated[str, typer.Argument(help="N or vN")],
    reason: Annotated[str, typer.Option("--reason", "-m", help="Why (kept in the move log).")],
    alias: Annotated[str, typer.Option(help="The alias to move.")] = "champion",
    canary: Annotated[
        float | None,
        typer.Option(
            min=0.0,
            max=1.0,
            help="Canary instead: the version answers this share of the policy's users until the online test "
            "promotes or rolls it back (`mint canary`; needs `mint up` and traffic).",
        ),
    ] = None,
    catalog: CatalogOpt = DEFAULT_CATALOG,
    store: StoreOpt = DEFAULT_STORE,
    tracking_uri: TrackingOpt = None,
) -> None:
    """Point an alias (champion by default) at a version. Serving follows champion via reconcile."""
    if canary is not None:
        if alias != "champion":
            raise typer.BadParameter("--canary promotes to champion; leave --alias out")
        workspace = {"store": store, "catalog_url": catalog}  # MLflow: the flag's, else the stack's
        if tracking_uri:
            workspace["tracking_uri"] = tracking_uri
        run_canary_cmd(policy, _version(version), {"canary": {"share": canary}, "workspace": workspace})
        return
    try:
        move = _registry(catalog, store, tracking_uri).set_alias(policy, alias, _version(version), reason)
    except MintError as e:
        raise _fail(e) from e
    console.print(f"{policy}@{alias}: {_v(move.from_version)} -> {_v(move.to_version)}")


@registry_app.command("rollback")
def registry_rollback(
    policy: str,
    to: Annotated[
        str | None, typer.Option(help="N or vN; default: the champion before the current one.")
    ] = None,
    reason: Annotated[str, typer.Option("--reason", "-m", help="Why (kept in the move log).")] = "rollback",
    catalog: CatalogOpt = DEFAULT_CATALOG,
    store: StoreOpt = DEFAULT_STORE,
    tracking_uri: TrackingOpt = None,
) -> None:
    """Move champion back to an earlier version."""
    try:
        reg = _registry(catalog, store, tracking_uri)
        move = reg.rollback(policy, _version(to) if to else None, reason)
    except MintError as e:
        raise _fail(e) from e
    console.print(f"{policy}@champion: {_v(move.from_version)} -> {_v(move.to_version)}")


@registry_app.command("retain")
def registry_retain(
    keep_last: Annotated[
        int, typer.Option("--keep-last", min=0, help="Keep each policy's newest N versions.")
    ],
    policy: Annotated[
        list[str] | None,
        typer.Option("--policy", help="Only this policy (repeatable); default: every policy."),
    ] = None,
    apply: Annotated[
        bool, typer.Option("--apply", help="Delete them; without it, only print what would go.")
    ] = False,
    reason: Annotated[str, typer.Option("--reason", "-m", help="Why (logged).")] = "retention",
    catalog: CatalogOpt = DEFAULT_CATALOG,
    store: StoreOpt = DEFAULT_STORE,
    tracking_uri: TrackingOpt = None,
) -> None:
    """Delete old versions: keep every aliased version, the lineage (mint.parent) of every aliased version across
    policies, and the newest N; the rest leave MLflow and the catalog. A dry run unless --apply; then run
    `mint catalog gc` to free their bytes."""
    from mint_core.registry.retention import plan_retention, protected

    try:
        reader = _reader(tracking_uri)
        aliased, revs = reader.everything()
        unknown = sorted(set(policy or ()) - set(aliased))
        if unknown:
            raise typer.BadParameter(f"no such policy: {', '.join(unknown)} (see `mint registry ls`)")
        guard = protected(aliased, revs)
        plans = [plan_retention(p, revs, guard, keep_last) for p in (policy or sorted(aliased))]
        if apply:
            reg = _registry(catalog, store, tracking_uri)
            for p in plans:
                if p.delete:  # checked again under the policy's lock: what changed meanwhile stays
                    done = reg.delete_versions(p.policy, p.delete, reason, guard)
                    p.keep.update(done.keep)
                    p.delete = done.delete
    except MintError as e:
        raise _fail(e) from e
    verb = "deleted" if apply else "would delete"
    table = Table(title=f"retention in {reader.uri}: keep aliased, their lineage, newest {keep_last}")
    for col in ("policy", "kept", "why", verb):
        table.add_column(col)
    for p in plans:
        kept = ", ".join(f"v{v}" for v in sorted(p.keep)) or "-"
        whys = "; ".join(f"v{v} {why}" for v, why in sorted(p.keep.items()) if not why.startswith("newest"))
        table.add_row(p.policy, kept, whys or "-", ", ".join(f"v{v}" for v in p.delete) or "-")
    console.print(table)
    total = sum(len(p.delete) for p in plans)
    if apply:
        console.print(f"{verb} {total} version(s); `mint catalog gc` now frees their bytes")
    else:
        console.print(f"{verb} {total} version(s); run again with --apply to delete them")


def _v(v: int | None) -> str:
    return "unset" if v is None else f"v{v}"
