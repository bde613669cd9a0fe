"""Remote storage through fsspec: checkpoints, merged models and metrics on URLs, written so no reader sees half of one.

Every check runs against ``memory://`` (an object store's semantics: no
rename, no lock) and ``file://`` (a file system through fsspec); plain
paths keep their own tests (test_checkpoint.py, test_final_model.py,
test_cli_errors.py). No network: the missing backends are named, never
contacted.
"""

from __future__ import annotations

import subprocess
import sys
import uuid
from pathlib import Path
from typing import Iterator

import pytest
import torch

import gossiptrain.state.merged_model as fm
from gossiptrain.cli.common import EXIT_USAGE
from gossiptrain.errors import CheckpointError, ConfigError
from gossiptrain.state import storage
from gossiptrain.state.checkpoint import Checkpointer, latest_good, list_checkpoints, restore
from gossiptrain.train.metrics import MetricsLog, check_metrics_path, read_metrics
from gossiptrain.train.peer_loop import PeerOptions

from .swarm import ROOT, run_forked
from .test_checkpoint import assert_same_state, small_model, train, trained
from .test_cli_errors import run_main

fsspec = pytest.importorskip("fsspec", reason="the storage extra: pip install -e '.[storage]' (make installs it)")
from fsspec.registry import known_implementations  # noqa: E402


@pytest.fixture(params=["memory", "file"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    """A fresh base URL: in fsspec's in-process memory store (removed afterwards), or under tmp_path as file://."""
    if request.param == "file":
        yield f"file://{tmp_path}/remote"
        return
    root = f"memory://gossiptrain-test-{uuid.uuid4().hex}"
    yield root
    fs = fsspec.filesystem("memory")
    if fs.exists(root):
        fs.rm(root, recursive=True)


def names(url: str) -> list[str]:
    return sorted(storage.list_names(storage.location(url)))


# -- locations -----------------------------------------------------------------------------------


def test_plain_paths_stay_paths_and_urls_are_parsed_without_contacting_anything(tmp_path: Path) -> None:
    assert storage.location("ckpt/run1") == Path("ckpt/run1")
    assert storage.location(tmp_path) == tmp_path
    assert storage.location(Path("memory://x")) == Path("memory:/x")  # a Path object is always local
    url = storage.location("memory://bucket/run/")
    assert url == storage.URL("memory://bucket/run") and str(url) == "memory://bucket/run"
    model = url / "merged.safetensors"
    assert (model.name, model.suffix, str(model.parent)) == ("merged.safetensors", ".safetensors", "memory://bucket/run")
    assert str(fm.metadata_path(str(model))) == "memory://bucket/run/merged.json"
    assert str(fm.metadata_path("memory://bucket/model.bin")) == "memory://bucket/model.bin.json"


# -- checkpoints ---------------------------------------------------------------------------------


def test_a_checkpoint_round_trips_through_a_url(store: str) -> None:
    directory = f"{store}/ck"
    model, opt = trained()
    with Checkpointer(directory, keep=2) as ck:
        for step in (10, 20, 30):
            train(model, opt, 1, seed=step)
            info = ck.save(model, opt, step=step, samples_seen=16 * step, fingerprint="run-a", peer="p1", shard=2)
    assert str(info.path) == f"{directory}/ckpt-000003-step-30.json"
    assert [p.name for p in list_checkpoints(directory)] == ["ckpt-000003-step-30.json", "ckpt-000002-step-20.json"]
    assert len(names(directory)) == 2 * 3  # retention deleted the oldest; no temporary object is left
    ckpt = latest_good(directory)
    assert (ckpt.info.step, ckpt.info.samples_seen, ckpt.info.shard, ckpt.info.path) == (30, 480, 2, info.path)
    blank = small_model(seed=7)
    blank_opt = torch.optim.SGD(blank.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-4)
    restore(ckpt, blank, blank_opt, fingerprint="run-a")
    assert_same_state(model.state_dict(), blank.state_dict())
    assert_same_state(opt.state_dict(), blank_opt.state_dict())


class PowerCut(BaseException):
    """The process dies here: nothing after it runs, no except clause of the code under test catches it."""


def cut_power_at(monkeypatch: pytest.MonkeyPatch, suffix: str, *, uploaded: bool) -> None:
    """The next write of a name ending in ``suffix`` dies, after uploading its temporary object or before."""
    real = storage.write_atomic

    def write_atomic(target: storage.Location, data: bytes) -> None:
        if not target.name.endswith(suffix):
            return real(target, data)
        if uploaded:
            real(target.parent / f".{target.name}{storage.TMP_SUFFIX}", data)
        raise PowerCut

    monkeypatch.setattr(storage, "write_atomic", write_atomic)


@pytest.mark.parametrize("suffix, uploaded", [(".json", True), (".json", False), (".optim.safetensors", True)])
def test_a_save_cut_short_never_yields_a_checkpoint(
    store: str, monkeypatch: pytest.MonkeyPatch, suffix: str, uploaded: bool
) -> None:
    directory = f"{store}/ck"
    model, opt = trained()
    ck = Checkpointer(directory)
    ck.save(model, opt, step=1)
    cut_power_at(monkeypatch, suffix, uploaded=uploaded)
    with torch.no_grad():
        model[0].weight.add_(1.0)
    with pytest.raises(PowerCut):
        ck.save(model, opt, step=2)
    monkeypatch.undo()
    ck.close()
    assert "ckpt-000002-step-2.model.safetensors" in names(directory)  # the data went first
    assert "ckpt-000002-step-2.json" not in names(directory)
    assert latest_good(directory).info.step == 1
    # The next save never reuses the number and clears what the cut left.
    with Checkpointer(directory) as again:
        again.save(model, opt, step=3)
    assert not [n for n in names(directory) if "-000002-" in n]
    assert [p.name for p in list_checkpoints(directory)] == ["ckpt-000003-step-3.json", "ckpt-000001-step-1.json"]


def test_a_failed_upload_is_a_checkpoint_error_and_leaves_nothing_behind(store: str, monkeypatch: pytest.MonkeyPatch) -> None:
    directory = f"{store}/ck"
    model, opt = trained()
    with Checkpointer(directory) as ck:
        ck.save(model, opt, step=1)
        before = names(directory)
        real = storage.write_atomic

        def refuse_metadata(target: storage.Location, data: bytes) -> None:
            if target.name.endswith(".json"):
                raise OSError("503 Slow Down")
            real(target, data)

        monkeypatch.setattr(storage, "write_atomic", refuse_metadata)
        with pytest.raises(CheckpointError, match="could not write checkpoint ckpt-000002-step-2 .*Slow Down"):
            ck.save(model, opt, step=2)
    assert names(directory) == before and latest_good(directory).info.step == 1


def test_a_half_written_data_object_is_caught_and_the_previous_checkpoint_used(store: str) -> None:
    # A store that showed a partial object under its final name: the metadata's size and hash catch it.
    directory = f"{store}/ck"
    model, opt = trained()
    with Checkpointer(directory) as ck:
        ck.save(model, opt, step=1)
        newest = ck.save(model, opt, step=2)
    victim = newest.path.parent / newest.files["model"]["file"]
    storage.write_atomic(victim, storage.read_bytes(victim)[:100])
    assert latest_good(directory).info.step == 1


# -- the merged model ----------------------------------------------------------------------------


def test_a_merged_model_round_trips_through_a_url(store: str) -> None:
    tensors = {"layer.weight": torch.full((3, 2), 0.5), "layer.bias": torch.arange(3.0), "count": torch.tensor(4)}
    info = fm.write_merged(f"{store}/out/merged.safetensors", tensors, members=[fm.MemberInfo("p1", 10, 2)], fingerprint="f")
    assert (str(info.path), str(info.metadata)) == (f"{store}/out/merged.safetensors", f"{store}/out/merged.json")
    assert names(f"{store}/out") == ["merged.json", "merged.safetensors"]  # no temporary object left
    back, meta = fm.read_merged(str(info.path))
    assert back.keys() == tensors.keys() and all(torch.equal(back[k], tensors[k]) for k in tensors)
    assert meta["sha256"] == info.sha256 and meta["members"][0]["id"] == "p1"
    storage.write_atomic(info.path, storage.read_bytes(info.path)[:-5])
    with pytest.raises(CheckpointError, match="truncated or corrupt"):
        fm.read_merged(str(info.path))


# -- metrics -------------------------------------------------------------------------------------


def test_metrics_lines_reach_a_url_at_close_and_appending_continues_the_file(store: str) -> None:
    url = f"{store}/runs/peer.jsonl"
    check_metrics_path(url, "--metrics")
    with MetricsLog(url) as log:
        log.write({"event": "start", "step": 0})
        log.write({"event": "eval", "step": 5, "loss": float("nan")})
        assert read_metrics(url) == []  # not uploaded yet: at most every 30 s, and at close
    assert read_metrics(url) == [{"event": "start", "step": 0}, {"event": "eval", "step": 5, "loss": None}]
    with MetricsLog(url, upload_every=0) as log:  # a restarted peer appends, as to a local file
        log.write({"event": "done", "step": 9})
        assert [r["event"] for r in read_metrics(url)] == ["start", "eval", "done"]  # due at once
    assert [r["event"] for r in read_metrics(url)] == ["start", "eval", "done"]


def test_a_url_file_is_uploaded_when_due_and_a_failed_upload_is_retried(store: str, monkeypatch: pytest.MonkeyPatch) -> None:
    now = [0.0]
    target = storage.location(f"{store}/m.jsonl")
    out = storage.open_append(target, upload_every=10, clock=lambda: now[0])
    out.write("a\n")
    assert not storage.exists(target)
    now[0] = 10.0
    out.write("b\n")
    assert storage.read_bytes(target) == b"a\nb\n"

    def store_down(target: storage.Location, data: bytes) -> None:
        raise OSError("store down")

    monkeypatch.setattr(storage, "write_atomic", store_down)
    now[0] = 20.0
    out.write("c\n")  # the upload fails: logged, kept, the run goes on
    monkeypatch.undo()
    assert storage.read_bytes(target) == b"a\nb\n"
    out.write("d\n")  # not due yet (the failed try counts as one)
    out.close()
    assert storage.read_bytes(target) == b"a\nb\nc\nd\n"


def test_a_url_file_goes_on_in_parts_so_a_long_run_holds_and_uploads_only_the_last(
    store: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    now = [0.0]
    target = storage.location(f"{store}/m.jsonl")
    uploads: list[tuple[str, int]] = []
    real = storage.write_atomic

    def counted(where: storage.Location, data: bytes) -> None:
        uploads.append((str(where).rsplit("/", 1)[-1], len(data)))
        real(where, data)

    monkeypatch.setattr(storage, "write_atomic", counted)
    out = storage.open_append(target, upload_every=10, clock=lambda: now[0], part_bytes=8)
    lines = [f"line {i}\n" for i in range(7)]  # 7 bytes each: a part is full at its second line
    for line in lines:
        out.write(line)
    assert [name for name, _ in uploads] == ["m.jsonl", "m.jsonl.1", "m.jsonl.2"]  # each part once, when full
    assert max(n for _, n in uploads) == 14
    out.close()  # the last line, in a part of its own
    assert storage.read_appended(target) == "".join(lines).encode()
    assert read_metrics(f"{store}/m.jsonl") == []  # not JSON: skipped, but read without error
    appended = storage.open_append(target, upload_every=0, part_bytes=8)  # a restarted peer continues the last part
    appended.write("again\n")
    appended.close()
    assert [str(p).rsplit("/", 1)[-1] for p in storage.appended_parts(target)] == [
        "m.jsonl", "m.jsonl.1", "m.jsonl.2", "m.jsonl.3"]  # it went on in the last line's part
    assert storage.read_appended(target) == ("".join(lines) + "again\n").encode()


def test_a_full_part_whose_upload_failed_goes_first_next_time(store: str, monkeypatch: pytest.MonkeyPatch) -> None:
    target = storage.location(f"{store}/m.jsonl")
    out = storage.open_append(target, upload_every=1000, clock=lambda: 0.0, part_bytes=4)
    real = storage.write_atomic

    def store_down(where: storage.Location, data: bytes) -> None:
        raise OSError("store down")

    monkeypatch.setattr(storage, "write_atomic", store_down)
    out.write("ab\n")
    out.write("cd\n")  # part 0 is full: its upload fails, it is kept
    monkeypatch.setattr(storage, "write_atomic", real)
    out.write("ef\n")
    out.write("gh\n")  # part 1 full: part 0 goes first, then it
    assert storage.read_bytes(target) == b"ab\ncd\n"
    out.close()
    assert storage.read_appended(target) == b"ab\ncd\nef\ngh\n"


# -- refused early -------------------------------------------------------------------------------


def test_a_scheme_fsspec_does_not_know_is_a_config_error_naming_the_flag() -> None:
    with pytest.raises(ConfigError, match=r"--checkpoint-dir 'nosuch://b/ck': fsspec knows no storage scheme nosuch://"):
        PeerOptions(join="127.0.0.1:1", checkpoint_dir="nosuch://b/ck")
    with pytest.raises(ConfigError, match="fsspec knows no storage scheme"):
        Checkpointer("nosuch://b/ck")


def test_a_missing_backend_is_a_config_error_naming_the_package(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(
        known_implementations, "gtmissing", {"class": "gossiptrain_no_such_backend.FS", "err": "Install gtmissingfs to access it"}
    )
    with pytest.raises(ConfigError, match=r"--final-model 'gtmissing://b/m.safetensors': the gtmissing:// backend is not "
                                          r"installed: Install gtmissingfs"):
        PeerOptions(join="127.0.0.1:1", final_model="gtmissing://b/m.safetensors")
    with pytest.raises(ConfigError, match="--metrics 'gtmissing://b/m.jsonl'"):
        check_metrics_path("gtmissing://b/m.jsonl", "--metrics")


@pytest.mark.parametrize("url, package", [("s3://bucket/ck", "s3fs"), ("gs://bucket/ck", "gcsfs"), ("hdfs://nn/ck", "pyarrow")])
def test_the_usual_backends_when_missing_are_named(url: str, package: str) -> None:
    import importlib.util

    if importlib.util.find_spec(package) is not None:
        pytest.skip(f"{package} is installed here")
    with pytest.raises(ConfigError, match=package):
        PeerOptions(join="127.0.0.1:1", resume=url)


def test_a_url_without_fsspec_installed_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "fsspec", None)  # import fsspec now raises ImportError
    with pytest.raises(ConfigError, match=r"--resume 'memory://b/ck' is a URL: remote storage needs fsspec: "
                                          r"pip install 'gossiptrain\[storage\]'"):
        PeerOptions(join="127.0.0.1:1", resume="memory://b/ck")
    assert storage.location("plain/dir") == Path("plain/dir")  # plain paths never need it


@pytest.mark.parametrize(
    "argv, flag",
    [
        (["peer", "--join", "127.0.0.1:1", "--quiet", "--checkpoint-dir", "nosuch://b/ck"], "--checkpoint-dir"),
        (["peer", "--join", "127.0.0.1:1", "--quiet", "--metrics", "nosuch://b/m.jsonl"], "--metrics"),
        (["peer", "--join", "127.0.0.1:1", "--quiet", "--final-model", "nosuch://b/m.safetensors"], "--final-model"),
        (["export", "--join", "127.0.0.1:1", "--out", "nosuch://b/m.safetensors"], "--out"),
    ],
)
def test_the_cli_refuses_a_bad_url_with_exit_2_before_joining(
    argv: list[str], flag: str, capsys: pytest.CaptureFixture[str]
) -> None:
    rc, err = run_main(argv, capsys)
    assert rc == EXIT_USAGE, err
    assert f"{flag} 'nosuch://" in err and "fsspec knows no storage scheme" in err, err
    assert "Traceback" not in err and err.count("\n") == 1, err


def test_the_cli_resumes_from_a_file_url(tmp_path: Path) -> None:
    """``--resume file://...`` reads through fsspec before joining: a damaged checkpoint is named, a good one loads."""
    url = f"file://{tmp_path}/ck"
    model, opt = trained()
    with Checkpointer(url) as ck:
        meta = ck.save(model, opt, step=3)
    model_object = meta.path.parent / meta.files["model"]["file"]
    good = storage.read_bytes(model_object)
    storage.write_atomic(model_object, good[:-7])
    result = run_forked(["peer", "--join", "127.0.0.1:9", "--resume", url, "--quiet"], 60, "gossiptrain peer", tmp_path)
    assert result.returncode == 2, result
    assert f"no good checkpoint in {url}" in result.stderr and str(model_object) in result.stderr, result.stderr
    storage.write_atomic(model_object, good)
    result = run_forked(["peer", "--join", "127.0.0.1:9", "--join-attempts", "1", "--resume", url, "--quiet"], 60,
                        "gossiptrain peer", tmp_path)
    assert result.returncode == 2 and "checkpoint" not in result.stderr, result.stderr  # loaded; then no swarm to join


def test_plain_paths_never_import_fsspec(tmp_path: Path) -> None:
    code = (
        "import sys, torch\n"
        "from gossiptrain.state.checkpoint import Checkpointer, latest_good\n"
        "from gossiptrain.state.merged_model import write_merged, read_merged\n"
        "from gossiptrain.train.metrics import MetricsLog\n"
        "from gossiptrain.train.peer_loop import PeerOptions\n"
        "d = sys.argv[1]\n"
        "PeerOptions(join='h:1', checkpoint_dir=d + '/ck', metrics=d + '/m.jsonl', final_model=d + '/m.safetensors')\n"
        "m = torch.nn.Linear(2, 2)\n"
        "with Checkpointer(d + '/ck') as ck: ck.save(m, None, step=1)\n"
        "latest_good(d + '/ck'); read_merged(write_merged(d + '/m.safetensors', m.state_dict(), members=[]).path)\n"
        "with MetricsLog(d + '/m.jsonl') as log: log.write({'a': 1})\n"
        "print('fsspec' in sys.modules)\n"
    )
    result = subprocess.run([sys.executable, "-c", code, str(tmp_path)], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "False"
