"""The GPU tools' behaviour on a machine without a CUDA device (their GPU runs are measured, not tested)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parent.parent


def _cuda_present() -> bool:
    from w4pack.native import cuda

    return cuda.available()


@pytest.mark.skipif(_cuda_present(), reason="a CUDA device is present (this checks the message on a machine without one)")
@pytest.mark.parametrize("tool,args", [("profile_gpu", ["--shape", "256x128", "--m", "4"]),
                                       ("ws_trace", ["--configs", "256x128:4"]),
                                       ("read_order", ["--shapes", "256x128"]),
                                       ("bench_lean_instances", ["--loops", "base,fold=1"]),
                                       ("bench_attention", ["--lengths", "16,64"])])
def test_gpu_tools_without_a_device_say_so(tool, args):
    r = subprocess.run([sys.executable, str(ROOT / "tools" / f"{tool}.py"), *args],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    # "no CUDA device: ..." here; "CUDA library unavailable: ..." where nvcc did not build the library
    assert len(lines) == 1 and lines[0].startswith(f"{tool}: "), r.stderr
    assert "Traceback" not in r.stderr


def test_bench_attention_lengths_and_floor():
    """The floor a table row is set against: the keys' and values' bytes at the copy rate (a 7B layer's 32 kv
    heads of 128 at 4000 keys: 65.5 MB, 19.5 µs at 3350 GB/s)."""
    bench = _tool("bench_attention")
    assert bench.parse_lengths("16, 1500,,4000") == [16, 1500, 4000]
    for bad in ("0", "x", "1.5", ","):
        with pytest.raises(ValueError, match="--lengths"):
            bench.parse_lengths(bad)
    assert bench.kv_bytes(32, 128, 4000) == 65_536_000
    assert bench.floor_us(bench.kv_bytes(32, 128, 4000), 3350.0) == pytest.approx(19.56, abs=0.01)
    r = subprocess.run([sys.executable, str(ROOT / "tools" / "bench_attention.py"), "--shapes", "llama9"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "--shapes: llama9; choose from llama2-7b" in r.stderr, r.stderr


def test_bench_gpu_floors_need_no_device():
    # the two floors per shape (bytes at the measured read stream, FLOPs at cuBLAS's rate), as in
    # ../shared/reference/gpu-anchors.md: 27.0 us of bytes for a 70B layer at M = 1, 91.0 us of FLOPs at M = 128
    pytest.importorskip("torch")
    r = subprocess.run([sys.executable, str(ROOT / "tools" / "bench_gpu.py"), "--floors", "--shapes",
                        "8192x28672,4096x4096", "--ms", "1,128"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    rows = {line.split("|")[1].strip(): line for line in r.stdout.splitlines() if line.startswith("| 8192") or
            line.startswith("| 4096")}
    assert "**27.0** / 0.7" in rows["8192×28672"] and "29.0 / **91.0**" in rows["8192×28672"], r.stdout
    assert "**1.9** / 0.1" in rows["4096×4096"] and "2.4 / **6.5**" in rows["4096×4096"], r.stdout
    # integer zero points add one byte per group of 128 and column: 8192×28672 reads 1.8 MB more
    r = subprocess.run([sys.executable, str(ROOT / "tools" / "bench_gpu.py"), "--floors", "--shapes", "8192x28672",
                        "--ms", "1", "--zeros", "int"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "| 8192×28672 | **27.4** / 0.7 |" in r.stdout, r.stdout + r.stderr


def test_bench_gpu_floors_take_a_given_reference():
    # on another GPU the H200's references misstate the floors: --read-bw / --tflops replace them (an H100's
    # ~3000 GB/s puts a 70B layer's bytes at 40.4 us, not 27.0), and the header says which references it used
    pytest.importorskip("torch")
    r = subprocess.run([sys.executable, str(ROOT / "tools" / "bench_gpu.py"), "--floors", "--shapes", "8192x28672",
                        "--ms", "1,128", "--read-bw", "3000", "--tflops", "600"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "at 3000 GB/s / FLOPs at 600 TFLOP/s (given (--read-bw / --tflops))" in r.stdout, r.stdout
    assert "| 8192×28672 | **40.4** / 0.8 | 43.5 / **100.2** |" in r.stdout, r.stdout


def test_bench_gpu_tables_take_the_reference_in_use(capsys):
    pytest.importorskip("torch")
    bench_gpu = _tool("bench_gpu")
    rows = [{"M": 1, "w4pack_us": 50.0, "cublas_mm_us": 117.0, "cublas_linear_us": 111.0, "tinygemm_us": None,
             "gemlite_us": None, "w4pack_gbs": 2400.0, "plan": {"kernel": 8, "splits": 1}}]
    saved = dict(bench_gpu.REF)
    try:
        bench_gpu.set_reference(3000.0, 600e12, "measured here")
        bench_gpu.print_tables("head", [(8192, 28672, rows)])
    finally:
        bench_gpu.REF.update(saved)
    out = capsys.readouterr().out
    assert "| 1 | 50.0 | 111.0 | - | - | 2.22x | - | - | 2400 | 80% | 40.4 | 8/1 |" in out, out
    assert "% of the 3000 GB/s read stream" in out and "references measured here" in out, out


def _tool(name: str):
    """A script of tools/ imported as a module (its recorded-data paths need no device)."""
    import importlib

    sys.path.insert(0, str(ROOT / "tools"))
    try:
        return importlib.import_module(name)
    finally:
        sys.path.pop(0)


def test_bench_gpu_tables_print_the_binding_floor(capsys):
    # the end-of-run tables from recorded rows (their GPU measurement is not testable here)
    pytest.importorskip("torch")
    bench_gpu = _tool("bench_gpu")
    rows = [{"M": m, "w4pack_us": us, "cublas_mm_us": 117.0, "cublas_linear_us": 111.0, "tinygemm_us": 63.0,
             "gemlite_us": None, "w4pack_gbs": 2400.0, "plan": {"kernel": 4, "splits": 5}} for m, us in ((1, 50.0),
                                                                                                      (128, 130.0))]
    bench_gpu.print_tables("head", [(8192, 28672, rows)])
    out = capsys.readouterr().out.splitlines()
    assert "| 1 | 50.0 | 111.0 | 63.0 | - | 2.22x | 1.76x | - | 2400 | 53% | 27.0 | 4/5 |" in out
    assert any(line.startswith("| 128 | 130.0 |") and "| 91.0 |" in line for line in out)
    assert "  M=1: 2.22x" in out


def test_bench_gpu_switched_measurements_drop_the_cached_plans(monkeypatch):
    # a planner switch (W4P_CUDA_*) is read by the native planner at each plan, but layers cache their plans: the
    # switched measurement must plan afresh, and the next one must not inherit the switched plan or the variable
    pytest.importorskip("torch")
    bench_gpu = _tool("bench_gpu")

    class Layer:
        def __init__(self):
            self._plans = {(150, "wgmma_ws"): "stale"}

    lins = [Layer(), Layer()]
    seen = []

    def fake_measure(lins_, k, n, m, kernel="auto", splits=0):
        seen.append((os.environ.get("W4P_CUDA_WS_ROWS"), [dict(lin._plans) for lin in lins_], kernel, splits))
        for lin in lins_:
            lin._plans[(m, kernel)] = "planned"
        return 1.5

    monkeypatch.setattr(bench_gpu, "measure_w4", fake_measure)
    monkeypatch.setenv("W4P_CUDA_WS_ROWS", "256")
    assert bench_gpu.measure_w4_env(lins, 4096, 11008, 150, "wgmma_ws", 1, {"W4P_CUDA_WS_ROWS": "192"}) == 1.5
    assert seen == [("192", [{}, {}], "wgmma_ws", 1)]
    assert os.environ["W4P_CUDA_WS_ROWS"] == "256" and all(lin._plans == {} for lin in lins)
    monkeypatch.delenv("W4P_CUDA_WS_ROWS")
    bench_gpu.measure_w4_env(lins, 4096, 11008, 150, "wgmma", 0, {"W4P_CUDA_WGMMA_KP": "2"})
    assert "W4P_CUDA_WGMMA_KP" not in os.environ and "W4P_CUDA_WS_ROWS" not in os.environ


def _ncu_stalls(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(ROOT / "tools" / "ncu_stalls.py"), *args], capture_output=True,
                          text=True, timeout=60)


def test_ncu_stalls_ranks_the_instructions_of_a_recorded_source_page():
    # tests/data/ncu_source_page.csv: eight rows of an H200 source page (wgmma_ws, 256-row blocks, M = 1024)
    r = _ncu_stalls(str(ROOT / "tests" / "data" / "ncu_source_page.csv"), "--json", "--top", "3")
    assert r.returncode == 0, r.stderr
    s = json.loads(r.stdout)
    assert "wgmma_ws_kernel" in s["kernel"]
    assert s["samples"] == 14230 + 14152 + 5047 + 577 + 428 + 273 + 173 + 0
    top = s["top"]
    assert abs(top[0]["share"] - 14230 / 34880) < 1e-12 and top[0]["executed"] == 458752
    assert [t["sass"].split()[0] for t in top] == ["WARPGROUP.DEPBAR.LE", "WARPGROUP.DEPBAR.LE", "@!P0"]
    assert list(top[0]["reasons"])[0] == "barrier" and list(top[2]["reasons"])[0] == "long_sb"
    assert top[0]["share"] > top[1]["share"] > top[2]["share"] > 0.1
    ops = {o["opcode"]: o["share"] for o in s["opcodes"]}
    assert abs(sum(ops.values()) - 1.0) < 1e-9 and ops["WARPGROUP"] > 0.8 and "BRA" in ops and "LDC" not in ops


def test_ncu_stalls_refuses_other_files_in_one_line(tmp_path):
    bad = tmp_path / "summary.csv"
    bad.write_text('"ID","Kernel Name","Metric Name"\n"0","k","Duration"\n')
    for path in (bad, tmp_path / "missing.csv"):
        r = _ncu_stalls(str(path))
        assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
        assert r.stderr.startswith(f"ncu_stalls: {path}: ") and len(r.stderr.strip().splitlines()) == 1


def test_ncu_stalls_stops_quietly_when_its_reader_leaves():
    # `ncu_stalls.py page.csv | head -1`: a reader that has left ends it with status 0 and nothing on stderr (here
    # the pipe closes before the interpreter has started, so the first print meets it closed)
    cmd = [sys.executable, str(ROOT / "tools" / "ncu_stalls.py"), str(ROOT / "tests" / "data" / "ncu_source_page.csv")]
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    p.stdout.close()
    err = p.stderr.read().decode()
    assert p.wait(timeout=60) == 0, err
    assert err == "", err


def test_ws_trace_reads_its_configurations():
    ws = _tool("ws_trace")
    assert ws.parse_config("4096x11008:256") == (4096, 11008, 256, {})
    assert ws.parse_config("8192X28672:128:W4P_CUDA_WS_SK=0,W4P_CUDA_WS_RS=2") == (
        8192, 28672, 128, {"W4P_CUDA_WS_SK": "0", "W4P_CUDA_WS_RS": "2"})
    for bad in ("4096:256", "4096x11008", "4096x11008:0", "axb:1", "64x64:1:PATH=/x", "64x64:1:W4P_X", "1x1:1:a:b"):
        with pytest.raises(ws.ConfigError):
            ws.parse_config(bad)


def _record() -> np.ndarray:
    # three blocks (ns, cycles at 1.5 GHz): two plain ones (main loop, epilogue) and a stream-K one with two
    # segments; a fourth row that never ran
    rec = np.zeros((4, 32), dtype=np.uint64)
    rows = [(1_000, [11_000, 13_000]), (1_100, [12_000, 14_500]), (1_200, [5_200, 8_200, 20_200, 26_200])]
    for b, (start, events) in enumerate(rows):
        rec[b, 0], rec[b, 1] = start, 0
        for ev, t in enumerate(events, 1):
            rec[b, 2 * ev], rec[b, 2 * ev + 1] = t, (t - start) * 3 // 2
        rec[b, 31] = (1 << 32) | (7 + b)
    return rec


def test_ws_trace_summarizes_a_record():
    s = _tool("ws_trace").summarize(_record())
    assert s["blocks"] == 3 and s["sms"] == 3
    assert s["start_us"] == {"min": 0.0, "median": 0.1, "max": 0.2}
    assert s["events"][1] == {"min": 4.2, "median": 10.0, "max": 11.0}
    assert s["epilogue_us"][1] == {"min": 2.0, "median": 2.5, "max": 3.0}  # 13-11, 14.5-12, 8.2-5.2
    assert s["epilogue_us"][2] == {"min": 6.0, "median": 6.0, "max": 6.0}
    assert s["end_us"] == {"min": 12.0, "median": 13.5, "max": 25.2}
    assert s["clock_mhz"] == pytest.approx(1500.0)
    with pytest.raises(ValueError, match="no block"):
        _tool("ws_trace").summarize(np.zeros((2, 32), dtype=np.uint64))


def test_ws_trace_summarizes_a_saved_record_without_a_device(tmp_path):
    np.save(tmp_path / "t.npy", _record())
    tool = str(ROOT / "tools" / "ws_trace.py")
    r = subprocess.run([sys.executable, tool, "--summarize", str(tmp_path / "t.npy"), "--json"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["blocks"] == 3
    (tmp_path / "bad.npy").write_bytes(b"not a record")
    r = subprocess.run([sys.executable, tool, "--summarize", str(tmp_path / "bad.npy")], capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 2 and r.stderr.startswith(f"ws_trace: {tmp_path / 'bad.npy'}: ")
    assert len(r.stderr.strip().splitlines()) == 1 and "Traceback" not in r.stderr
    r = subprocess.run([sys.executable, tool, "--configs", "64x64"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and r.stderr.startswith("ws_trace: '64x64'")


def test_bench_tp_two_gloo_ranks_equal_one(tmp_path):
    """tools/bench_tp.py's exactness checks on two CPU processes (gloo): the all-reduced row-parallel outputs,
    an act-order layer's regrouped shards included, and the gathered column-parallel ones equal one rank's."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    out = tmp_path / "tp.json"
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                           str(ROOT / "tools" / "bench_tp.py"), "--device", "cpu", "--shape", "tiny", "--ms", "1,3",
                           "--json", str(out)], capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "exact: 8 layer x M cases" in proc.stdout
    doc = json.loads(out.read_text())
    assert doc["size"] == 2 and not doc["failures"]
    assert {r["layer"] for r in doc["rows"]} == {"qkv", "o", "gate_up", "down"}


def _bench_records(path: Path) -> None:
    # two shapes, three M; cuBLAS's two layouts differ so that the faster one must be the baseline
    recs = [{"kind": "run", "gpu": "older run"}, {"kind": "gemm", "K": 64, "N": 64, "M": 1, "w4pack_us": 1.0},
            {"kind": "run", "gpu": "NVIDIA H200", "date": "2026-12-04 10:00 UTC", "command": "bench"},
            {"kind": "bandwidth", "copy_rw_gbs": 1.0}]
    for k, n, base in ((4096, 4096, 20.0), (8192, 28672, 120.0)):
        for m, f in ((1, 2.5), (16, 2.0), (256, 0.8)):
            recs.append({"kind": "gemm", "K": k, "N": n, "M": m, "cublas_mm_us": base, "cublas_linear_us": base * 1.5,
                         "w4pack_us": base / f, "tinygemm_us": base / 1.25 if m < 256 else None,
                         "gemlite_us": float("nan")})
    recs.append({**recs[4], "w4pack_us": 20.0 / 4.0})  # a repeated measurement replaces the earlier one
    path.write_text("\n".join(json.dumps(r) for r in recs) + "\n")


def test_plot_bench_table_is_the_speedup_over_the_faster_cublas(tmp_path):
    pb = _tool("plot_bench")
    _bench_records(tmp_path / "r.jsonl")
    head, rows = pb.read_records(tmp_path / "r.jsonl")
    assert head["gpu"] == "NVIDIA H200" and len(rows) == 6
    table = pb.markdown(head, rows).splitlines()
    assert table[0].startswith("NVIDIA H200, 2026-12-04 10:00 UTC")
    r4096 = next(line for line in table if line.startswith("| 4096×4096"))
    cells = [c.strip() for c in r4096.split("|")[2:-1]]
    # M = 1 was re-measured (4.0x); gemlite's NaN is left out; tinygemm is the best peer where it ran
    assert cells == ["4.00x (5.0 µs) (tinygemm 1.25x)", "2.00x (tinygemm 1.25x)", "0.80x"], cells
    geo = [c.strip() for c in table[-1].split("|")[2:-1]]
    assert geo == [f"{(4.0 * 2.5) ** 0.5:.2f}x", "2.00x", "0.80x"], geo


def test_plot_bench_writes_the_png_and_refuses_empty_input(tmp_path):
    pytest.importorskip("matplotlib", reason="the plot needs matplotlib: pip install 'w4pack[bench]'")
    _bench_records(tmp_path / "r.jsonl")
    tool = str(ROOT / "tools" / "plot_bench.py")
    r = subprocess.run([sys.executable, tool, str(tmp_path / "r.jsonl"), "--png", str(tmp_path / "p.png")],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    data = (tmp_path / "p.png").read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000
    (tmp_path / "e.jsonl").write_text(json.dumps({"kind": "bandwidth"}) + "\n")
    r = subprocess.run([sys.executable, tool, str(tmp_path / "e.jsonl")], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "no gemm records" in r.stderr, r.stderr


@pytest.mark.parametrize("line", ["[1, 2]", "7", '"gemm"'])
def test_plot_bench_refuses_a_line_that_is_not_an_object(tmp_path, line):
    """A JSON line that parses but is not a record is bad input: one line naming the file and line, exit 2."""
    (tmp_path / "r.jsonl").write_text(json.dumps({"kind": "run"}) + "\n" + line + "\n")
    r = subprocess.run([sys.executable, str(ROOT / "tools" / "plot_bench.py"), str(tmp_path / "r.jsonl")],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and f"{tmp_path / 'r.jsonl'}:2: a JSON" in r.stderr, \
        r.stderr


def test_smollm2_widening_keeps_the_model_s_function(tmp_path):
    """tools/smollm2_llama_quant.py widens a llama (hidden and query heads, zero padded, norms rescaled) without
    changing its logits: here the committed tiny llama.cpp file, 256 -> 512 wide, 4 -> 8 query heads on 2 kv
    heads (the inserted heads after each group's own, their q rows and o_proj columns zero)."""
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    gguf = pytest.importorskip("gguf")
    sys.path.insert(0, str(ROOT / "tools"))
    try:
        import smollm2_llama_quant as tool
    finally:
        sys.path.pop(0)
    src = ROOT / "tests" / "data" / "llama_quantize" / "tiny-Q6_K.gguf"
    wide = tmp_path / "wide.gguf"
    assert tool.write_float(src, wide, 512) == 256
    r = gguf.GGUFReader(str(wide))
    assert r.fields["llama.embedding_length"].contents() == 512
    assert r.fields["llama.attention.head_count"].contents() == 8
    t = {x.name: np.asarray(x.data) for x in r.tensors}
    q = t["blk.0.attn_q.weight"].reshape(8, 64, 512)
    o = t["blk.0.attn_output.weight"].reshape(512, 8, 64)
    assert [bool(q[h].any()) for h in range(8)] == [True, True, False, False] * 2
    assert [bool(o[:, h].any()) for h in range(8)] == [True, True, False, False] * 2
    assert not o[256:].any() and not t["token_embd.weight"][:, 256:].any()
    assert tool.float_check(src, wide) < 1e-5


def _fixtures_or_skip() -> None:
    if not (os.environ.get("W4PACK_FIXTURES") or (ROOT.parent / "shared" / "fixtures").is_dir()):
        pytest.skip("fixtures not found: set W4PACK_FIXTURES or place shared/fixtures beside the checkout")


def test_fuzz_refuses_a_bad_targets_regex_in_one_line(tmp_path):
    """--targets takes a regular expression: one that does not compile is a usage error (exit 2), no traceback."""
    _fixtures_or_skip()
    r = subprocess.run([sys.executable, str(ROOT / "tools" / "fuzz.py"), "--targets", "(", "--list",
                        "--out", str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "--targets" in r.stderr and "Traceback" not in r.stderr, r.stderr


def test_fuzz_targets_keeps_only_the_readers_that_match(tmp_path):
    """--targets with the default --reader all fuzzes the readers that have a matching target (llama.cpp's files:
    gguf and w4pack) instead of refusing because the other readers have none; a regex nothing matches is refused."""
    _fixtures_or_skip()
    tool = [sys.executable, str(ROOT / "tools" / "fuzz.py"), "--out", str(tmp_path), "--list", "--runs", "2"]
    r = subprocess.run([*tool, "--targets", "llama-Q4_K"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    plans = [json.loads(line) for line in r.stdout.splitlines()]
    assert sorted({p["reader"] for p in plans}) == ["gguf", "w4pack"], plans
    assert {p["target"] for p in plans} == {"gguf/llama-Q4_K_M", "w4pack/gguf/llama-Q4_K_M"}, plans
    r = subprocess.run([*tool, "--targets", "no-such-target"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "no target" in r.stderr and "Traceback" not in r.stderr, r.stderr


@pytest.mark.parametrize("tool,args", [("make_llama_quants", ["--types", "Q4_K_M,BOGUS", "--moe-types", ""]),
                                       ("make_llama_quants", ["--types", "", "--moe-types", "Q9_K"]),
                                       ("smollm2_llama_quant", ["--ftype", "BOGUS"])])
def test_llama_quant_tools_refuse_an_unknown_file_type_first(tmp_path, tool, args):
    """An unknown llama.cpp file type is a usage error (exit 2, naming it) before any file is written or any
    model read, not an AttributeError from llama_cpp after the float model was built."""
    pytest.importorskip("llama_cpp", reason="pip install llama-cpp-python to run the llama.cpp quantizing tools")
    pytest.importorskip("gguf")
    out = tmp_path / "out"
    where = ["--out", str(out)] if tool == "make_llama_quants" else [str(out)]
    r = subprocess.run([sys.executable, str(ROOT / "tools" / f"{tool}.py"), *where, *args],
                       capture_output=True, text=True, timeout=60)
    bad = "BOGUS" if any("BOGUS" in a for a in args) else "Q9_K"
    assert r.returncode == 2 and f"unknown llama.cpp file type '{bad}'" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr and not out.exists(), r.stderr


@pytest.mark.parametrize("tool,args", [("make_llama_quants", ["--types", "Q4_K_M", "--moe-types", ""]),
                                       ("smollm2_llama_quant", [])])
def test_llama_quant_tools_refuse_an_output_that_is_a_file(tmp_path, tool, args):
    """The output folder given as an existing file: a usage error naming it (exit 2), not FileExistsError."""
    pytest.importorskip("llama_cpp", reason="pip install llama-cpp-python to run the llama.cpp quantizing tools")
    pytest.importorskip("gguf")
    out = tmp_path / "a-file"
    out.write_text("x")
    where = ["--out", str(out)] if tool == "make_llama_quants" else [str(out)]
    r = subprocess.run([sys.executable, str(ROOT / "tools" / f"{tool}.py"), *where, *args],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and f"{out} is a file" in r.stderr and "Traceback" not in r.stderr, r.stderr


def test_make_llama_quants_leaves_no_partial_file_when_llama_cpp_fails(tmp_path, monkeypatch):
    """A quantization that fails part-way (llama.cpp returned an error after writing some bytes) leaves neither
    the type's file nor its ``.partial`` in the output folder (tests/data/llama_quantize in normal use)."""
    pytest.importorskip("gguf")
    sys.path.insert(0, str(ROOT / "tools"))
    try:
        import make_llama_quants as tool
    finally:
        sys.path.pop(0)

    def failing(src, dst, ftype, threads=1, quiet=True):
        dst.write_bytes(b"GGUF half written")
        raise SystemExit(f"llama_model_quantize {src} -> {dst} ({ftype}) failed with status 1")

    monkeypatch.setattr(tool, "llama_quantize", failing)
    out = tmp_path / "out"
    with pytest.raises(SystemExit, match="failed with status 1"):
        tool.make(out, ["Q4_K_M"])
    assert sorted(p.name for p in out.iterdir()) == []


def test_sass_loop_counts_the_common_path_per_tile():
    # tools/cuda_sass_loop.py on a made-up SASS listing: the loop with the MMAs (not the staging loop before it);
    # at each branch the side without a block barrier (a stripe's end), then with the MMAs (a tile computed, not
    # skipped), then with the loads (the next step's weights, not "nothing left to load"); instructions per tile =
    # that path / (MMAs / 4)
    sass_loop = _tool("cuda_sass_loop")
    text = """
        /*0000*/                   MOV R1, c[0x0][0x28] ;
        /*0010*/                   LDS R2, [R3] ;
        /*0020*/               @P0 BRA 0x10 ;
        /*0030*/                   ISETP.GE.AND P1, PT, R4, R5, PT ;
        /*0040*/               @P1 BRA 0x70 ;
        /*0050*/                   LDG.E.128 R8, desc[UR4][R6.64] ;
        /*0060*/                   LDG.E.128 R12, desc[UR4][R6.64+0x200] ;
        /*0070*/               @P2 BRA 0xd0 ;
        /*0080*/                   LOP3.LUT R16, R8, 0xf000f, RZ, 0xc0, !PT ;
        /*0090*/                   HMMA.16816.F32 R20, R16, R18, R20 ;
        /*00a0*/                   HMMA.16816.F32 R20, R16, R18, R20 ;
        /*00b0*/                   HMMA.16816.F32 R20, R16, R18, R20 ;
        /*00c0*/                   HMMA.16816.F32 R20, R16, R18, R20 ;
        /*00d0*/               @P3 BRA 0x110 ;
        /*00e0*/                   STS [R30], R20 ;
        /*00f0*/                   BAR.SYNC.DEFER_BLOCKING 0x0 ;
        /*0100*/                   LDS R31, [R30] ;
        /*0110*/                   IADD3 R4, R4, 0x1, RZ ;
        /*0120*/               @P4 BRA 0x30 ;
        /*0130*/                   EXIT ;
    """
    ins = [(int(m.group(1), 16), (m.group(2) or "").strip(), m.group(3), m.group(4).strip())
           for m in sass_loop.INS.finditer(text)]
    lo, hi = sass_loop.main_loop(ins)
    assert (ins[lo][0], ins[hi][0]) == (0x30, 0x120)
    path = [ins[k][0] for k in sass_loop.hot_path(ins, lo, hi)]
    want = [0x30, 0x40, 0x50, 0x60, 0x70, 0x80, 0x90, 0xa0, 0xb0, 0xc0, 0xd0, 0x110, 0x120]
    assert path == want, [hex(a) for a in path]
    assert len(path) / (sum(ins[k][2].startswith("HMMA") for k in sass_loop.hot_path(ins, lo, hi)) / 4) == 13.0


def test_sass_cmp_pairs_renamed_kernels_and_counts_removed_ones():
    # tools/cuda_sass_cmp.py on two made-up builds: a renamed kernel pairs with its old name through --rename,
    # kernels dropped on purpose (--removed) are counted, not failed; a changed byte or an unnamed loss still fails
    cmp = _tool("cuda_sass_cmp")
    old_v3 = "void gemv2_kernel<__half, 0, 2, Gv2Cfg<16, 2, 2, false> >(Params)"
    old_v4 = "void gemv2_kernel<__half, 0, 2, Gv2Cfg<16, 2, 2, true> >(Params)"
    before = {"90a": {old_v3: b"A" * 32, old_v4: b"B" * 16, "void bulk_kernel<__half>(Params)": b"C" * 16}}
    after = {"90a": {"void gemv_kernel<__half, 0, 2>(Params)": b"A" * 32, "void bulk_kernel<__half>(Params)": b"C" * 16}}
    renames = [cmp.rename_arg(r"gemv2_kernel<(.+), Gv2Cfg<16, 2, 2, false> >=gemv_kernel<\1>")]
    removed = [r"Gv2Cfg<(?!16, 2, 2, false>)"]
    lines, ok = cmp.compare(before, after, renames, removed)
    assert ok and lines[-1] == "IDENTICAL", lines
    assert "byte-identical 2; differing 0; only before 0; only after 0" in lines[1] and "removed as named 1" in lines[1]
    assert not cmp.compare(before, after, renames)[1]  # the variant's loss not named: a difference
    assert not cmp.compare(before, after, removed=removed)[1]  # not paired: one only before, one only after
    changed = {"90a": {**after["90a"], "void gemv_kernel<__half, 0, 2>(Params)": b"A" * 31 + b"a"}}
    lines, ok = cmp.compare(before, changed, renames, removed)
    assert not ok and any(line.startswith("  DIFF void gemv_kernel<__half, 0, 2>") for line in lines), lines
    with pytest.raises(Exception, match="REGEX=REPLACEMENT"):
        cmp.rename_arg("no-equals-sign")


def test_bench_run_auto_mode_installs_and_removes_the_default(monkeypatch):
    # bench_run's "auto" rows time load_model's default decode path as installed, name the engine that answered,
    # and leave the model as they found it for the next mode
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    bench = _tool("bench_run")
    monkeypatch.setitem(bench.SHAPES, "tiny", dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                                   num_attention_heads=4, num_key_value_heads=2, vocab_size=96,
                                                   tie_word_embeddings=False, group_size=32))
    monkeypatch.delenv("W4PACK_LEAN", raising=False)
    model = bench.build_float("tiny", "cpu", torch.float32)
    assert bench.swap_to_w4(model, "tiny", "cpu", "exact") == 14
    rows = []
    with bench.lean_mode(model, "auto"):
        assert model.w4pack_decode == "lean"
        for b in (1, 2):
            rows.append(bench.decode_rate(model, b, 4, 1, "auto"))
    assert rows[0]["decode"] == "lean" and rows[1]["decode"].startswith("eager (") and rows[1]["batch"] == 2
    assert "generate" not in model.__dict__ and not hasattr(model, "_w4pack_lean")
    assert bench.decode_rate(model, 1, 4, 1, "eager")["decode"] == "eager"
    assert bench.decode_rate(model, 1, 4, 1, "eager", prompt=40)["prompt"] == 40
    text = bench.table([{"shape": "tiny", "float": [], "w4": rows}])
    assert "auto/lean" in text and "auto/eager" in text


def test_bench_run_variants_parse_set_and_tabulate(monkeypatch):
    # --variants: each a set of environment variables, set while its run installs and times the loop, then
    # restored; the table names each row's variant and round, and matches it with the float row of the same
    bench = _tool("bench_run")
    got = bench.parse_variants("base; W4PACK_LEAN_ATTN=sdpa ;W4PACK_LEAN_ATTN=sdpa,W4PACK_LEAN_FOLD=1;")
    assert got == [("base", {}), ("W4PACK_LEAN_ATTN=sdpa", {"W4PACK_LEAN_ATTN": "sdpa"}),
                   ("W4PACK_LEAN_ATTN=sdpa,W4PACK_LEAN_FOLD=1", {"W4PACK_LEAN_ATTN": "sdpa", "W4PACK_LEAN_FOLD": "1"})]
    with pytest.raises(ValueError, match="'fold' is not VAR=VALUE"):
        bench.parse_variants("base;fold")
    monkeypatch.setenv("W4PACK_LEAN_ATTN", "matmul")
    monkeypatch.delenv("W4PACK_LEAN_FOLD", raising=False)
    with bench.environment({"W4PACK_LEAN_ATTN": "sdpa", "W4PACK_LEAN_FOLD": "1"}):
        assert os.environ["W4PACK_LEAN_ATTN"] == "sdpa" and os.environ["W4PACK_LEAN_FOLD"] == "1"
    assert os.environ["W4PACK_LEAN_ATTN"] == "matmul" and "W4PACK_LEAN_FOLD" not in os.environ

    def row(mode, rate, variant=None, rnd=None, **more):
        r = {"mode": mode, "decode": "lean", "batch": 1, "decode_tokens_per_s": rate, "ms_per_step": 1000 / rate,
             **more}
        return {**r, "variant": variant, "round": rnd} if variant else r

    text = bench.table([{"shape": "tiny", "float": [row("compiled", 100.0), row("auto", 150.0, "base", 1),
                                                    row("auto", 160.0, "x=1", 1)],
                         "w4": [row("compiled", 200.0), row("auto", 300.0, "base", 1),
                                row("auto", 320.0, "x=1", 1, attn="kernel")]}])
    lines = text.splitlines()
    assert any("auto/lean [base] #1" in ln and "150.0" in ln and "2.00x" in ln and "3.00x" in ln for ln in lines)
    assert any("auto/lean:kernel [x=1] #1" in ln and "160.0" in ln and "3.20x" in ln for ln in lines), text


def test_bench_lean_instances_reads_its_loops():
    # --loops: "base" or settings joined by "+", each a GraphDecoder keyword with its value read; anything else
    # is refused naming the part
    bench = _tool("bench_lean_instances")
    got = bench.parse_loops("base, fuse=0 ,fold=1+fuse=0,attn=sdpa+fuse=1,")
    assert got == [("base", {}), ("fuse=0", {"fuse": False}), ("fold=1+fuse=0", {"fold": True, "fuse": False}),
                   ("attn=sdpa+fuse=1", {"attn": "sdpa", "fuse": True})]
    with pytest.raises(ValueError, match="'fold' is not one of"):
        bench.parse_loops("base,fold")
    with pytest.raises(ValueError, match="'depth=2' is not one of"):
        bench.parse_loops("depth=2")
    with pytest.raises(ValueError, match="'fold=yes'.*'yes' is not 0 or 1"):
        bench.parse_loops("fold=yes")
    with pytest.raises(ValueError, match="names no loop"):
        bench.parse_loops(" , ")


def test_gpu_ab_rotates_the_libraries_and_puts_the_installed_one_back(tmp_path, monkeypatch, capsys):
    gpu_ab = _tool("gpu_ab")
    libdir = tmp_path / "_lib"
    monkeypatch.setattr(gpu_ab, "LIBDIR", libdir)
    monkeypatch.setattr(gpu_ab, "LIB", libdir / "libw4p_cuda.so")
    libdir.mkdir()
    (libdir / "libw4p_cuda.so").write_bytes(b"installed")
    a, b = tmp_path / "a.so", tmp_path / "b.so"
    a.write_bytes(b"A")
    b.write_bytes(b"B")
    times = {b"A": [10.0, 11.0, 12.0], b"B": [8.0, 9.0, 7.0]}
    order = []

    def fake_run(lib, bench_args, timeout):
        body = gpu_ab.LIB.read_bytes()  # the library under test is the one installed while it runs
        order.append(body)
        assert bench_args == ["--ms", "1"]
        t = times[body].pop(0)
        return [{"kind": "run", "gpu": "TestGPU"},
                {"kind": "gemm", "K": 64, "N": 128, "M": 1, "w4pack_us": t, "cublas_mm_us": 30.0,
                 "cublas_linear_us": 31.0}]

    monkeypatch.setattr(gpu_ab, "run_one", fake_run)
    out = tmp_path / "ab.jsonl"
    assert gpu_ab.main([f"base={a}", f"new={b}", "--rounds", "3", "--json", str(out), "--", "--ms", "1"]) == 0
    assert order == [b"A", b"B", b"B", b"A", b"A", b"B"]
    assert (libdir / "libw4p_cuda.so").read_bytes() == b"installed"
    text = capsys.readouterr().out
    assert "| 64×128, 1 | 10.0 / 11.0 / 12.0 (**11.0**) | 8.0 / 9.0 / 7.0 (**8.0**) | 30.0 | 0.727 |" in text
    assert "base 2.727x, new 3.750x" in text
    recs = [json.loads(line) for line in out.read_text().splitlines()]
    assert [(r["lib"], r["round"]) for r in recs if r["kind"] == "gemm"] == [
        ("base", 1), ("new", 1), ("new", 2), ("base", 2), ("base", 3), ("new", 3)]


def test_gpu_ab_refuses_bad_library_specs(tmp_path):
    gpu_ab = _tool("gpu_ab")
    lib = tmp_path / "a.so"
    lib.write_bytes(b"A")
    for specs, msg in (([f"a={lib}"], "at least two"), ([f"a={lib}", f"a={lib}"], "named twice"),
                       ([f"a={lib}", "b"], "NAME=PATH"), ([f"a={lib}", f"b={tmp_path / 'no.so'}"], "no such")):
        with pytest.raises(SystemExit, match=msg):
            gpu_ab.parse_libs(specs)


def test_gpu_ab_leaves_no_library_where_none_was_installed(tmp_path, monkeypatch, capsys):
    """Before: the last library tested stayed installed at w4pack/_lib when none had been."""
    gpu_ab = _tool("gpu_ab")
    libdir = tmp_path / "_lib"
    monkeypatch.setattr(gpu_ab, "LIBDIR", libdir)
    monkeypatch.setattr(gpu_ab, "LIB", libdir / "libw4p_cuda.so")
    a, b = tmp_path / "a.so", tmp_path / "b.so"
    a.write_bytes(b"A")
    b.write_bytes(b"B")
    monkeypatch.setattr(gpu_ab, "run_one", lambda lib, bench_args, timeout: [
        {"kind": "run", "gpu": "TestGPU"},
        {"kind": "gemm", "K": 64, "N": 128, "M": 1, "w4pack_us": 1.0, "cublas_mm_us": 3.0, "cublas_linear_us": 3.0}])
    assert gpu_ab.main([f"a={a}", f"b={b}", "--", "--ms", "1"]) == 0
    assert not (libdir / "libw4p_cuda.so").exists()


@pytest.mark.skipif(_cuda_present(), reason="a CUDA device is present (this checks the message on a machine without one)")
@pytest.mark.parametrize("tool,args", [("bench_run", ["--shapes", "smollm2", "--batches", "1", "--modes", "eager"]),
                                       ("bench_tp", ["--shape", "tiny"])])
def test_cuda_default_benches_without_a_device_say_so(tool, args):
    """Before: their default --device cuda died in a torch traceback on a machine without a GPU."""
    r = subprocess.run([sys.executable, str(ROOT / "tools" / f"{tool}.py"), *args],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 2 and r.stderr.strip() == f"{tool}: " + r.stderr.strip().split(": ", 1)[1], r.stderr
    assert "no CUDA device" in r.stderr and len(r.stderr.strip().splitlines()) == 1


@pytest.mark.parametrize("argv,says", [
    (["bench_cpu.py", "--shapes", "4096"], "'4096' is not KxN"),
    (["bench_cpu_decode.py", "--tokens", "1"], "--tokens must be at least 2"),
    (["cuda_sass_cmp.py", "/nonexistent_a", "/nonexistent_b"], "no cubins found"),
    (["make_q4_k_m.py", "/nonexistent.gguf", "/tmp/x.gguf"], "no such file"),
])
def test_tools_refuse_bad_arguments_in_one_line(argv, says):
    """Before: a traceback (bench_cpu, bench_cpu_decode, make_q4_k_m) or a false "IDENTICAL" (cuda_sass_cmp)."""
    r = subprocess.run([sys.executable, str(ROOT / "tools" / argv[0]), *argv[1:]], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 2 and says in r.stderr and "Traceback" not in r.stderr, (r.stdout, r.stderr)


def test_make_demo_checkpoint_refuses_an_existing_output_in_one_line(tmp_path):
    tool = [sys.executable, str(ROOT / "tools" / "make_demo_checkpoint.py"), str(tmp_path / "d")]
    assert subprocess.run(tool, capture_output=True, timeout=120).returncode == 0
    r = subprocess.run(tool, capture_output=True, text=True, timeout=120)
    assert r.returncode == 4 and "output already exists" in r.stderr and "Traceback" not in r.stderr, r.stderr


@pytest.mark.parametrize("tool", ["demo", "get_smollm2"])
def test_tools_without_options_still_answer_help(tool):
    """Before: demo.py ran (and replaced out/demo) on --help; get_smollm2.py fetched the model."""
    r = subprocess.run([sys.executable, str(ROOT / "tools" / f"{tool}.py"), "--help"], capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0 and r.stdout.startswith("usage:"), r.stdout
