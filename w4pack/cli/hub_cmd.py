"""w4pack push / pull: publish a packed checkpoint to the Hugging Face Hub and fetch one back.

Thin wrappers over ``w4pack.hub.push`` / ``pull``. Errors are one line with exit 4 (network, 401, 403, 404)
or 2 (an invalid folder or --endpoint, refused before any request); the token never appears in any output.
"""
from __future__ import annotations

from pathlib import Path

import click

from . import check_endpoint, emit_json, plural, require_packed, settle
from .extras import needs_extras

_ENDPOINT_HELP = "Hub URL (default: $HF_ENDPOINT or https://huggingface.co)."
_TOKEN_HELP = "Hugging Face token (default: $HF_TOKEN or the saved login). Never printed."


@click.command()
@click.argument("path", type=click.Path(path_type=Path))
@click.argument("repo_id")
@click.option("--private", is_flag=True, help="Create the repository as private (when it does not exist yet).")
@click.option("--revision", default=None, metavar="BRANCH", help="Branch to push to (created if missing).")
@click.option("--commit-message", default=None, help="Commit summary.")
@click.option("--create-pr", is_flag=True, help="Open a pull request instead of committing to the branch.")
@click.option("--endpoint", default=None, metavar="URL", help=_ENDPOINT_HELP)
@click.option("--token", default=None, metavar="TOKEN", help=_TOKEN_HELP, show_default=False)
@click.option("--dry-run", is_flag=True, help="Validate and show what would be uploaded; make no request.")
@click.option("--no-validate", is_flag=True, help="Upload without checking the folder first (not recommended).")
@click.option("--json", "as_json", is_flag=True, help="One JSON document on stdout.")
@needs_extras("push")
def push(path: Path, repo_id: str, private: bool, revision: str | None, commit_message: str | None,
         create_pr: bool, endpoint: str | None, token: str | None, dry_run: bool, no_validate: bool,
         as_json: bool) -> None:
    """Upload the checkpoint folder PATH to the Hub repository REPO_ID (owner/name).

    PATH is validated first (schema, index, checksums); README.md is written or updated in PATH with a model
    card (base model and license when the source supplied them, quantization details). Every non-hidden file of
    PATH is uploaded, sub-folders included; top-level *.safetensors, *.safetensors.index.json and w4pack.json
    on the branch that PATH lacks are deleted in the same commit. Re-running after a failure sends only what is
    missing. A Hub-compatible server without Xet storage needs HF_HUB_DISABLE_XET=1 in the environment.

    Exit 0 ok, 2 bad input or usage (an invalid folder, REPO_ID or --endpoint: nothing is sent), 4 I/O or
    network failure (401, 403, 404 each named).
    """
    from ..hub import push as do_push

    check_endpoint(endpoint)
    if not no_validate:
        require_packed(path, "push", repo_id)
    result = do_push(path, repo_id, private=private, revision=revision, commit_message=commit_message,
                     create_pr=create_pr, endpoint=endpoint, token=token, dry_run=dry_run,
                     validate=not no_validate)
    settle()  # committed on the Hub: a Ctrl-C from here on cannot make this push "interrupted"
    if as_json:
        result = {k: v for k, v in result.items() if k != "card"}
        emit_json(result)
        return
    if dry_run:
        click.echo(f"dry run: would push {len(result['files'])} files ({result['total_bytes'] / 1e6:.1f} MB) "
                   f"from {path} to {result['url']} ({result['revision']}"
                   f"{', as a pull request' if create_pr else ''}); model card "
                   f"{'would be written' if result['card_changed'] else 'unchanged'}")
        for f in result["files"]:
            click.echo(f"  {f['path']}  {f['size']} bytes")
        return
    if result["unchanged"]:
        click.echo(f"{result['url']} ({result['revision']}) already holds these {len(result['files'])} files; "
                   f"nothing to upload (commit {result['commit'][:12]})")
        return
    where = result["pr_url"] or (result["url"] + (f" ({result['revision']})" if result["revision"] != "main" else ""))
    deleted = f", deleted {len(result['deleted_files'])} stale" if result["deleted_files"] else ""
    click.echo(f"pushed {len(result['changed_files'])} changed of {len(result['files'])} files{deleted} to "
               f"{where} (commit {result['commit'][:12]})")


@click.command()
@click.argument("repo_id")
@click.argument("dest", type=click.Path(path_type=Path))
@click.option("--revision", default=None, help="Branch, tag or commit (default: main).")
@click.option("--endpoint", default=None, metavar="URL", help=_ENDPOINT_HELP)
@click.option("--token", default=None, metavar="TOKEN", help=_TOKEN_HELP, show_default=False)
@click.option("--force", is_flag=True, help="Replace DEST if it is an earlier download (a checkpoint folder).")
@click.option("--json", "as_json", is_flag=True, help="One JSON document on stdout.")
@needs_extras("pull")
def pull(repo_id: str, dest: Path, revision: str | None, endpoint: str | None, token: str | None, force: bool,
         as_json: bool) -> None:
    """Download the packed checkpoint REPO_ID into DEST, validated; DEST appears only when complete.

    Exit 0 ok, 2 bad input or usage (REPO_ID, --endpoint, or a download that is not a valid w4pack checkpoint),
    4 I/O or network failure (DEST exists without --force; 401, 403, 404 each named).
    """
    from ..store.checkpoint import validate_checkpoint
    from ..hub import pull as do_pull

    check_endpoint(endpoint)
    out = do_pull(repo_id, dest, revision=revision, endpoint=endpoint, token=token, force=force)
    settle()  # DEST is in place: a Ctrl-C from here on cannot make this pull "interrupted"
    report = validate_checkpoint(out, checksums=False)
    doc = {"repo_id": repo_id, "revision": revision or "main", "path": str(out), "layers": report["num_layers"],
           "shards": len(report["shards"]), "total_size": report["total_size"]}
    if as_json:
        emit_json(doc)
    else:
        click.echo(f"pulled {repo_id} ({doc['revision']}) into {out}: {plural(doc['layers'], 'quantized layer')}, "
                   f"{plural(doc['shards'], 'shard')}, {doc['total_size'] / 1e6:.1f} MB, validated")
