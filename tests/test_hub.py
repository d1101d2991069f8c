"""push / pull / hf:// sources against a real Hub-protocol server on loopback (tests/hub_server.py),
driven by the real huggingface_hub client with HF_HUB_DISABLE_XET=1 and an explicit endpoint."""
from __future__ import annotations

import json
import socket
from pathlib import Path

import pytest

from hub_fixtures import (BAD_TOKEN, OTHER_TOKEN, READ_TOKEN, TOKEN, USER, folder_bytes,  # noqa: F401
                          hub, make_checkpoint)
from hub_server import VALIDATED_AGAINST, parse_front_matter

REPO = f"{USER}/tiny-w4"


def _cli(args: list[str], capfd: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    from w4pack.cli import main

    rc = main(args)
    out, err = capfd.readouterr()
    return rc, out, err


@pytest.fixture
def ckpt(tmp_path: Path) -> Path:
    return make_checkpoint(tmp_path / "tiny-w4", verify={"passed": True, "layers": 4, "max_rel_err": 3e-7,
                                                          "worst": ["model.layers.0.mlp.down_proj"]})


def _lfs_oids(folder: Path) -> set[str]:
    manifest = json.loads((folder / "w4pack.json").read_text())
    return {s["sha256"] for s in manifest["shards"]}


def _uploaded(hub, since: int = 0) -> list[str]:  # noqa: ANN001
    return [r.path.rsplit("/", 1)[-1] for r in hub.requests[since:] if r.route == "lfs_upload" and r.status == 200]


# -- round trip ---------------------------------------------------------------------------------------
def test_push_pull_round_trip_is_byte_identical(hub, ckpt: Path, tmp_path: Path) -> None:  # noqa: ANN001
    from w4pack.hub import pull, push

    events: list[dict] = []
    res = push(ckpt, REPO, endpoint=hub.endpoint, token=TOKEN, progress=events.append)
    assert res["commit"] and not res["unchanged"] and res["card_written"]
    local = folder_bytes(ckpt)
    assert "README.md" in local and len([f for f in local if f.endswith(".safetensors")]) >= 2
    # the server holds exactly the folder (plus the repo's own .gitattributes)
    remote = hub.files(REPO)
    assert {k: v for k, v in remote.items() if k != ".gitattributes"} == local
    # every shard went through LFS (batch + PUT with sha256 check), once
    assert sorted(_uploaded(hub)) == sorted(_lfs_oids(ckpt))
    assert hub.count("commit", status=200) == 1
    assert [e["file"] for e in events] == [f["path"] for f in res["files"]]
    assert events[-1]["bytes_done"] == events[-1]["bytes_total"] == sum(len(v) for v in local.values())

    out = pull(REPO, tmp_path / "pulled", endpoint=hub.endpoint, token=TOKEN)
    assert folder_bytes(out) == local
    assert not (out / ".cache").exists() and not (out / ".gitattributes").exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".pulled")]  # no temp sibling left


def test_model_card_renders_and_validates(hub, ckpt: Path) -> None:  # noqa: ANN001
    from huggingface_hub import ModelCard

    from w4pack.hub import push

    (ckpt / "README.md").write_text("---\nlanguage: en\nlicense: mit\ntags:\n- mine\n---\n\nNotes by the author.\n")
    push(ckpt, REPO, endpoint=hub.endpoint, token=TOKEN)
    text = (ckpt / "README.md").read_text()
    assert hub.validated_cards and hub.validated_cards[-1] == text  # the Hub's validate-yaml accepted it
    card = ModelCard(text)  # front matter parsed back by huggingface_hub (PyYAML)
    meta = card.data.to_dict()
    assert meta["base_model"] == "example-org/tiny-llama-base"
    assert meta["base_model_relation"] == "quantized"
    assert meta["library_name"] == "w4pack"
    assert meta["license"] == "mit"  # the author's explicit license wins over the inherited one
    assert meta["language"] == "en"  # unknown keys are kept
    assert meta["pipeline_tag"] == "text-generation"
    assert meta["tags"][0] == "mine" and {"w4pack", "int4", "gptq"} <= set(meta["tags"])
    assert parse_front_matter(text)["base_model_relation"] == "quantized"  # and by the server's reader
    body = card.text
    assert "Notes by the author." in body
    assert "| 4 | 4-bit | 64 | integer | no | float16 | 2 |" in body
    assert "| 4 | 4-bit | 32 | symmetric | yes | float16 | 1 |" in body
    assert "| 4 | 4-bit | 32 | float minimum | no | float16 | 1 |" in body
    assert "## Verification" in body and "| max_rel_err | 3e-07 |" in body
    # a second render of the updated card is identical (generated part replaced, not appended)
    from w4pack.hub import model_card

    assert model_card(ckpt, repo_id=REPO) == text


def test_convert_writes_the_card_and_push_updates_it(tmp_path: Path) -> None:
    """A converted folder is a complete Hugging Face model folder: its README.md card, titled with the output's
    name, is there before any push (not checksummed, so the author may edit it; validate accepts it). Rendering
    again keeps the author's text outside the generated block, and a block written under the earlier marker
    wording is replaced, not duplicated."""
    from conftest import fixture_dir

    import w4pack
    from w4pack.convert import convert
    from w4pack.hub import CARD_BEGIN, CARD_END, model_card

    out = tmp_path / "tiny-w4"
    convert(fixture_dir("gptq", "ag_tiny_llama_b4_g64_descact_sym"), out, show_progress=False)
    text = (out / "README.md").read_text()
    assert text == model_card(out) and "# tiny-w4\n" in text and ".w4pack-tmp" not in text
    assert w4pack.validate_checkpoint(out)["num_layers"] == 14
    (out / "README.md").write_text(text + "\nBenchmarks by the author.\n")
    assert w4pack.validate_checkpoint(out)["num_layers"] == 14
    again = model_card(out, repo_id="someone/tiny-w4")
    assert again.count(CARD_END) == 1 and "Benchmarks by the author." in again and "# someone/tiny-w4" in again
    old_marker = "<!-- w4pack:card:begin (generated by w4pack push; edits inside are replaced) -->"
    (out / "README.md").write_text(text.replace(CARD_BEGIN, old_marker))
    assert model_card(out) == text


def test_card_inherits_license_and_omits_unknown_base(tmp_path: Path) -> None:
    from huggingface_hub import ModelCard

    from w4pack.hub import model_card

    folder = make_checkpoint(tmp_path / "m", source={"format": "awq"})
    meta = ModelCard(model_card(folder)).data.to_dict()
    assert "base_model" not in meta and "base_model_relation" not in meta and "license" not in meta
    assert "awq" in meta["tags"] and "## Verification" not in model_card(folder)
    (folder / "README.md").write_text("---\nbase_model: someone/original\n---\n")  # named by the author
    meta = ModelCard(model_card(folder)).data.to_dict()
    assert meta["base_model"] == "someone/original" and meta["base_model_relation"] == "quantized"


def test_card_does_not_publish_a_local_base_path(tmp_path: Path) -> None:
    # a TOML source records its --base folder as base_model: not a Hub id, so not in the card's front matter
    from huggingface_hub import ModelCard

    from w4pack.hub import model_card

    base = tmp_path / "llama-base"
    base.mkdir()
    for recorded in (str(base), "/srv/models/llama", "~/llama", "./llama", "../llama"):
        folder = make_checkpoint(tmp_path / f"m{abs(hash(recorded))}",
                                 source={"format": "toml", "base_model": recorded})
        card = model_card(folder)
        assert "base_model" not in ModelCard(card).data.to_dict() and recorded not in card, recorded


# -- re-runs send only what is missing ------------------------------------------------------------------
def test_repeated_push_sends_nothing_new(hub, ckpt: Path) -> None:  # noqa: ANN001
    from w4pack.hub import push

    first = push(ckpt, REPO, endpoint=hub.endpoint, token=TOKEN)
    mark = len(hub.requests)
    again = push(ckpt, REPO, endpoint=hub.endpoint, token=TOKEN)
    later = hub.requests[mark:]
    assert again["unchanged"] and again["changed_files"] == [] and again["commit"] == first["commit"]
    assert not [r for r in later if r.route in ("lfs_upload", "lfs_verify", "commit")]
    assert {r.route for r in later} == {"create_repo", "revision_info", "preupload", "lfs_batch"}


def test_interrupted_push_resumes_with_only_the_missing_blobs(hub, ckpt: Path, capfd) -> None:  # noqa: ANN001
    oids = sorted(_lfs_oids(ckpt))
    hub.fail("lfs_upload", 400, match=oids[-1], message="storage refused the part")  # not retried by the client
    rc, out, err = _cli(["push", str(ckpt), REPO, "--endpoint", hub.endpoint, "--token", TOKEN], capfd)
    assert rc == 4 and "HTTP 400" in err and TOKEN not in out + err
    first = _uploaded(hub)
    assert oids[-1] not in first and hub.count("commit") == 0
    mark = len(hub.requests)
    rc, out, err = _cli(["push", str(ckpt), REPO, "--endpoint", hub.endpoint, "--token", TOKEN, "--json"], capfd)
    assert rc == 0, err
    second = _uploaded(hub, mark)
    assert sorted(first + second) == oids  # each blob sent exactly once over both runs
    assert hub.count("commit", status=200) == 1
    assert json.loads(out)["commit"] == hub.repos[REPO].refs["main"]


def test_stale_shards_of_an_earlier_push_are_deleted(hub, tmp_path: Path) -> None:  # noqa: ANN001
    from w4pack.hub import push

    a = make_checkpoint(tmp_path / "a", max_shard_size=20_000)
    (a / "original").mkdir()
    (a / "original" / "model.safetensors").write_bytes(b"\0" * 100)  # the owner's extra copy: kept
    push(a, REPO, endpoint=hub.endpoint, token=TOKEN)
    b = make_checkpoint(tmp_path / "b", seed=1, max_shard_size=10**9)
    res = push(b, REPO, endpoint=hub.endpoint, token=TOKEN)
    assert res["deleted_files"] and all(f.endswith(".safetensors") for f in res["deleted_files"])
    remote = {k for k in hub.files(REPO) if k != ".gitattributes"}
    assert remote == set(folder_bytes(b)) | {"original/model.safetensors"}


# -- transient failures -----------------------------------------------------------------------------
def test_transient_failures_are_retried(hub, ckpt: Path, tmp_path: Path) -> None:  # noqa: ANN001
    from w4pack.hub import pull, push

    hub.fail("preupload", 503)
    hub.drop("lfs_upload")  # connection closed without an answer
    hub.fail("commit", 502)  # the client does not retry a commit; w4pack re-runs the idempotent upload
    hub.fail("resolve", 429, match="config.json", headers={"Retry-After": "0"})
    res = push(ckpt, REPO, endpoint=hub.endpoint, token=TOKEN)
    assert res["commit"] == hub.repos[REPO].refs["main"]
    assert hub.count("preupload", status=503) == 1 and hub.count("commit", status=502) == 1
    assert any(r.route == "lfs_upload" and r.status == -1 for r in hub.requests)
    assert sorted(set(_uploaded(hub))) == sorted(_lfs_oids(ckpt))
    out = pull(REPO, tmp_path / "p", endpoint=hub.endpoint, token=TOKEN)
    assert folder_bytes(out) == folder_bytes(ckpt)
    assert hub.count("resolve", status=429) == 1


# -- errors: one clear line, exit 4, never the token ------------------------------------------------
@pytest.mark.parametrize("case", ["401", "401-anonymous", "403", "404", "409"])
def test_http_errors_give_one_line_and_exit_4(hub, ckpt: Path, tmp_path: Path, capfd, caplog,  # noqa: ANN001
                                             case: str) -> None:
    token = {"401": BAD_TOKEN, "401-anonymous": "", "403": OTHER_TOKEN, "404": TOKEN, "409": TOKEN}[case]
    auth = ["--token", token] if token else []
    if case == "404":
        args = ["pull", f"{USER}/does-not-exist", str(tmp_path / "d"), "--endpoint", hub.endpoint] + auth
    else:
        if case == "409":
            hub.fail("commit", 409, message="branch is locked")
        args = ["push", str(ckpt), REPO, "--endpoint", hub.endpoint] + auth
    rc, out, err = _cli(args, capfd)
    assert rc == 4
    lines = [ln for ln in err.splitlines() if ln.strip()]
    errors = [ln for ln in lines if ln.startswith("w4pack: error:")]
    assert len(errors) == 1, err
    expect = {"401": "authentication failed (HTTP 401)", "401-anonymous": "authentication failed (HTTP 401)",
              "403": "permission denied (HTTP 403)", "404": "not found on", "409": "conflict (HTTP 409)"}[case]
    assert expect in errors[0] and "Traceback" not in err
    for secret in (BAD_TOKEN, OTHER_TOKEN, TOKEN, READ_TOKEN):
        assert secret not in out + err + caplog.text
    assert not (tmp_path / "d").exists()
    if case != "404":
        assert hub.count("commit", status=200) == 0


def test_network_failure_exits_4(ckpt: Path, tmp_path: Path, capfd, monkeypatch) -> None:  # noqa: ANN001
    import huggingface_hub.constants as hc

    import w4pack.hub

    monkeypatch.setattr(w4pack.hub, "_RETRY_WAIT", 0.01)  # w4pack's own re-runs; keeps the test short
    monkeypatch.setattr(hc, "HF_HUB_DISABLE_XET", True)
    monkeypatch.setattr(hc, "HF_HUB_CACHE", str(tmp_path / "hf-cache"))
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{s.getsockname()[1]}"
    rc, out, err = _cli(["pull", REPO, str(tmp_path / "d"), "--endpoint", dead, "--token", TOKEN], capfd)
    assert rc == 4 and "w4pack: error:" in err and TOKEN not in out + err
    rc, out, err = _cli(["push", str(ckpt), REPO, "--endpoint", dead, "--token", TOKEN], capfd)
    assert rc == 4 and "network failure" in err and TOKEN not in out + err


def test_server_error_on_pull_is_named_and_retried(hub, ckpt: Path, tmp_path: Path, capfd,  # noqa: ANN001
                                                   monkeypatch) -> None:
    import w4pack.hub
    from w4pack.hub import pull, push

    monkeypatch.setattr(w4pack.hub, "_RETRY_WAIT", 0.01)
    push(ckpt, REPO, endpoint=hub.endpoint, token=TOKEN)
    hub.fail("revision_info", 500)  # once: w4pack runs the (resuming) download again
    out = pull(REPO, tmp_path / "once", endpoint=hub.endpoint, token=TOKEN)
    assert folder_bytes(out) == folder_bytes(ckpt) and hub.count("revision_info", status=500) == 1
    hub.fail("revision_info", 500, times=3)  # every attempt: one line naming the HTTP failure
    rc, out, err = _cli(["pull", REPO, str(tmp_path / "never"), "--endpoint", hub.endpoint, "--token", TOKEN],
                        capfd)
    assert rc == 4 and "the Hub failed (HTTP 500)" in err and not (tmp_path / "never").exists()


def test_card_rejected_by_the_hub_is_bad_input(hub, tmp_path: Path, capfd) -> None:  # noqa: ANN001
    folder = make_checkpoint(tmp_path / "m", source={"format": "gptq"})  # no base model known
    (folder / "README.md").write_text("---\nbase_model_relation: merge\n---\nmine\n")
    rc, out, err = _cli(["push", str(folder), REPO, "--endpoint", hub.endpoint, "--token", TOKEN], capfd)
    assert rc == 2 and "rejected the model card metadata" in err and "base_model" in err
    assert hub.count("commit") == 0 and TOKEN not in out + err


# -- refused before any request ---------------------------------------------------------------------
def test_invalid_folder_is_refused_before_any_request(hub, ckpt: Path, capfd) -> None:  # noqa: ANN001
    shard = sorted(ckpt.glob("*.safetensors"))[0]
    data = bytearray(shard.read_bytes())
    data[-1] ^= 0xFF
    shard.write_bytes(bytes(data))
    rc, out, err = _cli(["push", str(ckpt), REPO, "--endpoint", hub.endpoint, "--token", TOKEN], capfd)
    assert rc == 2 and "sha256" in err and shard.name in err
    assert hub.requests == []

    cfg = json.loads((ckpt / "config.json").read_text())
    del cfg["quantization_config"]
    (ckpt / "config.json").write_text(json.dumps(cfg))
    rc, out, err = _cli(["push", str(ckpt), REPO, "--endpoint", hub.endpoint, "--token", TOKEN], capfd)
    assert rc == 2 and "quantization_config" in err and hub.requests == []

    rc, out, err = _cli(["push", str(ckpt), REPO, "--endpoint", hub.endpoint, "--token", TOKEN, "--no-validate"],
                        capfd)
    assert rc == 0 and "WITHOUT checking" in err and hub.count("commit", status=200) == 1


def test_dry_run_makes_no_request(hub, ckpt: Path, capfd) -> None:  # noqa: ANN001
    before = folder_bytes(ckpt)
    rc, out, err = _cli(["push", str(ckpt), REPO, "--endpoint", hub.endpoint, "--token", TOKEN, "--dry-run",
                         "--json"], capfd)
    assert rc == 0, err
    plan = json.loads(out)
    assert plan["dry_run"] and plan["card_changed"] and "README.md" in {f["path"] for f in plan["files"]}
    assert hub.requests == [] and folder_bytes(ckpt) == before  # nothing sent, nothing written
    rc, out, err = _cli(["push", str(ckpt), REPO, "--dry-run"], capfd)
    assert rc == 0 and "would push" in out and hub.requests == []


# -- pull: atomic, no clobber, validated ------------------------------------------------------------
def test_pull_refuses_to_clobber_and_validates(hub, ckpt: Path, tmp_path: Path, capfd) -> None:  # noqa: ANN001
    from w4pack.errors import BadInputError, IOFailure
    from w4pack.hub import pull, push

    push(ckpt, REPO, endpoint=hub.endpoint, token=TOKEN)
    dest = tmp_path / "dest"
    dest.mkdir()
    (dest / "keep.txt").write_text("mine")
    with pytest.raises(IOFailure, match="already exists"):
        pull(REPO, dest, endpoint=hub.endpoint, token=TOKEN)
    assert (dest / "keep.txt").exists() and hub.count("resolve") == 0
    with pytest.raises(IOFailure, match=r"holds no checkpoint \(keep.txt\)"):  # not --force's to delete
        pull(REPO, dest, endpoint=hub.endpoint, token=TOKEN, force=True)
    with pytest.raises(BadInputError, match="is a file, not a folder"):
        pull(REPO, dest / "keep.txt" / "x", endpoint=hub.endpoint, token=TOKEN)
    with pytest.raises(IOFailure, match="is a file, not an earlier checkpoint folder"):  # it would become a folder
        pull(REPO, dest / "keep.txt", endpoint=hub.endpoint, token=TOKEN, force=True)
    assert (dest / "keep.txt").read_text() == "mine" and hub.count("resolve") == 0
    (dest / "config.json").write_text("{}")
    with pytest.raises(IOFailure, match=r"holds no checkpoint \(config.json, keep.txt\)"):  # a project's config
        pull(REPO, dest, endpoint=hub.endpoint, token=TOKEN, force=True)
    (dest / "model.safetensors").write_text("")  # an earlier model folder: --force replaces it
    rc, out, err = _cli(["pull", REPO, str(dest), "--endpoint", hub.endpoint, "--token", TOKEN, "--force",
                         "--json"], capfd)
    assert rc == 0, err and json.loads(out)["layers"] == 4
    assert folder_bytes(dest) == folder_bytes(ckpt)

    hub.add_repo(f"{USER}/not-w4pack", {"config.json": b"{}", "model.safetensors": b"\0" * 64})
    with pytest.raises(BadInputError, match="not a valid w4pack checkpoint"):
        pull(f"{USER}/not-w4pack", tmp_path / "bad", endpoint=hub.endpoint, token=TOKEN)
    assert not (tmp_path / "bad").exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".bad")]


def test_pull_force_replaces_in_one_step_and_is_restored_after_a_kill(hub, ckpt: Path, tmp_path: Path,
                                                                     monkeypatch) -> None:  # noqa: ANN001
    """Issue 30, 5: `pull --force` renamed the old destination aside, then the download in; interrupted between the
    two, no destination was left. Now one exchange (no rename of the destination at all), and a destination that
    the two-rename fallback left aside is put back by the next pull."""
    import os

    from w4pack import atomic
    from w4pack.errors import IOFailure
    from w4pack.hub import pull, push

    push(ckpt, REPO, endpoint=hub.endpoint, token=TOKEN)
    dest = tmp_path / "dest"
    dest.mkdir()
    (dest / "model.safetensors").write_text("")  # an earlier model folder (--force replaces only those)
    if getattr(atomic, "_renameat2", "run") is not None:
        real_replace = os.replace

        def no_rename_of_dest(a, b, *args, **kw):  # noqa: ANN001, ANN002, ANN003
            if dest in (Path(a), Path(b)):
                raise AssertionError("the destination was renamed: not one atomic step")
            return real_replace(a, b, *args, **kw)

        monkeypatch.setattr(os, "replace", no_rename_of_dest)
        pull(REPO, dest, endpoint=hub.endpoint, token=TOKEN, force=True)
        monkeypatch.undo()
        assert folder_bytes(dest) == folder_bytes(ckpt) and not [p for p in tmp_path.iterdir() if ".w4pack-" in p.name]
    # what a kill between the fallback's renames leaves (old w4pack too): the destination, aside
    aside = tmp_path / ".dest.w4pack-old-a1b2c3d4"
    aside.mkdir()
    os.rename(dest, aside / "x")
    with pytest.raises(IOFailure, match="already exists"):
        pull(REPO, dest, endpoint=hub.endpoint, token=TOKEN)
    assert folder_bytes(dest) == folder_bytes(ckpt) and not aside.exists()


def test_branch_and_pull_request(hub, ckpt: Path, tmp_path: Path) -> None:  # noqa: ANN001
    from w4pack.hub import pull, push

    res = push(ckpt, REPO, endpoint=hub.endpoint, token=TOKEN, revision="dev", private=True)
    repo = hub.repos[REPO]
    assert repo.private and repo.refs["dev"] == res["commit"] and "w4pack.json" not in hub.files(REPO, "main")
    assert f"w4pack pull {REPO} ./{REPO.split('/')[1]} --revision dev\n" in (ckpt / "README.md").read_text()
    out = pull(REPO, tmp_path / "dev", revision="dev", endpoint=hub.endpoint, token=TOKEN)
    assert folder_bytes(out) == folder_bytes(ckpt)
    with pytest.raises(Exception, match="404"):  # private: invisible to another user
        pull(REPO, tmp_path / "x", revision="dev", endpoint=hub.endpoint, token=OTHER_TOKEN)

    pr = push(ckpt, REPO, endpoint=hub.endpoint, token=TOKEN, create_pr=True, commit_message="w4pack via PR")
    assert pr["pr_url"].endswith("/discussions/1") and repo.refs["refs/pr/1"] == pr["commit"]
    assert repo.commits[pr["commit"]].summary == "w4pack via PR"
    assert "w4pack.json" not in hub.files(REPO, "main")  # main untouched


def test_read_only_token_can_pull_but_not_push(hub, ckpt: Path, tmp_path: Path) -> None:  # noqa: ANN001
    from w4pack.errors import IOFailure
    from w4pack.hub import pull, push

    push(ckpt, REPO, endpoint=hub.endpoint, token=TOKEN)
    out = pull(REPO, tmp_path / "ro", endpoint=hub.endpoint, token=READ_TOKEN)
    assert folder_bytes(out) == folder_bytes(ckpt)
    (ckpt / "notes").mkdir()  # something new to push (a top-level file the manifest lacks would be refused)
    (ckpt / "notes" / "extra.txt").write_text("new file")
    with pytest.raises(IOFailure, match=r"HTTP 403") as info:
        push(ckpt, REPO, endpoint=hub.endpoint, token=READ_TOKEN)
    assert READ_TOKEN not in str(info.value)


# -- hf:// sources for convert ----------------------------------------------------------------------
def test_source_patterns_pick_only_what_the_format_needs() -> None:
    from w4pack.errors import BadInputError
    from w4pack.hub import _source_patterns, parse_hub_spec

    assert parse_hub_spec("hf://o/n") == ("o/n", None, None)
    assert parse_hub_spec("hf:/o/n@refs%2Fpr%2F2/sub/x.gguf") == ("o/n", "refs/pr/2", "sub/x.gguf")
    with pytest.raises(BadInputError):
        parse_hub_spec("hf://only-one-part")
    pats, target = _source_patterns(["a.gguf", "b.gguf", "README.md"], "b.gguf")
    assert target == "b.gguf" and "b.gguf" in pats and "a.gguf" not in pats
    with pytest.raises(BadInputError, match="2 GGUF files"):
        _source_patterns(["a.gguf", "b.gguf"], None)
    assert _source_patterns(["m.Q4_0.gguf", "README.md"], None)[1] == "m.Q4_0.gguf"
    pats, target = _source_patterns(["model.pt", "config.json"], None)
    assert "*.pt" in pats and "*.safetensors" not in pats and target is None
    pats, target = _source_patterns(["quant_dir/quant.toml", "quant_dir/a.npy", "base.safetensors"], None)
    assert {"*.toml", "*.npy", "*.safetensors"} <= set(pats) and target is None


def test_several_gguf_files_are_answered_with_a_spec_that_works(hub, tmp_path: Path, capfd,  # noqa: ANN001
                                                                 monkeypatch) -> None:
    """A repository of several GGUF files: the line names the source to type, with the repository, revision and
    folder given (it said "hf://owner/name/..."); converting that works and prints nothing on stderr (the Hub
    client's "Repo card metadata block was not found" for a card without front matter stayed on stderr)."""
    gguf = (Path(__file__).resolve().parent / "data" / "llama_quantize" / "tiny-Q4_K_M.gguf").read_bytes()
    hub.add_repo(f"{USER}/ggufs", {"sub/a.gguf": gguf, "sub/b.gguf": gguf, "README.md": b"no front matter\n"})
    monkeypatch.setenv("HF_ENDPOINT", hub.endpoint)
    monkeypatch.setenv("W4PACK_CACHE", str(tmp_path / "cache"))
    rc, out, err = _cli(["convert", f"hf://{USER}/ggufs@main/sub", str(tmp_path / "x")], capfd)
    named = f"hf://{USER}/ggufs@main/sub/a.gguf"
    assert rc == 2 and f"name one: {named} (others: sub/b.gguf)" in err, err
    rc, out, err = _cli(["convert", named, str(tmp_path / "x")], capfd)
    assert rc == 0 and err == "", err

    from w4pack.errors import BadInputError
    from w4pack.hub import _source_patterns

    with pytest.raises(BadInputError, match=r"name one: hf://o/n@v1/a\.gguf \(others: b\.gguf\)"):
        _source_patterns(["a.gguf", "b.gguf"], None, spec="hf://o/n@v1")


def test_convert_from_hf_uses_only_needed_files(hub, ckpt: Path, tmp_path: Path, capfd,  # noqa: ANN001
                                                monkeypatch) -> None:
    from w4pack.checkpoint import validate_checkpoint
    from w4pack.hub import push, resolve_source

    push(ckpt, f"{USER}/src", endpoint=hub.endpoint, token=TOKEN)
    # an unrelated big file in the repo must not be downloaded
    hub.add_repo(f"{USER}/other")
    monkeypatch.setenv("HF_ENDPOINT", hub.endpoint)
    monkeypatch.setenv("HF_TOKEN", TOKEN)
    local = resolve_source(f"hf://{USER}/src", endpoint=hub.endpoint, token=TOKEN)
    assert folder_bytes(local) == folder_bytes(ckpt)
    n = hub.count("resolve")
    assert resolve_source(f"hf://{USER}/src@main") == local and hub.count("resolve") == n  # cached by commit
    mark = len(hub.requests)
    assert resolve_source(f"hf://{USER}/src@{local.parent.name}") == local and len(hub.requests) == mark  # offline

    rc, out, err = _cli(["convert", f"hf://{USER}/src", str(tmp_path / "repacked"), "--json"], capfd)
    assert rc == 0, err
    summary = validate_checkpoint(tmp_path / "repacked")
    assert summary["num_layers"] == 4 and summary["source"]["base_model"] == "example-org/tiny-llama-base"
    assert TOKEN not in out + err


def test_malformed_endpoint_is_bad_input_for_hf_sources_too(hub, ckpt: Path, tmp_path: Path, capfd,  # noqa: ANN001
                                                             monkeypatch) -> None:
    """$HF_ENDPOINT that is not a URL: for hf:// sources it was "network failure" (4) from the client; now bad
    input (2) naming $HF_ENDPOINT, as push/pull --endpoint, with no request made, a cached commit included."""
    from w4pack.errors import BadInputError
    from w4pack.hub import check_endpoint, push, resolve_source

    push(ckpt, f"{USER}/src", endpoint=hub.endpoint, token=TOKEN)
    monkeypatch.setenv("W4PACK_CACHE", str(tmp_path / "cache"))
    local = resolve_source(f"hf://{USER}/src", endpoint=hub.endpoint, token=TOKEN)
    sha = local.parent.name
    monkeypatch.setenv("HF_ENDPOINT", "notaurl")
    mark = len(hub.requests)
    for spec in (f"hf://{USER}/src", f"hf://{USER}/src@{sha}"):  # (the second is in the cache: no request needed)
        with pytest.raises(BadInputError, match=r"^\$HF_ENDPOINT must be an http:// or https:// URL .*'notaurl'"):
            resolve_source(spec)
    for argv in (["convert", f"hf://{USER}/src", str(tmp_path / "out")],
                 ["convert", f"hf://{USER}/src", str(tmp_path / "out"), "--dry-run"],
                 ["inspect", f"hf://{USER}/src"],
                 ["verify", str(ckpt), "--against", f"hf://{USER}/src"]):
        rc, out, err = _cli(argv, capfd)
        assert rc == 2 and err.count("\n") == 1 and out == "", (argv, rc, out, err)
        assert err.startswith("w4pack: error: $HF_ENDPOINT must be an http:// or https:// URL") and \
            "network" not in err, err
    assert len(hub.requests) == mark and not (tmp_path / "out").exists()
    # an explicit endpoint is named as the caller passed it (the CLI's --endpoint), and wins over $HF_ENDPOINT
    for bad in ("ftp://host/x", "http://", "localhost:8080", "http://[::1", "https://exa mple.com"):
        with pytest.raises(BadInputError, match=r"^--endpoint must be"):
            check_endpoint(bad, "--endpoint")
    assert check_endpoint(hub.endpoint + "/") == hub.endpoint
    monkeypatch.delenv("HF_ENDPOINT")
    assert check_endpoint(None) == "https://huggingface.co"


def test_convert_gptq_fixture_from_hf(hub, tmp_path: Path, monkeypatch, capfd) -> None:  # noqa: ANN001
    from conftest import fixture_dir

    pytest.importorskip("w4pack.formats.gptq")
    from w4pack.checkpoint import validate_checkpoint

    src = fixture_dir("gptq", "gm_tiny_llama_b4_g64_descact_sym_v1_sharded")
    files = {p.relative_to(src).as_posix(): p.read_bytes() for p in src.rglob("*") if p.is_file()}
    hub.add_repo("w4org/tiny-gptq", files)
    monkeypatch.setenv("HF_ENDPOINT", hub.endpoint)
    rc, out, err = _cli(["convert", "hf://w4org/tiny-gptq", str(tmp_path / "w4"), "--json"], capfd)
    assert rc == 0, err
    fetched = {r.path.split("/resolve/", 1)[1].split("/", 1)[1] for r in hub.requests
               if r.route == "resolve"}  # every downloaded file is resolved (LFS ones then redirected)
    assert not [f for f in fetched if f.startswith("truth/") or f in ("case.json", "quant_log.csv")]
    assert {f for f in files if f.endswith(".safetensors")} <= fetched
    summary = validate_checkpoint(tmp_path / "w4")
    assert summary["num_layers"] > 0 and summary["source"]["base_model"] == "w4org/tiny-gptq"
    # and the converted model goes up and comes back intact
    from w4pack.hub import pull, push

    push(tmp_path / "w4", "w4org/tiny-w4", endpoint=hub.endpoint, token=TOKEN)
    back = pull("w4org/tiny-w4", tmp_path / "back", endpoint=hub.endpoint, token=TOKEN)
    assert folder_bytes(back) == folder_bytes(tmp_path / "w4")


def test_server_rejects_unknown_routes_loudly(hub) -> None:  # noqa: ANN001
    import urllib.error
    import urllib.request

    with pytest.raises(urllib.error.HTTPError) as info:
        urllib.request.urlopen(f"{hub.endpoint}/api/spaces/x/y/runtime", timeout=5)
    assert info.value.code == 599 and b"no route" in info.value.read()
    assert hub.protocol_errors == [f"hub_server: no route GET /api/spaces/x/y/runtime (api)"]
    hub.protocol_errors.clear()  # expected here; the fixture asserts the list is empty


def test_client_version_is_the_one_the_server_was_checked_against() -> None:
    import huggingface_hub

    major = huggingface_hub.__version__.split(".")[0]
    assert major == VALIDATED_AGAINST.split(".")[0], (
        f"huggingface_hub {huggingface_hub.__version__}: re-check tests/hub_server.py routes "
        f"(validated against {VALIDATED_AGAINST})")


def test_read_only_folder_gets_its_card_uploaded_from_memory(hub, ckpt: Path, monkeypatch) -> None:  # noqa: ANN001
    import w4pack.hub as whub

    def refuse(path: Path, text: str) -> None:
        raise PermissionError(13, "Read-only file system", str(path))

    monkeypatch.setattr(whub, "_write_text_atomic", refuse)
    res = whub.push(ckpt, REPO, endpoint=hub.endpoint, token=TOKEN)
    assert not (ckpt / "README.md").exists() and not res["card_written"]
    card = hub.files(REPO)["README.md"].decode()
    assert card == whub.model_card(ckpt, repo_id=REPO) and "base_model_relation: quantized" in card


def test_convert_gguf_from_hf_picks_the_named_file(hub, tmp_path: Path, monkeypatch, capfd) -> None:  # noqa: ANN001
    from conftest import fixture_dir

    pytest.importorskip("w4pack.formats.gguf")
    from w4pack.checkpoint import validate_checkpoint

    gguf = (fixture_dir("gguf", "q4_0_exact_in512_out256") / "tensors.gguf").read_bytes()
    hub.add_repo("w4org/ggufs", {"tiny.Q4_0.gguf": gguf, "tiny.copy.gguf": gguf, "README.md": b"# ggufs\n"})
    monkeypatch.setenv("HF_ENDPOINT", hub.endpoint)
    rc, out, err = _cli(["convert", "hf://w4org/ggufs", str(tmp_path / "x")], capfd)
    assert rc == 2 and "name one: hf://w4org/ggufs/tiny.Q4_0.gguf " in err and hub.count("resolve") == 0
    rc, out, err = _cli(["convert", "hf://w4org/ggufs/tiny.Q4_0.gguf", str(tmp_path / "w4"), "--json"], capfd)
    assert rc == 0, err
    fetched = {r.path.rsplit("/", 1)[-1] for r in hub.requests if r.route == "resolve"}
    assert "tiny.Q4_0.gguf" in fetched and "tiny.copy.gguf" not in fetched
    from w4pack.hub import resolve_source

    sha = hub.repos["w4org/ggufs"].refs["main"]
    mark = len(hub.requests)
    got = resolve_source(f"hf://w4org/ggufs@{sha}/tiny.Q4_0.gguf")  # cached: no request, the file itself
    assert got.is_file() and got.read_bytes() == gguf and len(hub.requests) == mark
    assert validate_checkpoint(tmp_path / "w4")["num_layers"] == 1


def test_a_malformed_hub_spec_is_shown_as_typed(capsys: pytest.CaptureFixture[str]) -> None:  # noqa: D103
    """convert's SRC is a Path, which collapses hf://x to hf:/x: the error showed 'hf:/foo', not what was typed."""
    from w4pack.cli import main

    capsys.readouterr()
    assert main(["convert", "hf://only-one-part", "unused-out"]) == 2
    err = capsys.readouterr().err
    assert "'hf://only-one-part' is not a Hub source" in err and "hf:/only" not in err.replace("hf://", "")


def test_the_card_is_written_with_the_umask_mode(tmp_path: Path) -> None:
    """The card rewritten for a push was mkstemp's 0600, where convert's files follow the umask (0644 at 022):
    unreadable to a teammate or a server running as another user."""
    from w4pack.hub import _write_text_atomic
    from w4pack.store.atomic import umask_mode

    card = tmp_path / "README.md"
    card.write_text("old")
    _write_text_atomic(card, "new")
    assert card.read_text() == "new" and card.stat().st_mode & 0o777 == umask_mode(0o666)


def test_card_names_the_bit_widths_the_layers_have(tmp_path: Path) -> None:
    """An 8-bit checkpoint was tagged int4/4-bit and introduced as "4-bit weights"."""
    from conftest import fixture_dir
    from huggingface_hub import ModelCard

    from w4pack.convert import convert
    from w4pack.hub import model_card

    out = tmp_path / "b8"
    convert(fixture_dir("gptq", "ag_b8_sym_g128"), out, show_progress=False)
    card = ModelCard(model_card(out))
    tags = set(card.data.to_dict()["tags"])
    assert {"w4pack", "int8", "8-bit"} <= tags and not {"int4", "4-bit"} & tags
    assert "8-bit weights" in card.text and "4-bit" not in card.text.split("## Quantization")[0]


def test_repacking_keeps_the_license_and_origin(tmp_path: Path) -> None:
    """Re-sharding a packed folder kept its base model but dropped the license its card publishes."""
    from huggingface_hub import ModelCard

    from w4pack.convert import convert

    first = make_checkpoint(tmp_path / "m", source={"format": "gptq", "base_model": "example-org/tiny-llama-base",
                                                    "license": "llama2", "path": "hf://example-org/tiny-gptq"})
    again = tmp_path / "again"
    convert(first, again, show_progress=False)
    meta = ModelCard((again / "README.md").read_text()).data.to_dict()
    assert meta["license"] == "llama2" and meta["base_model"] == "example-org/tiny-llama-base"
    notes = json.loads((again / "w4pack.json").read_text())["source"]["notes"]
    assert "originally from hf://example-org/tiny-gptq" in notes


def test_push_refuses_a_folder_that_is_no_checkpoint(hub, tmp_path: Path, capfd) -> None:  # noqa: ANN001
    """--no-validate used to publish a GPTQ folder with a w4pack card ("layout `?` v?", "0 layers")."""
    folder = tmp_path / "gptq"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    (folder / "model.safetensors").write_bytes(b"\0" * 16)
    rc, out, err = _cli(["push", str(folder), REPO, "--endpoint", hub.endpoint, "--token", TOKEN, "--no-validate"],
                        capfd)
    assert rc == 2 and "no w4pack.json" in err and "w4pack convert" in err and len(err.strip().splitlines()) == 1
    assert hub.requests == [] and not (folder / "README.md").exists()


@pytest.mark.parametrize("card", [b"\xff\xfe\x00\x00garbage", b"---\nlicense: [mit\ntags: x\n---\n\nbody\n"],
                         ids=["not-utf8", "bad-yaml"])
def test_an_unreadable_card_is_named_on_one_line(hub, ckpt: Path, capfd, card: bytes) -> None:  # noqa: ANN001
    (ckpt / "README.md").write_bytes(card)
    rc, out, err = _cli(["push", str(ckpt), REPO, "--endpoint", hub.endpoint, "--token", TOKEN], capfd)
    assert rc == 2 and f"{ckpt / 'README.md'}:" in err and len(err.strip().splitlines()) == 1, err
    assert "\\n" not in err and "Traceback" not in err and "unexpected" not in err
    assert hub.requests == [] and (ckpt / "README.md").read_bytes() == card
